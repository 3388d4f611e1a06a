"""Verdict time against the bare engines, measured in the same run (ratios; these machines
are noisy, so each side runs --repeat times, interleaved, and medians are compared).

bare     benchmarks/bare_engines.py: each engine's own import + load + one forward, nothing else
verdict  `difftest report CKPT --no-audit-config --chain-steps 0 --no-target-capture`: the verdict,
         first divergence and diagnosis (both engines, probes, ledgers, vocab/capture/conversion
         audit, and the fp32 noise-floor run when the draft is stored in low precision)
full     `difftest report CKPT`: the verdict plus the config audit, measured target capture and
         predicted acceptance (no goal; shown so the cost of each extra is visible)
Each is a fresh process, so each pays Python and torch start-up alike. Goal: verdict / bare <= 1.5.

    python benchmarks/verdict_overhead.py [--repeat 3] [--full]   (default: the embedded SmolLM2 fixture)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1):  # 1 is a divergence verdict, a result like any other
        raise SystemExit(f"{' '.join(cmd[:4])}...: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="also time the full default report")
    args = ap.parse_args()
    from difftest.fixturegen.default import default_fixture

    fx = default_fixture(progress=False)
    ckpt = [str(fx.checkpoint), "--target", str(fx.target), "--states", str(fx.states), "-q", "--out"]
    difftest = [sys.executable, "-m", "difftest.cli", "report"]
    cmds = {
        "bare": [sys.executable, str(HERE / "bare_engines.py"), str(fx.checkpoint), str(fx.legacy), str(fx.target), str(fx.states),
                 "--dtype", "auto"],
        "verdict": difftest + ckpt + ["/tmp/difftest-bench-verdict", "--no-audit-config", "--chain-steps", "0", "--no-target-capture"],
    }
    if args.full:
        cmds["full"] = difftest + ckpt + ["/tmp/difftest-bench-full"]
    seconds: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(args.repeat):
        for name, cmd in cmds.items():
            seconds[name].append(timed(cmd))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out = {"fixture": str(fx.checkpoint), "repeat": args.repeat, "median_s": med,
           "ratio_verdict_over_bare": med["verdict"] / med["bare"], "goal": 1.5}
    if "full" in med:
        out["ratio_full_report_over_bare"] = med["full"] / med["bare"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
