"""Refuse checkpoints no comparison can be honest about, with one line that says what was
found and what was expected.

Contradictions (config against itself or against the tensor shapes), non-finite weights
and vocab maps neither engine can index are input errors. A d2t that is wrong in one of
the *named* ways (absolute ids, arange subtracted, ...) is not: it is a diagnosis, and the
audit reports it.
"""

from __future__ import annotations

import torch

from difftest.checkpoint import Checkpoint
from difftest.errors import InputError

# audit.vocab causes that name how a d2t came to point outside the target vocab: those
# reach the report as a diagnosis instead of failing here.
NAMED_D2T_CORRUPTIONS = {"d2t_absolute_ids", "d2t_arange_subtracted"}


def _rows(ckpt: Checkpoint, suffix: str) -> list[tuple[str, torch.Size]]:
    return [(n, ckpt.shape(n)) for n in ckpt.tensor_names() if n.endswith(suffix)]


def _expect(ckpt: Checkpoint, suffix: str, want: tuple[int, ...], why: str) -> None:
    for name, shape in _rows(ckpt, suffix):
        if tuple(shape) != want:
            raise InputError(f"{ckpt.path}: {name} has shape {list(shape)}, expected {list(want)} ({why})")


def validate_config(ckpt: Checkpoint) -> None:
    s = ckpt.spec
    for field in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "target_vocab_size", "draft_vocab_size", "target_hidden_size"):
        if getattr(s, field) <= 0:
            raise InputError(f"{ckpt.path}: config {field} is {getattr(s, field)}, expected a positive integer")
    if s.num_attention_heads % s.num_key_value_heads:
        raise InputError(f"{ckpt.path}: num_attention_heads {s.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads {s.num_key_value_heads}")
    if s.draft_vocab_size > s.target_vocab_size:
        raise InputError(f"{ckpt.path}: draft_vocab_size {s.draft_vocab_size} exceeds the target vocab_size {s.target_vocab_size}")
    if s.aux_layer_ids is not None and len(set(s.aux_layer_ids)) != len(s.aux_layer_ids):
        raise InputError(f"{ckpt.path}: eagle_aux_hidden_state_layer_ids {list(s.aux_layer_ids)} repeats a layer")


# Positions a rotary cache may be built for. Long-context targets declare up to about a million
# (Qwen 1M: 1,010,000); SGLang builds a cos/sin cache of this many rows at construction.
MAX_POSITIONS = 1 << 22
# What the engines may build beyond the stored weights: the embedding they share from the target
# (vocab x hidden) and a head they poison when it is missing (draft vocab x hidden), plus slack
# for norms and buffers. Anything more is memory the config asks for that no weight backs.
SLACK_PARAMS = 1 << 20


def decoder_layers_stored(ckpt: Checkpoint) -> int:
    """Decoder layers the weights hold, under either format's prefix."""
    indices = {n.split(".")[1] for n in ckpt.tensor_names() if n.startswith("layers.") and n.count(".") > 1}
    return len(indices) + any(n.startswith("midlayer.") for n in ckpt.tensor_names())


def implied_parameters(ckpt: Checkpoint) -> int:
    """Parameters the engines allocate for this config: every size field enters here."""
    s = ckpt.spec
    H, D = s.hidden_size, s.head_dim
    attention = H * s.num_attention_heads * D * 2 + 2 * H * s.num_key_value_heads * D  # q/o + k/v
    layer = 2 * attention + 3 * H * s.intermediate_size  # the first layer reads 2H; counted for all
    return (s.num_hidden_layers * layer + H * s.num_aux * s.target_hidden_size
            + s.target_vocab_size * H + s.draft_vocab_size * H)


def validate_sizes(ckpt: Checkpoint) -> None:
    """Every size field bounded before anything is built: by the weights, or by a stated bound."""
    s = ckpt.spec
    layer_cfg = ckpt.config.get("transformer_layer_config", ckpt.config)
    stored = decoder_layers_stored(ckpt)
    if s.num_hidden_layers < 1 or s.num_hidden_layers > max(stored, 1):
        raise InputError(f"{ckpt.path}: config num_hidden_layers is {s.num_hidden_layers}, but the weights hold "
                         f"{stored} decoder layer(s); expected at most that many (each configured layer is built)")
    layer_types = layer_cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != s.num_hidden_layers):
        count = len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__
        raise InputError(f"{ckpt.path}: config layer_types has {count} entries, expected one per layer "
                         f"(num_hidden_layers {s.num_hidden_layers})")
    if not 1 <= s.max_position_embeddings <= MAX_POSITIONS:
        raise InputError(f"{ckpt.path}: config max_position_embeddings is {s.max_position_embeddings}, expected "
                         f"1..{MAX_POSITIONS} (engines build a rotary cache of that many positions)")
    implied, held = implied_parameters(ckpt), sum(ckpt.shape(n).numel() for n in ckpt.tensor_names())
    allowance = held + s.target_vocab_size * s.hidden_size + s.draft_vocab_size * s.hidden_size + SLACK_PARAMS
    if implied > allowance:
        raise InputError(f"{ckpt.path}: the config's sizes imply {implied:,} parameters, but the weights hold {held:,}; "
                         "a size field is larger than any stored tensor backs")


DTYPE_LABELS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_label(ckpt: Checkpoint) -> tuple[str, str] | None:
    """(config key, label) of the dtype the config declares, top level first."""
    for node, prefix in ((ckpt.config, ""), (ckpt.config.get("transformer_layer_config") or {}, "transformer_layer_config.")):
        for key in ("dtype", "torch_dtype"):
            if isinstance(node, dict) and isinstance(node.get(key), str):
                return prefix + key, node[key].replace("torch.", "")
    return None


def validate_dtype_label(ckpt: Checkpoint) -> None:
    """A dtype label that the stored weights cannot be cast to exactly makes the engines run
    different weights: speculators' from_pretrained casts to the label, SGLang's loader keeps
    what is stored. (A float32 label over bf16/fp16 weights casts exactly: no difference.)"""
    found = dtype_label(ckpt)
    if found is None or found[1] not in DTYPE_LABELS:
        return
    key, label = found
    stored = ckpt.stored_dtype()
    want = DTYPE_LABELS[label]
    if want == stored or want == torch.float32:
        return
    stored_name = next(n for n, d in DTYPE_LABELS.items() if d == stored)
    raise InputError(f"{ckpt.path}: config {key} says {label} but the weights are stored as {stored_name}; speculators "
                     f"casts them to {label} on load and SGLang keeps {stored_name}, so the two would run different "
                     f"weights; fix: set {key} to \"{stored_name}\" in config.json, or re-save the weights as {label}")


def validate_shapes(ckpt: Checkpoint) -> None:
    s = ckpt.spec
    H, D = s.hidden_size, s.head_dim
    _expect(ckpt, "embed_tokens.weight", (s.target_vocab_size, H), "vocab_size x hidden_size")
    _expect(ckpt, "lm_head.weight", (s.draft_vocab_size, H), "draft_vocab_size x hidden_size")
    _expect(ckpt, "fc.weight", (H, s.num_aux * s.target_hidden_size), "hidden_size x (aux layers x target_hidden_size)")
    for proj, heads in (("q_proj", s.num_attention_heads), ("k_proj", s.num_key_value_heads), ("v_proj", s.num_key_value_heads)):
        for name, shape in _rows(ckpt, f"self_attn.{proj}.weight"):
            # Only the first decoder layer reads [embedding, hidden state]; later layers read the hidden state.
            first = name.startswith(("layers.0.", "midlayer."))
            want = (heads * D, 2 * H if first else H)
            if tuple(shape) != want:
                raise InputError(f"{ckpt.path}: {name} has shape {list(shape)}, expected {list(want)} "
                                 f"(heads x head_dim, by {'2 x ' if first else ''}hidden_size)")
    _expect(ckpt, "self_attn.o_proj.weight", (H, s.num_attention_heads * D), "hidden_size x num_attention_heads x head_dim")
    _expect(ckpt, "mlp.gate_proj.weight", (s.intermediate_size, H), "intermediate_size x hidden_size")
    _expect(ckpt, "mlp.down_proj.weight", (H, s.intermediate_size), "hidden_size x intermediate_size")


def validate_values(ckpt: Checkpoint) -> None:
    for name, t in ckpt.tensors():
        # In blocks: a mask over a whole 8B-shape embedding is 0.5 GiB more to hold.
        if t.is_floating_point() and not all(torch.isfinite(b).all() for b in t.reshape(-1).split(1 << 24)):
            bad = sum(int((~torch.isfinite(b)).sum()) for b in t.reshape(-1).split(1 << 24))
            raise InputError(f"{ckpt.path}: {name} holds {bad} NaN/Inf values; expected finite weights")


def validate_vocab_maps(ckpt: Checkpoint) -> None:
    from difftest.audit.vocab import check_vocab

    N, V = ckpt.spec.draft_vocab_size, ckpt.spec.target_vocab_size
    if ckpt.has("d2t"):
        d2t = ckpt.get("d2t")
        if d2t.is_floating_point() or d2t.dtype == torch.bool or d2t.is_complex():
            raise InputError(f"{ckpt.path}: d2t has dtype {str(d2t.dtype).replace('torch.', '')}, expected int64 offsets")
        if d2t.dim() != 1 or d2t.shape[0] != N:
            raise InputError(f"{ckpt.path}: d2t has shape {list(d2t.shape)}, expected [{N}] (draft_vocab_size)")
    if ckpt.has("t2d"):
        t2d = ckpt.get("t2d")
        if t2d.is_floating_point() or t2d.is_complex() or (t2d.dtype != torch.bool and not ((t2d == 0) | (t2d == 1)).all()):
            raise InputError(f"{ckpt.path}: t2d has dtype {str(t2d.dtype).replace('torch.', '')}, expected a bool mask over the target vocab")
        if t2d.dim() != 1 or t2d.shape[0] != V:
            raise InputError(f"{ckpt.path}: t2d has shape {list(t2d.shape)}, expected [{V}] (target vocab_size)")
    if ckpt.has("d2t"):
        named = {f.cause for f in check_vocab(ckpt)} & NAMED_D2T_CORRUPTIONS
        mapped = ckpt.get("d2t").long() + torch.arange(N)
        if not named and (mapped.min() < 0 or mapped.max() >= V):
            raise InputError(f"{ckpt.path}: d2t maps draft ids to target ids in [{int(mapped.min())}, {int(mapped.max())}], "
                             f"expected inside [0, {V}) (target = draft + d2t[draft])")


def validate_checkpoint(ckpt: Checkpoint) -> None:
    validate_config(ckpt)
    validate_sizes(ckpt)
    validate_dtype_label(ckpt)
    validate_shapes(ckpt)
    validate_vocab_maps(ckpt)
    validate_values(ckpt)
