"""The fault catalog, run through the real engines: every fault caught, at its place, with its cause."""

import json
from dataclasses import replace

import pytest

from difftest.diagnosis import CAUSES
from difftest.faults import FAULTS, FAULTS_BY_NAME
from difftest.probes import PROBE_NAMES
from difftest.selftest import fixtures, run_one, run_selftest
from difftest.states import load_states
from tests.conftest import tree_hash
from tests.test_cli import difftest


def test_catalog_declares_known_places_and_causes():
    assert len(FAULTS) >= 14 and len(FAULTS_BY_NAME) == len(FAULTS)
    for f in FAULTS:
        if f.notice_only:
            # Harmless to the computation: named by an informational finding of an audit check,
            # never by a diagnosis rule (which would make a verdict of it).
            assert f.diagnosis not in CAUSES and f.caught_at.startswith("audit:"), f.name
            continue
        assert f.diagnosis in CAUSES, f.name
        assert f.caught_at in PROBE_NAMES or f.caught_at.startswith("audit:"), f.name


def test_selftest_on_tiny_catches_every_fault_in_both_dtypes(tiny):
    before = tree_hash(tiny)
    score = run_selftest("tiny")
    misses = [o.as_dict() for o in score.outcomes if not o.passed]
    assert score.ok, misses
    # Faults made after training need a training metric, which the random tiny draft has not.
    assert score.caught == len(score.faults) == sum(len(f.dtypes) for f in FAULTS if not f.after_training)
    assert tree_hash(tiny) == before  # every fault edits scratch copies only


@pytest.mark.parametrize("serving", ["sglang", "vllm"])
def test_selftest_with_specforge_as_training_catches_what_its_drafts_can_carry(tiny, serving):
    """The catalog against a SpecForge export, one column per serving engine: every fault a
    SpecForge draft can carry caught at its place, and each that it cannot said so with why."""
    before = tree_hash(tiny)
    score = run_selftest("tiny", serving=(serving,), training="specforge")
    misses = [o.as_dict() for o in score.outcomes if not o.passed and o.applies]
    assert score.ok and {o.training for o in score.outcomes} == {"specforge"}, misses
    absent = {o.fault for o in score.outcomes if not o.applies}
    declared = {f.name for f in FAULTS if not f.on_engine(serving, "specforge").applies}
    assert absent == declared and {"d2t_missing", "norm_flag_dropped"} <= absent
    assert all(o.why for o in score.outcomes if not o.applies)
    # Where SpecForge's draft meets a fault elsewhere than speculators', the place moves with it.
    if serving == "sglang":
        dummy = [o for o in score.outcomes if o.fault == "launch_draft_load_format_dummy"]
        assert dummy and all(o.found_at == "fc.output" for o in dummy)
    assert tree_hash(tiny) == before


def test_a_fault_found_at_another_place_is_a_miss(tiny):
    # Localization is part of the score: the same fault declared at the wrong probe fails.
    fx = fixtures("tiny")[0]
    states = load_states(fx.states)
    right = run_one(fx, states, "fp32", FAULTS_BY_NAME["rope_theta_dropped"])
    wrong = run_one(fx, states, "fp32", replace(FAULTS_BY_NAME["rope_theta_dropped"], caught_at="logits"))
    assert right.passed and right.found_at == "layer0.attn_output"
    assert not wrong.passed and wrong.found_at == right.found_at


def test_selftest_cli_writes_its_table_and_exits_zero(tmp_path):
    proc = difftest("selftest", "--fixture", "tiny", "--dtype", "fp32", "--fault", "d2t_absolute_ids",
                    "--fault", "aux_ids_off_by_one", "--out", tmp_path, "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("selftest: mutation score 2/2 (100%), false alarms 0/1")
    doc = json.loads((tmp_path / "selftest.json").read_text())
    assert doc["ok"] and [o["fault"] for o in doc["outcomes"]] == ["clean", "d2t_absolute_ids", "aux_ids_off_by_one"]
    assert "| tiny | fp32 | aux_ids_off_by_one | audit:capture | audit:capture |" in (tmp_path / "selftest.md").read_text()


@pytest.mark.parametrize("args,message", [
    (["--fault", "no_such_fault"], "unknown fault(s) no_such_fault"),
    (["--dtype", "fp8"], "--dtype must be one of"),
    (["--fixture", "huge"], "--fixture must be tiny, default or all"),
    (["--training", "axolotl"], "--training takes one of speculators, specforge"),
])
def test_selftest_bad_options_are_one_line_errors(tmp_path, args, message):
    proc = difftest("selftest", *args, "--out", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr
