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


@dataclass(frozen=True)
class Repair:
    name: str
    undoes: str  # what the repaired copy changes, for the report
    tensors: Callable[[Checkpoint], dict[str, torch.Tensor]]  # the tensors it replaces or adds


def _d2t_from_t2d(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Offsets onto exactly the ids t2d selects: target = draft + d2t[draft] lands on them in order."""
    ids = torch.nonzero(ckpt.get("t2d").bool()).flatten()
    d2t = ckpt.get("d2t")
    return {"d2t": (ids - torch.arange(ids.numel())).to(d2t.dtype)}


REPAIRS: dict[str, Repair] = {r.name: r for r in (
    Repair("d2t_from_t2d", "d2t rebuilt as offsets onto the ids t2d selects", _d2t_from_t2d),
)}


def repaired_copy(ckpt: Checkpoint, repair_name: str) -> Checkpoint:
    """The checkpoint with one repair applied, in a scratch directory that lives as long as
    the returned checkpoint. The config is copied as is; every tensor is rewritten."""
    repair = REPAIRS[repair_name]
    scratch = tempfile.TemporaryDirectory(prefix="difftest-repair-")
    root = Path(scratch.name)
    (root / "config.json").write_text(json.dumps(ckpt.config))
    tensors = dict(ckpt.tensors())
    tensors.update(repair.tensors(ckpt))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    copy = load_checkpoint(root)
    return replace(copy, source=ckpt.origin, _scratch=scratch)

