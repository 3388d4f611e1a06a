"""The deployment itself: a served directory and the SGLang launch command, checked against the
training checkpoint through the CLI, and `difftest convert`, which must prove what it writes."""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftest.faults import FAULTS, FAULTS_BY_NAME, Workspace
from difftest.fixturegen.default import tiny_fixture
from difftest.report import validate_report
from difftest.states import load_states

DEPLOYMENT_FAULTS = [f for f in FAULTS if f.deployed]


def _difftest(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftest.cli", *args], capture_output=True, text=True, timeout=timeout)


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _deployed_workspace(tmp_path: Path) -> Workspace:
    fx = tiny_fixture()
    ws = Workspace.copy_of(fx.checkpoint, load_states(fx.states), fx.target, tmp_path, torch.float32)
    ws.deploy()
    return ws


def _report(ws: Workspace, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    launch = ws.root / "launch.txt"
    launch.write_text(shlex.join(ws.launch) + "\n")
    proc = _difftest("report", str(ws.checkpoint), "--target", str(ws.target), "--states", str(ws.states_file()),
                     "--serve", str(ws.served), "--launch-file", str(launch), "--out", str(out), "-q", *extra)
    path = out / "report.json"
    return proc, json.loads(path.read_text()) if path.is_file() else None


def test_the_catalog_has_every_deployment_fault_the_issue_names():
    classes = " ".join(f.bug_class for f in DEPLOYMENT_FAULTS)
    for words in ("renamed by hand", "arange", "EAGLE for an EAGLE-3", "verbatim", "norm_before_fc missing", "rope theta",
                  "lm_head.weight missing", "--speculative-token-map", "another dtype", "--json-model-override-args",
                  "no --dtype", "draft_vocab_size missing", "tie_word_embeddings switched on", "speculators-format",
                  "EAGLE with a --speculative-token-map", "load-format dummy", "window-size"):
        assert words in classes, words


def test_a_correct_served_copy_and_command_is_parity(tmp_path):
    ws = _deployed_workspace(tmp_path / "ws")
    before = _tree_digest(ws.served) | {f"ckpt/{k}": v for k, v in _tree_digest(ws.checkpoint).items()}
    proc, rep = _report(ws, tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rep["verdict"] == "PARITY"
    validate_report(rep)
    dep = rep["deployment"]
    assert {r["status"] for r in dep["tensors"]} == {"equal (bitwise)"}
    assert all(r["status"] == "carried" for r in dep["config"])
    assert dep["plan"]["chain_steps"] == int(ws.launch[ws.launch.index("--speculative-num-steps") + 1])
    # Nothing the user gave is modified.
    assert before == _tree_digest(ws.served) | {f"ckpt/{k}": v for k, v in _tree_digest(ws.checkpoint).items()}


@pytest.mark.parametrize("fault", DEPLOYMENT_FAULTS, ids=lambda f: f.name)
def test_each_deployment_fault_is_caught_at_its_place_through_the_cli(fault, tmp_path):
    ws = _deployed_workspace(tmp_path / "ws")
    fault.inject(ws)
    # The measured config audit answers how SGLang reads each field, which no deployment changes.
    proc, rep = _report(ws, tmp_path / "out", "--no-audit-config")
    assert rep is not None, proc.stderr
    if fault.notice_only:
        assert proc.returncode == 0 and rep["verdict"] == "PARITY", proc.stdout
        notices = [f for f in rep["audit"]["findings"] if f["cause"] == fault.diagnosis]
        assert notices and f"audit:{notices[0]['check']}" == fault.caught_at
        return
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (rep["diagnosis"]["found_at"], rep["diagnosis"]["cause"]) == (fault.caught_at, fault.diagnosis)
    assert set(fault.also) <= set(rep["diagnosis"]["also"]), rep["diagnosis"]["also"]
    assert proc.stdout.startswith("DIVERGED")
    # -q prints the verdict only: no engine's own bar (a dummy load still lists the files through
    # SGLang's loader, whose bar ignores TQDM_DISABLE) or warning gets through.
    assert not proc.stderr.strip(), proc.stderr[-500:]


def test_a_launch_flag_sglang_does_not_know_is_exit_2_naming_it(tmp_path):
    ws = _deployed_workspace(tmp_path / "ws")
    ws.launch += ["--speculative-draft-magic", "7"]
    proc, rep = _report(ws, tmp_path / "out")
    assert proc.returncode == 2 and rep is None
    assert proc.stderr.count("\n") == 1 and "--speculative-draft-magic" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("edit, words", [
    (lambda ws: ws.set_launch_flag("--speculative-draft-model-path", str(ws.checkpoint)), "is not the served directory"),
    (lambda ws: ws.launch.__delitem__(slice(ws.launch.index("--speculative-algorithm"),
                                            ws.launch.index("--speculative-algorithm") + 2)), "no --speculative-algorithm"),
    (lambda ws: ws.launch.__setitem__(slice(0, 3), ["python", "serve.py"]), "names no serving engine's server"),
])
def test_a_launch_that_does_not_serve_this_directory_is_exit_2(tmp_path, edit, words):
    ws = _deployed_workspace(tmp_path / "ws")
    edit(ws)
    proc, rep = _report(ws, tmp_path / "out")
    assert proc.returncode == 2 and rep is None, proc.stdout + proc.stderr
    assert words in proc.stderr and proc.stderr.count("\n") == 1


def test_serve_without_a_launch_command_is_exit_2(tmp_path):
    fx = tiny_fixture()
    proc = _difftest("report", str(fx.checkpoint), "--serve", str(fx.legacy), "--out", str(tmp_path))
    assert proc.returncode == 2 and "--launch" in proc.stderr and not (tmp_path / "report.json").exists()


def test_a_tree_launch_is_reported_as_not_simulated(tmp_path):
    ws = _deployed_workspace(tmp_path / "ws")
    ws.set_launch_flag("--speculative-eagle-topk", "4")
    ws.set_launch_flag("--speculative-num-draft-tokens", "8")
    proc, rep = _report(ws, tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    topk = next(r for r in rep["deployment"]["launch"] if r["flag"] == "--speculative-eagle-topk")
    assert topk["value"] == 4 and topk["simulated"] is False and "topk=1" in topk["instead"]
    assert any(f["cause"] == "launch_flag_not_simulated" for f in rep["audit"]["findings"])


def test_multi_layer_eagle_is_reported_as_not_simulated_with_what_ran_instead(tmp_path):
    ws = _deployed_workspace(tmp_path / "ws")
    ws.launch.append("--enable-multi-layer-eagle")
    proc, rep = _report(ws, tmp_path / "out")
    assert proc.returncode == 0 and rep["verdict"] == "PARITY", proc.stdout + proc.stderr
    row = next(r for r in rep["deployment"]["launch"] if r["flag"] == "--enable-multi-layer-eagle")
    assert row["simulated"] is False and "EagleDraftWorker" in row["instead"]
    notice = next(f for f in rep["audit"]["findings"] if f["cause"] == "launch_flag_not_simulated")
    assert notice["measured"]["flag"] == "--enable-multi-layer-eagle"


def test_a_decrypted_draft_config_is_what_sglang_reads_and_what_the_audit_compares(tmp_path):
    """A speculators directory refused as it is serves through --decrypted-draft-config-file
    naming a legacy config.json for it; the launch table shows the file, and the config audit
    reads it in place of the directory's own."""
    ws = _deployed_workspace(tmp_path / "ws")
    legacy = ws.root / "legacy-config.json"
    legacy.write_text((ws.served / "config.json").read_text())
    FAULTS_BY_NAME["served_speculators_directory"].inject(ws)
    ws.set_launch_flag("--decrypted-draft-config-file", str(legacy))
    proc, rep = _report(ws, tmp_path / "out")
    assert proc.returncode == 0 and rep["verdict"] == "PARITY", proc.stdout + proc.stderr
    row = next(r for r in rep["deployment"]["launch"] if r["flag"] == "--decrypted-draft-config-file")
    assert row["value"] == str(legacy) and row["simulated"]
    assert rep["deployment"]["plan"]["served_config_file"] == str(legacy)
    assert all(r["status"] == "carried" for r in rep["deployment"]["config"])


def test_convert_writes_a_served_directory_and_proves_parity_on_it(tmp_path):
    fx = tiny_fixture()
    before = _tree_digest(fx.checkpoint)
    out = tmp_path / "served"
    proc = _difftest("convert", str(fx.checkpoint), str(out), "--reports", str(tmp_path / "reports"), "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _tree_digest(fx.checkpoint) == before
    command = next(line.strip() for line in proc.stdout.splitlines() if "sglang.launch_server" in line)
    assert f"--speculative-draft-model-path {out.resolve()}" in command
    assert "parity proven" in proc.stdout
    rep = json.loads((tmp_path / "reports" / "report.json").read_text())
    assert rep["verdict"] == "PARITY" and rep["deployment"]["launch_argv"] == shlex.split(command)
    # The printed command, fed back through --launch, is the same deployment.
    again = _difftest("report", str(fx.checkpoint), "--serve", str(out), "--launch", command, "--out",
                      str(tmp_path / "again"), "-q", "--no-audit-config", "--chain-steps", "0")
    assert again.returncode == 0, again.stdout + again.stderr


def test_convert_never_writes_into_the_training_checkpoint_or_over_a_directory(tmp_path):
    fx = tiny_fixture()
    proc = _difftest("convert", str(fx.checkpoint), str(fx.checkpoint / "served"))
    assert proc.returncode == 2 and "never writes into its inputs" in proc.stderr
    assert not (fx.checkpoint / "served").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    proc = _difftest("convert", str(fx.checkpoint), str(taken))
    assert proc.returncode == 2 and (taken / "keep.txt").read_text() == "mine" and "--force" in proc.stderr
    # Inputs the parity report needs are read before anything is written.
    fresh = tmp_path / "fresh"
    proc = _difftest("convert", str(fx.checkpoint), str(fresh), "--states", str(tmp_path / "no-such-states"))
    assert proc.returncode == 2 and "no-such-states" in proc.stderr and proc.stderr.count("\n") == 1
    assert not fresh.exists() and not any(tmp_path.glob("fresh*"))


def test_convert_force_replaces_an_existing_directory_whole(tmp_path):
    fx = tiny_fixture()
    out = tmp_path / "served"
    out.mkdir()
    (out / "model-old.safetensors").write_text("an earlier, hand-made copy")
    proc = _difftest("convert", str(fx.checkpoint), str(out), "--reports", str(tmp_path / "reports"), "-q", "--force")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reports", "served"]  # nothing left beside it


def test_a_failed_conversion_leaves_no_half_directory(tmp_path, monkeypatch):
    from difftest import convert
    from difftest.checkpoint import load_checkpoint

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "save_file", disk_full)
    with pytest.raises(OSError):
        convert.served_copy(load_checkpoint(tiny_fixture().checkpoint), tmp_path / "served")
    assert list(tmp_path.iterdir()) == []



def test_a_speculators_directory_served_as_is_is_the_verdict_not_an_error(tmp_path):
    """SGLang 0.5.23's config code refuses speculators' format (no model_type): a server would
    not start. That is the verdict on the deployment, named with what the user can do."""
    ws = _deployed_workspace(tmp_path / "ws")
    before = _tree_digest(ws.checkpoint)
    ws.set_launch_flag("--speculative-draft-model-path", str(ws.checkpoint))
    launch = ws.root / "launch.txt"
    launch.write_text(shlex.join(ws.launch) + "\n")
    out = tmp_path / "out"
    proc = _difftest("report", str(ws.checkpoint), "--target", str(ws.target), "--states", str(ws.states_file()),
                     "--serve", str(ws.checkpoint), "--launch-file", str(launch), "--out", str(out), "-q")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("DIVERGED") and "served_format_not_servable" in proc.stdout
    rep = json.loads((out / "report.json").read_text())
    validate_report(rep)
    assert (rep["diagnosis"]["cause"], rep["diagnosis"]["found_at"]) == ("served_format_not_servable", "audit:launch")
    assert "difftest convert" in rep["diagnosis"]["fix"] and "--decrypted-draft-config-file" in rep["diagnosis"]["fix"]
    assert "model_type" in rep["deployment"]["refused"]  # SGLang's own words, not difftest's guess
    assert "sglang refuses this directory" in (out / "report.md").read_text()
    assert _tree_digest(ws.checkpoint) == before


def test_a_served_directory_missing_a_shard_is_exit_2_before_any_engine(tmp_path):
    from safetensors.torch import load_file, save_file

    ws = _deployed_workspace(tmp_path / "ws")
    tensors = load_file(str(ws.served / "model.safetensors"))
    (ws.served / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n].contiguous() for n in names[::2]}, str(ws.served / "model-00001-of-00002.safetensors"))
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (ws.served / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    proc, rep = _report(ws, tmp_path / "out")
    assert proc.returncode == 2 and rep is None, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "model-00002-of-00002.safetensors" in proc.stderr


def test_a_served_config_sglang_cannot_read_is_exit_2_naming_the_file(tmp_path):
    ws = _deployed_workspace(tmp_path / "ws")
    ws.edit_served_config(lambda c: c.__setitem__("model_type", "no-such-model"))
    proc, rep = _report(ws, tmp_path / "out")
    assert proc.returncode == 2 and rep is None, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_with_flag_edits_the_command_as_a_user_would():
    from difftest.engines.base import Deployment

    d = Deployment(Path("/s"), ("python", "-m", "sglang.launch_server", "--dtype=float16", "--speculative-algorithm",
                                "EAGLE", "--json-model-override-args", "{}"), Path("/"))
    assert d.with_flag("--speculative-algorithm", "EAGLE3").launch_argv[-2:] == ("--speculative-algorithm", "EAGLE3")
    assert "EAGLE" not in d.with_flag("--speculative-algorithm", "EAGLE3").launch_argv[:-1]
    assert d.with_flag("--dtype", "bfloat16").launch_argv.count("--dtype=float16") == 0
    assert "--json-model-override-args" not in d.with_flag("--json-model-override-args", None).launch_argv
    assert d.with_flag("--json-model-override-args", None).launch_argv[:3] == ("python", "-m", "sglang.launch_server")
