import json

import pytest

from difftest.checkpoint import CheckpointFormat, load_checkpoint
from difftest.convert import legacy_to_speculators, speculators_to_legacy
from difftest.errors import InputError
from tests.conftest import tree_hash


def test_detects_both_formats(tiny):
    assert load_checkpoint(tiny / "speculators").format is CheckpointFormat.SPECULATORS
    assert load_checkpoint(tiny / "legacy").format is CheckpointFormat.LEGACY


def test_both_formats_describe_the_same_draft(tiny):
    from dataclasses import replace

    from difftest.convert import LEGACY_AUX_ID_SHIFT

    a, b = load_checkpoint(tiny / "speculators"), load_checkpoint(tiny / "legacy")
    # The formats number aux layers differently (see convert.py); everything else is equal.
    assert b.spec.aux_layer_ids == tuple(k - LEGACY_AUX_ID_SHIFT for k in a.spec.aux_layer_ids)
    assert replace(a.spec, aux_layer_ids=None) == replace(b.spec, aux_layer_ids=None)
    assert a.spec.draft_vocab_size < a.spec.target_vocab_size


def test_unknown_format_is_an_input_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(InputError, match="unknown checkpoint format"):
        load_checkpoint(tmp_path)


def test_reading_never_writes(tiny):
    before = tree_hash(tiny)
    ckpt = load_checkpoint(tiny / "speculators")
    dict(ckpt.tensors())
    assert tree_hash(tiny) == before


def test_converter_round_trip_is_lossless(tiny, tmp_path):
    src = load_checkpoint(tiny / "speculators")
    speculators_to_legacy(src, tmp_path / "legacy")
    legacy = load_checkpoint(tmp_path / "legacy")
    assert legacy.format is CheckpointFormat.LEGACY
    assert all(n.startswith("midlayer.") for n in legacy.tensor_names() if "self_attn" in n)
    legacy_to_speculators(legacy, tmp_path / "back", verifier_path="../target")
    back = load_checkpoint(tmp_path / "back")
    assert back.spec == src.spec
    assert sorted(back.tensor_names()) == sorted(src.tensor_names())
    for name, tensor in src.tensors():
        assert back.get(name).equal(tensor), name


def test_converter_refuses_wrong_direction(tiny, tmp_path):
    with pytest.raises(ValueError):
        speculators_to_legacy(tiny / "legacy", tmp_path / "x")
    with pytest.raises(ValueError):
        legacy_to_speculators(tiny / "speculators", tmp_path / "y")
