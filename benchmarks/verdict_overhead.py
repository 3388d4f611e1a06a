"""Verdict time against the bare engines, measured in the same run (ratios; these machines
are noisy, so each side runs --repeat times, interleaved, and medians are compared).

bare E     benchmarks/bare_engines.py --serving E: speculators' and serving engine E's own import +
           load + one forward, nothing else (vLLM in its own venv, a process of its own)
verdict E  `difftest report CKPT --serving E --no-audit-config --chain-steps 0 --no-target-capture`: the
           verdict, first divergence and diagnosis against E (both engines, probes, ledgers,
           vocab/capture/conversion audit, and the fp32 noise-floor run when the draft is stored in
           low precision)
full       `difftest report CKPT` against every serving engine: the verdicts plus the config audit,
           measured target capture and predicted acceptance, against the bare runs of all engines
Each is a fresh process, so each pays Python and torch start-up alike, and each ends without
Python's module teardown (difftest.process_exit; about 2 s once SGLang is imported, on both
sides, so neither counts it). Goals (#31): verdict / bare
<= 1.15, full / bare <= 1.5. The full report's phases (from its plain progress lines) show where
its time goes.

    python benchmarks/verdict_overhead.py [--repeat 3] [--full] [--out FILE]   (default: the embedded SmolLM2 fixture)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from difftest.engines import SERVING_ENGINES

HERE = Path(__file__).resolve().parent
# Every serving engine difftest has, as the default report serves on them all.
SERVING = tuple(SERVING_ENGINES)


def timed(cmd: list[str]) -> tuple[float, dict[str, float]]:
    """Wall seconds, and the seconds from each progress line to the next (a phase's share)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):  # 1 is a divergence verdict, a result like any other
        raise SystemExit(f"{' '.join(cmd[:4])}...: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    from difftest.progress import PLAIN_LINE

    marks = [(float(m["elapsed"]), m["note"]) for m in map(PLAIN_LINE.match, proc.stderr.splitlines()) if m]
    phases: dict[str, float] = {}
    for (t, what), (t_next, _) in zip(marks, marks[1:]):
        key = re.sub(r"\(.*", "", what).strip()  # the same phase in every run, whatever it names
        phases[key] = phases.get(key, 0.0) + t_next - t
    if marks:
        phases["outside the report (start-up, imports before it, exit)"] = wall - marks[-1][0]
    return wall, phases


def host() -> dict:
    from first_run import cpu_bf16  # the same bf16 probe the first-run benchmark records

    return {"cores": os.cpu_count(), "bf16": cpu_bf16()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--full", action="store_true", help="also time the full default report")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    from difftest.fixturegen.default import default_fixture

    fx = default_fixture(progress=False)
    ckpt = [str(fx.checkpoint), "--target", str(fx.target), "--states", str(fx.states), "--out"]
    difftest = [sys.executable, "-m", "difftest.cli", "report"]
    bare = [sys.executable, str(HERE / "bare_engines.py"), str(fx.checkpoint), str(fx.legacy), str(fx.target),
            str(fx.states), "--dtype", "auto", "--serving"]
    verdict = ["--no-audit-config", "--chain-steps", "0", "--no-target-capture"]
    # Per serving engine: training's and that engine's bare runs, against a report on that engine alone.
    cmds = {}
    for engine in SERVING:
        cmds[f"bare {engine}"] = bare + [engine]
        cmds[f"verdict {engine}"] = difftest + ckpt + [f"/tmp/difftest-bench-verdict-{engine}", "--serving", engine] + verdict
    if args.full:
        cmds["bare all"] = bare + [",".join(SERVING)]
        cmds["full"] = difftest + ckpt + ["/tmp/difftest-bench-full", "--serving", ",".join(SERVING)]
    seconds: dict[str, list[float]] = {k: [] for k in cmds}
    phases: dict[str, list[dict[str, float]]] = {k: [] for k in cmds}
    for _ in range(args.repeat):
        for name, cmd in cmds.items():
            wall, phase = timed(cmd)
            seconds[name].append(wall)
            phases[name].append(phase)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out = {"fixture": str(fx.checkpoint), "repeat": args.repeat, "host": host(), "seconds": seconds, "median_s": med,
           "ratio_verdict_over_bare": {e: med[f"verdict {e}"] / med[f"bare {e}"] for e in SERVING},
           "goal_verdict": 1.15}
    if "full" in med:
        out["ratio_full_report_over_bare"] = med["full"] / med["bare all"]
        out["goal_full"] = 1.5
        names = {k for run in phases["full"] for k in run}
        out["full_report_phases_median_s"] = {k: statistics.median(run.get(k, 0.0) for run in phases["full"])
                                              for k in sorted(names)}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
