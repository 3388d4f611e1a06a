"""Real-shape drafts end to end: wall time and peak RSS against the bytes that must be held.

Builds (once) a random draft at a published shape (`difftest build-fixtures NAME`), runs
`difftest report` on it in bf16 under `/usr/bin/time -v`, and prints:
  peak RSS / unavoidable bytes, where unavoidable = the draft checkpoint's tensors (each
  engine builds its own model from them, one after the other) + the target's shared
  embedding, head and norm + the captured states.
Absolute seconds are printed for the record only; the goal is the ratio.

    python benchmarks/realshape_memory.py [--shape llama3.1-8b|kimi-k2.5] [--root DIR]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path


def tensor_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                n = 1
                for d in s.get_shape():
                    n *= d
                total += n * {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "BOOL": 1, "U8": 1}[s.get_dtype()]
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3.1-8b")
    ap.add_argument("--root", type=Path, default=None)
    args = ap.parse_args()
    root = args.root or Path(".cache/difftest") / args.shape
    if not (root / "speculators" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "difftest.cli", "build-fixtures", args.shape, "--out", str(root)], check=True)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "difftest.cli", "report", str(root / "speculators"),
           "--dtype", "bf16", "--no-audit-config", "--chain-steps", "2", "--out", str(root / "report"), "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr).group(1)
    need = tensor_bytes(root / "speculators") + tensor_bytes(root / "target") + tensor_bytes(root / "states.safetensors")
    print(f"{args.shape}: verdict {proc.stdout.strip()}  wall {wall}  peak RSS {rss_kb / 2**20:.2f} GiB  "
          f"unavoidable {need / 2**30:.2f} GiB  ratio {rss_kb * 1024 / need:.2f}")


if __name__ == "__main__":
    main()
