"""SpecForge as a training engine, on the tiny SpecForge draft (fixtures/tiny/specforge, written by
SpecForge's own exporter): its own config reading, warm start, embedding load and TTT unroll."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from difftest.checkpoint import load_checkpoint
from difftest.engines.base import ParamFate, RunOptions, TensorFate
from difftest.pipeline import candidate_adapter, prepare, reference_adapter, run
from difftest.probes import PROBE_NAMES


@pytest.fixture(scope="module")
def specforge():
    return reference_adapter("specforge")


@pytest.fixture(scope="module")
def inputs(tiny):
    return prepare(tiny / "specforge", tiny / "target", tiny / "states.safetensors")


def test_the_tiny_draft_is_what_specforges_exporter_writes(tiny, tmp_path):
    from difftest.fixturegen.specforge_tiny import build

    rebuilt = load_checkpoint(build(tmp_path / "specforge"))
    shipped = load_checkpoint(tiny / "specforge")
    assert rebuilt.config == shipped.config
    assert sorted(rebuilt.tensor_names()) == sorted(shipped.tensor_names())
    for name in shipped.tensor_names():
        assert torch.equal(rebuilt.get(name), shipped.get(name)), name
    assert any(n.startswith("midlayer.") for n in shipped.tensor_names())
    assert not any("embed" in n for n in shipped.tensor_names())  # the exporter drops it


def test_specforge_and_sglang_compute_the_same_draft_in_fp32(inputs, specforge):
    result = run(inputs, dtype=torch.float32, reference=specforge, candidate=candidate_adapter("sglang"), chain_steps=3)
    failing = [(r.probe, r.metrics) for r in result.comparison.results if not r.ok]
    assert not failing
    assert set(result.reference.probes) == set(PROBE_NAMES)
    worst = max(r.metrics["rel_max"] for r in result.comparison.results if r.metrics and "rel_max" in r.metrics)
    assert worst < 1e-5
    assert result.reference.chain.draft_tokens.shape == (inputs.states.num_tokens, 3)


def test_the_ledger_and_the_capture_plan_are_specforges(inputs, specforge, tiny):
    plan = specforge.capture_plan(inputs.checkpoint, inputs.target, RunOptions())
    # SpecForge's id i is layer i's output: the HF hidden state one further on, as SGLang captures it.
    configured = inputs.checkpoint.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert plan.hf_layer_ids == [i + 1 for i in configured] == list(inputs.states.aux_layer_ids)
    ran = specforge.run(inputs.checkpoint, inputs.target, inputs.states, RunOptions())
    assert set(ran.ledger.names(TensorFate.CONSUMED)) == set(inputs.checkpoint.tensor_names())
    assert ran.ledger.names(ParamFate.SHARED) == ["embed_tokens.weight"]
    assert ran.details["warm_start"]["missing_keys"] == ["embed_tokens.weight"]


@pytest.mark.parametrize("args, says", [
    (["--training", "specforge", "{tiny}/speculators"], "SpecForge reads the directory its export writes"),
    (["--training", "axolotl", "{tiny}/specforge"], "--training takes one of speculators, specforge"),
    # SpecForge's export says nothing of its trainer, and a converted speculators draft has the same layout.
    (["{tiny}/specforge"], "nothing that says which trainer wrote it"),
])
def test_a_checkpoint_specforge_cannot_read_is_one_line_and_exit_2(tiny, tmp_path, args, says):
    args = [a.format(tiny=tiny) for a in args]
    proc = subprocess.run([sys.executable, "-m", "difftest.cli", "report", *args, "--target", str(tiny / "target"),
                           "--states", str(tiny / "states.safetensors"), "--serving", "sglang", "--out",
                           str(tmp_path / "out"), "-q"], capture_output=True, text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not (tmp_path / "out" / "report.json").exists()


def test_a_specforge_draft_with_norm_output_is_diagnosed_from_the_state_it_hands_on(tiny, tmp_path):
    """norm_output=true: SpecForge 0.2.0 still hands each TTT step the pre-norm state; SGLang hands
    on the normed one (EAGLE-3.1). This step's logits agree; the next step's input does not."""
    from difftest.fixturegen.specforge_tiny import build

    draft = build(tmp_path / "specforge", config_edits={"norm_output": True})
    inputs = prepare(draft, tiny / "target", tiny / "states.safetensors")
    assert inputs.checkpoint.config["norm_output"] is True
    result = run(inputs, dtype=torch.float32, reference=reference_adapter("specforge"),
                 candidate=candidate_adapter("sglang"))
    by_probe = {r.probe: r for r in result.comparison.results}
    assert all(by_probe[name].ok for name in PROBE_NAMES if name != "next_step_hidden")
    assert not by_probe["next_step_hidden"].ok and by_probe["next_step_hidden"].metrics["rel_max"] > 0.1
    assert result.diagnosis.cause == "norm_output_read_differently"
    assert result.diagnosis.probe == "next_step_hidden"
    # The same weights without the flag: both hand on the pre-norm state.
    plain = prepare(build(tmp_path / "plain"), tiny / "target", tiny / "states.safetensors")
    again = run(plain, dtype=torch.float32, reference=reference_adapter("specforge"), candidate=candidate_adapter("sglang"))
    assert again.diagnosis is None or again.diagnosis.cause != "norm_output_read_differently"
    assert all(r.ok for r in again.comparison.results)


def test_the_trainer_is_read_from_the_directory_where_it_says(tiny):
    from difftest.engines import training_engine_for
    from difftest.errors import InputError

    assert training_engine_for(load_checkpoint(tiny / "speculators")) == "speculators"
    # difftest's conversion keeps speculators' norm flags, which SpecForge's draft has no notion of.
    assert "norm_before_fc" in load_checkpoint(tiny / "legacy").config
    assert training_engine_for(load_checkpoint(tiny / "legacy")) == "speculators"
    with pytest.raises(InputError, match="--training speculators or --training specforge"):
        training_engine_for(load_checkpoint(tiny / "specforge"))


def test_the_config_audit_measures_a_specforge_export_in_its_own_layout(inputs, specforge):
    """Variants are written as SpecForge's exporter writes them (the transformer fields at the
    top), and each field is measured in SpecForge and in SGLang."""
    result = run(inputs, dtype=torch.float32, reference=specforge, candidate=candidate_adapter("sglang"),
                 audit_config=True)
    rows = {r["field"]: r for r in result.config_audit}
    assert "transformer_layer_config.rms_norm_eps" not in rows
    assert rows["rms_norm_eps"]["verdict"] == "honored by both"
    assert rows["rope_parameters.rope_theta"]["verdict"] == "honored by both"
    assert rows["rms_norm_eps"]["training_effect"] > 0.01
    # SpecForge's config reader forces tie_word_embeddings off and SGLang honors it: at false, the
    # export's value, both compute the same draft, so it is benign and no verdict.
    assert rows["tie_word_embeddings"]["verdict"] == "changes sglang only"
    tied = [f for f in result.findings if f.cause == "tied_embeddings"]
    assert tied and all(f.severity.value == "benign" for f in tied)
    assert result.diagnosis is None
