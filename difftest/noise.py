"""The low-precision noise floor: what rounding alone does to one engine's probes.

One engine's run at the low dtype is compared with its own fp32 run on the same inputs.
Cross-engine differences at that dtype are judged against this floor, which is how the
bf16 row of the tolerance table is justified rather than picked by hand.
"""

from __future__ import annotations

import torch

from difftest.compare import activation_metrics
from difftest.engines.base import EngineRun
from difftest.probes import PROBES, ProbeKind


def noise_floor(low: EngineRun, full: EngineRun) -> dict[str, dict[str, float]]:
    floor = {}
    for spec in PROBES:
        if spec.kind is not ProbeKind.ACTIVATION:
            continue
        a, b = low.probes.get(spec.name), full.probes.get(spec.name)
        if a is None or b is None or a.shape != b.shape:
            continue
        m = activation_metrics(b, a)
        floor[spec.name] = {"rel_max": m["rel_max"], "rel_diff": m["rel_diff"]}
    return floor
