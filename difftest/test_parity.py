"""The parity suite: one test per probe, so a CI log names the probe that broke.

Run as `pytest difftest/` (embedded fixture) or with --difftest-ckpt DIR for your draft.
"""

from __future__ import annotations

import importlib

import pytest

from difftest.probes import PROBE_NAMES


@pytest.mark.parametrize("engine_module", ["sglang.srt.models.llama_eagle3", "speculators.models.eagle3",
                                           "specforge.algorithms.eagle3.model"])
def test_engine_imports(engine_module):
    # An engine that cannot be imported is a failure, never a skip.
    if engine_module.startswith("sglang"):
        from difftest.engines.sglang_engine.runtime import ensure_runtime

        ensure_runtime("cpu")
    importlib.import_module(engine_module)


def test_vllm_imports_in_its_own_venv():
    # vLLM runs in .venv-vllm behind the venv bridge: a venv that is missing or cannot import
    # vLLM fails here, never skips.
    from difftest.engines.vllm_engine.adapter import _bridge

    assert _bridge().hello["vllm"] == "0.32.0"


@pytest.mark.parametrize("probe", PROBE_NAMES)
def test_probe_parity(difftest_result, difftest_on_embedded_fixture, probe, request):
    from difftest.known_divergences import KNOWN_UPSTREAM_DIVERGENCES
    from difftest.probes import probe_index

    result = next(r for r in difftest_result.comparison.results if r.probe == probe)
    diag = difftest_result.diagnosis
    first = difftest_result.comparison.first_divergence
    if (difftest_on_embedded_fixture and diag and diag.cause in KNOWN_UPSTREAM_DIVERGENCES
            and probe_index(probe) >= probe_index(first.probe) and not result.ok):
        request.applymarker(pytest.mark.xfail(reason=f"known upstream divergence {diag.cause}: "
                                              + KNOWN_UPSTREAM_DIVERGENCES[diag.cause], strict=True))
    assert result.ok, (
        f"{probe}: {result.status.value} {result.detail} metrics={result.metrics} tolerance={result.tolerance}"
        + (f"\nroot cause: {diag.cause}: {diag.explanation}\nfix: {diag.fix}" if diag else "")
    )


@pytest.mark.serving_engines("sglang")
def test_kernel_standin_never_called(difftest_result):
    standin = difftest_result.candidate.details["sgl_kernel_standin"]
    assert standin["total_calls"] == 0, f"sgl_kernel stand-in was called: {standin['calls']}"


def test_predicted_acceptance_agrees(difftest_result):
    acc = difftest_result.acceptance
    if acc is None:
        pytest.skip("--difftest-chain-steps 0: acceptance not simulated")
    assert acc.reference.scored_rows > 0, "no row could be scored: no response rows with a greedy continuation"
    assert acc.agree, (
        f"predicted mean accept length {acc.candidate.engine} {acc.candidate.mean_accept_length:.3f} vs "
        f"{acc.reference.engine} {acc.reference.mean_accept_length:.3f} (tolerance ±{acc.tolerance}); "
        f"per-step reach {acc.candidate.reach} vs {acc.reference.reach}"
        + (f"\nroot cause: {difftest_result.diagnosis.cause}" if difftest_result.diagnosis else ""))


def test_target_capture_parity(difftest_result):
    tc = difftest_result.target_capture
    if tc is None:
        pytest.skip("the states carry no first_token_ids, so the target cannot be re-run on their sequences")
    found = [f for f in difftest_result.findings if f.check == "target_capture"]
    assert not found, "; ".join(f"{f.cause}: {f.message}" for f in found)
    assert tc.serving_hf_ids == tc.training_hf_ids
