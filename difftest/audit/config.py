"""Config translation audit: does the serving engine honor each field of the training config?

Decided empirically, from the installed engines, never from a list: for each field a
variant checkpoint is written (config changed, weights symlinked read-only), both engines
are built from it, and their outputs and module graphs are compared with their baseline
runs. A field that changes the training engine's forward but not the serving engine's is
not carried by the trip training -> (what is served) -> serving; its effect at this
checkpoint's value is then measured as training(actual) against training(neutral value).

The field table below only says how to perturb a field and which value is neutral;
whether it is honored is always measured.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from difftest.audit.findings import Finding, Severity
from difftest.checkpoint import Checkpoint, CheckpointFormat, declared_window, load_checkpoint, rope_acts_beyond
from difftest.compare import activation_metrics
from difftest.engines.base import EngineAdapter, EngineRun, RunOptions
from difftest.states import CapturedStates
from difftest.target import TargetWeights

CHECK = "config"
EFFECT_THRESHOLD = 1e-5  # fp32: above reduction-order noise (see tolerances.py)
AUDIT_TOKENS = 96

Perturb = Callable[[Any], Any]


@dataclass(frozen=True)
class FieldRule:
    pattern: str  # dotted path, fnmatch-style
    kind: str  # behavioral | structural | metadata | capture
    perturb: Perturb | None = None
    neutral: Any = None  # the value under which the field does nothing (None: no such value)
    cause: str = "config_flag_not_carried"
    why: str = ""
    also: tuple[tuple[str, Any], ...] = ()  # companion settings a valid variant needs
    # the row length past which the field acts at a config's values (None: at any length)
    acts_beyond: Callable[[dict], int | None] | None = None


def _toggle(v):
    return not bool(v)


FIELD_RULES: tuple[FieldRule, ...] = (
    FieldRule("norm_before_residual", "behavioral", _toggle, False, "norm_before_residual_ignored"),
    FieldRule("norm_before_fc", "behavioral", _toggle, False),
    FieldRule("fc_norm", "behavioral", _toggle, False, also=(("norm_before_fc", False),),
              why="fc_norm and norm_before_fc are mutually exclusive in speculators"),
    FieldRule("norm_output", "behavioral", _toggle, False, why="feeds post-norm states back between draft steps; one step cannot show it"),
    FieldRule("transformer_layer_config.rms_norm_eps", "behavioral", lambda v: 0.5),
    FieldRule("transformer_layer_config.rope_parameters.rope_theta", "behavioral", lambda v: v * 0.25, cause="rope_mismatch"),
    FieldRule("transformer_layer_config.rope_theta", "behavioral", lambda v: v * 0.25, cause="rope_mismatch"),
    FieldRule("transformer_layer_config.rope_parameters.rope_type", "behavioral", lambda v: "linear", "default", "rope_mismatch",
              also=(("transformer_layer_config.rope_parameters.factor", 4.0),), acts_beyond=rope_acts_beyond),
    FieldRule("transformer_layer_config.rope_scaling", "behavioral", lambda v: {"rope_type": "linear", "factor": 4.0}, None,
              "rope_mismatch", acts_beyond=rope_acts_beyond),
    FieldRule("transformer_layer_config.sliding_window", "behavioral", lambda v: 2, None, "sliding_window_ignored",
              acts_beyond=declared_window),
    FieldRule("transformer_layer_config.layer_types", "behavioral",
              lambda v: ["full_attention" if t == "sliding_attention" else "sliding_attention" for t in v], None,
              "sliding_window_ignored", acts_beyond=declared_window),
    FieldRule("transformer_layer_config.use_sliding_window", "behavioral", _toggle, None, "sliding_window_ignored",
              acts_beyond=declared_window),
    FieldRule("transformer_layer_config.hidden_act", "behavioral", lambda v: "gelu" if v != "gelu" else "silu"),
    FieldRule("transformer_layer_config.tie_word_embeddings", "behavioral", _toggle, False, "tied_embeddings"),
    FieldRule("transformer_layer_config.max_position_embeddings", "behavioral", lambda v: max(int(v) // 8, 64)),
    FieldRule("tie_word_embeddings", "behavioral", _toggle, False, "tied_embeddings"),
    FieldRule("eagle_aux_hidden_state_layer_ids", "capture", why="which target layers are captured: see the capture audit"),
    FieldRule("eagle_config.*", "capture", why="which target layers are captured (SGLang's layout): see the capture audit"),
    FieldRule("draft_vocab_size", "structural", why="must equal lm_head rows and d2t length (checked against the tensors)"),
    FieldRule("target_hidden_size", "structural", why="sets fc's input width (checked against the tensors)"),
    FieldRule("transformer_layer_config.hidden_size", "structural"),
    FieldRule("transformer_layer_config.intermediate_size", "structural"),
    FieldRule("transformer_layer_config.num_attention_heads", "structural"),
    FieldRule("transformer_layer_config.num_key_value_heads", "structural"),
    FieldRule("transformer_layer_config.head_dim", "structural"),
    FieldRule("transformer_layer_config.num_hidden_layers", "structural"),
    FieldRule("transformer_layer_config.vocab_size", "structural"),
    FieldRule("transformer_layer_config.attention_bias", "structural", why="adds bias tensors"),
    FieldRule("transformer_layer_config.mlp_bias", "structural", why="adds bias tensors"),
    FieldRule("embed_requires_grad", "metadata", why="training only"),
    FieldRule("speculators_config*", "metadata", why="verifier and proposal settings, no forward meaning"),
    FieldRule("transformer_layer_config.attention_dropout", "metadata", why="dropout is off at inference"),
    FieldRule("transformer_layer_config.initializer_range", "metadata", why="init only; weights come from the checkpoint"),
    FieldRule("transformer_layer_config.pretraining_tp", "metadata", why="unused by either draft"),
    FieldRule("transformer_layer_config.use_cache", "metadata", why="generation cache flag"),
    FieldRule("transformer_layer_config.[bpe]*_token_id", "metadata", why="token ids for generation, unused by the draft"),
    FieldRule("transformer_layer_config.model_type", "metadata", why="selects the llama layer classes in both engines"),
    FieldRule("*architectures", "metadata"),
    FieldRule("*dtype", "metadata", why="difftest sets the run dtype explicitly"),
    FieldRule("*_version", "metadata"),
    FieldRule("auto_map*", "metadata"),
    FieldRule("speculators_model_type", "metadata", why="format marker"),
)


def _leaves(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v and not path.endswith("rope_scaling"):
            out.extend(_leaves(v, path + "."))
        else:
            out.append((path, v))
    return out


# The table is written in speculators' layout. SGLang's layout (what SpecForge exports) keeps the
# transformer fields at the top: a path there is read as its speculators twin when no rule names it.
LAYER_PREFIX = "transformer_layer_config."


def rule_for(path: str, layout: CheckpointFormat = CheckpointFormat.SPECULATORS) -> FieldRule | None:
    rule = next((r for r in FIELD_RULES if fnmatch.fnmatch(path, r.pattern)), None)
    if rule is None and layout is CheckpointFormat.LEGACY:
        return rule_for(LAYER_PREFIX + path)
    return rule


def in_layout(path: str, layout: CheckpointFormat) -> str:
    """A path of the table (speculators' layout) where `layout` keeps that field."""
    return path.removeprefix(LAYER_PREFIX) if layout is CheckpointFormat.LEGACY else path


def _set(d: dict, path: str, value) -> dict:
    d = copy.deepcopy(d)
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return d


@dataclass
class _Engines:
    reference: EngineAdapter
    candidate: EngineAdapter
    target: TargetWeights
    states: CapturedStates
    options: RunOptions
    # (engine, config) -> its run: a field's neutral value is often what its variant set
    # (a flag toggled off), and the same config over the same weights is the same build.
    runs: dict = field(default_factory=dict)


def _variant(base: Checkpoint, config: dict, root: Path, name: str) -> Checkpoint:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    # Exactly what the engines read from the base (its shards and their index), nothing stray.
    for f in base.weight_files():
        os.symlink(f.resolve(), d / f.name)  # read-only use: the weights are never opened for writing
    return load_checkpoint(d)


def _effect(a: EngineRun, b: EngineRun) -> float:
    """Largest change over the activation probes both runs have; graph changes count as inf."""
    if a.details.get("module_graph") != b.details.get("module_graph"):
        return float("inf")
    worst = 0.0
    for name, x in a.probes.items():
        y = b.probes.get(name)
        if y is None or not x.is_floating_point():
            continue
        if x.shape != y.shape:
            return float("inf")
        worst = max(worst, activation_metrics(x, y)["rel_max"])
    if set(a.missing) != set(b.missing):
        return float("inf")
    return worst


def _unmeasurable(run: EngineRun) -> str:
    """Why a baseline run cannot anchor the measurement ('' when it can)."""
    for name, t in run.probes.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{run.engine}'s baseline already has non-finite values at {name} (see the load ledger)"
    return ""


def _run(adapter: EngineAdapter, ckpt: Checkpoint, e: _Engines) -> EngineRun | str:
    key = (adapter.name, json.dumps(ckpt.config, sort_keys=True))
    if key not in e.runs:
        e.runs[key] = _build_and_run(adapter, ckpt, e)
    return e.runs[key]


def _build_and_run(adapter: EngineAdapter, ckpt: Checkpoint, e: _Engines) -> EngineRun | str:
    from difftest.errors import ServingRefused

    try:
        return adapter.run(ckpt, e.target, e.states, e.options)
    except ServingRefused as exc:  # without the variant's scratch path, which differs on every run
        return f"{exc.engine} refuses the variant: {exc.reason}"
    except Exception as exc:  # an engine refusing a variant is itself an answer
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def audit_config(ckpt: Checkpoint, target: TargetWeights, states: CapturedStates, reference: EngineAdapter,
                 candidate: EngineAdapter, options: RunOptions | None = None,
                 runs: dict | None = None) -> tuple[list[dict], list[Finding]]:
    """Rows (one per config field, for the report) and findings. `runs`: earlier runs of this
    audit on the same checkpoint, target and states, by (engine, config), e.g. training's
    variants measured for another serving engine; new runs are added to it."""
    options = options or RunOptions()
    e = _Engines(reference, candidate, target, states.head(AUDIT_TOKENS), RunOptions(dtype=torch.float32, device=options.device),
                 {} if runs is None else runs)
    rows: list[dict] = []
    findings: list[Finding] = []
    with tempfile.TemporaryDirectory(prefix="difftest-cfg-") as tmp:
        root = Path(tmp)
        # Variants are written in the layout the training engine reads (its adapter says which).
        layout = getattr(reference, "checkpoint_layout", CheckpointFormat.SPECULATORS)
        if ckpt.format is CheckpointFormat.LEGACY and layout is CheckpointFormat.SPECULATORS:
            from difftest.convert import legacy_to_speculators

            legacy_to_speculators(ckpt, root / "base", verifier_path=str(target.path))
            base = load_checkpoint(root / "base")
        else:
            base = ckpt
        config = base.config
        base_ref, base_cand = _run(reference, base, e), _run(candidate, base, e)
        if isinstance(base_ref, str) or isinstance(base_cand, str):
            raise RuntimeError(f"config audit baseline failed: {base_ref if isinstance(base_ref, str) else base_cand}")
        broken = _unmeasurable(base_ref) or _unmeasurable(base_cand)
        if broken:
            # A flipped field cannot be told apart from NaN already in the outputs: every
            # variant would "change" the forward. Say so instead of reporting findings.
            return [{"field": path, "value": value, "kind": (rule_for(path, base.format) or FieldRule("", "unclassified")).kind,
                     "verdict": f"not measured: {broken}"} for path, value in _leaves(base.config)], []
        for i, (path, value) in enumerate(_leaves(config)):
            rule = rule_for(path, base.format)
            if rule is not None and rule.kind == "behavioral":
                row, finding = _measure_field(i, path, value, rule, base, base_ref, base_cand, root, e)
                rows.append(row)
                findings += [finding] if finding else []
                continue
            row = {"field": path, "value": value, "kind": rule.kind if rule else "unclassified"}
            row["verdict"] = {"structural": "checked against tensor shapes", "metadata": "no forward meaning",
                              "capture": "see capture audit"}.get(row["kind"], "unclassified: not tested")
            row["why"] = rule.why if rule else ""
            rows.append(row)
    return rows, findings


def _measure_field(i: int, path: str, value, rule: FieldRule, base: Checkpoint, base_ref: EngineRun,
                   base_cand: EngineRun, root: Path, e: _Engines) -> tuple[dict, Finding | None]:
    """One behavioral field: both engines built from a variant with the field perturbed,
    each compared with its own baseline."""
    row = {"field": path, "value": value, "kind": rule.kind, "cause": rule.cause}
    training, serving = e.reference.name, e.candidate.name
    new = rule.perturb(value)
    row["perturbed_to"] = new
    variant_cfg = _set(base.config, path, new)
    for extra_path, extra_value in rule.also:
        variant_cfg = _set(variant_cfg, in_layout(extra_path, base.format), extra_value)
    variant = _variant(base, variant_cfg, root, f"v{i}")
    ref_v, cand_v = _run(e.reference, variant, e), _run(e.candidate, variant, e)
    ref_eff = _effect(base_ref, ref_v) if not isinstance(ref_v, str) else None
    cand_eff = _effect(base_cand, cand_v) if not isinstance(cand_v, str) else None
    row.update({"training_effect": ref_eff if ref_eff is not None else ref_v,
                "serving_effect": cand_eff if cand_eff is not None else cand_v})
    ref_changes = ref_eff is not None and ref_eff > EFFECT_THRESHOLD
    cand_changes = cand_eff is not None and cand_eff > EFFECT_THRESHOLD
    finding = None
    if ref_eff is None or cand_eff is None:
        who = " and ".join(n for n, eff in ((training, ref_eff), (serving, cand_eff)) if eff is None)
        row["verdict"] = f"variant rejected by {who}"
        if ref_eff is not None and ref_eff > EFFECT_THRESHOLD and cand_eff is None:
            finding = Finding(CHECK, rule.cause, Severity.INFO,
                              f"{path}={new!r} is accepted by {training} but refused by {serving}: {cand_v}")
    elif ref_changes and cand_changes:
        row["verdict"] = "honored by both"
    elif not ref_changes and not cand_changes:
        row["verdict"] = "inert in both" + (f" ({rule.why})" if rule.why else "")
    elif cand_changes:
        row["verdict"] = f"changes {serving} only"
        # SpecForge's config reader, for one, forces tie_word_embeddings off: at the neutral value
        # the serving engine computes what training does, and only another value would not.
        benign = value == rule.neutral
        finding = Finding(CHECK, rule.cause, Severity.BENIGN if benign else Severity.ERROR,
                          f"{path} changes {serving}'s forward but not {training}'s" +
                          (f"; benign here: this checkpoint's value {value!r} is the neutral one" if benign else ""),
                          {"serving_effect": cand_eff})
    else:
        row["verdict"] = f"ignored by {serving}"
        finding = _ignored_finding(path, value, rule, base, base_ref, root, i, e)
    return row, finding


def _ignored_finding(path, value, rule: FieldRule, base: Checkpoint, base_ref: EngineRun, root: Path, i: int, e: _Engines) -> Finding:
    """Measure what the ignored field does at this checkpoint's value: training's forward at it against
    training's forward at the neutral value."""
    if rule.neutral is None and path.endswith(("sliding_window", "layer_types", "use_sliding_window")):
        edits = [(in_layout(LAYER_PREFIX + "layer_types", base.format), ["full_attention"] * base.spec.num_hidden_layers),
                 (in_layout(LAYER_PREFIX + "sliding_window", base.format), None)]
    elif rule.neutral is not None or path.endswith("rope_scaling"):
        edits = [(path, rule.neutral)]
    else:
        edits = []
    neutral_cfg = None
    for edit_path, edit_value in edits:
        neutral_cfg = _set(neutral_cfg or base.config, edit_path, edit_value)
    measured: dict = {}
    if neutral_cfg is not None and value != rule.neutral:
        run = _run(e.reference, _variant(base, neutral_cfg, root, f"n{i}"), e)
        if not isinstance(run, str):
            logits = activation_metrics(base_ref.probes["logits"], run.probes["logits"])
            agree = (base_ref.probes["draft_token"] == run.probes["draft_token"]).float().mean().item()
            measured = {"neutral_value": rule.neutral, "logits_rel_diff": logits["rel_diff"],
                        "logits_rel_max": logits["rel_max"], "draft_token_agreement": agree}
    elif value == rule.neutral:
        measured = {"neutral_value": rule.neutral, "logits_rel_diff": 0.0, "draft_token_agreement": 1.0}
    if measured and value == rule.neutral:
        return Finding(CHECK, rule.cause, Severity.BENIGN,
                       f"{e.candidate.name} ignores {path}={value!r}; benign here: this checkpoint's value is the neutral "
                       "one", measured)
    if measured and measured.get("logits_rel_max", 0.0) <= EFFECT_THRESHOLD:
        return _not_exercised(path, value, rule, base, e, measured)
    if measured:
        # What the serving engine computes is training's forward at the neutral value: drafting
        # the chain that way in the training engine costs the cause alone (difftest/repairs.py).
        measured["undo"] = {"repair": "config_as_served", "engine": "reference",
                            "args": {"edits": edits, "layout": base.format.value}}
    return Finding(CHECK, rule.cause, Severity.ERROR,
                   f"{e.candidate.name} ignores {path}={value!r}, which changes {e.reference.name}'s forward" +
                   (f" (vs {rule.neutral!r}: draft-token agreement {measured['draft_token_agreement']:.3f}, "
                    f"logits rel_diff {measured['logits_rel_diff']:.3g})" if measured else ""), measured)


def _not_exercised(path, value, rule: FieldRule, base: Checkpoint, e: _Engines, measured: dict) -> Finding:
    """An ignored field whose value is not the neutral one, yet changes nothing on the audit's
    rows: they do not reach where it acts. Not benign; say what input would measure it."""
    longest = int(e.states.seq_lens.max())
    reach = rule.acts_beyond(base.config) if rule.acts_beyond else None
    measured = {**measured, "longest_row": longest}
    if reach is not None and longest <= reach:
        measured["exercised_from_tokens"] = reach + 1
        why = (f"it acts only on rows longer than {reach} tokens and the longest row the audit ran has {longest}; "
               f"states with a row of at least {reach + 1} tokens would measure it")
    else:
        why = (f"at this checkpoint's value it changes nothing on these {e.states.num_tokens} tokens (longest row "
               f"{longest}), so whether it matters cannot be told from them")
    return Finding(CHECK, rule.cause, Severity.NOT_EXERCISED,
                   f"{e.candidate.name} ignores {path}={value!r}; not exercised here: {why}", measured)
