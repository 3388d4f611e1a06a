"""Where difftest writes, and how its command line fails: through the CLI, as a subprocess.

An unusable or in-input output directory is refused before any engine runs; a failed run
leaves nothing that could pass for its result; two runs never share an output directory;
every usage error is one line and exit 2; an interrupt says so and exits 130.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tree_hash
from tests.test_cli import difftest


def one_error_line(proc, *words):
    assert proc.returncode == 2, (proc.stdout[-500:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("difftest: error:"), proc.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture()
def immutable_dir(tmp_path):
    """A directory even root cannot write into (root passes every os.access check)."""
    d = tmp_path / "immutable"
    d.mkdir()
    made = subprocess.run(["chattr", "+i", str(d)], capture_output=True)
    assert made.returncode == 0, f"chattr +i failed on this filesystem: {made.stderr!r}"
    yield d
    subprocess.run(["chattr", "-i", str(d)], check=True)


OUTS = {
    "an_existing_file": (lambda t, ckpt: (t / "afile").write_text("x") and t / "afile", "exists and is not a directory"),
    "a_proc_path": (lambda t, ckpt: Path("/proc/difftest-out"), "cannot write there"),
    "inside_the_checkpoint": (lambda t, ckpt: ckpt / "reports", "never writes into its inputs"),
    "the_checkpoint_itself": (lambda t, ckpt: ckpt, "never writes into its inputs"),
    "inside_the_target": (lambda t, ckpt: ckpt.parent / "target" / "out", "never writes into its inputs"),
}


@pytest.mark.parametrize("case", sorted(OUTS))
def test_an_unusable_out_is_refused_up_front(tiny_copy, tmp_path, case):
    ckpt = tiny_copy / "speculators"
    make, words = OUTS[case]
    out = make(tmp_path, ckpt)
    before = tree_hash(tiny_copy)
    t0 = time.perf_counter()
    proc = difftest("report", ckpt, "--target", tiny_copy / "target", "--out", out)
    one_error_line(proc, words, str(out))
    # Up front: before any engine was imported, not after the run.
    assert time.perf_counter() - t0 < 30
    assert tree_hash(tiny_copy) == before


def test_an_immutable_out_is_refused_up_front(tiny, immutable_dir):
    one_error_line(difftest("report", tiny / "speculators", "--out", immutable_dir), "cannot write there")


@pytest.mark.parametrize("command", [
    ["fuzz", "--examples", "1"],
    ["selftest", "--fixture", "tiny", "--fault", "d2t_missing"],
    ["build-fixtures", "tiny"],
    ["convert", "CKPT", "NEWDIR"],
])
def test_every_command_that_writes_checks_its_out_first(tiny, tmp_path, command):
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = [str(tiny / "speculators") if a == "CKPT" else str(tmp_path / "served") if a == "NEWDIR" else a for a in command]
    flag = "--reports" if command[0] == "convert" else "--out"
    one_error_line(difftest(*args, flag, afile), "exists and is not a directory")
    assert afile.read_text() == "x" and not (tmp_path / "served").exists()


def test_a_failed_run_leaves_no_earlier_report_behind(tiny, tmp_path):
    out = tmp_path / "out"
    assert difftest("report", tiny / "speculators", "--no-audit-config", "--out", out, "-q").returncode == 0
    assert json.loads((out / "report.json").read_text())["verdict"] == "PARITY"
    proc = difftest("report", tiny / "speculators", "--states", tmp_path / "missing.safetensors", "--out", out)
    one_error_line(proc, "missing.safetensors")
    assert not any((out / name).exists() for name in ("report.json", "report.md", "report.html"))


def test_a_run_that_created_its_out_and_failed_removes_it(tiny, tmp_path):
    out = tmp_path / "new" / "out"
    one_error_line(difftest("report", tiny / "speculators", "--states", tmp_path / "nope.safetensors", "--out", out))
    assert not out.exists()


def test_two_runs_never_write_the_same_out(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # Hold the directory as a running difftest does.
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        one_error_line(difftest("report", tiny / "speculators", "--out", out), "another difftest run is writing there")
    finally:
        os.close(fd)
    assert not any(out.iterdir())


@pytest.mark.parametrize("args,words", [
    (["report", "--no-such-flag"], ["No such option: --no-such-flag"]),
    (["no-such-command"], ["No such command"]),
    (["report", "--max-tokens", "abc"], ["--max-tokens"]),
    (["report", "CKPT", "--max-tokens", "0"], ["--max-tokens must be at least 1, got 0"]),
    (["report", "CKPT", "--max-tokens", "-5"], ["--max-tokens must be at least 1, got -5"]),
    (["report", "CKPT", "--baseline", "DIR"], ["is a directory", "--baseline"]),
])
def test_usage_errors_are_one_line_and_exit_2(tiny, tmp_path, args, words):
    (tmp_path / "adir").mkdir()
    args = [str(tiny / "speculators") if a == "CKPT" else str(tmp_path / "adir") if a == "DIR" else a for a in args]
    one_error_line(difftest(*args, *(["--out", tmp_path / "out"] if args[0] == "report" and len(args) > 2 else [])), *words)


def _sigint_as_a_shell_gives_it() -> None:
    """The child starts with SIGINT deliverable and at its default, whatever the test process
    inherited: a full CI run twice saw the child finish its report as if the signal never came,
    while the test alone passed every time, so nothing the runner's process carries may decide it."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_exits_130_with_one_line_and_no_partial_report(tmp_path):
    """On the default draft, whose report runs for tens of seconds after its first engine
    starts: on tiny the rest took 3 s, and a loaded CI host delivered the signal after the run
    had ended."""
    from difftest.fixturegen.default import default_fixture

    default_fixture(progress=False)  # built (or verified) before the clock matters
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "difftest.cli", "report", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_a_shell_gives_it)
    # Interrupt inside an engine: the progress line that announces the first engine's forward.
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "load, forward" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == "difftest: interrupted; nothing partial was written", err[-2000:]
    assert not any("Traceback" in ln for ln in lines)
    assert not out.exists() or not any(out.iterdir())


def test_the_reproduce_command_is_shell_quoted(tiny, tmp_path):
    out = tmp_path / "with space"
    assert difftest("report", tiny / "speculators", "--no-audit-config", "--out", out, "-q").returncode == 0
    md = (out / "report.md").read_text()
    command = md.split("## Reproduce", 1)[1].split("```")[1].strip()
    assert str(out) in shlex.split(command), command


@pytest.mark.parametrize("command", ["report", "capture", "convert", "selftest", "fuzz", "build-fixtures"])
def test_help_is_readable_at_80_columns_and_report_offers_no_fault_switch(command):
    """Every option name whole at 80 columns (rich cuts a long one with an ellipsis), and the
    serving-fault switches the selftest uses are not offered to a user as settings."""
    proc = subprocess.run([sys.executable, "-m", "difftest.cli", command, "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80", "TERM": "dumb"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "…" not in proc.stdout, proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80
    if command == "report":
        assert "--serve-without-aux-capture" not in proc.stdout and "--serve-lm-head-from-target" not in proc.stdout
        assert "--states" in proc.stdout and "--target" in proc.stdout


def test_the_report_shows_what_is_absent_and_says_a_shared_reason_once(tiny_copy, tmp_path):
    """A legacy draft without lm_head.weight: the tensor table cannot list it (the checkpoint has
    no such tensor), so the parameters no tensor filled get rows of their own, in report.md and
    report.html. The config audit cannot measure over SGLang's NaN-poisoned head: one line says
    why for every field, not one row per field."""
    from safetensors.torch import load_file, save_file

    legacy = tiny_copy / "legacy"
    tensors = load_file(str(legacy / "model.safetensors"))
    tensors.pop("lm_head.weight")
    save_file(tensors, str(legacy / "model.safetensors"))
    proc = difftest("report", legacy, "--target", tiny_copy / "target", "--states", tiny_copy / "states.safetensors",
                    "--chain-steps", "0", "--no-target-capture", "--out", tmp_path / "out", "-q")
    assert proc.returncode == 1, proc.stderr[-2000:]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| sglang | lm_head.weight | **init** |" in md, md
    html = (tmp_path / "out" / "report.html").read_text()
    assert "Parameters no checkpoint tensor filled" in html and "<code>lm_head.weight</code>" in html
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    rows = report["audit"]["config"]
    assert len({r["verdict"] for r in rows}) == 1
    assert f"All {len(rows)} fields not measured: sglang's baseline already has non-finite values" in md
    assert md.count("not measured: sglang's baseline") == 1
