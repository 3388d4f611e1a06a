"""The CLI as a user runs it: a subprocess, its exit codes, its files, its inputs untouched."""

import json
import os
import subprocess
import sys

import pytest

from difftest.report import validate_report
from difftest.report.views import comparisons
from tests.conftest import tree_hash
from tests.test_progress import assert_only_progress_lines


def difftest(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "difftest.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=600, env=env)


def test_report_parity_on_every_serving_engine(tiny, tmp_path):
    """The default: training against SGLang and vLLM, one report, each comparison whole."""
    before = tree_hash(tiny)
    env = {k: v for k, v in os.environ.items() if k != "DIFFTEST_SERVING"}
    proc = difftest("report", tiny / "speculators", "--dtype", "fp32", "--out", tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "PARITY: sglang: PARITY; vllm: PARITY"
    # stderr is a pipe here, as in CI: plain progress lines and nothing from the engines
    assert_only_progress_lines(proc.stderr)
    rep = json.loads((tmp_path / "report.json").read_text())
    validate_report(rep)
    assert rep["serving_engines"] == ["sglang", "vllm"]
    for name, comparison in comparisons(rep).items():
        assert comparison["verdict"] == "PARITY" and comparison["first_divergence"] is None
        assert comparison["engines"]["candidate"]["name"] == name
    assert comparisons(rep)["sglang"]["environment"]["packages"]["sglang"] == "0.5.23"
    assert comparisons(rep)["vllm"]["engines"]["candidate"]["details"]["worker"]["vllm"] == "0.32.0"
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# difftest report: PARITY")
    assert "## sglang: PARITY" in md and "## vllm: PARITY" in md and md.count("| logits | pass |") == 2
    html = (tmp_path / "report.html").read_text()
    assert "id='sglang-deployment'" in html and "id='vllm-deployment'" in html
    assert tree_hash(tiny) == before


@pytest.mark.parametrize("fmt,dtype", [("speculators", "fp32"), ("legacy", "bf16")])
def test_report_parity(tiny, tmp_path, fmt, dtype):
    before = tree_hash(tiny)
    proc = difftest("report", tiny / fmt, "--dtype", dtype, "--serving", "sglang", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("PARITY")
    # stderr is a pipe here, as in CI: plain progress lines and nothing from the engines
    assert_only_progress_lines(proc.stderr)
    rep = json.loads((tmp_path / "report.json").read_text())
    validate_report(rep)
    assert rep["verdict"] == "PARITY" and rep["first_divergence"] is None
    assert rep["environment"]["packages"]["sglang"] == "0.5.23"
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# difftest report: PARITY") and "| logits | pass |" in md
    assert tree_hash(tiny) == before


@pytest.mark.parametrize("flag,probe,cause", [
    ("--serve-without-aux-capture", "fc.input", "aux_capture_off_fc_skipped"),
    ("--serve-lm-head-from-target", "logits", "lm_head_replaced_by_target"),
])
def test_report_serving_fault_diverges(tiny, tmp_path, flag, probe, cause):
    proc = difftest("report", tiny / "speculators", flag, "--out", tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    rep = json.loads((tmp_path / "report.json").read_text())
    validate_report(rep)
    assert rep["first_divergence"]["probe"] == probe and rep["diagnosis"]["cause"] == cause
    assert f"first divergence at {probe}" in proc.stdout


@pytest.mark.parametrize("make_bad", ["missing_dir", "bad_json", "unknown_format", "bad_dtype"])
def test_bad_input_is_one_line_and_exit_2(tiny_copy, tmp_path, make_bad):
    ckpt = tiny_copy / "speculators"
    extra = []
    if make_bad == "missing_dir":
        ckpt = tmp_path / "nope"
    elif make_bad == "bad_json":
        (ckpt / "config.json").write_text("{not json")
    elif make_bad == "unknown_format":
        (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif make_bad == "bad_dtype":
        extra = ["--dtype", "int3"]
    before = tree_hash(tiny_copy)
    proc = difftest("report", ckpt, *extra, "--out", tmp_path / "out")
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("difftest: error:"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "report.json").exists()
    assert tree_hash(tiny_copy) == before
