"""`difftest capture`: the states a report needs, from a target and prompts.

The hidden states come from the serving engine's own target forward with aux capture, the
layers it resolves for this draft, as its server hands them to the draft
(`SGLangAdapter.capture_target`). speculators 0.9.0 has no capture code of its own: its
`generate_offline_data` asks a vLLM server (ExampleHiddenStatesConnector), so that route needs
the vLLM engine.

Prompts are token rows, as speculators' prepare-data writes them (`input_ids`, optional
`loss_mask`), or chats (`messages` / `conversations`), rendered with the target tokenizer's
own chat template the way speculators' preprocessing bounds them: one row per assistant turn,
the loss mask on what follows the prompt render.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from difftest.errors import InputError
from difftest.states import CapturedStates

ACCEPTED = ("a JSON list or JSONL file of records with input_ids (and optionally loss_mask), "
            "or with messages / conversations (a chat, rendered with the target's chat template)")


@dataclass(frozen=True)
class PromptRow:
    input_ids: list[int]
    loss_mask: list[int]


def _records(path: Path) -> list:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the prompts ({exc}); expected {ACCEPTED}") from None
    try:
        if text.lstrip().startswith("["):
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not JSON or JSONL ({exc.msg}, line {exc.lineno}); expected {ACCEPTED}") from None
    if not records:
        raise InputError(f"{path}: no prompts in it; expected {ACCEPTED}")
    return records


def _chat_rows(messages: list, tokenizer, where: str) -> list[PromptRow]:
    """speculators' _render_boundary_rows, on the target's own template: for each assistant
    turn, the render of the turns before it (with the generation prompt) is the boundary, and
    the render through it is the row."""
    turns = [{"role": m.get("role", m.get("from")), "content": m.get("content", m.get("value"))} for m in messages]
    rows = []
    for j, turn in enumerate(turns):
        if turn["role"] not in ("assistant", "gpt"):
            continue
        before = tokenizer.apply_chat_template(turns[:j], add_generation_prompt=True, tokenize=True)
        through = tokenizer.apply_chat_template(turns[:j + 1], add_generation_prompt=False, tokenize=True)
        before, through = list(_ids(before)), list(_ids(through))
        if through[:len(before)] != before:
            raise InputError(f"{where}: the chat template does not render turn {j} as a continuation of the turns "
                             "before it, so the loss mask's boundary is undefined")
        rows.append(PromptRow(through, [0] * len(before) + [1] * (len(through) - len(before))))
    if not rows:
        raise InputError(f"{where}: a chat with no assistant turn has nothing to score")
    return rows


def _ids(rendered) -> list[int]:
    # transformers 5 returns a BatchEncoding-like mapping from apply_chat_template(tokenize=True)
    return rendered["input_ids"] if hasattr(rendered, "keys") else rendered


def read_prompts(path: Path, target_dir: Path, vocab_size: int, max_positions: int) -> list[PromptRow]:
    """Every row checked against the target before any engine runs: ids in its vocab, lengths
    within its positions, at least two tokens (one row to draft from)."""
    tokenizer = None
    rows: list[PromptRow] = []
    for i, rec in enumerate(_records(Path(path))):
        where = f"{path}: record {i}"
        if not isinstance(rec, dict):
            raise InputError(f"{where} is not an object; expected {ACCEPTED}")
        if "input_ids" in rec:
            ids = rec["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InputError(f"{where}: input_ids must be a list of integers")
            mask = rec.get("loss_mask", [1] * len(ids))
            if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
                raise InputError(f"{where}: loss_mask must be 0/1 integers, one per input id")
            rows.append(PromptRow(list(ids), list(mask)))
        elif "messages" in rec or "conversations" in rec:
            if tokenizer is None:
                tokenizer = _tokenizer(target_dir, where)
            rows += _chat_rows(rec.get("messages", rec.get("conversations")), tokenizer, where)
        else:
            raise InputError(f"{where} has neither input_ids nor messages; expected {ACCEPTED}")
    for i, row in enumerate(rows):
        if len(row.input_ids) < 2:
            raise InputError(f"{path}: row {i} has {len(row.input_ids)} token(s); a draft needs at least two")
        bad = next((t for t in row.input_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InputError(f"{path}: row {i} holds token id {bad}, outside the target's vocabulary of {vocab_size}")
        if len(row.input_ids) > max_positions:
            raise InputError(f"{path}: row {i} has {len(row.input_ids)} tokens, more than the target's "
                             f"max_position_embeddings {max_positions}")
    return rows


def _tokenizer(target_dir: Path, where: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    except (OSError, ValueError) as exc:
        raise InputError(f"{where} is a chat, and the target {target_dir} has no tokenizer to render it "
                         f"({type(exc).__name__}); give input_ids instead") from None
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"{where} is a chat, and the target's tokenizer has no chat template; give input_ids instead")
    return tokenizer


def capture(checkpoint, target, rows: list[PromptRow], engine, options) -> CapturedStates:
    """The serving engine's target forward over the full rows, paired as the draft reads them:
    row t of a request is token t+1 with the target's states at token t (speculators'
    shift_batch; the EAGLE worker), so each request's first token is kept aside."""
    sequences = [r.input_ids for r in rows]
    served = engine.capture_target(checkpoint, target, sequences, options)
    if served.hf_layer_ids is None:
        raise InputError(f"{engine.name} captures no aux layers for this draft (it would feed it the target's last "
                         "state only); the states a report needs cannot come from it")
    keep, start = [], 0
    for n in (len(s) for s in sequences):
        keep.append(torch.arange(start, start + n - 1))
        start += n
    return CapturedStates(
        input_ids=torch.tensor([t for s in sequences for t in s[1:]], dtype=torch.int64),
        seq_lens=torch.tensor([len(s) - 1 for s in sequences], dtype=torch.int64),
        aux_hidden_states=served.hidden[torch.cat(keep)].float(),
        verifier_last_hidden_states=None,
        aux_layer_ids=tuple(served.hf_layer_ids),
        loss_mask=torch.tensor([m for r in rows for m in r.loss_mask[1:]], dtype=torch.uint8),
        first_token_ids=torch.tensor([s[0] for s in sequences], dtype=torch.int64),
    )
