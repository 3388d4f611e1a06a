"""Signature -> named root cause. The rules are data; the matcher is a few lines.

A signature is the audit's error findings plus the first divergent probe (its status and
words in its detail). Rules are tried in order, most specific first; the first that
matches names the cause. A rule that needs a finding is what turns "logits differ" into
"lm_head left at random init". Each rule carries the explanation a user reads and a hint
that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from difftest.audit.findings import Finding, Severity
from difftest.compare import Comparison, Status

ANY_DIVERGENCE = (Status.FAIL, Status.MISSING, Status.SHAPE)


@dataclass(frozen=True)
class Rule:
    cause: str
    # first divergence at one of these; empty: the rule does not look at the probes
    probes: tuple[str, ...] = ()
    statuses: tuple[Status, ...] = ANY_DIVERGENCE
    rounding_only: bool = False  # the first divergence must vanish at a lower precision
    # an error finding with one of these causes must be present; empty: none needed
    findings: tuple[str, ...] = ()
    explanation: str = ""
    fix: str = ""
    # A finding rule's home: the probes its cause can change. It is reported at the first of
    # these that diverges, else at its audit check, never beside a probe it cannot affect.
    home: tuple[str, ...] = ()

    def matches(self, first, errors: set[str]) -> bool:
        if self.findings and not errors.intersection(self.findings):
            return False
        if not self.probes:
            return bool(self.findings)
        return (first is not None and first.probe in self.probes and first.status in self.statuses
                and (not self.rounding_only or first.equal_after_rounding_to is not None))


D2T_FIX = "Store d2t as offsets, target = draft + d2t[draft], with t2d the boolean mask of the same ids; rebuild both from the training vocab mapping."

RULES: tuple[Rule, ...] = (
    # Nothing else can be said about a deployment whose server would not start.
    Rule("served_format_not_servable", findings=("served_format_not_servable",),
         explanation=("The served directory is in speculators' format (config.json with speculators_config and "
                      "architectures Eagle3DraftModel, no model_type). SGLang reads a draft's config through "
                      "transformers' AutoConfig, which refuses it: a server launched with this command fails at start, "
                      "before any weight is loaded. Nothing was served, so nothing was compared."),
         fix=("Serve the legacy layout: `difftest convert TRAIN_CKPT OUT` writes it (aux ids in SGLang's convention, "
              "d2t offsets, every field SGLang reads) and prints the launch command. Or keep this directory and add "
              "--decrypted-draft-config-file F, F being a legacy config.json for it (SGLang loads layers.0.* names).")),
    # The launch command decides the rest of the wiring, so it is named before what it causes.
    Rule("served_config_not_servable", findings=("served_config_not_servable",),
         explanation=("SGLang cannot build the draft's model class from the served config.json (the error is in the "
                      "evidence): a server launched with this command fails at start, before any weight is loaded. "
                      "Nothing was served, so nothing was compared."),
         fix=("Write the config `difftest convert TRAIN_CKPT OUT` writes: every field SGLang reads, draft_vocab_size "
              "(the lm_head's rows) and target_hidden_size included.")),
    Rule("served_weights_refused", findings=("served_weights_refused",),
         explanation=("The serving engine's weight loader refuses a tensor the served directory holds (vLLM's "
                      "AutoWeightsLoader raises on a name no parameter of the draft has, where SGLang skips it without "
                      "a word): a server started on it fails while loading. Nothing was served, so nothing was "
                      "compared."),
         fix=("Name the tensors as training saved them (speculators' names, or `midlayer.*` in the legacy format): "
              "`difftest convert TRAIN_CKPT OUT` writes them.")),
    Rule("aux_layer_count_not_read", findings=("aux_layer_count_not_read",),
         explanation=("vLLM sizes the draft's fc for 3 aux layers unless its config says otherwise in a place its "
                      "EAGLE-3 model reads (num_aux_hidden_states, or eagle_config's layer ids); a speculators config "
                      "keeps the draft's own ids elsewhere, so a draft trained on another number of aux layers fails "
                      "to load: a vLLM server would not start. Nothing was compared."),
         fix=("vLLM 0.32.0 cannot serve this draft as it is: serve it on SGLang, or train with three aux layers "
              "(speculators' default).")),
    Rule("speculative_algorithm_not_eagle3", findings=("speculative_algorithm_not_eagle3",),
         explanation=("The launch command serves an EAGLE-3 draft with --speculative-algorithm EAGLE. SGLang then "
                      "resolves no aux hidden-state capture (the draft gets the target's last state, and fc is skipped "
                      "by the width check) and its EAGLE worker replaces the draft's own head with the target's "
                      "(set_embed_and_head). Nothing fails; acceptance collapses."),
         fix="Launch with --speculative-algorithm EAGLE3."),
    # Under EAGLE with a wrong token map, the algorithm comes first: EAGLE3 ignores the map, so
    # fixing the algorithm alone recovers everything (the map is then named beside it).
    Rule("speculative_token_map_differs", findings=("speculative_token_map_differs",),
         explanation="The worker reads draft ids through --speculative-token-map, which is not the map the draft was trained with.",
         fix="Drop --speculative-token-map and launch with --speculative-algorithm EAGLE3: the served d2t is then used."),
    Rule("draft_weights_random", findings=("draft_weights_random",),
         explanation=("The launch command loads the draft with the dummy load format: SGLang's DummyModelLoader "
                      "fills every parameter with random values and reads none of the served files. The server starts "
                      "and drafts, and every draft token is noise."),
         fix=("Drop the dummy load format (--speculative-draft-load-format, or a --load-format dummy the draft "
              "inherits) so the served weights are read.")),
    Rule("draft_window_differs", findings=("draft_window_differs",),
         explanation=("--speculative-draft-window-size makes SGLang's EAGLE-3 draft attend to a sliding window of "
                      "recent tokens on every layer, a window training did not use; beyond it the draft's attention "
                      "sees other keys than in training."),
         fix=("Drop --speculative-draft-window-size, or set it to the window training's config declares "
              "(sliding_window on a sliding_attention draft layer).")),
    Rule("launch_override_reaches_draft", findings=("launch_override_reaches_draft",),
         explanation=("The launch command's --json-model-override-args is applied by SGLang's ModelConfig to the "
                      "draft's config as well as the target's, so the draft is served with a field value its "
                      "directory does not hold and training did not use."),
         fix=("Drop the field from --json-model-override-args (an override meant for the target reaches the draft "
              "too), or set it in the served config.json to what training used.")),
    # The config translation comes first: a lost flag also drops the keys of the module it would build.
    Rule("lm_head_replaced_by_target", findings=("lm_head_from_target",),
         explanation=("The serving worker replaced the draft's own draft-vocab head with the target's full-vocab head "
                      "(set_embed_and_head instead of set_embed), so the draft scores target ids it was never trained on "
                      "and its argmax is read through d2t as if it were a draft id."),
         fix="Set draft_vocab_size in the serving config and ship lm_head.weight, so the worker takes set_embed."),
    Rule("tied_embeddings", findings=("tied_embeddings",),
         explanation=("tie_word_embeddings is set in the serving config, so SGLang uses the (target-vocab) embedding as "
                      "the draft's head instead of its own draft-vocab lm_head."),
         fix="Set tie_word_embeddings to false in the serving config: an EAGLE-3 draft's lm_head is its own."),
    Rule("draft_vocab_not_carried", findings=("draft_vocab_not_carried",),
         explanation="draft_vocab_size did not reach the serving config, so the serving draft is built with the wrong head size.",
         fix="Carry draft_vocab_size into the serving config."),
    Rule("rope_mismatch", findings=("rope_mismatch",),
         explanation="The serving config's RoPE (theta or scaling) differs from training's, so attention sees different positions.",
         fix="Carry rope_theta / rope_scaling (transformers 5: rope_parameters) into the serving config unchanged."),
    Rule("config_flag_not_carried", findings=("config_flag_not_carried", "sliding_window_ignored"),
         explanation="A config field that changes the draft's forward did not reach, or is not honored by, the serving engine.",
         fix="Carry the field named in the audit findings into the serving config (and check the serving engine reads it)."),
    Rule("duplicate_tensor_copies", findings=("duplicate_tensor_copies",),
         explanation=("The checkpoint stores some parameters twice, under both formats' names (`midlayer.*` and "
                      "`layers.0.*`), with different values. Each engine maps both names onto one parameter, so the copy "
                      "it loads is whichever comes last in its key order, and the engines need not pick the same one."),
         fix="Keep one copy of each parameter: the names of the format the checkpoint declares."),
    Rule("token_map_from_other_tensor", findings=("token_map_from_other_tensor",),
         explanation=("SGLang's load_weights takes every tensor whose name contains 'd2t' as the token map "
                      "(hot_token_id), the last one winning; here a tensor other than d2t set it, so SGLang maps "
                      "draft ids with other offsets than speculators, which reads d2t."),
         fix="Remove or rename the other tensors whose names contain 'd2t'; keep only d2t."),
    Rule("keys_dropped", findings=("keys_dropped",),
         explanation=("The serving engine skipped checkpoint tensors whose names it does not know, without a word "
                      "(SGLang's load_weights ignores unknown names), so the parameters they were meant for stayed at "
                      "random init. Typical: decoder weights under `layers.0.*` where SGLang expects `midlayer.*`."),
         fix="Rename the checkpoint's keys to the serving format (speculators `layers.0.` -> SGLang `midlayer.`), e.g. with difftest's converter."),
    Rule("lm_head_missing", home=("logits", "target_token"), findings=("lm_head_missing",),
         explanation=("The checkpoint has no lm_head, so the serving draft's head stayed at random init while speculators "
                      "fills its head from the verifier's rows. Every draft token is then noise."),
         fix="Ship lm_head.weight (draft_vocab_size x hidden) in the checkpoint."),
    Rule("embedding_not_shared", findings=("embedding_not_shared",),
         explanation="The serving draft kept its own randomly initialized embedding: the target's was never shared with it.",
         fix="Share the target embedding (set_embed needs target_hidden_size == hidden_size), or ship embed_tokens in the checkpoint."),
    Rule("fc_skipped_by_width_check", findings=("fc_skipped_by_width_check",),
         explanation=("Aux capture is on, but the aux concatenation (aux layers x target hidden) is exactly as wide as "
                      "the draft's embedding, so SGLang's check `hidden_states.shape[-1] != embeds.shape[-1]` is "
                      "false and fc is skipped: the draft's fc weights are never used. A single aux layer with "
                      "target_hidden_size == hidden_size always hits this."),
         fix="Use more than one aux layer (EAGLE-3 uses three), or a draft hidden size different from the aux width."),
    Rule("multi_layer_draft_differs", findings=("multi_layer_draft_differs",), probes=("final_norm", "logits"),
         explanation=("The draft has more than one decoder layer. Layer 0 agrees, but SGLang builds every layer as an "
                      "EAGLE-3 first layer (fed embeddings and hidden state) while speculators' later layers read the "
                      "hidden state alone, so the layers after the first compute different functions."),
         fix="Serve single-layer EAGLE-3 drafts on SGLang 0.5.23, or a serving build whose later draft layers match speculators'."),
    Rule("dynamic_rope_scaling_differs", findings=("dynamic_rope_scaling_differs",), probes=("layer0.attn_output",),
         explanation=("The draft uses dynamic NTK rope scaling, which transformers applies only beyond the original "
                      "context length and SGLang applies at every length: attention differs from layer 0 on."),
         fix="Train and serve the draft without dynamic rope scaling (linear or none), or serve it with the same rope implementation it was trained with."),
    Rule("aux_capture_off_fc_skipped", probes=("fc.input", "fc.output"), statuses=(Status.MISSING, Status.SHAPE),
         explanation=(
             "The serving draft received a hidden state as wide as its embedding, so SGLang's check "
             "`hidden_states.shape[-1] != embeds.shape[-1]` was false and the fc fusion of the aux layers "
             "was skipped. This happens when the target is not set up to capture EAGLE-3 aux hidden states "
             "and hands the draft its single last-layer state instead of the concatenation."),
         fix=(
             "Serve the target with aux capture on: the target model class must implement "
             "set_eagle3_layers_to_capture and the draft config must carry eagle_config."
             "eagle_aux_hidden_state_layer_ids; check that the hidden states reaching the draft are "
             "num_aux x target_hidden wide.")),
    Rule("aux_capture_off_fc_skipped", findings=("aux_capture_off", "aux_capture_unsupported"),
         explanation=("The serving target would not capture EAGLE-3 aux hidden states for this draft, so the draft gets "
                      "one layer instead of the concatenation and SGLang's shape check skips fc."),
         fix="Use a target model class with set_eagle3_layers_to_capture and keep eagle_config.use_aux_hidden_state true."),
    Rule("aux_layers_off_by_one", findings=("aux_layers_off_by_one",),
         explanation=("The server would capture each aux layer one off from the layers the draft was trained on. "
                      "The engines number aux ids differently: speculators' id k is HF hidden_states[k]; SGLang's "
                      "set_eagle3_layers_to_capture adds 1 to explicit ids (SpecForge counts the same way); vLLM's "
                      "runner reads eagle_config's ids as a layer's input. The draft then reads states it has never "
                      "seen and no error is raised."),
         fix=("For SGLang, write eagle_config.eagle_aux_hidden_state_layer_ids in its convention: speculators' ids "
              "minus 1 (difftest's converter does this). For vLLM 0.32.0, serve speculators' format, or add a top-level "
              "eagle_aux_hidden_state_layer_ids in HF numbering (SGLang's ids plus 1), which vLLM reads before "
              "eagle_config's and SGLang and SpecForge never read.")),
    Rule("aux_layers_wrong_order", findings=("aux_layers_wrong_order",),
         explanation=("The server concatenates the aux layers in layer order; the draft was trained on them in another "
                      "order, so fc mixes the wrong slices."),
         fix="Capture training data with the aux layer ids ascending, or retrain; the serving engine always concatenates in layer order."),
    Rule("aux_layers_mismatch", findings=("aux_layers_mismatch", "states_not_from_this_config"),
         explanation="The aux layers the server would capture are not the ones the draft's training data was captured at.",
         fix="Make eagle_aux_hidden_state_layer_ids in the serving config name the layers the training data used."),
    Rule("target_capture_values_differ", findings=("target_capture_values_differ",),
         explanation=("The serving target captures the right layers, but its states differ from the training capture "
                      "by more than the dtype's tolerance: the target weights, its dtype or its forward differ between "
                      "the capture used for training and the server."),
         fix="Capture training data from the exact target checkpoint and dtype the server runs, or re-capture on the serving stack."),
    # The two d2t corruptions people make by hand, each named with its own fix before the family.
    Rule("d2t_arange_subtracted", home=("target_token",), findings=("d2t_arange_subtracted",),
         explanation=("d2t holds correct offsets with arange subtracted: the hand 'fix' of a d2t misread as absolute "
                      "ids. Both engines compute target = draft + d2t[draft], so every draft token lands arange "
                      "places before its trained target id and nothing is ever accepted."),
         fix="Add arange back (d2t + arange(draft_vocab_size)), or re-save d2t from the training vocab mapping: "
             "offsets, target = draft + d2t[draft]."),
    Rule("d2t_absolute_ids", home=("target_token",), findings=("d2t_absolute_ids",),
         explanation=("d2t holds absolute target ids where offsets belong. Both engines compute target = draft + "
                      "d2t[draft], so every draft token is shifted by its own draft id."),
         fix="Store offsets: d2t - arange(draft_vocab_size) (target = draft + d2t[draft])."),
    Rule("d2t_convention", home=("target_token",), findings=("d2t_absolute_ids", "d2t_arange_subtracted", "d2t_all_zero", "d2t_t2d_disagree",
                                     "d2t_out_of_range", "d2t_not_unique", "d2t_bad_length", "d2t_bad_dtype"),
         explanation=("d2t does not hold offsets onto the ids the draft was trained on. Both engines compute "
                      "target = draft + d2t[draft], so absolute ids, or offsets with arange subtracted (the 'fix' "
                      "that breaks them), send every draft token to the wrong target id and nothing is ever accepted."),
         fix=D2T_FIX),
    Rule("d2t_missing", home=("target_token",), findings=("d2t_missing", "t2d_bad_shape", "t2d_bad_count"),
         explanation="The draft vocab is smaller than the target's but there is no usable mapping, so draft ids are read as target ids.",
         fix=D2T_FIX),
    Rule("served_tensor_changed", findings=("served_tensor_changed", "served_tensor_missing"),
         explanation=("The served directory does not hold the tensors training saved: one is changed (beyond a cast) "
                      "or missing, so the served draft computes with other weights than the trained one."),
         fix="Re-convert the training checkpoint (difftest convert TRAIN_CKPT OUT) instead of editing the served copy."),
    Rule("served_dtype_differs", findings=("served_dtype_differs",),
         explanation=("The launch command runs the draft at another precision than the checkpoint training saved: "
                      "--dtype, or auto as the engine resolves it (SGLang from the served config, where an fp32 config "
                      "is served in fp16; vLLM gives the draft the target's dtype)."),
         fix="Launch with --dtype set to the checkpoint's dtype (the evidence names it)."),
    Rule("shipped_embedding_replaced", findings=("shipped_embedding_replaced",), probes=("embed",),
         explanation=("The checkpoint ships an embedding of its own, not the target's. One engine uses the shipped "
                      "tensor, the other replaces it with the target's embedding (SGLang's EAGLE worker calls "
                      "set_embed whenever the hidden sizes match), so the draft embeds every token differently."),
         fix="Drop embed_tokens from the checkpoint if the draft was trained on the target's embedding, or serve "
             "with the shipped one (a draft whose hidden size differs from the target's keeps its own)."),
    # Below every injected-style cause: this one is a property of the trained draft, and whatever
    # breaks upstream of the residual (capture, keys, heads, vocab) is the first thing to fix.
    Rule("norm_before_residual_ignored", findings=("norm_before_residual_ignored",),
         explanation=("The draft was trained with norm_before_residual=true and the serving engine does not honor it "
                      "(measured by the config audit), so the residual stream after attention differs."),
         fix=("Train with norm_before_residual=false for SGLang 0.5.23, or serve on an engine that honors it: vLLM 0.32.0 "
              "does (its config audit measures it), or a later SGLang build.")),
    Rule("norm_before_residual_ignored", probes=("layer0.post_attn_residual",),
         explanation=(
             "The residual stream after attention differs while attention itself agrees: the draft was trained "
             "with norm_before_residual=true (the residual is the normed hidden state), and the serving engine "
             "adds the un-normed hidden state."),
         fix=("Train with norm_before_residual=false for SGLang 0.5.23, or serve on an engine that honors it: vLLM 0.32.0 "
              "does (its config audit measures it), or a later SGLang build.")),
    Rule("embedding_precision", probes=("embed",), rounding_only=True,
         explanation=(
             "The embeddings differ only by rounding: the checkpoint carries a low-precision copy of the target's "
             "embedding, which speculators uses, while SGLang's worker replaces it with the target's own (set_embed) "
             "at the run dtype. At the checkpoint's own dtype the two are identical."),
         fix="Compare at the checkpoint's dtype (--dtype auto, the default), or ship embed_tokens at the target's precision."),
    Rule("embedding_not_shared", probes=("embed",),
         explanation="The draft's token embedding differs from the target's: the serving draft did not receive the target's embedding.",
         fix="Share the target embedding with the draft (set_embed); check target_hidden_size equals hidden_size, or ship embed_tokens in the checkpoint."),
    Rule("norm_before_fc_not_applied", probes=("fc.input",),
         explanation="The aux states entering fc differ: one engine normalizes them first (norm_before_fc / fc_norm) and the other does not.",
         fix="Carry norm_before_fc / fc_norm into the serving config (SGLang reads eagle_config.norm_before_fc and top-level fc_norm)."),
    Rule("lm_head_mismatch", probes=("logits",),
         explanation=(
             "Everything up to the final norm agrees, but the logits do not: the serving draft multiplies by a "
             "different lm_head."),
         fix="Ship lm_head.weight in the checkpoint and set draft_vocab_size in the serving config so the worker takes set_embed, not set_embed_and_head."),
    Rule("vocab_mapping_mismatch", probes=("target_token",),
         explanation="Draft tokens agree but their target ids do not: the engines read d2t differently (offsets vs absolute ids).",
         fix="Store d2t as offsets (target = draft + d2t[draft]), as speculators and SGLang both expect."),
    # After training: both engines load the same changed checkpoint alike, so only the
    # training run's own metric exposes it (difftest/audit/shortfall.py tests each explanation).
    Rule("checkpoint_changed_after_training", findings=("checkpoint_changed_after_training",),
         explanation=("Predicted acceptance is far below the training run's held-out accuracy in both engines, and "
                      "the checkpoint's tensors are not the ones the training run saved: it was changed after "
                      "training (edited, converted lossily, or mixed from several runs)."),
         fix="Serve the training run's own saved checkpoint; re-run difftest with --training-run on what you deploy."),
    Rule("vocab_map_out_of_step", findings=("vocab_map_out_of_step",),
         explanation=("Predicted acceptance is far below training's in both engines, and the draft's predictions, "
                      "mapped through d2t, land on tokens the target emits no more often than chance: the vocab map "
                      "and the head disagree on what a draft id means (a map regenerated after training, or head rows "
                      "reordered)."),
         fix="Ship the d2t/t2d the draft was trained with (speculators writes them into the checkpoint at save)."),
    Rule("states_not_target_greedy", findings=("states_not_target_greedy",),
         explanation=("Predicted acceptance is far below training's, and the states' tokens are mostly not the "
                      "target's own greedy continuation: these states were not produced the way the training data was."),
         fix="Capture states from the target's own greedy (temperature-0) generations, as training data is."),
    Rule("acceptance_below_training", findings=("acceptance_below_training",),
         explanation=("Predicted acceptance is far below the training run's held-out accuracy, and none of the "
                      "explanations difftest can test here is supported by the numbers."),
         fix="Give --training-run (the checkpoint saved by training) so the checkpoint can be compared with it, and "
             "check that the states come from the same target and data distribution as training's."),
    Rule("draft_forward_fails", findings=("draft_forward_fails",),
         explanation=("The serving engine loads the served draft, and its first draft forward raises (the error is in "
                      "the evidence): a server started on it fails on the first request it drafts for. Nothing was "
                      "compared. Any other finding in this report names what in the checkpoint makes it fail."),
         fix=("Fix what the other findings name first; the error names the tensor or field the engine could not "
              "compute with.")),
    Rule("norm_output_read_differently", findings=("norm_output_read_differently",), probes=("next_step_hidden",),
         explanation=("This step's logits agree, and the hidden state it hands the next draft step does not: the "
                      "engines read norm_output differently. SGLang 0.5.23, vLLM 0.32.0 and speculators read it as "
                      "EAGLE-3.1 (the normed state goes on); SpecForge 0.2.0 reads it as 'norm before lm_head' and "
                      "always hands on the pre-norm state. Every chain step after the first drafts from another input "
                      "than training's."),
         fix=("Train SpecForge 0.2.0 drafts without norm_output in the config (both sides then hand on the pre-norm "
              "state and norm before lm_head), or train with a SpecForge that carries the normed state under "
              "norm_output (its change after 0.2.0).")),
    Rule("next_step_state_differs", probes=("next_step_hidden",),
         explanation=("This step's logits agree, and the hidden state it hands the next draft step does not, so every "
                      "chain step after the first drafts from another input than training's."),
         fix="Compare how each engine reads norm_output and which layer's output it carries between steps."),
    Rule("decoder_math_divergence",
         probes=("layer0.embed_norm", "layer0.hidden_norm", "layer0.attn_output", "layer0.mlp_output", "layer0.output", "final_norm"),
         explanation="The decoder layer computes differently in the two engines from this probe on, with identical inputs.",
         fix="Compare the config fields that shape this sub-block (rope, eps, heads, head_dim, sliding window) between the checkpoint and the serving config."),
)

CAUSES: dict[str, Rule] = {}
for _rule in RULES:
    CAUSES.setdefault(_rule.cause, _rule)


@dataclass
class Diagnosis:
    cause: str
    explanation: str
    fix: str
    probe: str | None  # the first divergent probe; None when only the audit found it
    evidence: list[str] = field(default_factory=list)  # the findings behind the cause
    also: list[str] = field(default_factory=list)  # other error findings' causes
    evidence_checks: list[str] = field(default_factory=list)  # the audit checks that produced the evidence
    # Every cause considered for the headline, most costly first: {cause, found_at, side,
    # cost_accept_length (None: not measured), within_tolerance (measured, and inside the
    # accept-length tolerance: costs nothing measurable), method (undone | emulated |
    # serving_gap | training_shortfall | not_measured), how}. The headline is its first entry.
    ranked: list[dict] = field(default_factory=list)

    @property
    def found_at(self) -> str:
        """Where it was caught: the first divergent probe, else the audit check."""
        if self.probe:
            return self.probe
        return f"audit:{self.evidence_checks[0]}" if self.evidence_checks else "audit"

    def as_dict(self) -> dict:
        return {"cause": self.cause, "probe": self.probe, "found_at": self.found_at, "explanation": self.explanation,
                "fix": self.fix, "evidence": self.evidence, "also": self.also, "ranked": self.ranked}


def diagnose(comparison: Comparison, findings: list[Finding] = ()) -> Diagnosis | None:
    first = comparison.first_divergence
    errors = [f for f in findings if f.severity is Severity.ERROR]
    causes = {f.cause for f in errors}
    if first is None and not errors:
        return None
    probe = first.probe if first else None
    for rule in RULES:
        if rule.matches(first, causes):
            backing = [f for f in errors if f.cause in rule.findings]
            also = sorted({f.cause for f in errors if f.cause not in rule.findings})
            at = probe
            if rule.home and probe not in rule.home:
                at = _first_failing(comparison, rule.home)
            return Diagnosis(rule.cause, rule.explanation, rule.fix, at, [f.message for f in backing], also,
                             [f.check for f in backing])
    where = f"at {first.probe} ({first.status.value})" if first else "in the audit"
    return Diagnosis(
        "unexplained_divergence",
        f"The engines first disagree {where}; no known signature matches.",
        "Read the per-probe table from this probe on, the audit findings and the load ledger.",
        probe, [f.message for f in errors], sorted(causes), [f.check for f in errors],
    )


def _precision_only_first(comparison: Comparison, serving: Diagnosis | None) -> Diagnosis | None:
    """The precision diagnosis of the first divergent probe, when it differs by rounding alone
    and the serving headline is some other cause found by the audit."""
    first = comparison.first_divergence
    if serving is None or first is None or first.equal_after_rounding_to is None:
        return None
    if not serving.evidence or serving.cause == "embedding_precision":
        return None
    own = diagnose(comparison, [])
    if own is None or own.cause == serving.cause:
        return None
    return own


def _probe_owned_by_other_cause(comparison: Comparison, serving: Diagnosis | None,
                                findings: list[Finding]) -> Diagnosis | None:
    """The diagnosis the first divergent probe belongs to, when the headline is a different
    cause found by the audit alone and that probe's own cause is evidenced by a finding too:
    two causes, each at its own place (an off-by-one capture is not found at the residual
    that norm_before_residual changes)."""
    first = comparison.first_divergence
    if serving is None or first is None or serving.probe != first.probe or not serving.evidence:
        return None
    if first.probe in {p for r in RULES if r.cause == serving.cause for p in r.probes}:
        return None
    own_rule = CAUSES[serving.cause]
    other = diagnose(comparison, [f for f in findings if f.cause not in own_rule.findings])
    if other is None or other.cause == serving.cause or not other.evidence:
        return None
    return other if first.probe in {p for r in RULES if r.cause == other.cause for p in r.probes} else None


def _home_probe(cause: str, comparison: Comparison) -> str | None:
    """The first divergent probe where this cause's own rule looks or acts, if any fails there."""
    return _first_failing(comparison, {p for r in RULES if r.cause == cause for p in (*r.probes, *r.home)})


def _first_failing(comparison: Comparison, probes) -> str | None:
    return next((r.probe for r in comparison.results if not r.ok and r.probe in probes), None)


def _own_cost_finding(cause: str, own_costs: dict[str, Finding]) -> Finding | None:
    """The finding behind a rule's cause that was costed alone, if one was."""
    return next((own_costs[c] for c in CAUSES[cause].findings if c in own_costs), None) if cause in CAUSES else None


SHORTFALL_CAUSES = ("checkpoint_changed_after_training", "vocab_map_out_of_step", "states_not_target_greedy",
                    "acceptance_below_training")


def _own_cost_entry(finding: Finding, acceptance) -> dict:
    """A cause costed by undoing it alone: the accept length the engine it affects recovers."""
    cost = finding.measured["cost_accept_length"]
    engine = finding.measured.get("undone_in")
    whose = f"{engine}'s" if engine else "the serving engine's"
    if finding.measured.get("cost_method") == "emulated":
        how = f"measured alone ({finding.measured['undone']}): {whose} predicted accept length moves {-cost:+.3f}"
    else:
        how = (f"measured by undoing it alone ({finding.measured['undone']}): {whose} predicted accept length "
               f"recovers {cost:+.3f}")
    negligible = acceptance is not None and abs(cost) <= acceptance.tolerance
    if negligible:
        how += f": costs nothing measurable (within ±{acceptance.tolerance})"
    return {"cost_accept_length": cost, "how": how, "within_tolerance": negligible,
            "method": "emulated" if finding.measured.get("cost_method") == "emulated" else "undone"}


def _accounting_cause(shortfall: Finding, findings: list[Finding]) -> Finding | None:
    """The specific cause whose undo alone brings the reference engine's step-1 acceptance
    back within training's band: the test the shortfall audit itself applies, on the repaired copy."""
    if "training_full_acc_0" not in shortfall.measured or "band" not in shortfall.measured:
        return None
    floor = shortfall.measured["training_full_acc_0"] - shortfall.measured["band"]
    for f in findings:
        repaired = f.measured.get("repaired_step1")
        if f.severity is Severity.ERROR and repaired is not None and repaired >= floor:
            return f
    return None


def rank_by_cost(comparison: Comparison, findings: list[Finding], acceptance=None) -> Diagnosis | None:
    """The headline is the cause that costs the most acceptance.

    Two costs can be measured on every run that drafts chains: the serving divergence's
    (the reference engine's predicted accept length against the serving engine's, same rows,
    same checkpoint) and the training shortfall's (training's accept length, 1 + sum of
    full_acc_j, against the reference engine's prediction). A divergence within the accept-
    length tolerance costs nothing measurable and never outranks one that costs something.
    """
    from difftest.audit.shortfall import CHECK as SHORTFALL_CHECK

    shortfall = [f for f in findings if f.severity is Severity.ERROR and f.check == SHORTFALL_CHECK]
    serving_findings = [f for f in findings if f not in shortfall]
    serving = diagnose(comparison, serving_findings)
    candidates: list[tuple[Diagnosis, dict]] = []
    precision = _precision_only_first(comparison, serving) or _probe_owned_by_other_cause(comparison, serving,
                                                                                          serving_findings)
    if precision is not None:
        # The first divergent probe differs by rounding alone, and the real cause (a finding)
        # lives further down: each is reported at its own place, never one at the other's.
        serving.probe = _home_probe(serving.cause, comparison)
    own_costs = {f.cause: f for f in serving_findings if f.severity is Severity.ERROR
                 and isinstance(f.measured.get("cost_accept_length"), float)}
    if serving is not None:
        entry = {"cause": serving.cause, "found_at": serving.found_at, "side": "serving",
                 "cost_accept_length": None, "how": "not measured: no chain was drafted (--chain-steps 0)",
                 "method": "not_measured"}
        own = _own_cost_finding(serving.cause, own_costs)
        if acceptance is not None and not acceptance.reference.scored_rows:
            entry["how"] = ("not measured: no row could be scored (no response row whose recorded continuation is "
                            "the target's greedy one)")
        elif own is not None:
            entry.update(_own_cost_entry(own, acceptance))
        elif acceptance is not None:
            gap = acceptance.reference.mean_accept_length - acceptance.candidate.mean_accept_length
            entry["cost_accept_length"] = gap
            entry["method"] = "serving_gap"
            entry["how"] = (f"{acceptance.reference.engine} vs {acceptance.candidate.engine} predicted accept length on "
                            f"the same {acceptance.reference.scored_rows} rows")
            entry["within_tolerance"] = abs(gap) <= acceptance.tolerance
            if entry["within_tolerance"]:
                entry["how"] += f": costs nothing measurable (within ±{acceptance.tolerance})"
        candidates.append((serving, entry))
    if precision is not None:
        how = ("rounding only: not separable from the serving gap; compare at the checkpoint's dtype (--dtype auto) "
               "to remove it") if precision.cause == "embedding_precision" else (
               "not measured on its own: the engines' gap is one figure for every serving cause")
        entry = {"cause": precision.cause, "found_at": precision.found_at, "side": "serving",
                 "cost_accept_length": None, "how": how, "method": "not_measured"}
        own = _own_cost_finding(precision.cause, own_costs)
        if own is not None:  # measured alone after all (an undo, or the serving engine emulated)
            entry.update(_own_cost_entry(own, acceptance))
        candidates.append((precision, entry))
    demoted: list[dict] = []
    if shortfall:
        found = shortfall[0]
        short = diagnose(Comparison([]), [found])
        entry = {"cause": short.cause, "found_at": f"audit:{found.check}", "side": "training",
                 "cost_accept_length": found.measured.get("cost_accept_length"),
                 "how": "training's accept length (1 + sum of held-out full_acc_j) vs the reference engine's prediction",
                 "method": "training_shortfall"}
        recovered = found.measured.get("recovered_accept_length")
        if recovered is not None:
            # The change since training, undone alone: that is the cause's own cost.
            entry.update(cost_accept_length=recovered, method="undone",
                         how=(f"measured by undoing it alone ({found.measured['undone']}): "
                              f"{found.measured['undone_in']}'s predicted accept length recovers {recovered:+.3f}; "
                              f"training's is {found.measured['cost_accept_length']:+.3f} above the prediction"))
        candidates.append((short, entry))
        specific = _accounting_cause(found, serving_findings)
        if specific is not None:
            # The symptom is that cause's measured effect: it heads the report no longer.
            entry["how"] += (f"; the measured effect of {specific.cause}: with it undone "
                             f"({specific.measured['undone']}) step-1 acceptance is back within training's band")
            demoted.append(entry)
    ranked_causes = {d.cause for d, _ in candidates} | set().union(*(CAUSES[d.cause].findings for d, _ in candidates
                                                                    if d.cause in CAUSES))
    for cause, f in own_costs.items():
        if cause not in ranked_causes:
            other = diagnose(Comparison([]), [f])
            ranked_causes |= {other.cause, cause}
            candidates.append((other, {"cause": other.cause, "found_at": f"audit:{f.check}", "side": "serving",
                                       **_own_cost_entry(f, acceptance)}))
    if not candidates:
        return None

    def cost(item) -> float:
        c = item[1]["cost_accept_length"]
        if c is None:
            return 0.0
        # Within tolerance is no measurable cost, whatever its sign.
        if acceptance is not None and item[1]["side"] == "serving" and abs(c) <= acceptance.tolerance:
            return 0.0
        return c

    # Stable: the rules' order breaks ties; a symptom a specific cause accounts for goes after every cause.
    ordered = sorted(candidates, key=lambda item: (any(item[1] is d for d in demoted), -cost(item)))
    # One cause, one entry: a cause both the shortfall audit and a serving audit name (states
    # whose chunks are out of order) keeps its costlier measurement, not a second, contradicting one.
    seen: set[str] = set()
    ordered = [item for item in ordered if not (item[1]["cause"] in seen or seen.add(item[1]["cause"]))]
    head = ordered[0][0]
    head.ranked = [entry for _, entry in ordered]
    # Every other error the audit found is listed too, and says plainly that it was not costed.
    named = {e["cause"] for e in head.ranked}
    named |= {c for cause in list(named) if cause in CAUSES for c in CAUSES[cause].findings}
    for f in serving_findings:
        if f.severity is Severity.ERROR and f.cause not in named:
            named.add(f.cause)
            head.ranked.append({"cause": f.cause, "found_at": f"audit:{f.check}", "side": "serving",
                                "cost_accept_length": None,
                                "how": "not measured on its own: the engines' gap is one figure for every serving "
                                       "cause, and switching this one off alone is not simulated",
                                "method": "not_measured"})
    head.also = sorted(set(head.also) | {d.cause for d, _ in ordered[1:]})
    return head
