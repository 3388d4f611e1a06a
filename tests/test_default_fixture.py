"""The real default fixture: SmolLM2-135M target, a draft trained by speculators' own trainer.

Builds it on first use (cached afterwards), so this module is slow once per machine.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftest.checkpoint import CheckpointFormat, load_checkpoint
from difftest.fixturegen import smollm2
from difftest.fixturegen.cache import Step
from difftest.fixturegen.default import default_fixture
from difftest.report import validate_report
from difftest.states import load_states
from tests.conftest import tree_hash


@pytest.fixture(scope="module")
def fx():
    return default_fixture(progress=False)


def test_target_is_the_real_smollm2(fx):
    cfg = json.loads((fx.target / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["model_type"] == "llama"


def test_draft_keeps_the_trainers_defaults(fx):
    ckpt = load_checkpoint(fx.checkpoint)
    assert ckpt.format is CheckpointFormat.SPECULATORS
    # speculators resolves [2, n//2, n-3] for a 30-layer target.
    assert ckpt.spec.aux_layer_ids == (2, 15, 27)
    assert ckpt.spec.num_hidden_layers == 1 and ckpt.spec.draft_vocab_size < 49152
    layer = ckpt.config["transformer_layer_config"]
    assert layer.get("layer_types") == ["sliding_attention"]
    assert ckpt.config["norm_before_residual"] is True and ckpt.config["norm_before_fc"] is True
    # The legacy copy numbers aux layers in SGLang's convention (see convert.py).
    from dataclasses import replace

    legacy = load_checkpoint(fx.legacy).spec
    assert legacy.aux_layer_ids == (1, 14, 26)
    assert replace(legacy, aux_layer_ids=None) == replace(ckpt.spec, aux_layer_ids=None)


def test_heldout_step0_accuracy_is_far_above_chance(fx):
    acc = json.loads(fx.training.read_text())
    assert acc["heldout_conversations"] >= 10
    assert acc["full_acc_0"] > 0.1 and acc["full_acc_0"] > 100 * acc["chance"], acc


def test_built_steps_are_not_repeated(fx):
    p = smollm2.Paths(fx.target.parent)
    records = sorted(p.root.glob("*.done.json"))
    first_words = {r.name.split(".")[0].split("-")[0] for r in records}
    shipped = {"target", "conversations", "capture", "vocab", "draft", "export"}
    scratch = {"target", "generate", "capture", "vocab", "train", "export"}
    assert first_words in (shipped, scratch), first_words
    mtimes = {r: r.stat().st_mtime for r in records}
    smollm2.build()
    assert {r: r.stat().st_mtime for r in records} == mtimes
    for r in records:
        name = r.name[: -len(".done.json")]
        outputs = [p.root / k for k in json.loads(r.read_text())["sha256"]]
        assert Step(p.root, name, outputs).done()


def test_shipped_draft_is_the_trained_one(fx):
    """The shipped artifact restores to the trainer's own tensors, checksum by checksum, and
    its vocab mapping is the one speculators derives from the shipped generations."""
    from safetensors import safe_open

    manifest = smollm2.shipped_manifest()
    if manifest is None:
        pytest.skip("built from scratch: nothing shipped to check")  # only under DIFFTEST_FIXTURE_FROM_SCRATCH
    p = smollm2.Paths(fx.target.parent)
    with safe_open(str(fx.checkpoint / "model.safetensors"), framework="pt") as f:
        restored = {name: smollm2.tensor_sha256(f.get_tensor(name)) for name in f.keys()}
    assert restored == {name: t["sha256"] for name, t in manifest["draft"]["tensors"].items()}
    assert json.loads(p.conversations.read_text()) == json.loads((smollm2.SHIPPED_DIR / "conversations.json").read_text())


def test_a_tampered_shipped_draft_is_refused(fx, tmp_path, monkeypatch):
    import shutil

    from difftest.errors import InputError

    if smollm2.shipped_manifest() is None:
        pytest.skip("built from scratch: nothing shipped to check")
    shipped = tmp_path / "shipped"
    shutil.copytree(smollm2.SHIPPED_DIR, shipped)
    monkeypatch.setattr(smollm2, "SHIPPED_DIR", shipped)
    data = bytearray((shipped / "draft" / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (shipped / "draft" / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(InputError, match="checksum"):
        smollm2.restore_draft(smollm2.Paths(fx.target.parent), smollm2.shipped_manifest())


def test_speculators_trainer_runs_here_with_its_defaults(fx, tmp_path):
    """The from-scratch path stays alive in CI: speculators' own trainer, launched exactly as
    the fixture build launches it, runs two steps on CPU on a few captured conversations and
    saves a draft whose config carries the trainer defaults the shipped draft has."""
    p = smollm2.Paths(tmp_path)
    (tmp_path / "target").symlink_to(fx.target)
    convs = json.loads((fx.target.parent / "conversations.json").read_text())[:10]
    p.conversations.write_text(json.dumps(convs))
    smollm2.capture(p, lambda *a: None)
    smollm2.vocab(p)
    smollm2.train(p, lambda *a: None, epochs=1, extra_argv=("--max-steps", "2"))
    fresh = json.loads((smollm2._final_checkpoint(p.train_out) / "config.json").read_text())
    shipped = json.loads((fx.checkpoint / "config.json").read_text())
    for key in ("norm_before_residual", "norm_before_fc", "norm_output", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size"):
        assert fresh.get(key) == shipped.get(key), key
    assert fresh["transformer_layer_config"]["layer_types"] == shipped["transformer_layer_config"]["layer_types"]
    assert fresh["transformer_layer_config"].get("sliding_window") == shipped["transformer_layer_config"].get("sliding_window")


def test_heldout_states_pair_tokens_as_the_trainer_does(fx):
    from difftest.states import load_states

    st = load_states(fx.states)
    assert st.aux_layer_ids == (2, 15, 27)
    assert st.aux_hidden_states.shape[1] == 3 * 576 and st.loss_mask is not None


def test_main_job_reports_the_training_checkpoint_against_its_deployment(fx, tmp_path):
    """With no argument: the checkpoint as trained (speculators' format) against the directory
    `difftest convert` writes for it (legacy format, read by SGLang's own loader) and the
    shipped launch command, which is the one convert prints."""
    import shlex

    from difftest.convert import launch_command

    ckpt = load_checkpoint(fx.checkpoint)
    assert shlex.split(fx.launch.read_text()) == launch_command("legacy", "../target", ckpt.stored_dtype())
    before = tree_hash(fx.checkpoint.parent)
    proc = subprocess.run([sys.executable, "-m", "difftest.cli", "report", "--out", str(tmp_path), "-q"],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    validate_report(rep)
    assert rep["training"]["full_acc_0"] > 0.1
    assert rep["checkpoint"]["format"] == "speculators"
    dep = rep["deployment"]
    assert Path(dep["served_dir"]) == fx.served.resolve()
    assert all(r["status"].startswith("equal") for r in dep["tensors"]), dep["tensors"]
    assert dep["plan"]["chain_steps"] == rep["acceptance"]["candidate"]["steps"]
    if ckpt.config["norm_before_residual"]:
        # SGLang has no norm_before_residual: the trainer's default must show up as a real finding.
        assert rep["verdict"] == "DIVERGED"
        assert rep["first_divergence"]["probe"] == "layer0.post_attn_residual"
        assert rep["diagnosis"]["cause"] == "norm_before_residual_ignored"
    assert tree_hash(fx.checkpoint.parent) == before


def test_the_serving_chain_is_drafted_from_what_its_own_target_captures(fx, tmp_path):
    """Served aux ids copied verbatim: SGLang's target captures other layers than training's,
    and its chain is drafted from the layers its own target forward was measured to hold."""
    import torch

    from difftest import pipeline
    from difftest.faults import FAULTS_BY_NAME, Workspace

    ws = Workspace.copy_of(fx.checkpoint, load_states(fx.states), fx.target, tmp_path, torch.bfloat16)
    ws.deploy()
    FAULTS_BY_NAME["served_aux_ids_verbatim"].inject(ws)
    inputs = pipeline.prepare(ws.checkpoint, ws.target, ws.states_file())
    result = pipeline.run(inputs, dtype=torch.bfloat16, serving=ws.deployment(), chain_steps=2,
                          measure_target_capture=True)
    measured = result.target_capture.serving_hf_ids  # named from SGLang's own target forward
    assert measured == [k + 1 for k in inputs.states.aux_layer_ids]
    assert result.candidate.details["chain_notes"] == [
        f"drafted from the states this deployment's target captures (layers {measured}), not the training states"]
    assert result.diagnosis.ranked[0]["cause"] == "aux_layers_off_by_one"
    assert result.diagnosis.ranked[0]["found_at"] == "audit:capture"


def test_selftest_on_the_real_draft_catches_every_fault_in_both_dtypes(fx):
    from difftest.selftest import run_selftest

    score = run_selftest("default")
    misses = [o.as_dict() for o in score.outcomes if not o.passed]
    assert score.ok, misses
    assert {o.dtype for o in score.outcomes} == {"fp32", "bf16"}


def test_a_launch_cause_is_costed_by_undoing_it_alone(fx, tmp_path):
    """EAGLE for an EAGLE-3 draft: SGLang's chain is drafted again with the flag set back to
    EAGLE3, and the accept length that recovers is the cause's own cost. The engines agree on
    this draft within the tolerance, so undoing the only launch cause recovers the serving gap."""
    import torch

    from difftest import pipeline
    from difftest.faults import Workspace

    ws = Workspace.copy_of(fx.checkpoint, load_states(fx.states), fx.target, tmp_path, torch.float32)
    ws.edit_config(lambda c: c.update(norm_before_residual=False))  # the engines' one known difference, off
    ws.deploy()
    ws.set_launch_flag("--speculative-algorithm", "EAGLE")
    inputs = pipeline.prepare(ws.checkpoint, ws.target, ws.states_file())
    result = pipeline.run(inputs, dtype=torch.float32, serving=ws.deployment(), chain_steps=3)
    assert result.acceptance.reference.scored_rows > 100
    finding = next(f for f in result.findings if f.cause == "speculative_algorithm_not_eagle3")
    assert finding.measured["undone"] == "--speculative-algorithm EAGLE3"
    gap = result.acceptance.reference.mean_accept_length - result.acceptance.candidate.mean_accept_length
    assert gap > 0.2  # EAGLE collapses acceptance: no aux capture, the target's head
    assert finding.measured["cost_accept_length"] == pytest.approx(gap, abs=0.05)
    head = result.diagnosis.ranked[0]
    assert head["cause"] == "speculative_algorithm_not_eagle3"
    assert head["cost_accept_length"] == finding.measured["cost_accept_length"]
    assert head["how"].startswith("measured by undoing it alone (--speculative-algorithm EAGLE3)")


@pytest.mark.parametrize("fault,cause,found_at,with_run,undone,undone_in", [
    # Both engines map tokens through the same d2t: the mapped token diverges between them only
    # when something upstream does, so the cause sits there or at the audit that found it.
    # Both load it alike, so the reference engine carries its cost and training's metric shows it.
    ("d2t_arange_subtracted", "d2t_arange_subtracted", ("target_token", "audit:vocab"), True, "d2t rebuilt as offsets",
     "speculators"),
    # speculators fills a missing head from the verifier (its load_verifier_weights); SGLang
    # leaves it at init, so SGLang carries the cost.
    ("lm_head_missing", "lm_head_missing", ("logits",), True, "lm_head.weight put back from the training run", "sglang"),
    ("lm_head_missing", "lm_head_missing", ("logits",), False, "lm_head.weight rebuilt from the target's head rows",
     "sglang"),
])
def test_a_checkpoint_defect_headlines_its_own_cause_costed_by_undoing_it(fx, tmp_path, fault, cause, found_at,
                                                                          with_run, undone, undone_in):
    """The seeds' d2t 'fix' that subtracts arange; a draft shipped without its lm_head. The
    headline is the specific cause at its own place, with its own fix and the accept length that
    drafting again on a repaired scratch copy recovers in the engine that lost it; a training
    shortfall it causes is shown as its measured effect. Without the training run, the head is
    rebuilt as speculators builds it."""
    from difftest import pipeline
    from difftest.diagnosis import CAUSES
    from difftest.faults import FAULTS_BY_NAME, Workspace

    ws = Workspace.copy_of(fx.checkpoint, load_states(fx.states), fx.target, tmp_path, torch.float32)
    FAULTS_BY_NAME[fault].inject(ws)
    before = tree_hash(ws.checkpoint)
    inputs = pipeline.prepare(ws.checkpoint, ws.target, ws.states_file())
    result = pipeline.run(inputs, dtype=torch.float32, chain_steps=3, training_metrics=json.loads(fx.training.read_text()),
                          training_run=fx.training_run if with_run else None)
    diag = result.diagnosis
    assert diag.cause == cause and diag.found_at in found_at, diag.ranked
    assert diag.fix == CAUSES[cause].fix
    finding = next(f for f in result.findings if f.cause == cause)
    assert finding.measured["undone_in"] == undone_in and finding.measured["undone"].startswith(undone)
    assert diag.ranked[0]["cost_accept_length"] == finding.measured["cost_accept_length"] > 0.2, finding.measured
    symptom = next((e for e in diag.ranked if e["side"] == "training"), None)
    if undone_in == "speculators":
        assert f"measured effect of {cause}" in symptom["how"] and symptom["cause"] in diag.also
    else:
        assert symptom is None  # the training engine computes what training did: no shortfall
    assert tree_hash(ws.checkpoint) == before  # the repair is drafted on a scratch copy


def _states_chunks_reversed(ws):
    from dataclasses import replace

    st = ws.states
    ws.states = replace(st, aux_hidden_states=torch.cat(st.aux_hidden_states.split(st.target_hidden_size, dim=-1)[::-1],
                                                        dim=-1))


def _weights_in_bf16(ws):
    ws.edit_tensors(lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items() if v.is_floating_point()}))


def _random_embedding_shipped(ws):
    from difftest.target import load_target

    embed = load_target(ws.target).embed.float()
    g = torch.Generator().manual_seed(0)
    ws.edit_tensors(lambda t: t.__setitem__("embed_tokens.weight", torch.randn(embed.shape, generator=g) * embed.std()))


@pytest.mark.parametrize("case", ["states_chunks_reordered", "bf16_weights_at_fp32", "shipped_embedding_random"])
def test_the_acceptance_first_cases_each_name_their_cause_at_its_place(fx, tmp_path, case):
    """Three cases from the acceptance-first work, on the default draft with its training run:
    states whose aux chunks were concatenated in another order (both engines agree, acceptance
    collapses: the explanation must not call that free), bf16-stored weights run at fp32 (a
    rounding difference at embed is named as precision, the later real divergence at its own
    probe) and a draft that ships its own random embedding (which SGLang replaces)."""
    from difftest import pipeline
    from difftest.acceptance import explain
    from difftest.diagnosis import CAUSES
    from difftest.faults import Workspace
    from difftest.report.build import build_report, verdict_line

    ws = Workspace.copy_of(fx.checkpoint, load_states(fx.states), fx.target, tmp_path, torch.float32)
    {"states_chunks_reordered": _states_chunks_reversed, "bf16_weights_at_fp32": _weights_in_bf16,
     "shipped_embedding_random": _random_embedding_shipped}[case](ws)
    inputs = pipeline.prepare(ws.checkpoint, ws.target, ws.states_file())
    result = pipeline.run(inputs, dtype=torch.float32, chain_steps=3, training_metrics=json.loads(fx.training.read_text()),
                          training_run=fx.training_run, measure_target_capture=True)
    diag, line = result.diagnosis, verdict_line(build_report(result))
    ranked = {e["cause"]: e for e in diag.ranked}
    assert len(ranked) == len(diag.ranked), diag.ranked  # one entry per cause
    if case == "states_chunks_reordered":
        assert diag.cause == "aux_layers_wrong_order" and diag.ranked[0]["cost_accept_length"] > 0.2, diag.ranked
        said = " ".join(explain(result.acceptance, diag))
        assert "Both engines carry aux_layers_wrong_order" in said
        assert "(aux_layers_wrong_order" not in said.split("Both engines carry")[0]  # never called free
    elif case == "bf16_weights_at_fp32":
        assert "first divergence at embed (embedding_precision)" in line, line
        assert ranked["norm_before_residual_ignored"]["found_at"] == "layer0.post_attn_residual"
        assert "--dtype auto" in CAUSES["embedding_precision"].fix
    else:
        finding = next(f for f in result.findings if f.cause == "shipped_embedding_replaced")
        assert finding.measured["fates"] == {"speculators": "written", "sglang": "shared"}
        assert ranked["shipped_embedding_replaced"]["found_at"] == "embed"
        # Both engines agree the checkpoint is not what was trained: the shortfall names the tensor.
        changed = next(f for f in result.findings if f.cause == "checkpoint_changed_after_training")
        assert "embed_tokens.weight" in changed.message and diag.ranked[0]["cost_accept_length"] > 0.2


@pytest.mark.parametrize("fault", ["served_d2t_arange_subtracted", "served_lm_head_missing", "served_norm_flag_missing"])
def test_a_served_directory_cause_is_costed_on_a_repaired_copy_of_it(fx, tmp_path, fault):
    """A defect in the served directory: SGLang drafts its chain again on a scratch copy of that
    directory with the one defect put back as training had it (the tensor, the token map, the
    config keys). With nothing else between the engines, that recovers the serving gap; the
    user's served directory is never written."""
    from difftest import pipeline
    from difftest.diagnosis import CAUSES
    from difftest.faults import FAULTS_BY_NAME, Workspace

    ws = Workspace.copy_of(fx.checkpoint, load_states(fx.states), fx.target, tmp_path, torch.float32)
    ws.edit_config(lambda c: c.update(norm_before_residual=False))  # the engines' one known difference, off
    ws.deploy()
    FAULTS_BY_NAME[fault].inject(ws)
    before = tree_hash(ws.served)
    inputs = pipeline.prepare(ws.checkpoint, ws.target, ws.states_file())
    result = pipeline.run(inputs, dtype=torch.float32, serving=ws.deployment(), chain_steps=3)
    head = result.diagnosis.ranked[0]
    assert result.diagnosis.cause == FAULTS_BY_NAME[fault].diagnosis
    assert result.diagnosis.fix == CAUSES[result.diagnosis.cause].fix
    assert head["how"].startswith("measured by undoing it alone"), head
    gap = result.acceptance.reference.mean_accept_length - result.acceptance.candidate.mean_accept_length
    assert gap > 0.1 and head["cost_accept_length"] == pytest.approx(gap, abs=0.05), (gap, head)
    assert tree_hash(ws.served) == before


def test_a_field_the_server_ignores_is_costed_by_drafting_as_the_server_computes(fx):
    """SGLang has no norm_before_residual. speculators drafting with the field at the value SGLang
    behaves as costs that cause alone; as it is the only thing between the engines on this draft,
    that must reproduce the measured serving gap."""
    from difftest import pipeline

    inputs = pipeline.prepare(fx.checkpoint, fx.target, fx.states)
    result = pipeline.run(inputs, dtype=torch.float32, chain_steps=3, audit_config=True)
    finding = next(f for f in result.findings if f.cause == "norm_before_residual_ignored")
    assert finding.measured["undo"]["args"]["edits"] == [("norm_before_residual", False)]
    gap = result.acceptance.reference.mean_accept_length - result.acceptance.candidate.mean_accept_length
    assert finding.measured["cost_accept_length"] == pytest.approx(gap, abs=0.05)
    entry = next(e for e in result.diagnosis.ranked if e["cause"] == "norm_before_residual_ignored")
    assert entry["cost_accept_length"] == finding.measured["cost_accept_length"]
    assert entry["how"].startswith("measured alone (the training engine run as the serving engine computes it")


@pytest.mark.parametrize("fault", ["head_rows_shuffled_after_training", "fc_edited_after_training",
                                   "vocab_map_regenerated_after_training"])
def test_a_change_made_after_training_is_costed_by_putting_the_trained_tensors_back(fx, tmp_path, fault):
    """Both engines load the changed checkpoint alike; the training run's own saved checkpoint
    names what changed. Drafting again on a copy with exactly those tensors put back costs the
    change alone, and that is the headline's cost (training's gap is kept beside it)."""
    from difftest import pipeline
    from difftest.faults import FAULTS_BY_NAME, Workspace

    ws = Workspace.copy_of(fx.checkpoint, load_states(fx.states), fx.target, tmp_path, torch.float32)
    FAULTS_BY_NAME[fault].inject(ws)
    inputs = pipeline.prepare(ws.checkpoint, ws.target, ws.states_file())
    result = pipeline.run(inputs, dtype=torch.float32, chain_steps=3, training_metrics=json.loads(fx.training.read_text()),
                          training_run=fx.training_run)
    head = result.diagnosis.ranked[0]
    assert head["cause"] == FAULTS_BY_NAME[fault].diagnosis and head["method"] == "undone", head
    shortfall = next(f for f in result.findings if f.check == "acceptance")
    restored = [name for name, _ in shortfall.measured["undo"]["args"]["tensors"]]
    assert head["how"].startswith(f"measured by undoing it alone ({', '.join(restored)} put back from the training run)")
    assert head["cost_accept_length"] == shortfall.measured["recovered_accept_length"] > 0.2


def test_capture_reproduces_the_fixture_states_for_its_held_out_conversations(fx, tmp_path):
    """`difftest capture` on the held-out conversations the fixture's states were captured from
    (through transformers, at the layers speculators resolves): SGLang's own target forward
    gives the same tokens, masks and first tokens, and the aux states within fp32 tolerance."""
    from difftest.compare import activation_metrics
    from difftest.fixturegen.smollm2 import Paths, heldout_conversations
    from difftest.tolerances import tolerance_for

    shipped = load_states(fx.states)
    held = heldout_conversations(Paths(fx.checkpoint.parents[1]))[:len(shipped.seq_lens)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": c["input_ids"], "loss_mask": c["loss_mask"]}) + "\n"
                               for c in held))
    out = tmp_path / "captured.safetensors"
    proc = subprocess.run([sys.executable, "-m", "difftest.cli", "capture", str(fx.checkpoint), "--prompts", str(prompts),
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = load_states(out)
    for field in ("input_ids", "seq_lens", "first_token_ids", "loss_mask"):
        assert torch.equal(getattr(got, field), getattr(shipped, field)), field
    assert got.aux_layer_ids == shipped.aux_layer_ids
    tol = tolerance_for(torch.float32)
    m = activation_metrics(shipped.aux_hidden_states, got.aux_hidden_states)
    assert m["rel_max"] <= tol.rel_max and m["rel_diff"] <= tol.rel_diff, m


def test_capture_renders_a_chat_with_the_targets_template_and_masks_the_reply(fx):
    """A chat is bounded as speculators' preprocessing bounds it: the reply's tokens, after the
    render of the turns before it with the generation prompt, carry the loss mask."""
    from transformers import AutoTokenizer

    from difftest.capture import read_prompts
    from difftest.target import load_target

    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chats.json"
        path.write_text(json.dumps([{"messages": chat}]))
        target = load_target(fx.target)
        (row,) = read_prompts(path, fx.target, target.vocab_size, 8192)
    tok = AutoTokenizer.from_pretrained(str(fx.target))
    prompt = tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert row.input_ids[:len(prompt)] == prompt and len(row.input_ids) > len(prompt)
    assert row.loss_mask == [0] * len(prompt) + [1] * (len(row.input_ids) - len(prompt))
