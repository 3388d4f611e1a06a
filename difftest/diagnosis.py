"""Signature -> named root cause. The rules are data; the matcher is a few lines.

A signature is the first divergent probe, its status, and words in its detail. Rules
are tried in order; the first that matches names the cause. Each rule carries the
explanation a user reads and a hint that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from difftest.compare import Comparison, Status


@dataclass(frozen=True)
class Rule:
    cause: str
    probes: tuple[str, ...]  # first divergence at one of these
    statuses: tuple[Status, ...] = (Status.FAIL, Status.MISSING, Status.SHAPE)
    detail_contains: str = ""
    explanation: str = ""
    fix: str = ""


RULES: tuple[Rule, ...] = (
    Rule(
        cause="aux_capture_off_fc_skipped",
        probes=("fc.input", "fc.output"),
        statuses=(Status.MISSING, Status.SHAPE),
        explanation=(
            "The serving draft received a hidden state as wide as its embedding, so SGLang's check "
            "`hidden_states.shape[-1] != embeds.shape[-1]` was false and the fc fusion of the aux layers "
            "was skipped. This happens when the target is not set up to capture EAGLE-3 aux hidden states "
            "and hands the draft its single last-layer state instead of the concatenation."
        ),
        fix=(
            "Serve the target with aux capture on: the target model class must implement "
            "set_eagle3_layers_to_capture and the draft config must carry eagle_config."
            "eagle_aux_hidden_state_layer_ids; check that the hidden states reaching the draft are "
            "num_aux x target_hidden wide."
        ),
    ),
    Rule(
        cause="embedding_precision",
        probes=("embed",),
        detail_contains="within low-precision rounding",
        explanation=(
            "The embeddings differ only by rounding: the checkpoint carries a low-precision copy of the target's "
            "embedding, which speculators uses, while SGLang's worker replaces it with the target's own (set_embed) "
            "at the run dtype. At the checkpoint's own dtype the two are identical."
        ),
        fix="Compare at the checkpoint's dtype (--dtype auto, the default), or ship embed_tokens at the target's precision.",
    ),
    Rule(
        cause="embedding_not_shared",
        probes=("embed",),
        explanation="The draft's token embedding differs from the target's: the serving draft did not receive the target's embedding.",
        fix="Share the target embedding with the draft (set_embed); check target_hidden_size equals hidden_size, or ship embed_tokens in the checkpoint.",
    ),
    Rule(
        cause="norm_before_fc_not_applied",
        probes=("fc.input",),
        explanation="The aux states entering fc differ: one engine normalizes them first (norm_before_fc / fc_norm) and the other does not.",
        fix="Carry norm_before_fc / fc_norm into the serving config (SGLang reads eagle_config.norm_before_fc and top-level fc_norm).",
    ),
    Rule(
        cause="norm_before_residual_ignored",
        probes=("layer0.post_attn_residual",),
        explanation=(
            "The residual stream after attention differs while attention itself agrees: the draft was trained "
            "with norm_before_residual=true (the residual is the normed hidden state), and the serving engine "
            "adds the un-normed hidden state."
        ),
        fix="Train with norm_before_residual=false for SGLang, or use a serving build that honors norm_before_residual.",
    ),
    Rule(
        cause="lm_head_mismatch",
        probes=("logits",),
        explanation=(
            "Everything up to the final norm agrees, but the logits do not: the serving draft multiplies by a "
            "different lm_head. Either the checkpoint's lm_head was not loaded (left at random init), or the "
            "worker replaced it with the target's full-vocab head (set_embed_and_head, taken when "
            "draft_vocab_size is missing from the config)."
        ),
        fix="Ship lm_head.weight in the checkpoint and set draft_vocab_size in the serving config so the worker takes set_embed, not set_embed_and_head.",
    ),
    Rule(
        cause="vocab_mapping_mismatch",
        probes=("target_token",),
        explanation="Draft tokens agree but their target ids do not: the engines read d2t differently (offsets vs absolute ids).",
        fix="Store d2t as offsets (target = draft + d2t[draft]), as speculators and SGLang both expect.",
    ),
    Rule(
        cause="decoder_math_divergence",
        probes=("layer0.embed_norm", "layer0.hidden_norm", "layer0.attn_output", "layer0.mlp_output", "layer0.output", "final_norm"),
        explanation="The decoder layer computes differently in the two engines from this probe on, with identical inputs.",
        fix="Compare the config fields that shape this sub-block (rope, eps, heads, head_dim, sliding window) between the checkpoint and the serving config.",
    ),
)


@dataclass
class Diagnosis:
    cause: str
    explanation: str
    fix: str
    probe: str | None

    def as_dict(self) -> dict:
        return {"cause": self.cause, "probe": self.probe, "explanation": self.explanation, "fix": self.fix}


def diagnose(comparison: Comparison) -> Diagnosis | None:
    first = comparison.first_divergence
    if first is None:
        return None
    for rule in RULES:
        if first.probe in rule.probes and first.status in rule.statuses and rule.detail_contains in first.detail:
            return Diagnosis(rule.cause, rule.explanation, rule.fix, first.probe)
    return Diagnosis(
        "unexplained_divergence",
        f"The engines first disagree at {first.probe} ({first.status.value}); no known signature matches.",
        "Read the per-probe table from this probe on and the load ledger.",
        first.probe,
    )
