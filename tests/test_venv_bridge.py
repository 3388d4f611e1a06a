"""The subprocess bridge every engine in a venv of its own is reached through."""

import sys
from pathlib import Path

import pytest
import torch

from difftest.engines.venv_bridge import VenvBridge, WorkerFailed
from difftest.errors import InputError, ServingRefused

WORKERS = Path(__file__).parent / "bridge_workers"


@pytest.fixture()
def bridge():
    b = VenvBridge("echo", Path(sys.executable), "echo_worker", {"PYTHONPATH": str(WORKERS)})
    yield b
    b.close()


def test_round_trip_keeps_json_and_tensors_exact(bridge, capfd):
    tensors = {"bf16": torch.randn(3, 5).bfloat16(), "ids": torch.arange(7), "f32": torch.randn(2, 2)}
    answer = bridge.call("echo", {"a": [1, 2], "b": "x"}, tensors)
    assert answer.result["params"] == {"a": [1, 2], "b": "x"}
    for name, t in tensors.items():
        back = answer.tensors[name + ".doubled"]
        assert back.dtype == t.dtype and torch.equal(back, t * 2)
    assert bridge.hello == {"torch": torch.__version__}
    # The engine's own prints go to the worker's log, never to difftest's terminal.
    out, err = capfd.readouterr()
    assert "engine" not in out + err
    assert "engine banner on stdout" in bridge.log_path.read_text()


def test_a_closed_worker_runs_its_exit_handlers_and_exits_cleanly(bridge, tmp_path):
    """The worker skips interpreter teardown (seconds with an engine imported), but not what
    its exit handlers clean up; the parent sees a clean exit, not a kill."""
    bridge.call("on_exit", {"path": str(tmp_path / "ran")}, {})
    proc = bridge._proc
    bridge.close()
    assert proc.returncode == 0
    assert (tmp_path / "ran").read_text() == "exit handlers ran"


def test_one_worker_serves_many_calls(bridge):
    pids = {bridge.call("echo", {}, {}).result["pid"] for _ in range(3)}
    assert len(pids) == 1


@pytest.mark.parametrize("how, error", [("input", InputError), ("refused", ServingRefused),
                                        ("crash", WorkerFailed), ("unserializable", WorkerFailed)])
def test_worker_errors_keep_their_meaning_and_the_worker_lives(bridge, how, error):
    with pytest.raises(error) as info:
        bridge.call("refuse", {"how": how})
    if how == "input":
        assert str(info.value) == "bad served dir: no config.json"
    if how == "refused":
        assert (info.value.engine, info.value.cause) == ("echo", "served_architecture_unknown")
    if how == "crash":
        assert "ZeroDivisionError: an engine bug" in str(info.value)
    assert bridge.call("echo", {"after": how}).result["params"] == {"after": how}


def test_a_dead_worker_is_named_with_its_log(bridge):
    bridge.call("echo", {})
    with pytest.raises(WorkerFailed, match="exited with code 7 during die"):
        bridge.call("die", {})
    # The next call starts a fresh worker.
    assert bridge.call("echo", {"again": 1}).result["params"] == {"again": 1}


def test_a_worker_that_cannot_start_says_why(monkeypatch):
    monkeypatch.setenv("ECHO_WORKER_FAIL_AT_START", "1")
    b = VenvBridge("echo", Path(sys.executable), "echo_worker", {"PYTHONPATH": str(WORKERS)})
    with pytest.raises(WorkerFailed, match="(?s)exited with code 1 during start.*no module named 'engine'"):
        b.call("echo", {})
    b.close()


def test_a_missing_interpreter_is_named():
    b = VenvBridge("echo", Path("/nonexistent/bin/python"), "echo_worker")
    with pytest.raises(WorkerFailed, match="no interpreter at /nonexistent/bin/python"):
        b.call("echo", {})
