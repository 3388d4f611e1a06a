"""Training-time capture: aux hidden states the way speculators' training data holds them.

Convention (speculators 0.9.0, `models/utils.py` and `train/data.py`): layer id k is HF
`hidden_states[k]`, where index 0 is the embedding output and index k the output of
decoder layer k-1. The verifier's last state is the input of the final norm: HF's
`hidden_states[-1]` is taken after that norm in transformers 5.19, so a hook on the
norm's input is the only way to get the tensor the draft's `verifier_norm` expects.
For the same reason id n (allowed: the final state) is taken before the final norm, so
that id k always means "output of decoder layer k-1".
"""

from __future__ import annotations

import torch

from difftest.states import CapturedStates


@torch.no_grad()
def capture_states(model, sequences: list[list[int]], aux_layer_ids: list[int], loss_masks=None, shift: bool = False) -> CapturedStates:
    """shift=True pairs them as the draft consumes them (speculators' shift_batch, and the
    EAGLE worker): token t+1 with the target's states at token t, and the verifier state
    that scores token t+1's prediction."""
    from difftest.target import layer_boundaries

    model.eval()
    aux_parts, last_parts = [], []
    for ids in sequences:
        hs = layer_boundaries(model, ids)
        aux_parts.append(torch.cat([hs[k] for k in aux_layer_ids], dim=-1))
        last_parts.append(hs[-1])
    first = None
    if shift:
        first = torch.tensor([ids[0] for ids in sequences], dtype=torch.int64)
        aux_parts = [a[:-1] for a in aux_parts]
        last_parts = [v[1:] for v in last_parts]
        sequences = [ids[1:] for ids in sequences]
        loss_masks = None if loss_masks is None else [m[1:] for m in loss_masks]
    flat = [t for ids in sequences for t in ids]
    mask = None
    if loss_masks is not None:
        mask = torch.tensor([m for ms in loss_masks for m in ms], dtype=torch.uint8)
    return CapturedStates(
        input_ids=torch.tensor(flat, dtype=torch.int64),
        seq_lens=torch.tensor([len(s) for s in sequences], dtype=torch.int64),
        aux_hidden_states=torch.cat(aux_parts),
        verifier_last_hidden_states=torch.cat(last_parts),
        aux_layer_ids=tuple(aux_layer_ids),
        loss_mask=mask,
        first_token_ids=first,
    )
