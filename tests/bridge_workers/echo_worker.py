"""A worker for tests/test_venv_bridge.py: echoes, fails on request, and talks on stdout."""

import os
import sys

import torch

from difftest.engines.venv_bridge import serve
from difftest.errors import InputError, ServingRefused


def echo(params, tensors):
    print("engine banner on stdout", flush=True)
    print("engine warning on stderr", file=sys.stderr, flush=True)
    return {"params": params, "pid": os.getpid()}, {k + ".doubled": v * 2 for k, v in tensors.items()}


def refuse(params, tensors):
    if params["how"] == "input":
        raise InputError("bad served dir: no config.json")
    if params["how"] == "refused":
        raise ServingRefused("echo", "/srv/draft", "unknown architecture", "served_architecture_unknown")
    if params["how"] == "unserializable":
        return {"not json": object()}, {}
    raise ZeroDivisionError("an engine bug")


def die(params, tensors):
    os._exit(7)


def on_exit(params, tensors):
    """Registers an exit handler that leaves a file: the worker must run it when it ends."""
    import atexit
    from pathlib import Path

    atexit.register(Path(params["path"]).write_text, "exit handlers ran")
    return {}, {}


if os.environ.get("ECHO_WORKER_FAIL_AT_START"):
    raise ImportError("no module named 'engine'")
serve({"echo": echo, "refuse": refuse, "die": die, "on_exit": on_exit}, lambda: {"torch": torch.__version__})
