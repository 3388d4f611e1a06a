"""Each audit detector fires on a constructed case and stays quiet on the clean fixture."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

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
