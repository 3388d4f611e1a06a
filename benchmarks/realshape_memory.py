"""Real-shape drafts end to end: verdict time, and peak RSS against the bytes that must be held.

Builds (once) a random draft at a published shape (`difftest build-fixtures NAME`), then in
the same run:
  imports  a bare process that imports both engines and sets up SGLang's runtime: the
           code and libraries any run must hold (peak RSS, /usr/bin/time -v);
  report   `difftest report CKPT --dtype bf16 --no-audit-config --chain-steps 4` under
           /usr/bin/time -v: verdict, fp32 noise floor and predicted acceptance.
           (The config audit re-loads the draft once per config field, and the target
           stand-in has no layers to measure capture on; both are off here.)
and prints:
  unavoidable = imports + the target's shared embedding, head and norm + the states
                + the largest draft model one engine phase holds: the draft's tensors at
                the phase's dtype (fp32 for the noise-floor run). The engines run one after
                the other, so one draft model at a time is what must be resident.
  peak RSS / unavoidable (goal <= 1.3), and the verdict's wall time (goal < 3 min at the
  8B shape on 2 cores). Absolute figures are printed for the record only.

    python benchmarks/realshape_memory.py [--shape llama3.1-8b|kimi-k2.5] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "BOOL": 1, "U8": 1}


def tensor_bytes(path: Path, float_itemsize: int | None = None) -> int:
    """Bytes of every tensor under path; floating-point ones at float_itemsize when given."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                n = 1
                for d in s.get_shape():
                    n *= d
                dt = s.get_dtype()
                size = float_itemsize if float_itemsize and dt in ("BF16", "F16", "F32") else ITEMSIZE[dt]
                total += n * size
    return total


def time_v(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float, str]:
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) * 1024
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)
    return proc, rss, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3.1-8b")
    ap.add_argument("--root", type=Path, default=None)
    args = ap.parse_args()
    root = args.root or Path(".cache/difftest") / args.shape
    if not (root / "speculators" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "difftest.cli", "build-fixtures", args.shape, "--out", str(root)], check=True)
    imports = ("from difftest.cli import quiet_engines; quiet_engines(False);"
               "from difftest.engines.sglang_engine.runtime import ensure_runtime; ensure_runtime('cpu');"
               "import sglang.srt.models.llama_eagle3, speculators.models.eagle3, transformers")
    _, import_rss, _ = time_v([sys.executable, "-c", imports])
    proc, rss, wall = time_v([sys.executable, "-m", "difftest.cli", "report", str(root / "speculators"), "--dtype", "bf16",
                              "--no-audit-config", "--chain-steps", "4", "--out", str(root / "report"), "-q"])
    if proc.returncode not in (0, 1):
        raise SystemExit(proc.stderr[-3000:])
    shared = tensor_bytes(root / "target") + tensor_bytes(root / "states.safetensors")
    draft_bf16, draft_fp32 = tensor_bytes(root / "speculators", 2), tensor_bytes(root / "speculators", 4)
    unavoidable = import_rss + shared + draft_fp32  # the noise-floor phase holds the fp32 draft
    minutes, seconds = wall.split(":")[-2:]
    print(json.dumps({
        "shape": args.shape, "verdict": proc.stdout.strip(), "wall": wall,
        "wall_s": int(minutes) * 60 + float(seconds), "peak_rss_gib": rss / 2**30,
        "unavoidable_gib": {"imports": import_rss / 2**30, "target_and_states": shared / 2**30,
                            "draft_fp32": draft_fp32 / 2**30, "total": unavoidable / 2**30},
        "draft_bf16_gib": draft_bf16 / 2**30,
        "ratio_peak_over_unavoidable": rss / unavoidable, "goal_ratio": 1.3, "goal_wall_s": 180,
    }, indent=2))


if __name__ == "__main__":
    main()
