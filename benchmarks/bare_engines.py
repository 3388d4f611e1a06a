"""The baseline the harness is measured against: each engine's own import, load and one
forward over the captured states, with nothing of difftest's around them (no probes, no
ledgers, no audit). Run as its own process so that its wall time, like the harness's,
includes starting Python and importing torch.

speculators: Eagle3DraftModel.from_pretrained on the speculators-format draft, then
load_verifier_weights, one TTT step. SGLang: LlamaForCausalLMEagle3 from the legacy-format
draft's config, its load_weights, then what a server's EAGLE draft worker does to it
(eagle_worker_v2's init_token_map and init_lm_head, which share the target's embedding),
one draft EXTEND. Outside a server SGLang needs a process group, the CPU switch, a stand-in
for the target runner the worker asks for the embedding, and a ForwardBatch over its own
KV pools; difftest's runtime, worker stand-in and batch helpers are those minimum pieces,
reused here so both sides pay the same for them.

    python benchmarks/bare_engines.py SPECULATORS_DIR LEGACY_DIR TARGET_DIR STATES [--dtype bf16] [--device cpu]
        [--serving sglang,vllm]
Prints one JSON line: seconds per engine and phase.
"""

from __future__ import annotations

import argparse
import json
import time


def speculators_bare(ckpt: str, target: str, states, dtype, device: str) -> dict:
    t0 = time.perf_counter()
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    t1 = time.perf_counter()
    config = Eagle3SpeculatorConfig.from_pretrained(ckpt)
    config.transformer_layer_config._attn_implementation = "sdpa" if device == "cpu" else "simple_flex_attention"
    config.speculators_config.verifier.name_or_path = target
    model = Eagle3DraftModel.from_pretrained(ckpt, config=config)
    model.load_verifier_weights()
    model = model.to(device=device, dtype=dtype).eval()
    t2 = time.perf_counter()
    lens = states.seq_lens.tolist()
    with torch.no_grad():
        model(hidden_states=states.aux_hidden_states.to(device=device, dtype=dtype)[None],
              input_ids=states.input_ids.to(device)[None],
              document_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]).to(device)[None],
              position_ids=torch.cat([torch.arange(n) for n in lens]).to(device)[None], ttt_steps=1)
    t3 = time.perf_counter()
    return {"import": t1 - t0, "load": t2 - t1, "forward": t3 - t2}


def sglang_bare(ckpt: str, target: str, states, dtype, device: str) -> dict:
    import torch

    from difftest.checkpoint import load_checkpoint
    from difftest.engines.base import RunOptions
    from difftest.engines.sglang_engine import batches
    from difftest.engines.sglang_engine.adapter import SGLangAdapter
    from difftest.engines.sglang_engine.runtime import ensure_runtime
    from difftest.target import load_target

    t0 = time.perf_counter()
    ensure_runtime(device)
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    t1 = time.perf_counter()
    draft = load_checkpoint(ckpt)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLMEagle3(LlamaConfig(**draft.config)).eval()
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(draft.tensors())
    SGLangAdapter._share_target(model, load_target(target), RunOptions(dtype=dtype, device=device))
    t2 = time.perf_counter()
    with torch.no_grad():
        kv = batches.KVSpace(model.config, states.num_tokens, device, dtype)
        batch, backend, _ = batches.extend_batch(kv, states.input_ids, states.seq_lens.tolist(),
                                                 states.aux_hidden_states.to(device=device, dtype=dtype))
        batches.forward(model, batch, backend).next_token_logits.argmax(-1).cpu()
    t3 = time.perf_counter()
    return {"import": t1 - t0, "load": t2 - t1, "forward": t3 - t2}


def vllm_bare(ckpt: str, target: str, states_path: str, dtype) -> dict:
    """vLLM in its own venv, as the report's worker runs it: a process of its own, whose wall
    time (its Python start included) is what the report waits for."""
    import os
    import subprocess
    from pathlib import Path

    from difftest.engines.vllm_engine.adapter import DTYPE_NAMES, worker_python

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(here.parent)}
    t0 = time.perf_counter()
    proc = subprocess.run([str(worker_python()), str(here / "bare_vllm.py"), str(Path(ckpt).resolve()),
                           str(Path(target).resolve()), str(Path(states_path).resolve()), DTYPE_NAMES[dtype]],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"bare_vllm.py failed:\n{proc.stderr[-2000:]}")
    phases = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**phases, "process": time.perf_counter() - t0}


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser()
    ap.add_argument("speculators")
    ap.add_argument("legacy")
    ap.add_argument("target")
    ap.add_argument("states")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--serving", default="sglang", help="serving engines to time beside speculators: sglang,vllm")
    args = ap.parse_args()
    from difftest.cli import quiet_engines

    quiet_engines(False)
    from difftest.states import load_states
    from difftest.tolerances import DTYPES

    states = load_states(args.states)
    if args.dtype == "auto":  # as `difftest report` does: the dtype the draft is stored in
        from difftest.checkpoint import load_checkpoint

        dtype = load_checkpoint(args.speculators).stored_dtype()
    else:
        dtype = DTYPES[args.dtype]
    serving = args.serving.split(",")
    out = {"speculators": speculators_bare(args.speculators, args.target, states, dtype, args.device)}
    if "sglang" in serving:
        out["sglang"] = sglang_bare(args.legacy, args.target, states, dtype, args.device)
    if "vllm" in serving:  # vLLM reads the speculators-format draft itself
        out["vllm"] = vllm_bare(args.speculators, args.target, args.states, dtype)
    out["process_s"] = time.perf_counter() - t_start
    print(json.dumps(out))
    # difftest's command ends without Python's module teardown (about 2 s once SGLang is in);
    # the baseline ends the same way, so that neither side's wall time counts it.
    from difftest.process_exit import exit_after_handlers

    exit_after_handlers(0)


if __name__ == "__main__":
    main()
