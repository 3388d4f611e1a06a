"""Fuzzing both engines over drawn configs, and replaying the shrunk divergences it found."""

import pytest

from difftest.fuzz import REGRESSIONS_DIR, cases, explore, load_regressions, run_case
from difftest.known_divergences import KNOWN_UPSTREAM_DIVERGENCES

REGRESSIONS = load_regressions()


def test_a_short_fuzz_run_explains_every_divergence():
    summary = explore(8, seed=3)
    assert len(summary.outcomes) == 8
    assert {o.verdict for o in summary.outcomes} <= {"PARITY", "DIVERGED", "REFUSED"}
    assert summary.unexplained == [], [o.as_dict() for o in summary.outcomes if not o.explained]


def test_drawn_cases_build_real_checkpoints_both_engines_accept():
    # The strategy itself must mostly produce runnable drafts, or the fuzzer explores nothing.
    from hypothesis import HealthCheck, given, settings

    verdicts = []

    @settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases().filter(lambda c: c["target_hidden_size"] == c["hidden_size"]))
    def one(case):
        verdicts.append(run_case(case).verdict)

    one()
    assert verdicts and "REFUSED" not in verdicts


def test_regressions_are_kept():
    assert REGRESSIONS, f"no shrunk cases in {REGRESSIONS_DIR}"


@pytest.mark.parametrize("name,doc", REGRESSIONS, ids=[n for n, _ in REGRESSIONS])
def test_regression_is_still_diagnosed_the_same_way(name, doc):
    outcome = run_case(doc["case"])
    expected = doc["expected"]
    assert (outcome.verdict, outcome.cause, outcome.first_divergence) == (
        expected["verdict"], expected["cause"], expected["first_divergence"]), outcome.as_dict()
    assert outcome.explained


KNOWN = [pytest.param(d, id=n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_UPSTREAM_DIVERGENCES[d["expected"]["cause"]]))
         for n, d in REGRESSIONS if d["expected"]["cause"] in KNOWN_UPSTREAM_DIVERGENCES]


@pytest.mark.parametrize("doc", KNOWN)
def test_engines_agree_on_a_known_upstream_divergence(doc):
    # Expected to fail until the engines agree; strict, so a fix upstream is noticed.
    assert run_case(doc["case"]).verdict == "PARITY"


def test_an_engine_that_loads_some_aux_counts_is_fuzzed_mostly_with_those():
    """vLLM loads only 3-aux speculators drafts (a known divergence, kept as a regression): its
    draws lean to 3 so most reach its forward, and still include the counts it refuses."""
    from collections import Counter

    from difftest.fuzz import AUX_COUNTS, aux_counts_for

    drawn = Counter(aux_counts_for("vllm"))
    assert set(drawn) == set(AUX_COUNTS)
    assert drawn[3] > sum(n for count, n in drawn.items() if count != 3) / 2 and drawn.most_common(1)[0][0] == 3
    assert aux_counts_for("sglang") == AUX_COUNTS
