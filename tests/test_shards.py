"""Sharded checkpoints are read the way the engines read them: through the index.

A shard the index names but that is missing is exit 2 before any engine starts; a weight file
the index does not name is a visible note, never an input; the measured config audit runs on
the shards like on one file. The reader is fuzzed over shard sets.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from difftest.checkpoint import INDEX_FILE, load_checkpoint
from difftest.errors import InputError
from tests.conftest import tree_hash
from tests.test_cli import difftest
from tests.test_outputs_and_cli_surface import one_error_line


def shard(ckpt, groups: list[list[str]], tensors=None) -> dict[str, str]:
    """Rewrite ckpt's weights as len(groups) shards plus an index; returns the weight map."""
    tensors = tensors if tensors is not None else load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink(missing_ok=True)
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(ckpt / fname))
        weight_map.update({n: fname for n in names})
    (ckpt / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def halves(ckpt):
    names = sorted(load_file(str(ckpt / "model.safetensors")))
    return [names[::2], names[1::2]]


def test_a_sharded_checkpoint_with_a_stray_file_gives_parity_and_a_note(tiny_copy, tmp_path):
    ckpt = tiny_copy / "speculators"
    tensors = load_file(str(ckpt / "model.safetensors"))
    shard(ckpt, halves(ckpt))
    # A stray file the index does not name: random values under real names would be a false
    # decoder_math_divergence if it were read.
    save_file({n: torch.randn_like(t.float()).to(t.dtype) if t.is_floating_point() else t for n, t in tensors.items()},
              str(ckpt / "model-old.safetensors"))
    before = tree_hash(tiny_copy)
    out = tmp_path / "out"
    proc = difftest("report", ckpt, "--out", out, "-q")
    assert proc.returncode == 0 and proc.stdout.startswith("PARITY"), proc.stdout + proc.stderr[-2000:]
    rep = json.loads((out / "report.json").read_text())
    notes = [f for f in rep["audit"]["findings"] if f["cause"] == "weight_file_not_read"]
    assert len(notes) == 1 and "model-old.safetensors" in notes[0]["message"] and notes[0]["severity"] == "info"
    # The measured config audit ran on the shards: every behavioral field was measured.
    measured = [r for r in rep["audit"]["config"] if "perturbed_to" in r]
    assert measured and all(isinstance(r["training_effect"], float) for r in measured), measured[:3]
    assert tree_hash(tiny_copy) == before


def test_a_missing_shard_is_exit_2_before_any_engine(tiny_copy, tmp_path):
    ckpt = tiny_copy / "speculators"
    shard(ckpt, halves(ckpt))
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    one_error_line(difftest("report", ckpt, "--out", tmp_path / "out"), "model-00002-of-00002.safetensors", "not a file")


def test_several_weight_files_and_no_index_is_exit_2(tiny_copy, tmp_path):
    ckpt = tiny_copy / "speculators"
    shard(ckpt, halves(ckpt))
    (ckpt / INDEX_FILE).unlink()
    one_error_line(difftest("report", ckpt, "--out", tmp_path / "out"), "no model.safetensors.index.json")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_shard_sets_read_exactly_the_indexed_tensors_or_fail_cleanly(tiny, tmp_path_factory, data):
    src = load_file(str(tiny / "speculators" / "model.safetensors"))
    names = sorted(src)
    d = tmp_path_factory.mktemp("shards")
    (d / "config.json").write_text((tiny / "speculators" / "config.json").read_text())
    n_shards = data.draw(st.integers(1, 4))
    owner = data.draw(st.lists(st.integers(0, n_shards - 1), min_size=len(names), max_size=len(names)))
    groups = [[n for n, o in zip(names, owner) if o == i] for i in range(n_shards)]
    groups = [g for g in groups if g] or [names]
    weight_map = shard(d, groups, src)
    defect = data.draw(st.sampled_from(["none", "stray", "missing_shard", "wrong_file", "duplicate", "bad_index"]))
    files = sorted(set(weight_map.values()))
    if defect == "stray":
        save_file({names[0]: src[names[0]]}, str(d / "stray.safetensors"))
    elif defect == "missing_shard":
        (d / data.draw(st.sampled_from(files))).unlink()
    elif defect == "wrong_file" and len(files) > 1:
        name = data.draw(st.sampled_from(names))
        weight_map[name] = next(f for f in files if f != weight_map[name])
        (d / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    elif defect == "duplicate" and len(files) > 1:
        first, second = files[0], files[1]
        moved = load_file(str(d / first))
        save_file({**load_file(str(d / second)), **moved}, str(d / second))
    elif defect == "bad_index":
        (d / INDEX_FILE).write_text(json.dumps({"weight_map": data.draw(st.sampled_from([[], {}, {"x": 1}, None]))}))
    try:
        ckpt = load_checkpoint(d)
    except InputError as exc:
        assert defect != "none" and defect != "stray", exc
        assert "\n" not in str(exc)
        return
    assert defect in ("none", "stray") or len(files) == 1, defect
    assert sorted(ckpt.tensor_names()) == names
    for n in names:
        assert torch.equal(ckpt.get(n), src[n])
    assert ckpt.ignored_files == (["stray.safetensors"] if defect == "stray" else [])
