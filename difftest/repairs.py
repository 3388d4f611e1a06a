"""One cause undone on a scratch copy of the checkpoint, so that its own cost can be measured.

A finding that names a defect difftest can put right says so as data: `measured["undo"] =
{"repair": NAME, "args": {...}}`. The pipeline writes a copy of the checkpoint (or, under a
deployment, of the served directory) with that one repair applied (the user's directory is
never touched), drafts the chains again on it in the engine the defect affects, and records
the accept length it recovers on the finding. A repair only rebuilds what the inputs
themselves say the right value is (the checkpoint's t2d, the training run's tensors, what a
correct conversion of the training config writes); it never guesses one.
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
    training_checkpoint: Checkpoint | None = None  # what was trained, when repairing a served copy


@dataclass(frozen=True)
class Repaired:
    tensors: dict[str, torch.Tensor]  # the tensors it replaces or adds
    undoes: str  # what the repaired copy changes, and from where, for the report
    config: dict | None = None  # the whole config to write instead, when the repair is in it


@dataclass(frozen=True)
class Repair:
    name: str
    apply: Callable[[Checkpoint, RepairSources, dict], Repaired]  # (checkpoint, sources, the finding's args)
    served_only: bool = False  # repairs a served directory against the training checkpoint
    # The copy computes, in the training engine, what the serving engine computes (a config field
    # it ignores, set to the value it behaves as): its cost is what training's acceptance loses
    # that way, before minus after. Measured on the training checkpoint only.
    emulates_serving: bool = False


class RepairNotApplicable(Exception):
    """The repair cannot be made on this input; the message says why (reported as not measured)."""


def _d2t_from_t2d(ckpt: Checkpoint, _sources: RepairSources, _args: dict) -> Repaired:
    """Offsets onto exactly the ids t2d selects: target = draft + d2t[draft] lands on them in order."""
    ids = torch.nonzero(ckpt.get("t2d").bool()).flatten()
    d2t = ckpt.get("d2t")
    return Repaired({"d2t": (ids - torch.arange(ids.numel())).to(d2t.dtype)},
                    "d2t rebuilt as offsets onto the ids t2d selects")


def _lm_head_restored(ckpt: Checkpoint, sources: RepairSources, _args: dict) -> Repaired:
    """The head the draft was trained with. From the training run's saved checkpoint when one
    is given, or the training checkpoint when the head is missing from a served copy of it; else
    the target's head rows at the draft's target ids, which is what speculators'
    `load_verifier_weights` writes and its trainer keeps frozen (speculators/model.py)."""
    dtype = ckpt.get("fc.weight").dtype if "fc.weight" in ckpt.tensor_names() else torch.float32
    if sources.training_run is not None:
        from difftest.audit.shortfall import final_training_checkpoint
        from difftest.checkpoint import load_checkpoint

        trained = load_checkpoint(final_training_checkpoint(sources.training_run))
        if "lm_head.weight" in trained.tensor_names():
            return Repaired({"lm_head.weight": trained.get("lm_head.weight").to(dtype)},
                            f"lm_head.weight put back from the training run ({trained.path})")
    # A served copy that lost the head: the training checkpoint has the one trained (SpecForge
    # trains its head, so the target's rows below are not it).
    trained = sources.training_checkpoint
    if trained is not None and "lm_head.weight" in trained.tensor_names():
        return Repaired({"lm_head.weight": trained.get("lm_head.weight").to(dtype)},
                        "lm_head.weight put back from the training checkpoint")
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


def _served_tensor_restored(served: Checkpoint, sources: RepairSources, args: dict) -> Repaired:
    """The trained tensor put back under the name the served directory gives it (or would:
    a missing one goes in under the name a correct conversion writes), at the served dtype."""
    trained = sources.training_checkpoint.get(args["training"])
    stored = served.stored_dtype()
    if trained.is_floating_point() and stored.is_floating_point:
        trained = trained.to(stored)
    return Repaired({args["served"]: trained}, f"served {args['served']} put back from the trained {args['training']}")


def _served_config_restored(served: Checkpoint, sources: RepairSources, args: dict) -> Repaired:
    """The served config's keys for one field set back to what a correct conversion of the
    training config writes (a key it does not write is removed)."""
    from difftest.convert import converted_config

    expected = converted_config(sources.training_checkpoint)
    config = json.loads(json.dumps(served.config))
    for key in args["keys"]:
        if key in expected:
            config[key] = expected[key]
        else:
            config.pop(key, None)
    return Repaired({}, f"served config {', '.join(args['keys'])} set back to what the conversion writes", config)


def _config_as_served(ckpt: Checkpoint, _sources: RepairSources, args: dict) -> Repaired:
    """The training config with the fields the serving engine ignores set to what it behaves as
    (the edits' paths are in the layout the config audit measured them in)."""
    layout = args.get("layout", "speculators")
    if ckpt.format.value != layout:
        raise RepairNotApplicable(f"the field is a path of {layout}'s layout; this checkpoint is in {ckpt.format.value}'s")
    config = json.loads(json.dumps(ckpt.config))
    for path, value in args["edits"]:
        node = config
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    said = ", ".join(f"{p.rsplit('.', 1)[-1]}={v!r}" for p, v in args["edits"])
    return Repaired({}, f"the training engine run as the serving engine computes it ({said})", config)


def _restored_from_training_run(ckpt: Checkpoint, sources: RepairSources, args: dict) -> Repaired:
    """The tensors changed since training put back as the training run saved them, each at the
    dtype the checkpoint stores it in."""
    from difftest.audit.shortfall import final_training_checkpoint

    trained = load_checkpoint(final_training_checkpoint(sources.training_run))
    tensors = {name: trained.get(trained_name).to(ckpt.get(name).dtype) for name, trained_name in args["tensors"]}
    return Repaired(tensors, f"{', '.join(tensors)} put back from the training run")


REPAIRS: dict[str, Repair] = {r.name: r for r in (
    Repair("d2t_from_t2d", _d2t_from_t2d),
    Repair("lm_head_restored", _lm_head_restored),
    Repair("served_tensor_restored", _served_tensor_restored, served_only=True),
    Repair("served_config_restored", _served_config_restored, served_only=True),
    Repair("config_as_served", _config_as_served, emulates_serving=True),
    Repair("restored_from_training_run", _restored_from_training_run),
)}


def repaired_copy(ckpt: Checkpoint, undo: dict, sources: RepairSources) -> tuple[Checkpoint, str]:
    """The checkpoint with one repair applied (a finding's `undo`), in a scratch directory that
    lives as long as the returned checkpoint, and what the repair changed. The config is copied
    unless the repair rewrites it; every tensor is rewritten."""
    repaired = REPAIRS[undo["repair"]].apply(ckpt, sources, undo.get("args") or {})
    scratch = tempfile.TemporaryDirectory(prefix="difftest-repair-")
    root = Path(scratch.name)
    (root / "config.json").write_text(json.dumps(repaired.config if repaired.config is not None else ckpt.config))
    tensors = dict(ckpt.tensors())
    tensors.update(repaired.tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    copy = load_checkpoint(root)
    return replace(copy, source=ckpt.origin, _scratch=scratch), repaired.undoes

