"""Captured target hidden states: the one input both engines' drafts consume.

File format (safetensors, version 1):
    input_ids                    int64  [T]          packed token ids of all requests
    seq_lens                     int64  [R]          request lengths, sum(seq_lens) == T
    aux_hidden_states            float  [T, A*H]     the A aux layers concatenated, in id order
    verifier_last_hidden_states  float  [T, H]       optional: the target's last state BEFORE its final norm,
                                                     at the token row t predicts (t+1's state; see below)
    loss_mask                    uint8  [T]          optional: 1 where the token is a response token
    first_token_ids              int64  [R]          optional: each request's token before its first row,
                                                     so the target can be re-run on the exact sequences
Row t is one draft input: the token the draft embeds at t, with the target's aux states at
the token before it (speculators' shift_batch and the EAGLE worker pair them the same way),
and the verifier state whose head gives the target's next token after row t's token.
An SGLang server returns aux states only, so verifier states may be absent; the target's
greedy continuation is then the recorded sequence itself (temperature-0 responses).
metadata:
    difftest_states_version  "1"
    aux_layer_ids            JSON list, in HF convention: id k is HF hidden_states[k]
                             (k = 0 is the embedding output, k = n the last layer's output)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from difftest.errors import InputError

STATES_VERSION = "1"
REQUIRED = ("input_ids", "seq_lens", "aux_hidden_states")


@dataclass
class CapturedStates:
    input_ids: torch.Tensor
    seq_lens: torch.Tensor
    aux_hidden_states: torch.Tensor
    verifier_last_hidden_states: torch.Tensor | None
    aux_layer_ids: tuple[int, ...]
    loss_mask: torch.Tensor | None = None
    first_token_ids: torch.Tensor | None = None

    @property
    def target_hidden_size(self) -> int:
        return int(self.aux_hidden_states.shape[1]) // max(len(self.aux_layer_ids), 1)

    def sequences(self) -> list[list[int]] | None:
        """Each request's full token sequence (first token + rows), when the first tokens are known."""
        if self.first_token_ids is None:
            return None
        rows = self.input_ids.split(self.seq_lens.tolist())
        return [[int(f)] + r.tolist() for f, r in zip(self.first_token_ids, rows)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def head(self, max_tokens: int) -> "CapturedStates":
        """The first whole requests that fit in max_tokens (at least one request)."""
        lens = self.seq_lens.tolist()
        keep, total = 0, 0
        for n in lens:
            if keep and total + n > max_tokens:
                break
            keep, total = keep + 1, total + n
        return CapturedStates(
            input_ids=self.input_ids[:total],
            seq_lens=self.seq_lens[:keep],
            aux_hidden_states=self.aux_hidden_states[:total],
            verifier_last_hidden_states=None if self.verifier_last_hidden_states is None
            else self.verifier_last_hidden_states[:total],
            aux_layer_ids=self.aux_layer_ids,
            loss_mask=None if self.loss_mask is None else self.loss_mask[:total],
            first_token_ids=None if self.first_token_ids is None else self.first_token_ids[:keep],
        )


def save_states(states: CapturedStates, path: str | Path) -> None:
    tensors = {
        "input_ids": states.input_ids.to(torch.int64).contiguous(),
        "seq_lens": states.seq_lens.to(torch.int64).contiguous(),
        "aux_hidden_states": states.aux_hidden_states.contiguous(),
    }
    if states.verifier_last_hidden_states is not None:
        tensors["verifier_last_hidden_states"] = states.verifier_last_hidden_states.contiguous()
    if states.loss_mask is not None:
        tensors["loss_mask"] = states.loss_mask.to(torch.uint8).contiguous()
    if states.first_token_ids is not None:
        tensors["first_token_ids"] = states.first_token_ids.to(torch.int64).contiguous()
    metadata = {
        "difftest_states_version": STATES_VERSION,
        "aux_layer_ids": json.dumps(list(states.aux_layer_ids)),
    }
    save_file(tensors, str(path), metadata=metadata)


# What --states accepts, named in every error that could mean the wrong kind of input was given.
ACCEPTED_LAYOUTS = ("--states takes a difftest states file (.safetensors), a speculators datagen directory "
                    "(hidden_states/hs_<i>.safetensors), or SGLang /generate responses (.json/.jsonl)")


def load_states(path: str | Path) -> CapturedStates:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: hidden-states file not found; {ACCEPTED_LAYOUTS}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            missing = [n for n in REQUIRED if n not in names]
            if missing:
                raise InputError(f"{path}: hidden-states file lacks {missing}; expected {list(REQUIRED)} "
                                 f"({ACCEPTED_LAYOUTS})")
            t = {n: f.get_tensor(n) for n in names}
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: not a readable safetensors file ({exc}); {ACCEPTED_LAYOUTS}") from None
    try:
        aux_ids = tuple(json.loads(meta.get("aux_layer_ids", "[]")))
    except json.JSONDecodeError:
        raise InputError(f"{path}: metadata aux_layer_ids is not a JSON list") from None
    states = CapturedStates(
        input_ids=t["input_ids"],
        seq_lens=t["seq_lens"],
        aux_hidden_states=t["aux_hidden_states"],
        verifier_last_hidden_states=t.get("verifier_last_hidden_states"),
        aux_layer_ids=aux_ids,
        loss_mask=t.get("loss_mask"),
        first_token_ids=t.get("first_token_ids"),
    )
    _check_consistent(states, path)
    return states


def first_nonfinite_row(x: torch.Tensor, block: int = 4096) -> int | None:
    """The first row holding NaN or Inf, or None. In blocks of rows: a mask over all of them
    is half the states' size again."""
    for start in range(0, x.shape[0], block):
        bad = ~torch.isfinite(x[start:start + block]).reshape(min(block, x.shape[0] - start), -1).all(dim=1)
        if bad.any():
            return start + int(bad.nonzero()[0])
    return None


def first_id_outside(ids: torch.Tensor, vocab_size: int) -> int | None:
    """The position of the first token id outside [0, vocab_size), or None."""
    bad = (ids < 0) | (ids >= vocab_size)
    return int(bad.nonzero()[0]) if bad.any() else None


def _check_consistent(s: CapturedStates, path: Path) -> None:
    T = s.num_tokens
    if s.input_ids.dim() != 1 or s.input_ids.dtype != torch.int64:
        raise InputError(f"{path}: input_ids must be int64 [T], found {s.input_ids.dtype} {list(s.input_ids.shape)}")
    if int(s.seq_lens.sum()) != T or (s.seq_lens <= 0).any():
        raise InputError(f"{path}: seq_lens {s.seq_lens.tolist()[:8]} must be positive and sum to {T} tokens")
    for name in ("aux_hidden_states", "verifier_last_hidden_states"):
        x = getattr(s, name)
        if x is None:
            continue
        if x.dim() != 2 or x.shape[0] != T:
            raise InputError(f"{path}: {name} must be [{T}, width], found {list(x.shape)}")
        row = first_nonfinite_row(x)
        if row is not None:
            raise InputError(f"{path}: {name} row {row} holds NaN or Inf")
    for name, want in (("loss_mask", [T]), ("first_token_ids", [int(s.seq_lens.shape[0])])):
        x = getattr(s, name)
        if x is not None and list(x.shape) != want:
            raise InputError(f"{path}: {name} must be {want}, found {list(x.shape)}")


def check_states_fit(s: CapturedStates, target_hidden: int, num_aux: int, source: str) -> None:
    """The states must be as wide as the draft's config says, or no comparison is meaningful."""
    want = num_aux * target_hidden
    if s.aux_hidden_states.shape[1] != want:
        raise InputError(
            f"{source}: aux_hidden_states width {s.aux_hidden_states.shape[1]} does not match the draft config "
            f"({num_aux} aux layers x target hidden {target_hidden} = {want})"
        )
    if s.verifier_last_hidden_states is not None and s.verifier_last_hidden_states.shape[1] != target_hidden:
        raise InputError(
            f"{source}: verifier_last_hidden_states width {s.verifier_last_hidden_states.shape[1]} "
            f"does not match target hidden {target_hidden}"
        )
