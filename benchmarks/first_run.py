"""The first run on a fresh machine: the default fixture built from an empty cache, then
the main job (`difftest report` on it), each step timed and set against bare baselines
measured in the same run on the same host (ratios; these machines are noisy).

Baselines:
  greedy_token_s   one greedy token of the target (a single-token forward with a KV cache of
                   one prompt), what generation is made of;
  train_step_s     one fp32 training step of the same draft: speculators' Eagle3DraftModel,
                   one packed 2048-token batch of captured states, its 3-step TTT loss,
                   backward and an AdamW step, what an epoch of training is made of;
  bare_engines_s   each engine's own import + load + forward (benchmarks/bare_engines.py),
                   speculators, SGLang and vLLM as the default report runs them, what a
                   report is made of.
It also records whether this CPU has a fast bf16 path (its flags, and a measured
bf16 / fp32 time for the 576 x 1728 matmul that dominated Muon's Newton-Schulz step).

    python benchmarks/first_run.py [--from-scratch [--epochs N]] [--out FILE]

Default: what a new user's first `difftest report` does (the shipped generations and draft,
verified and restored). --from-scratch: generation and training run for real.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def cpu_bf16() -> dict:
    import torch

    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    a, b = torch.randn(576, 1728), torch.randn(1728, 576)

    def timed(x, y) -> float:
        for _ in range(3):
            x @ y
        t0 = time.perf_counter()
        for _ in range(20):
            x @ y
        return (time.perf_counter() - t0) / 20

    fp32 = timed(a, b)
    bf16 = timed(a.bfloat16(), b.bfloat16())
    return {"avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags, "avx512f": "avx512f" in flags,
            "matmul_576x1728_fp32_s": fp32, "matmul_576x1728_bf16_s": bf16, "bf16_over_fp32": bf16 / fp32,
            "fast_bf16": bf16 / fp32 < 1.5}


def greedy_token_seconds(target: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompt = torch.arange(1, 41)[None]
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def train_step_seconds(cache: Path) -> float:
    """One fp32 AdamW step of the fixture's draft on a packed batch of its captured states."""
    import torch
    from safetensors.torch import load_file
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    root = cache / "smollm2"
    draft = root / "draft" / "speculators"
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft))
    config.transformer_layer_config._attn_implementation = "sdpa"
    config.speculators_config.verifier.name_or_path = str(root / "target")
    model = Eagle3DraftModel.from_pretrained(str(draft), config=config)
    model.load_verifier_weights()
    model = model.float().train()
    files = sorted((root / "data" / "hidden_states").glob("hs_*.safetensors"))
    parts, total = [], 0
    while total < 2048:
        for f in files:
            hs = load_file(str(f))
            parts.append(hs)
            total += hs["token_ids"].shape[0]
            if total >= 2048:
                break
    ids = torch.cat([p["token_ids"] for p in parts])[:2048]
    hidden = torch.cat([p["hidden_states"] for p in parts])[:2048]
    doc = torch.cat([torch.full((p["token_ids"].shape[0],), i) for i, p in enumerate(parts)])[:2048]
    pos = torch.cat([torch.arange(p["token_ids"].shape[0]) for p in parts])[:2048]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    loss_cfg = resolve_loss_config("kl_div", "eager")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _, loss, _ = model(hidden_states=hidden[:, :-1].flatten(1)[None], input_ids=ids[None], document_ids=doc[None],
                           loss_mask=torch.ones(1, 2048, dtype=torch.bool), position_ids=pos[None],
                           verifier_last_hidden_states=hidden[:, -1][None], ttt_steps=3, loss_config=loss_cfg)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bare_engines_seconds(cache: Path) -> float:
    from difftest.engines import SERVING_ENGINES  # the default report serves on every one

    root = cache / "smollm2"
    cmd = [sys.executable, str(HERE / "bare_engines.py"), str(root / "draft" / "speculators"), str(root / "draft" / "legacy"),
           str(root / "target"), str(root / "draft" / "states.safetensors"), "--dtype", "auto",
           "--serving", ",".join(SERVING_ENGINES)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=os.environ)
    return time.perf_counter() - t0


def tensors_against_manifest(draft_dir: Path) -> dict:
    """The rebuilt draft's tensors against the checksums the manifest recorded when the
    shipped draft was trained: which are bit for bit the trained ones."""
    from safetensors.torch import load_file

    from difftest.fixturegen.smollm2 import tensor_sha256

    want = json.loads((ROOT / "fixtures" / "smollm2" / "manifest.json").read_text())["draft"]["tensors"]
    got = {name: tensor_sha256(t) for f in sorted(draft_dir.glob("*.safetensors")) for name, t in load_file(f).items()}
    same = sorted(n for n in want if got.get(n) == want[n]["sha256"])
    return {"tensors_in_manifest": len(want), "bitwise_equal": len(same),
            "differ": sorted(set(want) - set(same)), "not_in_manifest": sorted(set(got) - set(want))}


def reproduction(training: dict, trained: dict | None, cache: Path) -> dict:
    """Does the draft trained here land where the shipped one did? The band is the shipped
    held-out full_acc_0 +- 2 standard errors of a rate measured on this many positions: a
    rebuild inside it cannot be told apart from the shipped draft on these held-out states."""
    import math

    manifest = json.loads((ROOT / "fixtures" / "smollm2" / "manifest.json").read_text())["training"]
    shipped, rebuilt = manifest["heldout"]["full_acc_0"], training["full_acc_0"]
    n = training.get("scored_positions")
    half = 2 * math.sqrt(shipped * (1 - shipped) / n) if n else None
    return {"shipped_full_acc_0": shipped, "rebuilt_full_acc_0": rebuilt, "scored_positions": n,
            "band": [shipped - half, shipped + half] if half else None,
            "inside_band": bool(half) and abs(rebuilt - shipped) <= half,
            # the manifest writes the cache as $CACHE; so does this, to compare the rest
            "same_trainer_arguments": bool(trained) and [a.replace(str(cache), "$CACHE") for a in trained["argv"]]
            == manifest.get("argv"),
            "epochs": (trained or {}).get("epochs")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from-scratch", action="store_true", help="generate and train for real")
    ap.add_argument("--epochs", type=int, default=None, help="with --from-scratch: training epochs")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    from difftest.cli import quiet_engines

    quiet_engines(False)

    with tempfile.TemporaryDirectory(prefix="difftest-first-run-") as tmp:
        env = {**os.environ, "DIFFTEST_CACHE": tmp, "CI": "1"}
        env.pop("DIFFTEST_FIXTURE_FROM_SCRATCH", None)
        if args.from_scratch:
            env["DIFFTEST_FIXTURE_FROM_SCRATCH"] = "1"
            if args.epochs:
                env["DIFFTEST_TRAIN_EPOCHS"] = str(args.epochs)
        # The main job exactly as a new user runs it (stdin closed, stderr not a terminal:
        # the plain progress lines), from an empty cache.
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "difftest.cli", "report", "--out", str(Path(tmp) / "reports")],
                              env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        first_run = time.perf_counter() - t0
        if proc.returncode not in (0, 1):
            raise SystemExit(f"difftest report: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        records = {}
        for rec in sorted((Path(tmp) / "smollm2").glob("*.done.json")):
            r = json.loads(rec.read_text())
            records[r["step"]] = r
        build_s = sum(r["seconds"] for r in records.values())
        os.environ["DIFFTEST_CACHE"] = tmp
        bare = bare_engines_seconds(Path(tmp))
        token = greedy_token_seconds(Path(tmp) / "smollm2" / "target")
        step = train_step_seconds(Path(tmp))
        training = json.loads((Path(tmp) / "smollm2" / "training.json").read_text())
        trained = next((r.get("trained") or r for name, r in records.items() if name.startswith(("draft", "train"))), None)
        rebuilt = tensors_against_manifest(Path(tmp) / "smollm2" / "draft" / "speculators") if args.from_scratch else None

    def baseline_for(name: str) -> tuple[str, float]:
        if name.startswith(("generate", "conversations")):
            return "greedy_token_s", token
        if name.startswith(("train", "draft")):
            return "train_step_s", step
        return "bare_engines_s", bare

    steps = {}
    for name, r in records.items():
        key, base = baseline_for(name)
        steps[name] = {"seconds": r["seconds"], "baseline": key, "ratio": r["seconds"] / base}
    report_s = first_run - build_s
    out = {
        "mode": "from-scratch" if args.from_scratch else "shipped generations and draft",
        "host": {"machine": platform.machine(), "processor": platform.processor(), "cores": os.cpu_count(),
                 "bf16": cpu_bf16()},
        "baselines": {"greedy_token_s": token, "train_step_s": step, "bare_engines_s": bare},
        "steps": steps,
        "fixture_build_s": build_s,
        "reports_s": report_s,
        "reports_over_bare_engines": report_s / bare,
        "first_run_s": first_run,
        "first_run_over_bare_engines": first_run / bare,
        "heldout_full_acc_0": training.get("full_acc_0"),
        "verdict_lines": proc.stdout.strip().splitlines(),
    }
    if args.from_scratch:
        out["reproduction"] = {**reproduction(training, trained, Path(tmp) / "smollm2"), "draft_tensors": rebuilt}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
