"""What costs acceptance: causes ranked by their measured cost, and a checkpoint changed after
training caught through the training run's own metric."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from difftest.audit.findings import Finding, Severity
from difftest.compare import Comparison
from difftest.diagnosis import SHORTFALL_CAUSES, rank_by_cost
from difftest.report import validate_report


class _Figures:
    def __init__(self, engine: str, length: float):
        self.engine, self.mean_accept_length, self.scored_rows = engine, length, 300


class _Acceptance:
    tolerance = 0.05

    def __init__(self, ref: float, cand: float):
        self.reference, self.candidate = _Figures("speculators", ref), _Figures("sglang", cand)


def _serving_finding(cause: str = "norm_before_residual_ignored") -> Finding:
    return Finding("config", cause, Severity.ERROR, "measured by the config audit")


@settings(max_examples=200, deadline=None)
@given(ref=st.floats(1.0, 5.0), gap=st.floats(-1.0, 3.0), shortfall=st.one_of(st.none(), st.floats(-0.5, 4.0)),
       cause=st.sampled_from(SHORTFALL_CAUSES))
def test_the_headline_is_the_most_costly_cause(ref, gap, shortfall, cause):
    acc = _Acceptance(ref, ref - gap)
    gap = acc.reference.mean_accept_length - acc.candidate.mean_accept_length  # as measured, rounding included
    findings = [_serving_finding()]
    if shortfall is not None:
        findings.append(Finding("acceptance", cause, Severity.ERROR, "below training", {"cost_accept_length": shortfall}))
    diag = rank_by_cost(Comparison([]), findings, acc)
    costs = {e["cause"]: e["cost_accept_length"] for e in diag.ranked}
    assert diag.cause == diag.ranked[0]["cause"]
    serving_cost = 0.0 if abs(gap) <= acc.tolerance else gap
    if shortfall is not None:
        assert set(costs) == {"norm_before_residual_ignored", cause}
        # A divergence within the accept-length tolerance never outranks one that costs something.
        if shortfall > 0 and abs(gap) <= acc.tolerance:
            assert diag.cause == cause
        expected = cause if shortfall > serving_cost else "norm_before_residual_ignored"
        if shortfall != serving_cost:
            assert diag.cause == expected
    else:
        assert diag.cause == "norm_before_residual_ignored"
    serving_entry = next(e for e in diag.ranked if e["side"] == "serving")
    assert serving_entry["within_tolerance"] == (abs(gap) <= acc.tolerance)
    assert ("nothing measurable" in serving_entry["how"]) == serving_entry["within_tolerance"]


def test_without_chains_a_cost_is_not_guessed():
    diag = rank_by_cost(Comparison([]), [_serving_finding()], None)
    assert diag.ranked[0]["cost_accept_length"] is None and "not measured" in diag.ranked[0]["how"]


def _difftest(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "difftest.cli", "report", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fx():
    from difftest.fixturegen.default import default_fixture

    return default_fixture(progress=False)


def test_a_weight_edited_after_training_is_the_headline_not_the_free_divergence(fx, tmp_path):
    """Both engines load the edited checkpoint alike and agree with each other; only the training
    metric shows the collapse. The draft's own norm_before_residual divergence, which costs
    nothing, stays in the report below it."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "edited"
    shutil.copytree(fx.checkpoint, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["fc.weight"] = -tensors["fc.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    proc = _difftest(ckpt, "--target", fx.target, "--states", fx.states, "--training-metrics", fx.training,
                     "--training-run", fx.training_run, "--no-audit-config", "--out", tmp_path / "out")
    assert proc.returncode == 1, proc.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    validate_report(rep)
    diag = rep["diagnosis"]
    assert diag["cause"] == "checkpoint_changed_after_training" and diag["found_at"] == "audit:acceptance"
    head, *rest = diag["ranked"]
    assert head["cost_accept_length"] > 0.2, head
    free = next(e for e in rest if e["cause"] == "norm_before_residual_ignored")
    assert free["within_tolerance"] and "nothing measurable" in free["how"]
    finding = next(f for f in rep["audit"]["findings"] if f["check"] == "acceptance")
    changed = next(e for e in finding["measured"]["explanations"] if e["cause"] == "checkpoint_changed_after_training")
    assert changed["supported"] and changed["numbers"]["changed"] == ["fc.weight"]
    line = proc.stdout.splitlines()[0]
    # What the user came for first: each engine's predicted accept length and training's.
    assert line.startswith("DIVERGED: accept length sglang ")
    from difftest.audit.shortfall import expected_accept_length

    training, _ = expected_accept_length(json.loads(fx.training.read_text()), rep["acceptance"]["reference"]["steps"])
    assert f", training {training:.2f}; checkpoint_changed_after_training (found at audit:acceptance), costs +" in line
    assert "first divergence at layer0.post_attn_residual (norm_before_residual_ignored), costs nothing measurable" in line


def test_the_draft_as_trained_falls_within_training_band(fx, tmp_path):
    """No false shortfall on the draft as the trainer saved it, compared with its own run."""
    proc = _difftest(fx.checkpoint, "--target", fx.target, "--states", fx.states, "--training-metrics", fx.training,
                     "--training-run", fx.training_run, "--no-audit-config", "--no-target-capture",
                     "--out", tmp_path / "out", "-q")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not [f for f in rep["audit"]["findings"] if f["check"] == "acceptance"]
    assert rep["diagnosis"]["cause"] == "norm_before_residual_ignored"


def test_a_training_run_without_a_checkpoint_is_an_input_error(fx, tmp_path):
    (tmp_path / "run").mkdir()
    proc = _difftest(fx.checkpoint, "--training-run", tmp_path / "run", "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "no saved checkpoint" in proc.stderr


def test_config_audit_says_it_could_not_measure_over_a_nan_poisoned_baseline(tiny_copy, tmp_path):
    """A legacy draft with no lm_head: SGLang's head is NaN by design, so flipping any field
    'changes' its forward. The audit must decline to measure instead of reporting findings,
    and the headline stays the checkpoint's own fault."""
    from safetensors.torch import load_file, save_file

    legacy = tiny_copy / "legacy"
    tensors = load_file(str(legacy / "model.safetensors"))
    tensors.pop("lm_head.weight")
    save_file(tensors, str(legacy / "model.safetensors"))
    proc = _difftest(legacy, "--target", tiny_copy / "target", "--states", tiny_copy / "states.safetensors",
                     "--out", tmp_path / "out", "-q")
    assert proc.returncode == 1, proc.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["diagnosis"]["cause"] == "lm_head_missing"
    assert not [f for f in rep["audit"]["findings"] if f["check"] == "config" and f["severity"] == "error"]
    assert all(r["verdict"].startswith("not measured") for r in rep["audit"]["config"])
