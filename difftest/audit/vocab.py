"""d2t / t2d checks. speculators stores d2t as offsets: target = draft + d2t[draft]; t2d is a
bool mask over the target vocab with exactly draft_vocab_size entries set."""

from __future__ import annotations

import torch

from difftest.audit.findings import Finding, Severity
from difftest.checkpoint import Checkpoint

CHECK = "vocab"


def _err(cause: str, message: str, **measured) -> Finding:
    return Finding(CHECK, cause, Severity.ERROR, message, measured)


# t2d says which ids the draft was trained on, so a d2t that disagrees with it can be rebuilt from it.
REBUILD_FROM_T2D = {"undo": {"repair": "d2t_from_t2d"}}


def mapping_summary(d2t: torch.Tensor | None, draft_vocab: int) -> dict:
    """What each engine does with the stored d2t, for the report."""
    if d2t is None:
        return {"speculators": "no mapping: draft ids used as target ids",
                "sglang": "hot_token_id is None: draft ids used as target ids"}
    ar = torch.arange(d2t.shape[0])
    mapped = (d2t + ar).tolist()
    return {"speculators": "target = draft + d2t[draft]", "sglang": "hot_token_id = d2t + arange; target = hot_token_id[draft]",
            "first_mapped_ids": mapped[:8], "last_mapped_ids": mapped[-4:]}


def check_vocab(ckpt: Checkpoint) -> list[Finding]:
    spec = ckpt.spec
    N, V = spec.draft_vocab_size, spec.target_vocab_size
    d2t = ckpt.get("d2t") if ckpt.has("d2t") else None
    t2d = ckpt.get("t2d") if ckpt.has("t2d") else None
    if N == V and d2t is None:
        return []
    if d2t is None:
        return [_err("d2t_missing", f"draft vocab {N} < target vocab {V} but the checkpoint has no d2t: "
                     "both engines will treat draft ids as target ids")]
    out: list[Finding] = []
    if d2t.dtype not in (torch.int64, torch.int32):
        out.append(_err("d2t_bad_dtype", f"d2t has dtype {d2t.dtype}, expected int64 offsets"))
        d2t = d2t.long()
    if d2t.dim() != 1 or d2t.shape[0] != N:
        return out + [_err("d2t_bad_length", f"d2t has shape {list(d2t.shape)}, expected [{N}] (draft_vocab_size)")]
    ar = torch.arange(N)
    mapped = d2t.long() + ar
    truth = torch.nonzero(t2d.bool()).flatten() if t2d is not None and t2d.shape == (V,) else None

    if t2d is not None:
        if t2d.shape != (V,):
            out.append(_err("t2d_bad_shape", f"t2d has shape {list(t2d.shape)}, expected [{V}] (target vocab)"))
        elif int(t2d.bool().sum()) != N:
            out.append(_err("t2d_bad_count", f"t2d selects {int(t2d.bool().sum())} ids, expected draft_vocab_size {N}"))
            truth = None

    # Name the corruption before the generic range checks, so the report says why.
    if truth is not None and not torch.equal(mapped, truth):
        if torch.equal(d2t.long(), truth):
            return out + [_err("d2t_absolute_ids", "d2t holds absolute target ids where offsets belong "
                               "(d2t == sorted(t2d ids)); every mapped token is shifted by its draft id",
                               mismatched=int((mapped != truth).sum()), **REBUILD_FROM_T2D)]
        if torch.equal(d2t.long() + 2 * ar, truth):
            return out + [_err("d2t_arange_subtracted", "d2t has arange subtracted from correct offsets "
                               "(d2t + 2*arange == t2d ids): the 'fix' that scrambles every token",
                               mismatched=int((mapped != truth).sum()), **REBUILD_FROM_T2D)]
        if not d2t.any():
            return out + [_err("d2t_all_zero", "d2t is all zeros: identity onto the first N target ids, "
                               "while t2d selects others", mismatched=int((mapped != truth).sum()),
                               **REBUILD_FROM_T2D)]
        out.append(_err("d2t_t2d_disagree", f"d2t and t2d disagree on {int((mapped != truth).sum())} of {N} draft ids",
                        mismatched=int((mapped != truth).sum()), **REBUILD_FROM_T2D))
    elif truth is None and not d2t.any() and N < V:
        out.append(Finding(CHECK, "d2t_all_zero", Severity.ERROR,
                           "d2t is all zeros: identity onto the first N target ids (no t2d to confirm)"))

    if mapped.min() < 0 or mapped.max() >= V:
        bad = int(((mapped < 0) | (mapped >= V)).sum())
        out.append(_err("d2t_out_of_range", f"{bad} mapped ids fall outside the target vocab [0, {V})", count=bad))
    if mapped.unique().numel() != N:
        out.append(_err("d2t_not_unique", f"mapped ids are not unique: {N - mapped.unique().numel()} collisions"))
    if not bool((mapped[1:] > mapped[:-1]).all()):
        out.append(Finding(CHECK, "d2t_not_monotonic", Severity.BENIGN,
                           "mapped ids are not increasing; both engines still index them the same way"))
    return out
