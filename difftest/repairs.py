"""One cause undone on a scratch copy of the checkpoint, so that its own cost can be measured.

A finding that names a defect difftest can put right says so as data: `measured["undo"] =
{"repair": NAME}`. The pipeline writes a copy of the checkpoint with that one repair applied
(the user's directory is never touched), drafts the chains again on it in the engine the
defect affects, and records the accept length it recovers on the finding. A repair only
rebuilds what the checkpoint itself says the right value is; it never guesses one.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from difftest.checkpoint import Checkpoint, load_checkpoint
from difftest.target import TargetWeights


@dataclass(frozen=True)
class RepairSources:
    """What a repair may read besides the checkpoint: the inputs the user gave the run."""
    target: TargetWeights
    training_run: Path | None = None


@dataclass(frozen=True)
class Repaired:
    tensors: dict[str, torch.Tensor]  # the tensors it replaces or adds
    undoes: str  # what the repaired copy changes, and from where, for the report


@dataclass(frozen=True)
class Repair:
    name: str
    apply: Callable[[Checkpoint, RepairSources], Repaired]


def _d2t_from_t2d(ckpt: Checkpoint, _sources: RepairSources) -> Repaired:
    """Offsets onto exactly the ids t2d selects: target = draft + d2t[draft] lands on them in order."""
    ids = torch.nonzero(ckpt.get("t2d").bool()).flatten()
    d2t = ckpt.get("d2t")
    return Repaired({"d2t": (ids - torch.arange(ids.numel())).to(d2t.dtype)},
                    "d2t rebuilt as offsets onto the ids t2d selects")


def _lm_head_restored(ckpt: Checkpoint, sources: RepairSources) -> Repaired:
    """The head the draft was trained with. From the training run's saved checkpoint when one
    is given; else the target's head rows at the draft's target ids, which is what speculators'
    `load_verifier_weights` writes and its trainer keeps frozen (speculators/model.py)."""
    dtype = ckpt.get("fc.weight").dtype if "fc.weight" in ckpt.tensor_names() else torch.float32
    if sources.training_run is not None:
        from difftest.audit.shortfall import final_training_checkpoint
        from difftest.checkpoint import load_checkpoint

        trained = load_checkpoint(final_training_checkpoint(sources.training_run))
        if "lm_head.weight" in trained.tensor_names():
            return Repaired({"lm_head.weight": trained.get("lm_head.weight").to(dtype)},
                            f"lm_head.weight put back from the training run ({trained.path})")
    names = set(ckpt.tensor_names())
    if "t2d" in names:
        ids = torch.nonzero(ckpt.get("t2d").bool()).flatten()
    elif "d2t" in names:
        ids = torch.arange(ckpt.get("d2t").numel()) + ckpt.get("d2t").long()
    else:
        ids = torch.arange(sources.target.vocab_size)
    return Repaired({"lm_head.weight": sources.target.lm_head[ids].to(dtype)},
                    "lm_head.weight rebuilt from the target's head rows at the draft's target ids "
                    "(what speculators initializes and keeps frozen)")


REPAIRS: dict[str, Repair] = {r.name: r for r in (
    Repair("d2t_from_t2d", _d2t_from_t2d),
    Repair("lm_head_restored", _lm_head_restored),
)}


def repaired_copy(ckpt: Checkpoint, repair_name: str, sources: RepairSources) -> tuple[Checkpoint, str]:
    """The checkpoint with one repair applied, in a scratch directory that lives as long as
    the returned checkpoint, and what the repair changed. The config is copied as is; every
    tensor is rewritten."""
    repaired = REPAIRS[repair_name].apply(ckpt, sources)
    scratch = tempfile.TemporaryDirectory(prefix="difftest-repair-")
    root = Path(scratch.name)
    (root / "config.json").write_text(json.dumps(ckpt.config))
    tensors = dict(ckpt.tensors())
    tensors.update(repaired.tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    copy = load_checkpoint(root)
    return replace(copy, source=ckpt.origin, _scratch=scratch), repaired.undoes

