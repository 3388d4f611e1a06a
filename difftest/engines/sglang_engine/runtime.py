"""Process-wide SGLang state needed to build and run model code outside a server.

Done once per process: the CPU engine switch (read and cached at first import), the
kernel stand-in, a world-of-one process group, and published ServerArgs.
"""

from __future__ import annotations

import os
import socket
import threading

from difftest.engines.sglang_engine import kernel_standin

_lock = threading.Lock()
_ready_for: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_on_a_bare_stack(module: str) -> None:
    """The KV pool imports `module` lazily on its first write. Down that import an optional
    DeepEP probe fails and its module keeps the ImportError, whose traceback holds every
    frame of the stack that imported it, locals included: imported from a forward, the
    whole first model stays alive for the process (measured at the 8B shape: 0.9 GiB).
    A thread of its own gives that traceback nothing of ours to hold."""
    import importlib

    failure: list[BaseException] = []

    def load() -> None:
        try:
            importlib.import_module(module)
        except BaseException as exc:  # re-raised in the caller, where it belongs
            failure.append(exc)

    worker = threading.Thread(target=load, name="difftest-sglang-import")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]


def ensure_runtime(device: str) -> kernel_standin.StandInLedger:
    global _ready_for
    with _lock:
        if _ready_for is not None:
            if _ready_for != device:
                raise RuntimeError(f"sglang runtime already set up for {_ready_for}, cannot switch to {device}")
            return kernel_standin.LEDGER
        if device == "cpu":
            # is_cpu() is cached at first import; without this RotaryEmbedding imports vllm.
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        # Read once, when SGLang's model registry is first imported (known_archs says why).
        os.environ.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "difftest.engines.sglang_engine.known_archs")
        ledger = kernel_standin.install_if_needed()
        # Always a fresh port: an inherited MASTER_PORT may belong to a parent process's store.
        os.environ["MASTER_PORT"] = str(_free_port())
        from sglang.test.layer_ut_utils import init_single_process_dist

        init_single_process_dist(master_port=int(os.environ["MASTER_PORT"]), backend="gloo" if device == "cpu" else "nccl")
        _import_on_a_bare_stack("sglang.srt.model_executor.runner")
        _ready_for = device
        return ledger
