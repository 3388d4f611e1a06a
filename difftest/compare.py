"""Compare two engines' probe records. Knows probe names and dtypes, nothing of engines.

Check functions are built by small factories (after Polygraphy's compare.py) and every
result records the tolerance that would have made it pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from difftest.probes import PROBES, ProbeKind
from difftest.tolerances import Tolerance

TOPK = 5


class Status(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    MISSING = "missing"  # one engine never computed it
    SHAPE = "shape_mismatch"


@dataclass
class ProbeResult:
    probe: str
    status: Status
    metrics: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    would_pass_at: dict[str, float] = field(default_factory=dict)
    detail: str = ""
    # the low-precision dtype at which both sides become equal (a precision mismatch, not
    # different math); None when rounding does not explain the difference
    equal_after_rounding_to: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.PASS

    def as_dict(self) -> dict:
        return {
            "probe": self.probe,
            "status": self.status.value,
            "metrics": self.metrics,
            "tolerance": self.tolerance,
            "would_pass_at": self.would_pass_at,
            "detail": self.detail,
            "equal_after_rounding_to": self.equal_after_rounding_to,
        }


def activation_metrics(ref: torch.Tensor, cand: torch.Tensor) -> dict[str, float]:
    # In float64, from three dot products and one difference: every report computes this for
    # each probe twice (against the serving engine and for the noise floor), and the logits
    # probes are tokens x vocab, where separate elementwise passes took 0.1 s a probe.
    r, c = ref.double().flatten(), cand.double().flatten()
    rr, cc, rc = torch.dot(r, r).item(), torch.dot(c, c).item(), torch.dot(r, c).item()
    low, high = torch.aminmax(r)
    scale = max(high.item(), -low.item())
    diff = torch.sub(r, c).abs_()  # not in place on r: .double() of a float64 probe is the probe itself
    max_abs = diff.max().item()
    denom = rr + cc
    rel_diff = 0.0 if denom == 0 else 1 - 2 * rc / denom
    # As torch.nn.functional.cosine_similarity: each norm clamped at its eps, so zeros give 0.
    eps = 1e-8
    cos = rc / (max(rr**0.5, eps) * max(cc**0.5, eps))
    return {
        "max_abs": max_abs,
        "mean_abs": diff.mean().item(),
        "scale": scale,
        "rel_max": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf")),
        "rel_diff": max(rel_diff, 0.0),
        "cosine": cos,
    }


def make_activation_check(tol: Tolerance) -> Callable[[str, torch.Tensor, torch.Tensor], ProbeResult]:
    def check(name: str, ref: torch.Tensor, cand: torch.Tensor) -> ProbeResult:
        m = activation_metrics(ref, cand)
        ok = m["rel_max"] <= tol.rel_max and m["rel_diff"] <= tol.rel_diff
        detail, rounded_to = "", None
        if not ok:
            # A difference that vanishes when both sides are rounded to a low-precision
            # dtype is a precision mismatch, not different math: say so.
            for low in (torch.bfloat16, torch.float16):
                if ref.dtype != low and torch.equal(ref.to(low), cand.to(low)):
                    rounded_to = str(low).replace("torch.", "")
                    detail = f"within low-precision rounding: equal after rounding both to {rounded_to}"
                    break
        return ProbeResult(
            probe=name,
            status=Status.PASS if ok else Status.FAIL,
            metrics=m,
            tolerance={"rel_max": tol.rel_max, "rel_diff": tol.rel_diff},
            would_pass_at={"rel_max": m["rel_max"], "rel_diff": m["rel_diff"]},
            detail=detail,
            equal_after_rounding_to=rounded_to,
        )

    return check


def make_token_check(tol: Tolerance, ref_logits: torch.Tensor | None, cand_logits: torch.Tensor | None,
                     logits_agree: bool = True):
    """Tokens must agree exactly, except at near-ties of the reference logits, and near-ties
    excuse a flip only when the logits themselves agreed within tolerance: a flip caused by
    logits that already diverged is part of that divergence, not noise."""

    def check(name: str, ref: torch.Tensor, cand: torch.Tensor) -> ProbeResult:
        agree = ref == cand
        m: dict[str, float] = {"agreement": agree.float().mean().item(), "mismatches": int((~agree).sum())}
        allowed = torch.zeros_like(agree)
        margin_needed = 0.0
        if ref_logits is not None and ref_logits.shape[-1] >= 2:
            top2 = ref_logits.topk(2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1]) / ref_logits.abs().max().clamp_min(1e-30)
            allowed = margin <= tol.near_tie_margin
            m["near_ties"] = int(allowed.sum())
            if not logits_agree:
                allowed = torch.zeros_like(agree)
            if (~agree).any():
                margin_needed = margin[~agree].max().item()
        if cand_logits is not None and ref_logits is not None and cand_logits.shape == ref_logits.shape:
            k = min(TOPK, cand_logits.shape[-1])
            topk = cand_logits.topk(k, dim=-1).indices
            ref_argmax = ref_logits.argmax(dim=-1, keepdim=True)
            m[f"top{k}_agreement"] = (topk == ref_argmax).any(dim=-1).float().mean().item()
        bad = ~agree & ~allowed
        m["unexplained_mismatches"] = int(bad.sum())
        return ProbeResult(
            probe=name,
            status=Status.PASS if not bad.any() else Status.FAIL,
            metrics=m,
            tolerance={"near_tie_margin": tol.near_tie_margin},
            would_pass_at={"near_tie_margin": margin_needed},
            detail=f"{m['mismatches']} of {agree.numel()} tokens differ" if m["mismatches"] else "",
        )

    return check


@dataclass
class Comparison:
    results: list[ProbeResult]

    @property
    def first_divergence(self) -> ProbeResult | None:
        return next((r for r in self.results if not r.ok), None)

    @property
    def parity(self) -> bool:
        return self.first_divergence is None


def compare_runs(
    reference: dict[str, torch.Tensor],
    candidate: dict[str, torch.Tensor],
    tol: Tolerance,
    missing: dict[str, str] | None = None,
) -> Comparison:
    """Walk the probes in dataflow order; reference is the training-time engine.
    `missing` says, per probe, why an engine never computed it."""
    missing = missing or {}
    act = make_activation_check(tol)
    results = []
    tok = None
    for spec in PROBES:
        ref, cand = reference.get(spec.name), candidate.get(spec.name)
        if ref is None or cand is None:
            side = "candidate" if cand is None else "reference"
            why = missing.get(spec.name, f"not recorded by the {side} engine")
            results.append(ProbeResult(spec.name, Status.MISSING, detail=why))
            continue
        if ref.shape != cand.shape:
            results.append(ProbeResult(
                spec.name, Status.SHAPE,
                detail=f"shape {list(cand.shape)} vs reference {list(ref.shape)}",
                metrics={"ref_shape": list(ref.shape), "cand_shape": list(cand.shape)},
            ))
            continue
        if spec.kind is ProbeKind.TOKENS and tok is None:
            logits_ok = next((r.ok for r in results if r.probe == "logits"), False)
            tok = make_token_check(tol, reference.get("logits"), candidate.get("logits"), logits_ok)
        check = act if spec.kind is ProbeKind.ACTIVATION else tok
        results.append(check(spec.name, ref, cand))
    return Comparison(results)
