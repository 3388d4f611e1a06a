"""The chain (topk=1) draft as SGLang's EAGLE worker runs it, from every row at once.

Step 0 is the draft EXTEND over all rows (the target's aux states in). Step j >= 1 is one
DECODE in which every row t is its own request: its KV is the EXTEND's slots for its
request's rows up to t, then its own earlier chain steps; its input is the previous step's
draft token mapped to a target id by hot_token_id and the previous step's hidden state
(the draft's own output, pre-norm unless norm_output) -- what the worker feeds back.
"""

from __future__ import annotations

import torch

from difftest.engines.sglang_engine import batches
from difftest.states import CapturedStates


def request_starts(seq_lens: torch.Tensor) -> torch.Tensor:
    """[T]: for each packed row, the row its request starts at."""
    return torch.repeat_interleave(torch.cumsum(seq_lens, 0) - seq_lens, seq_lens)


def prefix_table(slots: torch.Tensor, seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[T + 1, width] req_to_token rows (row 0 is SGLang's unused one): row t + 1 lists the
    slots of row t's request up to and including t, then zeros."""
    T = int(slots.shape[0])
    starts = request_starts(seq_lens)
    local = torch.arange(T) - starts  # [T] each row's position in its request
    cols = torch.arange(width)
    keep = cols[None, :] <= local[:, None]
    src = (starts[:, None] + cols[None, :]).clamp(max=T - 1)
    table = torch.zeros(T + 1, width, dtype=torch.int64)
    table[1:] = torch.where(keep, slots.cpu()[src], 0)
    return table


@torch.no_grad()
def continue_chain(model, states: CapturedStates, extend: "batches.Extended", steps: int) -> torch.Tensor:
    """Draft-vocab ids [T, steps]: row t, step j is the draft's guess for the token j+1 after row t's."""
    T = states.num_tokens
    draft = [extend.draft]
    fed_back = extend.hidden
    if fed_back is None or fed_back.shape[0] != T:
        raise RuntimeError(f"draft EXTEND returned hidden states {None if fed_back is None else list(fed_back.shape)}, "
                           f"expected one row per token ({T})")
    lens = states.seq_lens
    local = torch.arange(T) - request_starts(lens)
    table = prefix_table(extend.slots, lens, int(lens.max()) + steps)
    hot = model.get_hot_token_id()
    for j in range(1, steps):
        prev = draft[-1]
        ids = hot.to(prev.device)[prev.clamp(max=hot.numel() - 1)] if hot is not None else prev
        new = extend.kv.take(T)
        table[torch.arange(1, T + 1), local + j] = new.cpu()
        kv_lens = local + j + 1
        batch, backend = batches.decode_batch(extend.kv, table, kv_lens, ids, (local + j), fed_back, new)
        out = batches.forward(model, batch, backend)
        draft.append(out.next_token_logits.argmax(dim=-1))
        fed_back = out.hidden_states
    return torch.stack([d.cpu() for d in draft], dim=1)
