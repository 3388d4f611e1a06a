"""The chain (topk=1) draft as SGLang's EAGLE worker runs it, from every row at once.

Step 0 is the draft EXTEND over all rows (the target's aux states in). Step j >= 1 is one
DECODE in which every row t is its own request: its KV is the EXTEND's slots for its
request's rows up to t, then its own earlier chain steps; its input is the previous step's
draft token mapped to a target id by hot_token_id and the previous step's hidden state
(the draft's own output, pre-norm unless norm_output) -- what the worker feeds back.
"""

from __future__ import annotations

import torch

from difftest.engines.base import RunOptions
from difftest.engines.sglang_engine import batches
from difftest.states import CapturedStates


@torch.no_grad()
def run_chain(model, states: CapturedStates, hidden: torch.Tensor, steps: int, options: RunOptions) -> torch.Tensor:
    """Draft-vocab ids [T, steps]: row t, step j is the draft's guess for the token j+1 after row t's."""
    device, dtype = options.device, options.dtype
    lens = [int(n) for n in states.seq_lens.tolist()]
    T = sum(lens)
    kv = batches.KVSpace(model.config, T * steps, device, dtype)
    batch, backend, slots = batches.extend_batch(kv, states.input_ids, lens, hidden.to(device=device, dtype=dtype))
    out = batches.forward(model, batch, backend)
    draft = [out.next_token_logits.argmax(dim=-1)]
    fed_back = out.hidden_states
    if fed_back is None or fed_back.shape[0] != T:
        raise RuntimeError(f"draft EXTEND returned hidden states {None if fed_back is None else list(fed_back.shape)}, "
                           f"expected one row per token ({T})")

    # Row t's prefix: its request's slots up to and including t.
    starts = torch.cumsum(states.seq_lens, 0) - states.seq_lens
    local = torch.cat([torch.arange(n) for n in lens])
    table = torch.zeros(T + 1, max(lens) + steps, dtype=torch.int64)
    slots_cpu = slots.cpu()
    row = 0
    for start, n in zip(starts.tolist(), lens):
        for t in range(n):
            table[row + 1, : t + 1] = slots_cpu[start: start + t + 1]
            row += 1
    hot = model.get_hot_token_id()
    for j in range(1, steps):
        prev = draft[-1]
        ids = hot.to(prev.device)[prev.clamp(max=hot.numel() - 1)] if hot is not None else prev
        new = kv.take(T)
        table[torch.arange(1, T + 1), local + j] = new.cpu()
        kv_lens = local + j + 1
        batch, backend = batches.decode_batch(kv, table, kv_lens, ids, (local + j), fed_back, new)
        out = batches.forward(model, batch, backend)
        draft.append(out.next_token_logits.argmax(dim=-1))
        fed_back = out.hidden_states
    return torch.stack([d.cpu() for d in draft], dim=1)
