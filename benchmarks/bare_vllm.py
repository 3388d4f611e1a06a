"""vLLM's bare baseline, run by bare_engines.py in vLLM's own venv (.venv-vllm): its import,
the draft built and loaded by its own get_model (the EAGLE proposer's embedding and head
sharing included), and one forward over the captured states through its CPU attention
backend, with nothing of difftest's around it (no probes, no ledger, no bridge). The pieces
that stand in for vLLM's model runner (config, KV cache, attention metadata) are the
adapter's own (difftest/engines/vllm_engine/worker.py), reused so both sides pay the same.

    .venv-vllm/bin/python benchmarks/bare_vllm.py SERVED_DIR TARGET_DIR STATES DTYPE
Prints one JSON line: seconds per phase.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    t0 = time.perf_counter()
    served, target, states_path, dtype = sys.argv[1:5]
    from difftest.engines.vllm_engine import worker  # sets vLLM's CPU environment before its import

    import torch
    import vllm.model_executor.models.llama_eagle3  # noqa: F401  the import a server pays
    from safetensors.torch import load_file

    t1 = time.perf_counter()
    draft = worker.Draft({"target": target, "served_dir": served, "dtype": dtype, "max_model_len": None,
                          "num_speculative_tokens": 1})
    t2 = time.perf_counter()
    states = load_file(states_path)
    seq_lens, ids = states["seq_lens"].to(torch.int64), states["input_ids"].to(torch.int64)
    positions = torch.arange(ids.numel()) - torch.repeat_interleave(torch.cumsum(seq_lens, 0) - seq_lens, seq_lens)
    blocks, table, slots = worker._layout(seq_lens, draft.spec.block_size)
    draft.allocate(blocks)
    with torch.no_grad():
        logits, _ = draft.forward(ids, positions, states["aux_hidden_states"], seq_lens, seq_lens.tolist(), table,
                                  slots, combine=True)
        logits.argmax(-1)
    t3 = time.perf_counter()
    print(json.dumps({"import": t1 - t0, "load": t2 - t1, "forward": t3 - t2}), flush=True)
    # As difftest's vLLM worker ends: without Python's module teardown, which neither side counts.
    from difftest.process_exit import exit_after_handlers

    exit_after_handlers(0)


if __name__ == "__main__":
    main()
