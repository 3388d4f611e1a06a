"""The one way to reach an engine that lives in a venv of its own: a long-lived worker process.

An engine whose pins cannot share difftest's venv (vLLM's CPU build pins another torch) runs
its adapter's engine half in its own interpreter. The two halves talk through files only:
each call is a directory holding `request.json` (the operation and its JSON parameters) and
`in.safetensors` (its tensors); the worker answers with `out.safetensors`, then `result.json`
(written last, by rename, so a half-written answer is never read). Nothing is pickled: a
worker can only hand back JSON and tensors, whatever its engine does.

The control channel is one line per call on the worker's stdin and one on a pipe of its
own; the worker's stdout and stderr (engine banners, warnings, tqdm bars) go to a log file,
quoted when the worker fails. One worker serves a whole difftest process: an engine import
costs seconds (vLLM about 12 s), and the config audit builds the draft once per variant.

The worker half (`serve`) imports only the standard library, torch, safetensors and
difftest.errors, all of which an engine venv has; the repository root is put on its path.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from difftest.errors import InputError, ServingRefused

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUEST, RESULT, TENSORS_IN, TENSORS_OUT = "request.json", "result.json", "in.safetensors", "out.safetensors"
# A worker's exceptions that mean something to difftest travel by name with their fields;
# anything else is a crash, with the worker's traceback.
TRANSPORTED = {"InputError": lambda e: {"message": str(e)},
               "ServingRefused": lambda e: {"engine": e.engine, "served_dir": e.served_dir, "reason": e.reason,
                                            "cause": e.cause}}
LOG_TAIL_CHARS = 4000


class WorkerFailed(RuntimeError):
    """The worker crashed or could not start: the engine's own error, with its log's tail."""


@dataclass
class Answer:
    result: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path))


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path)) if path.is_file() else {}


class VenvBridge:
    """The parent half: starts `python -m module` in the engine's venv and calls it."""

    def __init__(self, engine: str, python: Path, module: str, env: dict[str, str] | None = None):
        self.engine, self.python, self.module = engine, Path(python), module
        self.env = env or {}
        self._proc: subprocess.Popen | None = None
        self._scratch: tempfile.TemporaryDirectory | None = None
        self._calls = 0
        self._lock = threading.Lock()
        self.hello: dict = {}

    @property
    def log_path(self) -> Path:
        return Path(self._scratch.name) / "worker.log"

    def _log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-LOG_TAIL_CHARS:]

    def launch(self) -> None:
        """Start the worker without waiting for it: its imports run beside the caller's work,
        and the first call (or start) waits for its hello."""
        if self._proc is not None and self._proc.poll() is None:
            return
        if not self.python.is_file():
            raise WorkerFailed(f"{self.engine}'s venv has no interpreter at {self.python}")
        if self._scratch is not None:  # a worker that died: its log was quoted already
            self._scratch.cleanup()
        self._scratch = tempfile.TemporaryDirectory(prefix=f"difftest-{self.engine}-")
        read_fd, write_fd = os.pipe()
        path = [str(REPO_ROOT), self.env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")]
        env = {**os.environ, **self.env, "PYTHONPATH": os.pathsep.join(filter(None, path)),
               "DIFFTEST_BRIDGE_FD": str(write_fd)}
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen([str(self.python), "-u", "-m", self.module], stdin=subprocess.PIPE,
                                          stdout=log, stderr=log, env=env, cwd=self._scratch.name,
                                          pass_fds=(write_fd,))
        os.close(write_fd)
        self._answers = os.fdopen(read_fd, "r")
        self.hello = {}
        atexit.register(self.close)

    def start(self) -> dict:
        self.launch()
        if not self.hello:
            self.hello = json.loads(self._read_line("start"))
        return self.hello

    def _read_line(self, what: str) -> str:
        line = self._answers.readline()
        if not line:
            code = self._proc.wait()
            self._proc = None
            raise WorkerFailed(f"{self.engine} worker exited with code {code} during {what}; its log ends:\n"
                               + self._log_tail())
        return line.strip()

    def call(self, op: str, params: dict, tensors: dict[str, torch.Tensor] | None = None) -> Answer:
        with self._lock:
            self.start()
            self._calls += 1
            call_dir = Path(self._scratch.name) / f"call-{self._calls:05d}"
            call_dir.mkdir()
            _save_tensors(call_dir / TENSORS_IN, tensors or {})
            (call_dir / REQUEST).write_text(json.dumps({"op": op, "params": params}))
            self._proc.stdin.write(f"{call_dir}\n".encode())
            self._proc.stdin.flush()
            self._read_line(op)
            answer = json.loads((call_dir / RESULT).read_text())
            out = _load_tensors(call_dir / TENSORS_OUT)
            for f in call_dir.iterdir():
                f.unlink()
            call_dir.rmdir()
        if answer["ok"]:
            return Answer(answer["result"], out)
        kind, fields = answer["error"], answer.get("fields", {})
        if kind == "InputError":
            raise InputError(fields["message"])
        if kind == "ServingRefused":
            raise ServingRefused(**fields)
        trace = answer.get("traceback", "").strip()
        # The exception line first: it is what a one-line summary shows.
        raise WorkerFailed(f"{self.engine} failed in {op}: {trace.splitlines()[-1] if trace else 'no traceback'}\n{trace}")

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
            self._proc = None
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None


_BRIDGES: dict[tuple[str, str], VenvBridge] = {}


def bridge_for(engine: str, python: Path, module: str, env: dict[str, str] | None = None) -> VenvBridge:
    """One worker per (interpreter, module) for the whole process."""
    key = (str(python), module)
    if key not in _BRIDGES:
        _BRIDGES[key] = VenvBridge(engine, python, module, env)
    return _BRIDGES[key]


# ---- the worker half: runs in the engine's venv ----

Handler = Callable[[dict, dict[str, torch.Tensor]], "tuple[dict, dict[str, torch.Tensor]]"]


def serve(handlers: dict[str, Handler], hello: Callable[[], dict]) -> None:
    """Answer calls until stdin closes. `hello` runs first (the engine's import) and its
    dict is the start line; a failure there ends the worker with its traceback in the log."""
    answers = os.fdopen(int(os.environ["DIFFTEST_BRIDGE_FD"]), "w")
    answers.write(json.dumps(hello()) + "\n")
    answers.flush()
    for line in sys.stdin:
        call_dir = Path(line.strip())
        request = json.loads((call_dir / REQUEST).read_text())
        try:
            result, tensors = handlers[request["op"]](request["params"], _load_tensors(call_dir / TENSORS_IN))
            _save_tensors(call_dir / TENSORS_OUT, tensors)
            text = json.dumps({"ok": True, "result": result})
        except Exception as exc:  # every failure goes back as data; the parent decides what it means
            kind = type(exc).__name__
            text = json.dumps({"ok": False, "error": kind, "fields": TRANSPORTED[kind](exc)} if kind in TRANSPORTED
                              else {"ok": False, "error": "crash", "traceback": traceback.format_exc()})
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        partial = call_dir / (RESULT + ".partial")
        partial.write_text(text)
        partial.rename(call_dir / RESULT)
        answers.write(call_dir.name + "\n")
        answers.flush()
    # stdin closed: the parent waits for this exit, so it should not pay vLLM's module teardown.
    from difftest.process_exit import exit_after_handlers

    exit_after_handlers(0)
