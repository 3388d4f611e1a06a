"""A vLLM deployment: the served directory and the user's `vllm serve` command, read by vLLM's own
serve-argument parser and EngineArgs in its venv, routed there by the program the command names."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftest.audit.deployment import check_launch
from difftest.checkpoint import load_checkpoint
from difftest.engines import launch_engine
from difftest.engines.base import DeploymentPlan, LaunchFlag, LaunchRole
from difftest.report import validate_report

from conftest import tree_hash


def _difftest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftest.cli", *args], capture_output=True, text=True, timeout=600)


def _deploy(tiny: Path, root: Path, speculative: dict, *flags: str) -> tuple[Path, Path]:
    """The tiny draft copied to root/served, and a launch file beside it naming it relatively,
    as a user's deployment script would."""
    served = root / "served"
    shutil.copytree(tiny / "speculators", served)
    command = ["vllm", "serve", str(tiny / "target"), "--speculative-config",
               json.dumps({"method": "eagle3", "model": "served", **speculative}), "--port", "8000", *flags]
    launch = root / "launch.sh"
    launch.write_text(shlex.join(command) + "\n")
    return served, launch


def _report(tiny: Path, served: Path, launch: Path, out: Path, *extra: str):
    proc = _difftest("report", str(tiny / "speculators"), "--target", str(tiny / "target"), "--states",
                     str(tiny / "states.safetensors"), "--serve", str(served), "--launch-file", str(launch),
                     "--serving", "vllm", "--no-audit-config", "--out", str(out), "-q", *extra)
    path = out / "report.json"
    return proc, json.loads(path.read_text()) if path.is_file() else None


def test_launch_commands_go_to_the_engine_whose_server_they_start():
    assert launch_engine(("vllm", "serve", "t", "--speculative-config", "{}")) == "vllm"
    assert launch_engine(("VLLM_CPU_KVCACHE_SPACE=4", "python", "-m", "vllm.entrypoints.openai.api_server")) == "vllm"
    assert launch_engine(("python3", "-m", "sglang.launch_server", "--model-path", "t")) == "sglang"
    assert launch_engine(("sglang", "serve", "--model-path", "t")) == "sglang"
    assert launch_engine(("--model-path", "t", "--speculative-algorithm", "EAGLE3")) == "sglang"  # flags alone
    assert launch_engine(("python", "serve.py", "--model", "t")) is None


def test_the_launch_audit_reads_settings_by_role_not_by_one_engines_flag_names(tiny):
    """A plan in vLLM's words (its method inside --speculative-config, its --load-format) meets the
    same checks as SGLang's, and each fix is the edit the adapter says sets it right."""
    ckpt = load_checkpoint(tiny / "speculators")
    right = json.dumps({"method": "eagle3", "model": "served", "num_speculative_tokens": 3})
    plan = DeploymentPlan(dtype=torch.bfloat16, chain_steps=3, flags=[
        LaunchFlag("--speculative-config method", "eagle", "the EAGLE-1 path", role=LaunchRole.ALGORITHM,
                   expected="eagle3", set_right=("--speculative-config", right)),
        LaunchFlag("--dtype", "bfloat16", "the draft's dtype", given=False, role=LaunchRole.DTYPE),
        LaunchFlag("--load-format", "dummy", "how weights are read", role=LaunchRole.LOAD_FORMAT),
        LaunchFlag("--kv-cache-dtype", "fp8", "KV at fp8", simulated=False, instead="KV at the draft's dtype"),
    ])
    rows, findings = check_launch(plan, torch.float32, ckpt, ckpt)
    by_cause = {f.cause: f for f in findings}
    assert by_cause["speculative_algorithm_not_eagle3"].measured["undo"] == {"flag": "--speculative-config",
                                                                              "value": right}
    assert by_cause["served_dtype_differs"].measured["undo"] == {"flag": "--dtype", "value": "float32"}
    assert by_cause["draft_weights_random"].measured["undo"] == {"flag": "--load-format", "value": None}
    assert by_cause["launch_flag_not_simulated"].measured["flag"] == "--kv-cache-dtype"
    assert [r["role"] for r in rows] == ["algorithm", "dtype", "load_format", "other"]
    correct = DeploymentPlan(dtype=torch.float32, chain_steps=3, flags=[
        LaunchFlag("--speculative-config method", "eagle3", "", role=LaunchRole.ALGORITHM, expected="eagle3"),
        LaunchFlag("--load-format", "auto", "", role=LaunchRole.LOAD_FORMAT)])
    assert check_launch(correct, torch.float32, ckpt, ckpt)[1] == []


def test_a_correct_vllm_deployment_is_parity_and_nothing_given_is_modified(tiny, tmp_path):
    served, launch = _deploy(tiny, tmp_path, {"num_speculative_tokens": 3}, "--dtype", "float32")
    before = tree_hash(served), tree_hash(tiny)
    proc, rep = _report(tiny, served, launch, tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    validate_report(rep)
    assert rep["verdict"] == "PARITY" and rep["engines"]["candidate"]["name"] == "vllm"
    dep = rep["deployment"]
    assert dep["plan"]["chain_steps"] == 3 and dep["plan"]["dtype"] == "float32"
    assert rep["acceptance"]["candidate"]["steps"] == 3
    assert {r["status"] for r in dep["tensors"]} == {"equal (bitwise)"}
    assert all(r["status"] == "carried" for r in dep["config"]), [r for r in dep["config"] if r["status"] != "carried"]
    roles = {r["role"]: r for r in dep["launch"]}
    assert roles["algorithm"]["value"] == "eagle3" and roles["chain"]["value"] == 3
    assert rep["engines"]["candidate"]["details"]["served_as"].startswith(f"the served directory {served.resolve()}")
    assert before == (tree_hash(served), tree_hash(tiny))


def test_vllms_own_defaults_and_a_dummy_load_format_are_caught_at_the_launch(tiny, tmp_path):
    """No --dtype: vLLM gives the draft the target's dtype (SpeculativeConfig builds the draft's
    ModelConfig with it), whatever the checkpoint stores. --load-format dummy: the server's load
    format reaches the draft (get_draft_load_config), so every draft weight is random."""
    served, launch = _deploy(tiny, tmp_path, {"num_speculative_tokens": 2}, "--load-format", "dummy")
    proc, rep = _report(tiny, served, launch, tmp_path / "out")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    validate_report(rep)
    assert rep["diagnosis"]["cause"] == "draft_weights_random"
    dtype = next(f for f in rep["audit"]["findings"] if f["cause"] == "served_dtype_differs")
    assert dtype["measured"]["served"] == rep["deployment"]["plan"]["dtype"] != "float32"
    fates = {row["fate"] for row in rep["audit"]["ledgers"]["candidate"]["params"].values()}
    assert "randomized" in fates and "written" not in fates


@pytest.mark.parametrize("speculative, serving, says", [
    ({}, "vllm", "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "model": "elsewhere"}, "vllm", "is not the served directory"),
    ({"num_speculative_tokens": 2}, "sglang", "starts a vllm server; add vllm to --serving"),
])
def test_a_vllm_launch_it_cannot_check_is_one_line_and_exit_2(tiny, tmp_path, speculative, serving, says):
    served, launch = _deploy(tiny, tmp_path, speculative)
    (tmp_path / "elsewhere").mkdir()
    proc = _difftest("report", str(tiny / "speculators"), "--target", str(tiny / "target"), "--states",
                     str(tiny / "states.safetensors"), "--serve", str(served), "--launch-file", str(launch),
                     "--serving", serving, "--out", str(tmp_path / "out"), "-q")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not (tmp_path / "out" / "report.json").exists()
