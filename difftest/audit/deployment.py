"""Trained versus served, before any forward: every tensor, and every launch setting that
changes what the draft computes.

Tensors are matched by the name a correct conversion gives them (speculators `layers.0.`
is the legacy `midlayer.`; everything else keeps its name), and each row says which
parameter the serving engine's own load_weights put the served tensor into (its ledger),
so a tensor that is present but lands nowhere shows as such. Config fields are the
conversion audit's (audit/conversion.py), read from the config the serving engine built.
"""

from __future__ import annotations

import torch

from difftest.audit.findings import Finding, Severity
from difftest.checkpoint import Checkpoint, declared_window
from difftest.convert import DTYPE_FLAG, legacy_name, speculators_name
from difftest.engines.base import DeploymentPlan, LaunchFlag, LaunchRole, LoadLedger

CHECK_TENSORS = "served"
CHECK_LAUNCH = "launch"
# The engines share the target's embedding whenever the hidden sizes match, so a served
# directory without one is what a correct conversion may write.
OPTIONAL_IN_SERVED = ("embed_tokens.weight",)


def _compare(trained: torch.Tensor, served: torch.Tensor) -> tuple[str, float | None]:
    if trained.shape != served.shape:
        return f"changed: shape {tuple(trained.shape)} -> {tuple(served.shape)}", None
    if trained.dtype == served.dtype:
        if torch.equal(trained, served):
            return "equal (bitwise)", 0.0
    elif trained.is_floating_point() and served.is_floating_point() and torch.equal(trained.to(served.dtype), served):
        return f"equal within the cast {str(trained.dtype)[6:]} -> {str(served.dtype)[6:]}", 0.0
    if not trained.is_floating_point() or not served.is_floating_point():
        differ = int((trained.long() != served.long()).sum())
        return f"changed: {differ} of {trained.numel()} entries differ", float(differ)
    diff = float((trained.float() - served.float()).abs().max())
    return f"changed: max |diff| {diff:.3g}", diff


def check_served_tensors(training: Checkpoint, served: Checkpoint, ledger: LoadLedger) -> tuple[list[dict], list[Finding]]:
    rows, findings = [], []
    served_names = set(served.tensor_names())
    expected: dict[str, str] = {}
    for name in training.tensor_names():
        # SGLang loads either spelling (`layers.0.` through load_weights' `model.` fallback);
        # the legacy one is what a correct conversion writes, so a tensor in neither is missing there.
        spellings = (legacy_name(speculators_name(name)), speculators_name(name))
        expected[next((n for n in spellings if n in served_names), spellings[0])] = name
    for served_name, trained_name in sorted(expected.items()):
        into = ledger.tensors.get(served_name, (None, [], ""))[1]
        if served_name not in served_names:
            optional = speculators_name(trained_name) in OPTIONAL_IN_SERVED
            rows.append({"training": trained_name, "served": None, "status": "missing", "into": []})
            findings.append(Finding(CHECK_TENSORS, "served_tensor_missing", Severity.INFO if optional else Severity.ERROR,
                                    f"{trained_name} has no served counterpart (expected {served_name})"
                                    + (": the engine shares the target's" if optional else ""),
                                    {"tensor": trained_name, "expected": served_name} | ({} if optional else {
                                        "undo": {"repair": "served_tensor_restored",
                                                 "args": {"served": served_name, "training": trained_name}}})))
            continue
        status, diff = _compare(training.get(trained_name), served.get(served_name))
        rows.append({"training": trained_name, "served": served_name, "status": status, "into": into})
        if status.startswith("changed"):
            findings.append(Finding(CHECK_TENSORS, "served_tensor_changed", Severity.ERROR,
                                    f"served {served_name} is not the trained {trained_name}: {status}",
                                    {"tensor": served_name, "max_abs_diff": diff,
                                     "undo": {"repair": "served_tensor_restored",
                                              "args": {"served": served_name, "training": trained_name}}}))
    for extra in sorted(served_names - set(expected)):
        into = ledger.tensors.get(extra, (None, [], ""))[1]
        rows.append({"training": None, "served": extra, "status": "extra", "into": into})
        findings.append(Finding(CHECK_TENSORS, "served_tensor_extra", Severity.INFO,
                                f"served {extra} has no training counterpart"
                                + (f"; loaded into {into}" if into else "; no parameter took it"), {"tensor": extra}))
    return rows, findings


def config_rows(training: Checkpoint, served: Checkpoint) -> list[dict]:
    """Every served config field against what a correct conversion writes: carried, changed,
    dropped, added. Which of these change the forward is the conversion audit's (FIELDS) and
    the measured config audit's question; this table is the whole picture."""
    from difftest.convert import converted_config

    # A served directory in training's own format (vLLM serves speculators' as it is) is held
    # to training's config; one in the legacy layout, to the config a correct conversion writes.
    expected = training.config if served.format is training.format else converted_config(training)
    got = served.config
    rows = []
    for key in sorted(set(expected) | set(got)):
        if key in ("torch_dtype", "dtype", "transformers_version"):
            continue  # the stored precision is the launch audit's, and versions compute nothing
        if key not in got:
            status = "dropped"
        elif key not in expected:
            status = "added"
        else:
            status = "carried" if got[key] == expected[key] else "changed"
        rows.append({"field": key, "expected": expected.get(key), "served": got.get(key), "status": status})
    return rows


def _hot_ids(served: Checkpoint) -> torch.Tensor | None:
    if not served.has("d2t"):
        return None
    d2t = served.get("d2t").long()
    return d2t + torch.arange(d2t.numel())


def check_launch(plan: DeploymentPlan, reference_dtype: torch.dtype, training: Checkpoint,
                 served: Checkpoint) -> tuple[list[dict], list[Finding]]:
    """The launch's settings, read by role (each engine names its own flags), against what an
    EAGLE-3 draft trained this way needs."""
    rows = [f.as_row() for f in plan.flags]
    findings: list[Finding] = []
    algorithm = plan.by_role(LaunchRole.ALGORITHM)
    eagle3 = algorithm is None or algorithm.value == algorithm.expected
    if not eagle3:
        findings.append(Finding(CHECK_LAUNCH, "speculative_algorithm_not_eagle3", Severity.ERROR,
                                f"{algorithm.flag} {algorithm.value} for an EAGLE-3 draft (expected {algorithm.expected}): "
                                f"{algorithm.effect}",
                                {"algorithm": str(algorithm.value), "undo": _undo(algorithm)}))
    dtype = plan.by_role(LaunchRole.DTYPE)
    if plan.dtype != reference_dtype:
        findings.append(Finding(CHECK_LAUNCH, "served_dtype_differs", Severity.ERROR,
                                f"the launch runs the draft in {str(plan.dtype)[6:]}; training's checkpoint is "
                                f"{str(reference_dtype)[6:]}", {"served": str(plan.dtype)[6:],
                                                                 "training": str(reference_dtype)[6:],
                                                                 "undo": {"flag": dtype.flag if dtype else "--dtype",
                                                                          "value": DTYPE_FLAG[reference_dtype]}}))
    override = plan.by_role(LaunchRole.CONFIG_OVERRIDE)
    if override is not None:
        findings += _override_findings(override, served)
    token_map = plan.by_role(LaunchRole.TOKEN_MAP)
    if token_map is not None:
        hot = torch.tensor(torch.load(str(token_map.value), weights_only=True), dtype=torch.int64).flatten()
        trained = _hot_ids(training)
        agree = trained is not None and hot.shape == trained.shape and torch.equal(hot, trained)
        how = ("equals the trained d2t's target ids" if agree else
               f"disagrees with the trained d2t ({hot.numel()} ids against "
               f"{'no d2t' if trained is None else trained.numel()})" if trained is None or hot.shape != trained.shape
               else f"disagrees with the trained d2t in {int((hot != trained).sum())} of {hot.numel()} ids")
        if eagle3:
            findings.append(Finding(CHECK_LAUNCH, "speculative_token_map_ignored", Severity.INFO,
                                    f"{token_map.flag} {how}; {token_map.effect}", {"agrees": agree}))
        elif not agree:
            findings.append(Finding(CHECK_LAUNCH, "speculative_token_map_differs", Severity.ERROR,
                                    f"{token_map.flag} {how}: the worker reads draft ids through it",
                                    {"agrees": agree, "undo": {"flag": token_map.flag, "value": None}}))
    load_format = plan.by_role(LaunchRole.LOAD_FORMAT)
    if load_format is not None and load_format.value == "dummy":
        findings.append(Finding(CHECK_LAUNCH, "draft_weights_random", Severity.ERROR,
                                f"{load_format.flag} dummy: the engine's dummy loader fills every draft parameter with "
                                "random values and reads none of the served files",
                                {"flag": load_format.flag, "undo": _undo(load_format)}))
    window = plan.by_role(LaunchRole.WINDOW)
    trained_window = declared_window(training.config)
    if window is not None and window.value != trained_window:
        findings.append(Finding(CHECK_LAUNCH, "draft_window_differs", Severity.ERROR,
                                f"{window.flag} {window.value}: the served draft attends to the last "
                                f"{window.value} tokens only; training's config declares "
                                + ("full attention" if trained_window is None else f"a window of {trained_window}"),
                                {"served": window.value, "training": trained_window, "undo": _undo(window)}))
    for flag in plan.flags:
        if not flag.simulated:
            findings.append(Finding(CHECK_LAUNCH, "launch_flag_not_simulated", Severity.INFO,
                                    f"{flag.flag} {flag.value}: {flag.how_run}", {"flag": flag.flag,
                                                                                   "instead": flag.instead}))
    return rows, findings


def _undo(flag: LaunchFlag) -> dict:
    """The command-line edit that puts this setting right: the adapter's, else dropping the flag."""
    name, value = flag.set_right or (flag.flag, None)
    return {"flag": name, "value": value}


def _override_findings(flag: LaunchFlag, served: Checkpoint) -> list[Finding]:
    """A launch override the engine applies to the draft's config as well as the target's
    (the flag's effect says whose code does): a field it changes is served with a value the
    directory does not hold."""
    import json

    try:
        override = json.loads(str(flag.value))
    except json.JSONDecodeError:
        return []  # SGLang's own resolution refuses it first
    if not isinstance(override, dict):
        return []
    changed = {k: v for k, v in override.items() if served.config.get(k, "<absent>") != v}
    if not changed:
        return []
    return [Finding(CHECK_LAUNCH, "launch_override_reaches_draft", Severity.ERROR,
                    f"{flag.flag} sets {', '.join(f'{k}={v!r}' for k, v in changed.items())} on the "
                    f"draft's config too ({flag.effect}); the served "
                    f"config.json holds {', '.join(f'{k}={served.config.get(k)!r}' for k in changed)}",
                    {"fields": sorted(changed), "undo": _undo(flag)})]
