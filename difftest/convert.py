"""Convert a draft checkpoint between speculators' format and the legacy / SGLang format.

speculators -> legacy is what a user must do to serve a speculators-trained draft on
SGLang: SGLang reads a flat Llama config with `architectures: [LlamaForCausalLMEagle3]`.
Every field is carried (SGLang may still ignore some; the audit measures that), and the
few that have no honest equivalent are listed in `Conversion.notes`.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from difftest.checkpoint import LEGACY_ARCHITECTURE, Checkpoint, CheckpointFormat, load_checkpoint

# Draft-level EAGLE-3 flags that live at the top of a speculators config.
DRAFT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
LEGACY_LAYER_PREFIX = "midlayer."
# Aux layer ids mean different layers in the two formats. speculators' id k is HF
# hidden_states[k] (its datagen indexes the tuple directly); the legacy format's ids are
# what SGLang's set_eagle3_layers_to_capture receives, and it captures the input of layer
# k + 1, which is hidden_states[k + 1]. Verbatim copying is the off-by-one the brief lists;
# the capture audit measures the shift from SGLang's own code, and a test holds this to it.
LEGACY_AUX_ID_SHIFT = 1
# Bump when converted output changes, so cached conversions are rebuilt.
CONVERTER_VERSION = 3
# What a launch command writes for each stored dtype (SGLang's --dtype names).
DTYPE_FLAG = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The draft chain SGLang's EAGLE worker runs by default for a one-layer EAGLE-3 draft, topk 1.
SERVED_NUM_STEPS = 3
SPECULATORS_LAYER_PREFIX = "layers.0."


@dataclass
class Conversion:
    config: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)  # field -> what happened to it


def legacy_name(name: str) -> str:
    return LEGACY_LAYER_PREFIX + name[len(SPECULATORS_LAYER_PREFIX):] if name.startswith(SPECULATORS_LAYER_PREFIX) else name


def speculators_name(name: str) -> str:
    return SPECULATORS_LAYER_PREFIX + name[len(LEGACY_LAYER_PREFIX):] if name.startswith(LEGACY_LAYER_PREFIX) else name


def legacy_config(spec_config: dict[str, Any]) -> Conversion:
    layer = copy.deepcopy(spec_config["transformer_layer_config"])
    notes: dict[str, str] = {}
    out = {k: v for k, v in layer.items() if k not in ("architectures", "dtype", "transformers_version")}
    out["architectures"] = [LEGACY_ARCHITECTURE]
    out["model_type"] = "llama"
    out["draft_vocab_size"] = spec_config["draft_vocab_size"]
    hidden = layer["hidden_size"]
    out["target_hidden_size"] = spec_config.get("target_hidden_size") or hidden
    aux = spec_config.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None:
        aux = [int(k) - LEGACY_AUX_ID_SHIFT for k in aux]
        notes["eagle_aux_hidden_state_layer_ids"] = (f"shifted by -{LEGACY_AUX_ID_SHIFT} to SGLang's convention "
                                                     "(SGLang captures hidden_states[id + 1])")
    out["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": aux}
    for flag in DRAFT_FLAGS:
        out[flag] = bool(spec_config.get(flag, False))
    # Eagle3DraftModel always keeps its own draft-vocab lm_head; the flag it inherits from
    # the verifier's config describes the verifier, not the draft.
    if layer.get("tie_word_embeddings"):
        notes["tie_word_embeddings"] = "true in transformer_layer_config (inherited from the verifier); written false: the draft has its own lm_head"
    out["tie_word_embeddings"] = False
    if spec_config.get("embed_requires_grad"):
        notes["embed_requires_grad"] = "training-only, dropped"
    notes["speculators_config"] = "verifier and proposal settings have no legacy field; dropped"
    return Conversion(config=out, notes=notes)


def speculators_config(legacy: dict[str, Any], verifier_path: str | None = None) -> dict[str, Any]:
    layer = {k: v for k, v in legacy.items() if k not in (
        "architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", *DRAFT_FLAGS)}
    layer["architectures"] = ["LlamaForCausalLM"]
    layer["model_type"] = "llama"
    eagle = legacy.get("eagle_config") or {}
    hidden = legacy["hidden_size"]
    target_hidden = legacy.get("target_hidden_size")
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": legacy["draft_vocab_size"],
        "target_hidden_size": None if target_hidden in (None, hidden) else target_hidden,
        "eagle_aux_hidden_state_layer_ids": None if eagle.get("eagle_aux_hidden_state_layer_ids") is None else
            [int(k) + LEGACY_AUX_ID_SHIFT for k in eagle["eagle_aux_hidden_state_layer_ids"]],
        **{flag: bool(legacy.get(flag, eagle.get(flag, False))) for flag in DRAFT_FLAGS},
        "embed_requires_grad": False,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": verifier_path},
        },
    }


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves nothing behind
        raise
    if out_dir.exists():
        # Replacing (convert --force): the old directory is moved aside, not deleted, until the
        # new one holds its name, so no moment leaves the name empty or half written.
        old = out_dir.with_name(out_dir.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)


def speculators_to_legacy(src: str | Path | Checkpoint, out_dir: str | Path) -> Conversion:
    ckpt = src if isinstance(src, Checkpoint) else load_checkpoint(src)
    if ckpt.format is not CheckpointFormat.SPECULATORS:
        raise ValueError(f"{ckpt.path} is already in {ckpt.format.value} format")
    conv = legacy_config(ckpt.config)
    # SGLang's --dtype auto reads this; without it an fp32 draft would be served in fp16.
    conv.config["torch_dtype"] = DTYPE_FLAG.get(ckpt.stored_dtype(), "float32")
    _write(Path(out_dir), conv.config, {legacy_name(k): v for k, v in ckpt.tensors()})
    return conv


def converted_config(ckpt: Checkpoint) -> dict[str, Any]:
    """The config a correct conversion serves for this checkpoint (before the dtype it records):
    a legacy checkpoint's own, or the legacy form of a speculators one."""
    return legacy_config(ckpt.config).config if ckpt.format is CheckpointFormat.SPECULATORS else ckpt.config


def served_copy(src: Checkpoint, out_dir: Path) -> Conversion:
    """What `difftest convert` writes for SGLang: the legacy layout, from either format."""
    if src.format is CheckpointFormat.SPECULATORS:
        return speculators_to_legacy(src, out_dir)
    cfg = copy.deepcopy(src.config)
    cfg.setdefault("torch_dtype", DTYPE_FLAG.get(src.stored_dtype(), "float32"))
    _write(out_dir, cfg, dict(src.tensors()))
    return Conversion(cfg, {"format": "already legacy: copied"})


def launch_command(served_dir: str, target: str, dtype: torch.dtype, steps: int = SERVED_NUM_STEPS) -> list[str]:
    """The SGLang command that serves a converted draft as it was trained: EAGLE3 (aux
    capture on), a topk-1 chain, the draft's stored dtype."""
    return ["python", "-m", "sglang.launch_server", "--model-path", target,
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", served_dir,
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(steps + 1), "--dtype", DTYPE_FLAG.get(dtype, "float32")]


def legacy_to_speculators(src: str | Path | Checkpoint, out_dir: str | Path, verifier_path: str | None = None) -> None:
    ckpt = src if isinstance(src, Checkpoint) else load_checkpoint(src)
    if ckpt.format is not CheckpointFormat.LEGACY:
        raise ValueError(f"{ckpt.path} is already in {ckpt.format.value} format")
    _write(Path(out_dir), speculators_config(ckpt.config, verifier_path),
           {speculators_name(k): v for k, v in ckpt.tensors()})
