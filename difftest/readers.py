"""Hidden states captured somewhere else (a serving cluster, a datagen job), read into CapturedStates.

For targets too large for one machine the user captures states where the target runs and
brings the files here. Two layouts are read, each exactly as its producer writes it:

speculators datagen (a directory, or its `hidden_states/` folder):
    hidden_states/hs_{i}.safetensors   {"hidden_states": float [L, A+1, H], "token_ids": int64 [L]}
        row l is token l; slots 0..A-1 are the aux layers in id order, slot A the verifier's
        last state before its final norm (speculators' train/data.py reads it this way).
    the arrow dataset saved beside it (datasets.save_to_disk): columns input_ids, loss_mask;
        optional: without it every row counts as a response row.
    Files are taken in index order i = 0, 1, ...

SGLang server (a .json list or a .jsonl file, one object per request):
    {"input_ids": [prompt ids as sent], "output_ids": [...],
     "meta_info": {"hidden_states": [[prompt rows...], row, row, ...], ...}}
    i.e. the /generate response of a server started with --enable-return-hidden-states,
    requested with "return_hidden_states": true and temperature 0, with the request's
    input_ids added. hidden_states[0] is the prefill block (one row per prompt token),
    each later entry one decode step's row; the last output token is never fed back, so
    there are prompt + completion - 1 rows. With the target capturing aux layers for
    EAGLE-3 a row is the A aux states concatenated in layer order; the server returns no
    pre-norm verifier state, so the target's greedy continuation is the response itself.

Both are shifted the way speculators' shift_batch and the EAGLE worker pair them (see
states.py): row t = token t+1 with the states at token t.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from difftest.errors import InputError
from difftest.states import ACCEPTED_LAYOUTS, CapturedStates, first_id_outside, first_nonfinite_row

DATAGEN_FILE = re.compile(r"^hs_(\d+)\.safetensors$")


class StatesLayout:
    DIFFTEST = "difftest"
    DATAGEN = "speculators-datagen"
    SGLANG_SERVER = "sglang-server"


def detect_layout(path: Path) -> str:
    if path.is_dir():
        return StatesLayout.DATAGEN
    if path.suffix in (".json", ".jsonl"):
        return StatesLayout.SGLANG_SERVER
    return StatesLayout.DIFFTEST


def _pack(rows: list[dict], aux_layer_ids, source: str) -> CapturedStates:
    if not rows:
        raise InputError(f"{source}: no requests found")
    cat = lambda key: torch.cat([r[key] for r in rows])  # noqa: E731
    last = [r["last"] for r in rows]
    return CapturedStates(
        input_ids=cat("ids"),
        seq_lens=torch.tensor([r["ids"].numel() for r in rows], dtype=torch.int64),
        aux_hidden_states=cat("aux").float(),
        verifier_last_hidden_states=None if any(v is None for v in last) else torch.cat(last).float(),
        aux_layer_ids=tuple(aux_layer_ids),
        loss_mask=cat("mask").to(torch.uint8),
        first_token_ids=torch.tensor([r["first"] for r in rows], dtype=torch.int64),
    )


# --- speculators datagen -------------------------------------------------------------

def _datagen_files(path: Path) -> list[Path]:
    folder = path / "hidden_states" if (path / "hidden_states").is_dir() else path
    found = sorted(((int(m.group(1)), f) for f in folder.iterdir() if (m := DATAGEN_FILE.match(f.name))))
    if not found:
        raise InputError(f"{path}: no hs_<i>.safetensors files (speculators datagen layout) found; {ACCEPTED_LAYOUTS}")
    indices = [i for i, _ in found]
    if indices != list(range(len(indices))):
        gaps = sorted(set(range(max(indices) + 1)) - set(indices))[:5]
        raise InputError(f"{path}: datagen files are not numbered 0..{len(indices) - 1} (missing hs_{gaps[0]} ...)")
    return [f for _, f in found]


def _datagen_loss_masks(path: Path, n: int) -> list[list[int]] | None:
    root = path.parent if path.name == "hidden_states" else path
    if not (root / "dataset_info.json").is_file():
        return None
    import datasets

    ds = datasets.load_from_disk(str(root))
    if "loss_mask" not in ds.column_names or len(ds) != n:
        raise InputError(f"{root}: dataset beside the hidden states has {len(ds)} rows and columns {ds.column_names}; "
                         f"expected {n} rows with loss_mask")
    return [list(m) for m in ds["loss_mask"]]


def _check_ids(ids: torch.Tensor, vocab_size: int | None, where: str) -> None:
    if vocab_size is not None:
        k = first_id_outside(ids, vocab_size)
        if k is not None:
            raise InputError(f"{where}: token id {int(ids[k])} at position {k} is outside the target vocab [0, {vocab_size})")


def read_datagen(path: str | Path, aux_layer_ids, max_requests: int | None = None,
                 vocab_size: int | None = None) -> CapturedStates:
    path = Path(path)
    every = _datagen_files(path)
    masks = _datagen_loss_masks(path, len(every))
    files = every[:max_requests] if max_requests else every
    A = len(aux_layer_ids)
    rows = []
    for i, f in enumerate(files):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                hs, tok = h.get_tensor("hidden_states"), h.get_tensor("token_ids")
        except Exception as exc:
            raise InputError(f"{f}: not a datagen hidden-states file ({exc})") from None
        if hs.dim() != 3 or hs.shape[0] != tok.shape[0] or hs.shape[1] != A + 1 or tok.shape[0] < 2:
            raise InputError(f"{f}: hidden_states must be [L, {A}+1, H] with L = len(token_ids) >= 2, "
                             f"found {list(hs.shape)} for {list(tok.shape)} tokens")
        if tok.dim() != 1 or tok.is_floating_point() or tok.dtype == torch.bool or tok.is_complex():
            raise InputError(f"{f}: token_ids must be integer ids [L], found {str(tok.dtype).replace('torch.', '')} "
                             f"{list(tok.shape)}")
        _check_ids(tok, vocab_size, str(f))
        # The rows the reader keeps: aux slots of tokens 0..L-2, the verifier slot of tokens 1..L-1.
        row = first_nonfinite_row(torch.cat([hs[:-1, :A].flatten(1), hs[1:, A]], dim=1))
        if row is not None:
            raise InputError(f"{f}: hidden_states row {row} holds NaN or Inf")
        mask = torch.tensor(masks[i]) if masks else torch.ones(tok.shape[0], dtype=torch.uint8)
        if mask.shape[0] != tok.shape[0]:
            raise InputError(f"{f}: loss_mask has {mask.shape[0]} entries for {tok.shape[0]} tokens")
        rows.append({"ids": tok[1:].to(torch.int64), "aux": hs[:-1, :A].flatten(1), "last": hs[1:, A],
                     "mask": mask[1:], "first": int(tok[0])})
    return _pack(rows, aux_layer_ids, str(path))


def write_datagen(states: CapturedStates, path: str | Path) -> None:
    """The inverse of read_datagen, so the reader is tested on the exact layout."""
    import datasets

    seqs = _require_sequences(states)
    path = Path(path)
    (path / "hidden_states").mkdir(parents=True, exist_ok=True)
    A, H = len(states.aux_layer_ids), states.target_hidden_size
    bounds = torch.cumsum(states.seq_lens, 0) - states.seq_lens
    masks = []
    for i, (seq, start, n) in enumerate(zip(seqs, bounds.tolist(), states.seq_lens.tolist())):
        aux = states.aux_hidden_states[start:start + n].view(n, A, H)
        last = states.verifier_last_hidden_states[start:start + n]
        # The shift drops the last token's aux state and the first token's verifier state;
        # datagen has both, so they are written as zeros no reader of the shifted rows sees.
        aux_full = torch.cat([aux, aux.new_zeros(1, A, H)])
        last_full = torch.cat([last.new_zeros(1, H), last])
        hs = torch.cat([aux_full, last_full[:, None]], dim=1)
        save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(seq, dtype=torch.int64)},
                  str(path / "hidden_states" / f"hs_{i}.safetensors"))
        m = states.loss_mask[start:start + n].tolist() if states.loss_mask is not None else [1] * n
        masks.append([0] + m)
    datasets.Dataset.from_dict({"input_ids": seqs, "loss_mask": masks, "seq_len": [len(s) for s in seqs]}) \
        .save_to_disk(str(path))


# --- SGLang server -------------------------------------------------------------------

def _server_records(path: Path) -> list[dict]:
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    return data if isinstance(data, list) else [data]


def _ids(values, where: str, field: str) -> list[int]:
    if not isinstance(values, list) or not values and field == "input_ids":
        raise InputError(f"{where}: {field} must be a non-empty list of token ids")
    for k, v in enumerate(values):
        if type(v) is not int:  # bool is an int subclass, and 3.0 is not an id
            raise InputError(f"{where}: {field}[{k}] is {v!r}, expected an integer token id")
    return values


def _rows(blocks, where: str) -> torch.Tensor:
    """Prefill rows then one row per decode step, each the same width of finite numbers."""
    rows = list(blocks[0]) + list(blocks[1:])
    width = len(rows[0]) if isinstance(rows[0], list) else -1
    for k, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != width or width == 0:
            size = len(row) if isinstance(row, list) else type(row).__name__
            raise InputError(f"{where}: hidden-state row {k} has {size} values, expected {width} like row 0")
        if not all(type(v) in (float, int) for v in row):
            bad = next(v for v in row if type(v) not in (float, int))
            raise InputError(f"{where}: hidden-state row {k} holds {bad!r}, expected numbers")
    hs = torch.tensor(rows, dtype=torch.float32)
    row = first_nonfinite_row(hs)
    if row is not None:
        raise InputError(f"{where}: hidden-state row {row} holds NaN or Inf")
    return hs


def read_sglang_server(path: str | Path, aux_layer_ids, target_hidden: int, max_requests: int | None = None,
                       vocab_size: int | None = None) -> CapturedStates:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: server hidden-states file not found; {ACCEPTED_LAYOUTS}")
    records = _server_records(path)[: max_requests or None]
    if not records or not all(isinstance(r, dict) and "meta_info" in r for r in records):
        raise InputError(f"{path}: not SGLang server responses (no meta_info per request); {ACCEPTED_LAYOUTS}")
    A = len(aux_layer_ids)
    rows = []
    for n, rec in enumerate(records):
        where = f"{path}: request {n}"
        try:
            prompt, output = rec["input_ids"], rec["output_ids"]
            blocks = rec["meta_info"]["hidden_states"]
        except (KeyError, TypeError):
            raise InputError(f"{where}: needs input_ids, output_ids and meta_info.hidden_states "
                             "(a /generate response with return_hidden_states, plus the request's input_ids)") from None
        prompt, output = _ids(prompt, where, "input_ids"), _ids(output, where, "output_ids")
        if not isinstance(blocks, list) or not blocks or not isinstance(blocks[0], list) or not blocks[0] \
                or not isinstance(blocks[0][0], list):
            raise InputError(f"{where}: meta_info.hidden_states[0] must be the prefill block (a list of rows)")
        full = prompt + output
        _check_ids(torch.tensor(full, dtype=torch.int64), vocab_size, where)
        hs = _rows(blocks, where)
        if hs.shape[0] != len(full) - 1:
            raise InputError(f"{where}: {hs.shape[0]} hidden-state rows for {len(prompt)} prompt + {len(output)} "
                             f"output tokens; a server returns {len(full) - 1}")
        width = hs.shape[1]
        if width == target_hidden and A > 1:
            raise InputError(f"{where}: rows are {width} wide, one target layer: the server's target was not capturing "
                             f"aux hidden states (start it with the EAGLE-3 draft so it captures {A} layers)")
        if width != A * target_hidden:
            raise InputError(f"{where}: rows are {width} wide; {A} aux layers x target hidden {target_hidden} "
                             f"= {A * target_hidden} expected")
        mask = torch.tensor([0] * (len(prompt) - 1) + [1] * len(output), dtype=torch.uint8)
        rows.append({"ids": torch.tensor(full[1:], dtype=torch.int64), "aux": hs, "last": None,
                     "mask": mask, "first": full[0]})
    return _pack(rows, aux_layer_ids, str(path))


def write_sglang_server(states: CapturedStates, path: str | Path) -> None:
    """The inverse of read_sglang_server: responses as a server with aux capture returns them.
    Each request's prompt ends where its loss mask first turns on."""
    seqs = _require_sequences(states)
    bounds = torch.cumsum(states.seq_lens, 0) - states.seq_lens
    lines = []
    for seq, start, n in zip(seqs, bounds.tolist(), states.seq_lens.tolist()):
        mask = states.loss_mask[start:start + n].tolist() if states.loss_mask is not None else [0] * (n - 1) + [1]
        prompt_len = 1 + (mask.index(1) if 1 in mask else n - 1)
        aux = states.aux_hidden_states[start:start + n].tolist()
        blocks = [aux[:prompt_len]] + aux[prompt_len:]
        completion = len(seq) - prompt_len
        lines.append(json.dumps({"input_ids": seq[:prompt_len], "output_ids": seq[prompt_len:],
                                 "meta_info": {"hidden_states": blocks, "completion_tokens": completion}}))
    Path(path).write_text("\n".join(lines) + "\n")


def _require_sequences(states: CapturedStates) -> list[list[int]]:
    seqs = states.sequences()
    if seqs is None:
        raise ValueError("writing a capture layout needs first_token_ids (the unshifted sequences)")
    return seqs
