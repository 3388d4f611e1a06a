"""The probe vocabulary: every name both engine adapters fill, in dataflow order.

This is the only place probe names are spelled. Adapters fill them, the comparison
walks them in this order, and the first one that fails is the first divergence.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ProbeKind(str, Enum):
    ACTIVATION = "activation"  # a float tensor [tokens, width]
    TOKENS = "tokens"  # an integer tensor [tokens]


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    kind: ProbeKind
    meaning: str


PROBES: tuple[ProbeSpec, ...] = (
    ProbeSpec("embed", ProbeKind.ACTIVATION, "token embedding of the input ids (shared from the target)"),
    ProbeSpec("fc.input", ProbeKind.ACTIVATION, "aux hidden states as fc multiplies them, after any input_norm / fc_norm"),
    ProbeSpec("fc.output", ProbeKind.ACTIVATION, "fc fusion of the aux states down to the draft width"),
    ProbeSpec("layer0.embed_norm", ProbeKind.ACTIVATION, "layer 0 input_layernorm applied to the embedding"),
    ProbeSpec("layer0.hidden_norm", ProbeKind.ACTIVATION, "layer 0 hidden_norm applied to the fused hidden state"),
    ProbeSpec("layer0.attn_output", ProbeKind.ACTIVATION, "layer 0 self-attention output (after o_proj)"),
    ProbeSpec("layer0.post_attn_residual", ProbeKind.ACTIVATION, "residual stream after the attention add"),
    ProbeSpec("layer0.mlp_output", ProbeKind.ACTIVATION, "layer 0 MLP output"),
    ProbeSpec("layer0.output", ProbeKind.ACTIVATION, "layer 0 output: MLP output plus residual"),
    ProbeSpec("final_norm", ProbeKind.ACTIVATION, "final RMSNorm, the input of lm_head"),
    ProbeSpec("logits", ProbeKind.ACTIVATION, "draft-vocab logits at every position"),
    ProbeSpec("draft_token", ProbeKind.TOKENS, "greedy draft token id (draft vocab)"),
    ProbeSpec("target_token", ProbeKind.TOKENS, "draft token mapped to a target-vocab id"),
    # Not on the path to this step's logits: what the next chain step starts from (the last
    # layer's output, or its normed form under EAGLE-3.1's norm_output), as the engine hands it on.
    ProbeSpec("next_step_hidden", ProbeKind.ACTIVATION, "the hidden state this draft step hands its next chain step"),
)

PROBE_NAMES: tuple[str, ...] = tuple(p.name for p in PROBES)
PROBE_BY_NAME: dict[str, ProbeSpec] = {p.name: p for p in PROBES}


def probe_index(name: str) -> int:
    return PROBE_NAMES.index(name)
