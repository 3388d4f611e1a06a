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


def test_the_specforge_fixture_gets_a_verdict_from_every_serving_engine(tmp_path):
    """`difftest report --training specforge`: the SpecForge draft trained by SpecForge's trainer on
    SmolLM2, served by SGLang from the export as it is (with its launch command) and by vLLM. Every
    engine's acceptance is predicted from its own chain, and each verdict comes from the probes."""
    import json
    import os

    from difftest.fixturegen import specforge_smollm2
    from tests.conftest import tree_hash

    shipped = tree_hash(specforge_smollm2.SHIPPED_DIR)
    env = {k: v for k, v in os.environ.items() if k != "DIFFTEST_SERVING"}
    proc = subprocess.run([sys.executable, "-m", "difftest.cli", "report", "--training", "specforge", "--out",
                           str(tmp_path), "-q"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    sides = {name: c for name, c in rep["comparisons"].items()}
    assert set(sides) == {"sglang", "vllm"}
    sglang = sides["sglang"]
    assert {c["engines"]["reference"]["name"] for c in sides.values()} == {"specforge"}
    accept = {name: c["acceptance"] for name, c in sides.items()}
    for name, a in accept.items():
        # A trained draft: the chain is accepted beyond chance, the same in training and serving
        # wherever the probes agree.
        assert a["reference"]["mean_accept_length"] > 1.1, name
    assert sglang["verdict"] == "PARITY"
    assert abs(accept["sglang"]["reference"]["mean_accept_length"] - accept["sglang"]["candidate"]["mean_accept_length"]) <= 0.05
    # vLLM reads eagle_config's ids from a layer's input, SGLang and SpecForge from its output.
    assert sides["vllm"]["diagnosis"]["cause"] == "aux_layers_off_by_one"
    assert proc.stdout.startswith("DIVERGED: accept length sglang")
    assert tree_hash(specforge_smollm2.SHIPPED_DIR) == shipped


def test_a_shipped_specforge_draft_that_fails_its_checksum_is_refused(tmp_path, monkeypatch):
    import shutil

    from difftest.errors import InputError
    from difftest.fixturegen import specforge_smollm2

    copy = tmp_path / "shipped"
    shutil.copytree(specforge_smollm2.SHIPPED_DIR, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("100000.0", "10000.0"))
    monkeypatch.setattr(specforge_smollm2, "SHIPPED_DIR", copy)
    p = specforge_smollm2.Paths(tmp_path / "cache" / "specforge")
    with pytest.raises(InputError, match="does not match its checksum"):
        specforge_smollm2.restore(p, specforge_smollm2.shipped_manifest())
