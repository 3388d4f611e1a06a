"""Probe and hook overhead against a bare forward, in the same process on the same loaded
models (ratios of medians over --repeat interleaved runs; absolute seconds are noise here).

For each engine, once its draft is loaded the way its adapter loads it:
  bare    the engine's forward alone: speculators' model(...) for one TTT step; SGLang's
          draft EXTEND over a fresh KV pool (the pool and batch are part of any forward)
  probed  the adapter's probed forward: the same forward with every probe hook in place,
          each probe copied to the host in fp32, plus draft and mapped target tokens
Goal: probed / bare <= 1.10 for each engine.

    python benchmarks/hook_overhead.py [--repeat 7] [--ckpt DIR --target DIR --states FILE] [--dtype auto|fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def median_ratio(bare, probed, repeat: int) -> dict:
    bare(), probed()  # warm-up: first-call allocations and lazy imports are not overhead
    b, p = [], []
    for _ in range(repeat):
        t0 = time.perf_counter(); bare(); b.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); probed(); p.append(time.perf_counter() - t0)
    return {"bare_s": statistics.median(b), "probed_s": statistics.median(p),
            "ratio": statistics.median(p) / statistics.median(b)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--ckpt")
    ap.add_argument("--target")
    ap.add_argument("--states")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    import torch

    from difftest import pipeline
    from difftest.cli import quiet_engines
    from difftest.engines.base import RunOptions
    from difftest.engines.sglang_engine import batches
    from difftest.tolerances import DTYPES

    quiet_engines(False)
    if args.ckpt:
        inputs = pipeline.prepare(args.ckpt, args.target, args.states)
    else:
        from difftest.fixturegen.default import default_fixture

        fx = default_fixture(progress=False)
        inputs = pipeline.prepare(fx.checkpoint, fx.target, fx.states)
    dtype = inputs.checkpoint.stored_dtype() if args.dtype == "auto" else DTYPES[args.dtype]
    options = RunOptions(dtype=dtype)
    states, ckpt, target = inputs.states, inputs.checkpoint, inputs.target
    out = {"checkpoint": str(ckpt.origin), "dtype": str(dtype), "tokens": states.num_tokens, "repeat": args.repeat}

    spec = pipeline.reference_adapter()
    model, config, _ = spec._build(ckpt, target, options)
    feed = spec._inputs(states, options, config.transformer_layer_config._attn_implementation)
    with torch.no_grad():
        out["speculators"] = median_ratio(lambda: model(**feed, ttt_steps=1),
                                          lambda: spec._forward(model, states, options, 1), args.repeat)
    del model

    sgl = pipeline.candidate_adapter()
    from difftest.engines.sglang_engine.runtime import ensure_runtime

    ensure_runtime(options.device)
    model, _, _ = sgl._build(ckpt, target, options)
    lens = states.seq_lens.tolist()
    hidden = states.aux_hidden_states.to(dtype=dtype)

    @torch.no_grad()
    def bare():
        kv = batches.KVSpace(model.config, states.num_tokens, options.device, dtype)
        batch, backend, _ = batches.extend_batch(kv, states.input_ids, lens, hidden)
        batches.forward(model, batch, backend).next_token_logits.argmax(-1)

    out["sglang"] = median_ratio(bare, lambda: sgl._forward(model, target, states, options, 1), args.repeat)
    out["goal"] = 1.10
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
