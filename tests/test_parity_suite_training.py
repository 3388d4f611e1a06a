"""`pytest difftest/ --difftest-training specforge`: the parity suite with SpecForge as the training
engine, run as a user runs it (a pytest process of its own), on the tiny SpecForge draft."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _suite(tiny: Path, ckpt: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "difftest"), "-q", "-p", "no:cacheprovider",
                           "--difftest-ckpt", str(ckpt), "--difftest-target", str(tiny / "target"),
                           "--difftest-states", str(tiny / "states.safetensors"), "--difftest-serving", "sglang",
                           # The tiny states carry no greedy continuation to score a chain against.
                           "--difftest-dtype", "fp32", "--difftest-chain-steps", "0", *extra],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_the_suite_runs_specforge_as_the_training_engine(tiny):
    proc = _suite(tiny, tiny / "specforge", "--difftest-training", "specforge")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_the_suite_fails_on_the_state_specforge_hands_on_under_norm_output(tiny, tmp_path):
    draft = tmp_path / "specforge"
    shutil.copytree(tiny / "specforge", draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    proc = _suite(tiny, draft, "--difftest-training", "specforge")
    assert proc.returncode == 1, proc.stdout[-3000:]
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_probe_parity[sglang-next_step_hidden]" in failed[0], failed
    assert "norm_output_read_differently" in proc.stdout


def test_an_unknown_training_engine_is_a_usage_error(tiny):
    proc = _suite(tiny, tiny / "specforge", "--difftest-training", "axolotl")
    assert proc.returncode == 4 and "--difftest-training" in proc.stdout + proc.stderr
