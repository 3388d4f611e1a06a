"""The same inputs on the same host give the same report: everything but timings is equal.

A parameter an engine leaves at init is the case that once made two runs disagree (a head
materialized from whatever memory it got), so it is run twice here, through the CLI, as a
user would.
"""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file, save_file

from tests.test_cli import difftest

VARIES = ("timings_s", "seconds", "wall_s")


def _without_timings(node):
    if isinstance(node, dict):
        return {k: _without_timings(v) for k, v in node.items() if k not in VARIES}
    if isinstance(node, list):
        return [_without_timings(v) for v in node]
    return node


def _differences(a, b, where="report") -> list[str]:
    if type(a) is not type(b):
        return [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        return [d for k in sorted(set(a) | set(b))
                for d in (_differences(a[k], b[k], f"{where}.{k}") if k in a and k in b else [f"{where}.{k}: in one run"])]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    both_nan = isinstance(a, float) and math.isnan(a) and math.isnan(b)
    return [] if a == b or both_nan else [f"{where}: {a!r} != {b!r}"]


def _drop_head(fmt: str):
    def edit(ckpt_dir):
        f = ckpt_dir / fmt / "model.safetensors"
        tensors = load_file(str(f))
        tensors.pop("lm_head.weight")
        save_file(tensors, str(f))
    return edit


@pytest.mark.parametrize("case,edit", [
    ("tiny as shipped", None),
    ("legacy draft without lm_head", _drop_head("legacy")),
    ("speculators draft without lm_head", _drop_head("speculators")),
])
def test_two_runs_of_one_report_are_identical_apart_from_timings(tiny_copy, tmp_path, case, edit):
    fmt = "legacy" if "legacy" in case else "speculators"
    if edit:
        edit(tiny_copy)
    reports = []
    for run in ("a", "b"):
        proc = difftest("report", tiny_copy / fmt, "--target", tiny_copy / "target", "--states",
                        tiny_copy / "states.safetensors", "--out", tmp_path / run, "-q")
        assert proc.returncode in (0, 1), proc.stderr[-2000:]
        reports.append(_without_timings(json.loads((tmp_path / run / "report.json").read_text())))
    # The output directory is the one thing the user chose differently between the runs.
    for rep, run in zip(reports, ("a", "b")):
        rep["command"] = [str(tmp_path / "OUT") if arg == str(tmp_path / run) else arg for arg in rep["command"]]
    differences = _differences(*reports)
    assert not differences, "\n".join(differences[:10])
