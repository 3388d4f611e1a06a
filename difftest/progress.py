"""Step progress for long commands: a live status line on a terminal, plain lines in CI
logs, nothing under -q."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator

Step = Callable[[str], None]


@contextlib.contextmanager
def steps(enabled: bool, prefix: str = "difftest") -> Iterator[Step]:
    if not enabled:
        yield lambda _msg: None
        return
    if not sys.stderr.isatty():
        t0 = time.perf_counter()
        yield lambda msg: print(f"{prefix}: [{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
        return
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("starting") as status:
        t0 = time.perf_counter()

        def update(msg: str) -> None:
            console.log(msg)
            status.update(f"[bold]{msg}[/] ({time.perf_counter() - t0:.0f}s)")

        yield update
