"""Config translation check: does the config the serving engine reads say what training ran?

The training side is the speculators config (for a legacy checkpoint, the speculators
config difftest's converter gives speculators); the serving side is the legacy config the
serving engine was handed, after any serving-setup edits. Each field is read the way its
own format defines it, so a converter that drops or rewrites a field shows up here even
when the converter's output would agree with itself. Whether SGLang then *honors* a
carried field is the measured config audit's question (audit/config.py).
"""

from __future__ import annotations

from typing import Any, Callable

from difftest.audit.findings import Finding, Severity
from difftest.checkpoint import Checkpoint, CheckpointFormat, rope_of
from difftest.convert import speculators_config

CHECK = "conversion"
MISSING = "<missing>"


def _eagle(cfg: dict) -> dict:
    return cfg.get("eagle_config") or {}


# field -> (cause, training-side getter on the speculators config, serving-side getter on the legacy config)
Getter = Callable[[dict], Any]
FIELDS: tuple[tuple[str, str, Getter, Getter], ...] = (
    ("rope_theta", "rope_mismatch",
     lambda s: float(rope_of(s["transformer_layer_config"])[0]), lambda c: float(rope_of(c)[0])),
    ("rope_scaling", "rope_mismatch",
     lambda s: rope_of(s["transformer_layer_config"])[1], lambda c: rope_of(c)[1]),
    ("rms_norm_eps", "config_flag_not_carried",
     lambda s: s["transformer_layer_config"].get("rms_norm_eps"), lambda c: c.get("rms_norm_eps")),
    # SGLang's LlamaForCausalLMEagle3 reads eagle_config first, then the top level.
    ("norm_before_fc", "config_flag_not_carried",
     lambda s: bool(s.get("norm_before_fc", False)), lambda c: bool(_eagle(c).get("norm_before_fc", c.get("norm_before_fc", False)))),
    ("fc_norm", "config_flag_not_carried",
     lambda s: bool(s.get("fc_norm", False)), lambda c: bool(c.get("fc_norm") or c.get("use_aux_norm") or False)),
    ("norm_before_residual", "config_flag_not_carried",
     lambda s: bool(s.get("norm_before_residual", False)), lambda c: bool(c.get("norm_before_residual", False))),
    ("hidden_act", "config_flag_not_carried",
     lambda s: s["transformer_layer_config"].get("hidden_act", "silu"), lambda c: c.get("hidden_act", "silu")),
    ("draft_vocab_size", "draft_vocab_not_carried",
     lambda s: s.get("draft_vocab_size"), lambda c: c.get("draft_vocab_size", MISSING)),
    # Eagle3DraftModel always has its own draft-vocab lm_head: untied, whatever the verifier says.
    ("tie_word_embeddings", "tied_embeddings",
     lambda s: False, lambda c: bool(c.get("tie_word_embeddings", False))),
)


# The served (legacy) config keys each field is read from: what putting that one field back
# rewrites, to cost it alone (difftest/repairs.py).
SERVED_KEYS: dict[str, tuple[str, ...]] = {
    "rope_theta": ("rope_theta", "rope_parameters", "rope_scaling"),
    "rope_scaling": ("rope_theta", "rope_parameters", "rope_scaling"),
    "rms_norm_eps": ("rms_norm_eps",),
    "norm_before_fc": ("norm_before_fc", "eagle_config"),
    "fc_norm": ("fc_norm", "use_aux_norm"),
    "norm_before_residual": ("norm_before_residual",),
    "hidden_act": ("hidden_act",),
    "draft_vocab_size": ("draft_vocab_size",),
    "tie_word_embeddings": ("tie_word_embeddings",),
}


def training_config(ckpt: Checkpoint) -> dict:
    if ckpt.format is CheckpointFormat.SPECULATORS:
        return ckpt.config
    return speculators_config(ckpt.config)


def check_conversion(ckpt: Checkpoint, served: dict) -> tuple[list[dict], list[Finding]]:
    trained = training_config(ckpt)
    rows, findings = [], []
    for name, cause, train_get, serve_get in FIELDS:
        want, got = train_get(trained), serve_get(served)
        same = want == got or (isinstance(want, float) and isinstance(got, float) and abs(want - got) <= 1e-12 * max(abs(want), 1))
        rows.append({"field": name, "training": want, "serving": got, "carried": same})
        if not same:
            how = "dropped" if got in (MISSING, None) or (name.startswith(("norm", "fc")) and got is False) else f"is {got!r}"
            findings.append(Finding(CHECK, cause, Severity.ERROR,
                                    f"{name}: training used {want!r}, the serving config {how}",
                                    {"field": name, "training": want, "serving": got,
                                     "undo": {"repair": "served_config_restored", "args": {"keys": list(SERVED_KEYS[name])}}}))
    return rows, findings
