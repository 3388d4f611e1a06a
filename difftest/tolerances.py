"""The one dtype-tolerance table. Every comparison in difftest reads its thresholds here.

rel_max  = max|a - b| / max|b|   (max error relative to the tensor's own scale)
rel_diff = 1 - 2<a,b> / (|a|^2 + |b|^2), in fp64 (SGLang's comparator metric)

fp32: two engines running the same math differ only by reduction order; the shared notes
measured bit-identical logits with sdpa and 2.4e-7 with eager attention.
bf16: justified by the bf16 noise floor, measured on the fixture as one engine's bf16 run
against its own fp32 run (see `difftest.noise`); the tests assert each bound sits between
1x and 8x that floor, so it is neither below the noise nor loose enough to hide a bug.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rel_max: float
    rel_diff: float
    # Token probes may differ only where the reference's top-1/top-2 logit margin is
    # within this many rel_max-scaled units of the logits' scale: a near-tie.
    near_tie_margin: float

    def as_dict(self) -> dict:
        return asdict(self)


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rel_max=1e-5, rel_diff=1e-10, near_tie_margin=1e-5),
    torch.bfloat16: Tolerance(rel_max=5e-2, rel_diff=3e-4, near_tie_margin=5e-2),
    torch.float16: Tolerance(rel_max=8e-3, rel_diff=2e-5, near_tie_margin=8e-3),
}

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    return TOLERANCES[dtype]
