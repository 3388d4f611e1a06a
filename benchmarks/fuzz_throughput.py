"""Fuzz throughput, as ratios measured in one run (these machines are noisy; absolute
seconds are not goals).

The engine runtime is set up once per process (the first case pays the imports and is
reported separately). For each drawn case:
  build    writing the case's checkpoint, target and states (speculators builds the draft)
  engines  the two adapters' own load + forward, as each adapter times itself
  total    the case end to end through difftest (build, both engines, audit, comparison)
Prints examples per minute and total / engines, the harness's overhead over bare engines.

    python benchmarks/fuzz_throughput.py [--examples 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from hypothesis import HealthCheck, Phase, given, seed, settings

    from difftest import pipeline
    from difftest.cli import quiet_engines
    from difftest.fuzz import build_case, cases
    from difftest.tolerances import DTYPES

    quiet_engines(False)
    rows: list[dict] = []

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases().filter(lambda c: c["target_hidden_size"] == c["hidden_size"]))
    def one(case):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            ckpt, target, states = build_case(case, Path(tmp))
            t1 = time.perf_counter()
            result = pipeline.run(pipeline.prepare(ckpt, target, states), dtype=DTYPES[case["dtype"]], measure_noise=False)
        t2 = time.perf_counter()
        engines = sum(result.reference.timings_s.get(k, 0) + result.candidate.timings_s.get(k, 0) for k in ("load", "forward"))
        imports = result.reference.timings_s.get("import", 0) + result.candidate.timings_s.get("import", 0)
        rows.append({"build": t1 - t0, "total": t2 - t0, "engines": engines, "imports": imports})

    t0 = time.perf_counter()
    one()
    wall = time.perf_counter() - t0
    first, rest = rows[0], rows[1:] or rows
    total, engines = sum(r["total"] for r in rest), sum(r["engines"] for r in rest)
    out = {
        "examples": len(rows),
        "examples_per_minute_steady": 60 * len(rest) / total,
        "examples_per_minute_including_first": 60 * len(rows) / wall,
        "first_example_s": first["total"],
        "median_example_s": statistics.median(r["total"] for r in rest),
        "median_build_s": statistics.median(r["build"] for r in rest),
        "ratio_total_over_bare_engines": total / engines,
        "ratio_build_over_total": sum(r["build"] for r in rest) / total,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
