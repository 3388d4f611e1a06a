"""A tensor's fate in the report is the engine's real fate: through the CLI, on tiny copies.

An extra tensor both engines ignore is information (PARITY with a note), not a divergence;
a tensor SGLang takes as its token map because its name contains "d2t" is ledgered as such
and named as the cause; one parameter stored under both formats' names is flagged, and is
the cause when the copies differ.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import tree_hash
from tests.test_cli import difftest


def edit(ckpt, change) -> None:
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    change(t)
    save_file(t, str(f))


def report(ckpt, out):
    proc = difftest("report", ckpt, "--no-audit-config", "--out", out, "-q")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.returncode, json.loads((out / "report.json").read_text())


def findings(rep, cause):
    return [f for f in rep["audit"]["findings"] if f["cause"] == cause]


def test_a_tensor_both_engines_ignore_is_a_note_not_a_divergence(tiny_copy, tmp_path):
    ckpt = tiny_copy / "speculators"
    edit(ckpt, lambda t: t.update({"optimizer.exp_avg": torch.randn(16, 16)}))
    before = tree_hash(tiny_copy)
    code, rep = report(ckpt, tmp_path / "out")
    assert code == 0 and rep["verdict"] == "PARITY", rep.get("diagnosis")
    note = findings(rep, "tensor_unused_by_both")
    assert len(note) == 1 and note[0]["severity"] == "info" and "optimizer.exp_avg" in note[0]["message"]
    assert not findings(rep, "keys_dropped")
    assert tree_hash(tiny_copy) == before


def test_a_name_containing_d2t_is_ledgered_as_the_token_map_it_becomes(tiny_copy, tmp_path):
    ckpt = tiny_copy / "legacy"
    # Sorted after d2t in the file, so SGLang's load_weights reaches it last and serves with it.
    edit(ckpt, lambda t: t.update({"d2t_old": torch.roll(t["d2t"], 1)}))
    code, rep = report(ckpt, tmp_path / "out")
    fate = rep["audit"]["ledgers"]["candidate"]["tensors"]["d2t_old"]
    assert "hot_token_id" in json.dumps(fate), fate
    assert code == 1 and rep["diagnosis"]["cause"] == "token_map_from_other_tensor", rep["diagnosis"]
    assert "d2t_old" in findings(rep, "token_map_from_other_tensor")[0]["message"]


def test_one_parameter_under_both_names_is_flagged_and_named_when_the_copies_differ(tiny_copy, tmp_path):
    ckpt = tiny_copy / "legacy"
    edit(ckpt, lambda t: t.update({"layers.0.mlp.down_proj.weight": t["midlayer.mlp.down_proj.weight"].clone()}))
    code, rep = report(ckpt, tmp_path / "same")
    flagged = findings(rep, "duplicate_tensor_copies")
    assert len(flagged) == 1 and flagged[0]["severity"] == "info", flagged
    edit(ckpt, lambda t: t.update({"layers.0.mlp.down_proj.weight": -t["midlayer.mlp.down_proj.weight"]}))
    code, rep = report(ckpt, tmp_path / "differ")
    flagged = findings(rep, "duplicate_tensor_copies")
    assert len(flagged) == 1 and flagged[0]["severity"] == "error", flagged
    assert code == 1 and rep["diagnosis"]["cause"] == "duplicate_tensor_copies", rep["diagnosis"]
