"""Each audit detector fires on a constructed case and stays quiet on the clean fixture."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftest.audit.findings import Severity
from difftest.audit.vocab import check_vocab
from difftest.checkpoint import load_checkpoint


def causes(findings, severity="error"):
    return {f.cause for f in findings if f.severity.value == severity}


def rewrite(ckpt_dir, edit):
    f = ckpt_dir / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))
    return load_checkpoint(ckpt_dir)


def test_clean_fixture_mapping_is_quiet(tiny):
    assert causes(check_vocab(load_checkpoint(tiny / "speculators"))) == set()


@pytest.mark.parametrize("corrupt,cause", [
    (lambda t: t.__setitem__("d2t", t["d2t"] + torch.arange(t["d2t"].numel())), "d2t_absolute_ids"),
    (lambda t: t.__setitem__("d2t", t["d2t"] - torch.arange(t["d2t"].numel())), "d2t_arange_subtracted"),
    (lambda t: t.__setitem__("d2t", torch.zeros_like(t["d2t"])), "d2t_all_zero"),
    (lambda t: t.pop("d2t"), "d2t_missing"),
    (lambda t: t.__setitem__("d2t", t["d2t"].flip(0)), "d2t_t2d_disagree"),
])
def test_vocab_corruptions_are_named(tiny_copy, corrupt, cause):
    ckpt = rewrite(tiny_copy / "speculators", corrupt)
    assert cause in causes(check_vocab(ckpt))


def test_ledger_flags_a_dropped_decoder_key_and_param_left_at_init(tiny_copy, tiny):
    from difftest.audit.ledger import check_ledgers
    from difftest.pipeline import prepare, run

    rewrite(tiny_copy / "legacy", lambda t: t.__setitem__("model.layers.0.mlp.bogus.weight", t.pop("midlayer.mlp.down_proj.weight")))
    inputs = prepare(tiny_copy / "legacy", tiny / "target", tiny / "states.safetensors")
    result = run(inputs)
    found = causes(check_ledgers(result.reference, result.candidate))
    assert "keys_dropped" in found and "param_left_at_init" in found


def edit_config(ckpt_dir, edit):
    f = ckpt_dir / "config.json"
    cfg = json.loads(f.read_text())
    edit(cfg)
    f.write_text(json.dumps(cfg))
    return load_checkpoint(ckpt_dir)


def capture_findings(ckpt, tiny, serving=None, states=None):
    from difftest.audit.capture import check_capture
    from difftest.engines.base import RunOptions, ServingSetup
    from difftest.pipeline import candidate_adapter, reference_adapter
    from difftest.states import load_states
    from difftest.target import load_target

    target = load_target(tiny / "target")
    opts = RunOptions(serving=serving or ServingSetup())
    return check_capture(candidate_adapter().capture_plan(ckpt, target, opts),
                         reference_adapter().capture_plan(ckpt, target, opts),
                         states or load_states(tiny / "states.safetensors"))


@pytest.mark.parametrize("fmt", ["speculators", "legacy"])
def test_capture_check_is_quiet_on_the_clean_fixture(tiny, fmt):
    # Holds difftest's converter to SGLang's own +1 convention, measured from its code.
    assert causes(capture_findings(load_checkpoint(tiny / fmt), tiny)) == set()


def _shift_legacy_ids(delta):
    return lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids",
                                                   [k + delta for k in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]])


@pytest.mark.parametrize("edit,cause", [
    (_shift_legacy_ids(+1), "aux_layers_off_by_one"),  # speculators' ids copied verbatim
    (lambda c: c["eagle_config"]["eagle_aux_hidden_state_layer_ids"].reverse(), "states_not_from_this_config"),
    (lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [0, 3, 6]), "aux_layers_mismatch"),
    (lambda c: c["eagle_config"].__setitem__("use_aux_hidden_state", False), "aux_capture_off"),
])
def test_capture_check_names_what_the_server_would_capture(tiny_copy, tiny, edit, cause):
    ckpt = edit_config(tiny_copy / "legacy", edit)
    assert cause in causes(capture_findings(ckpt, tiny))


def test_capture_check_sees_a_target_not_set_up_for_capture(tiny):
    from difftest.engines.base import ServingSetup

    found = capture_findings(load_checkpoint(tiny / "speculators"), tiny, ServingSetup(aux_capture=False))
    assert causes(found) == {"aux_capture_off"}


def test_conversion_check_is_quiet_on_the_converter_output(tiny):
    from difftest.audit.conversion import check_conversion
    from difftest.convert import legacy_config

    ckpt = load_checkpoint(tiny / "speculators")
    rows, found = check_conversion(ckpt, legacy_config(ckpt.config).config)
    assert found == [] and all(r["carried"] for r in rows)


@pytest.mark.parametrize("edit,cause", [
    (lambda c: c.pop("norm_before_fc"), "config_flag_not_carried"),
    (lambda c: c.__setitem__("rope_theta", 1e6) or c.pop("rope_parameters", None), "rope_mismatch"),
    (lambda c: c.__setitem__("tie_word_embeddings", True), "tied_embeddings"),
    (lambda c: c.pop("draft_vocab_size"), "draft_vocab_not_carried"),
])
def test_conversion_check_names_a_field_lost_on_the_way_to_serving(tiny, edit, cause):
    from difftest.audit.conversion import check_conversion
    from difftest.convert import legacy_config

    ckpt = load_checkpoint(tiny / "speculators")
    served = legacy_config(ckpt.config).config
    edit(served)
    assert cause in causes(check_conversion(ckpt, served)[1])


def test_capture_check_sees_training_order_the_server_cannot_reproduce(tiny_copy, tiny):
    # Trained on the aux layers in descending order: the server concatenates in layer order.
    from dataclasses import replace

    from difftest.states import load_states

    st = load_states(tiny / "states.safetensors")
    H = st.verifier_last_hidden_states.shape[-1]
    reversed_states = replace(st, aux_layer_ids=st.aux_layer_ids[::-1],
                              aux_hidden_states=torch.cat(st.aux_hidden_states.split(H, dim=-1)[::-1], dim=-1))
    ckpt = edit_config(tiny_copy / "legacy", lambda c: c["eagle_config"]["eagle_aux_hidden_state_layer_ids"].reverse())
    assert causes(capture_findings(ckpt, tiny, states=reversed_states)) == {"aux_layers_wrong_order"}


@pytest.mark.parametrize("window", [2048, 4])
def test_an_ignored_window_the_rows_cannot_reach_is_not_exercised_never_benign(tiny_copy, window):
    """SGLang's draft ignores the sliding window. A window longer than every row the audit runs
    changes nothing there: that is not shown to be harmless, and the finding says what row
    length would measure it. A window the rows do reach is measured, as an error."""
    from difftest.audit.config import audit_config
    from difftest.pipeline import candidate_adapter, prepare, reference_adapter

    cfg_path = tiny_copy / "speculators" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["transformer_layer_config"]["sliding_window"] = window
    cfg_path.write_text(json.dumps(cfg))
    inputs = prepare(tiny_copy / "speculators", tiny_copy / "target", tiny_copy / "states.safetensors")
    _rows, findings = audit_config(inputs.checkpoint, inputs.target, inputs.states, reference_adapter(),
                                   candidate_adapter())
    found = [f for f in findings if f.cause == "sliding_window_ignored"]
    assert found and Severity.BENIGN not in {f.severity for f in found}
    longest = int(inputs.states.head(96).seq_lens.max())
    if window >= longest:
        assert {f.severity for f in found} == {Severity.NOT_EXERCISED}
        assert all(f.measured["exercised_from_tokens"] == window + 1 and f.measured["longest_row"] == longest
                   for f in found)
    else:
        assert Severity.ERROR in {f.severity for f in found}
