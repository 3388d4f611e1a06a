"""Upstream divergences between speculators 0.9.0 and a serving engine that difftest has found
and that nobody can fix from this side. The parity suite marks them as expected failures
on the embedded fixture, so CI stays green and the divergence is never forgotten; on a
user's checkpoint they fail as usual, because there they are the user's problem.
"""

from __future__ import annotations

from typing import Callable

from difftest.audit.findings import Finding, Severity
from difftest.checkpoint import Checkpoint

KNOWN_UPSTREAM_DIVERGENCES: dict[str, str] = {
    "norm_before_residual_ignored": (
        "speculators' trainer defaults to norm_before_residual=true; sglang 0.5.23's "
        "LlamaForCausalLMEagle3 input layer always keeps the un-normed hidden state as the "
        "residual (llama_eagle3.py, LlamaDecoderLayer.forward) and reads no such flag."
    ),
    "dynamic_rope_scaling_differs": (
        "found by difftest fuzz (fixtures/regressions/): with rope_type dynamic, transformers' "
        "dynamic NTK rotary embedding (speculators' layers) rescales only past the original "
        "max_position_embeddings, while sglang 0.5.23's DynamicNTKScalingRotaryEmbedding uses the "
        "scaled base at every length, so attention differs on ordinary-length requests."
    ),
    "multi_layer_draft_differs": (
        "found by difftest fuzz (fixtures/regressions/): sglang 0.5.23's LlamaForCausalLMEagle3 builds "
        "every decoder layer as the EAGLE-3 first layer, fed [embeddings, hidden state], while "
        "speculators' layers after the first read only the hidden state; layer 0 agrees and the "
        "output of a draft with more than one layer does not."
    ),
    "aux_layer_count_not_read": (
        "found by difftest fuzz against vLLM (fixtures/regressions/): vllm 0.32.0's EAGLE-3 LlamaModel sizes fc "
        "for num_aux_hidden_states, else the length of eagle_config's eagle_aux_hidden_state_layer_ids, else 3 "
        "(llama_eagle3.py, LlamaModel.__init__); its speculators config parser keeps the draft's own ids at the top "
        "level, which that count does not read, so a speculators draft trained on other than 3 aux layers fails "
        "to load (AutoWeightsLoader: fc.weight of the wrong width)."
    ),
    "norm_output_read_differently": (
        "specforge 0.2.0's OnlineEagle3Model hands each TTT step the pre-norm hidden state "
        "(algorithms/eagle3/model.py, `hidden_states = hidden_states_out`) and applies norm in compute_logits "
        "only when norm_output is set (modeling/draft/llama3_eagle.py); sglang 0.5.23 (llama_eagle3.py, "
        "`aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux`) and vllm 0.32.0 hand "
        "on the normed state when norm_output is true (EAGLE-3.1), so a SpecForge draft trained with it "
        "drafts every step after the first from another state than it was trained on."
    ),
}

# cause -> the serving engines it was found in (vLLM 0.32.0 reads norm_before_residual and
# builds later layers without the embeddings: on the embedded draft it agrees with training).
FOUND_IN: dict[str, frozenset[str]] = {
    "norm_before_residual_ignored": frozenset({"sglang"}),
    "dynamic_rope_scaling_differs": frozenset({"sglang"}),
    "multi_layer_draft_differs": frozenset({"sglang"}),
    "aux_layer_count_not_read": frozenset({"vllm"}),
    "norm_output_read_differently": frozenset({"sglang", "vllm"}),
}
# cause -> the training engines it was found with (speculators when not listed).
TRAINED_WITH: dict[str, frozenset[str]] = {
    "norm_output_read_differently": frozenset({"specforge"}),
}

# cause -> does this checkpoint have the feature?
_TRIGGERS: dict[str, Callable[[Checkpoint], bool]] = {
    # Measured by the config audit when it runs (its finding then replaces this one).
    "norm_before_residual_ignored": lambda c: c.spec.norm_before_residual,
    "multi_layer_draft_differs": lambda c: c.spec.num_hidden_layers > 1,
    "dynamic_rope_scaling_differs": lambda c: (c.spec.rope_scaling or {}).get("rope_type", (c.spec.rope_scaling or {}).get("type")) == "dynamic",
    # The load refusal reports it when it happens; this names it beside other findings.
    "aux_layer_count_not_read": lambda c: c.spec.num_aux != 3,
    # Measured by the next_step_hidden probe; this names it.
    "norm_output_read_differently": lambda c: c.config.get("norm_output") is True,
}


def check_known_divergences(ckpt: Checkpoint, serving_engine: str, training_engine: str = "speculators") -> list[Finding]:
    """Findings for features whose upstream divergence between this training engine and this
    serving engine is known but has no measured audit."""
    return [Finding("known", cause, Severity.ERROR, KNOWN_UPSTREAM_DIVERGENCES[cause])
            for cause, applies in _TRIGGERS.items() if serving_engine in FOUND_IN[cause]
            and training_engine in TRAINED_WITH.get(cause, frozenset({"speculators"})) and applies(ckpt)]
