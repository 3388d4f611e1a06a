"""Progress for long commands: one display for a whole run, a live bar on a terminal,
plain timestamped lines in CI logs, nothing under -q.

A run is planned as steps with an estimated duration each (measured on a 2-core host
without fast bf16; see benchmarks/first_run.py). The time left is the remaining
estimate scaled by how fast this host has been so far, so a slow host's estimate
corrects itself after the first step instead of promising the reference host's times.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

Step = Callable[[str], None]

# What one plain progress line looks like off a terminal (written by Tracker._render):
# elapsed seconds on the run's clock, the step's label, its note, and the time left.
PLAIN_LINE = re.compile(r"^(?P<prefix>[\w-]+): \[ *(?P<elapsed>\d+\.\d)s\] (?P<label>[^:]+): (?P<note>.*?)"
                        r"(?: \(about \d+:\d\d left\))?$")


@dataclass
class PlannedStep:
    name: str
    label: str
    estimate_s: float


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Tracker:
    """Progress of a planned run. `start`, `update` and `finish` name a planned step;
    `note` adds a line of detail to the current step (an engine phase, a trainer epoch)."""

    def __init__(self, enabled: bool, prefix: str = "difftest"):
        self.enabled, self.prefix = enabled, prefix
        self.plan: list[PlannedStep] = []
        self.done: dict[str, float] = {}  # step -> share of its estimate completed (1.0 when finished)
        self.seconds: dict[str, float] = {}  # finished step -> how long it took
        self.current: PlannedStep | None = None
        self.t0 = time.perf_counter()
        self.step_t0 = self.t0
        self._last_plain: tuple[str, str] | None = None
        self._rich = None
        self._task = None
        self._use_rich = False

    # -- the plan -----------------------------------------------------------------------
    def extend(self, steps: list[PlannedStep]) -> None:
        known = {s.name for s in self.plan}
        self.plan += [s for s in steps if s.name not in known]
        self._render()

    def _find(self, name: str) -> PlannedStep:
        for s in self.plan:
            if s.name == name:
                return s
        step = PlannedStep(name, name, 1.0)  # unplanned: shown, but adds nothing to the estimate
        self.plan.append(step)
        return step

    # -- what happens -------------------------------------------------------------------
    def start(self, name: str, note: str = "") -> None:
        self.current = self._find(name)
        self.step_t0 = time.perf_counter()
        self.done[name] = 0.0
        self._render(note or "started", force_line=True)

    def update(self, name: str, done: float, total: float, note: str = "") -> None:
        step = self._find(name)
        self.current = step
        self.done[name] = min(max(done / total, 0.0), 0.99) if total > 0 else self.done.get(name, 0.0)
        self._render(note or f"{done:g}/{total:g}")

    def note(self, text: str) -> None:
        self._render(text, force_line=True)

    def finish(self, name: str, note: str = "") -> None:
        self.done[name] = 1.0
        seconds = time.perf_counter() - self.step_t0
        self.seconds[name] = seconds
        self._render(note or f"done in {seconds:.0f}s", force_line=True)

    # -- estimates ----------------------------------------------------------------------
    def _estimated(self) -> tuple[float, float]:
        total = sum(s.estimate_s for s in self.plan)
        completed = sum(s.estimate_s * self.done.get(s.name, 0.0) for s in self.plan)
        return completed, total

    def time_left(self) -> float:
        """The current step's remainder (extrapolated from its own progress when it reports
        any, else its estimate less the time it has run) plus the steps not yet started, all
        at this host's pace so far: actual over estimated seconds of the finished steps."""
        finished = [s for s in self.plan if self.done.get(s.name) == 1.0]
        spent = sum(self.seconds.get(s.name, s.estimate_s) for s in finished)
        planned = sum(s.estimate_s for s in finished)
        pace = spent / planned if planned > 0 else 1.0
        left = sum(s.estimate_s for s in self.plan if s.name not in self.done) * pace
        if self.current is not None and self.done.get(self.current.name, 1.0) < 1.0:
            frac = self.done[self.current.name]
            running = time.perf_counter() - self.step_t0
            expected = self.current.estimate_s * pace
            left += running / frac * (1 - frac) if frac > 0.05 else max(expected - running, 0.1 * expected)
        return left

    # -- output -------------------------------------------------------------------------
    def _render(self, note: str = "", force_line: bool = False) -> None:
        if not self.enabled or self.current is None:
            return
        left = self.time_left()
        completed, total = self._estimated()
        if self.current.name in self.done and self.done[self.current.name] < 1.0 and total > 0:
            # Let the bar move inside a step that reports no fractions of its own.
            running = time.perf_counter() - self.step_t0
            completed = min(completed + min(running, self.current.estimate_s) * 0.9
                            * (1 - self.done[self.current.name]), total)
        label = self.current.label
        if self._use_rich and self._rich is None:
            self._start_rich()
        if self._rich is not None:
            self._rich.update(self._task, completed=completed, total=max(total, 1e-9),
                              description=f"{label}: {note[-70:]}" if note else label,
                              left=f"~{_clock(left)} left")
            return
        # CI logs: a line when a step starts or finishes, and at most one per quarter of it.
        quarter = str(int(self.done.get(self.current.name, 0.0) * 4))
        key = (self.current.name, quarter)
        if not force_line and key == self._last_plain:
            return
        self._last_plain = key
        elapsed = time.perf_counter() - self.t0
        tail = f" (about {_clock(left)} left)" if left > 0.5 else ""
        print(f"{self.prefix}: [{elapsed:6.1f}s] {label}: {note}{tail}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def live(self) -> Iterator["Tracker"]:
        """On a terminal, one rich bar for the whole run while the block runs. It appears at
        the first step, so an input error raised before any step stays the only line."""
        self._use_rich = self.enabled and sys.stderr.isatty()
        try:
            yield self
        finally:
            if self._rich is not None:
                self._render("done", force_line=True)
                self._rich.stop()
            self._rich, self._use_rich = None, False

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._rich = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                              TimeElapsedColumn(), TextColumn("{task.fields[left]}"), console=Console(stderr=True))
        self._task = self._rich.add_task("starting", total=1.0, left="")
        self._rich.start()


def silence_third_party_bars() -> None:
    """The engines' own tqdm bars (GGUF conversion, weight loading, shard writing) would
    print through ours. tqdm reads TQDM_* variables when it is first imported, so this runs
    before any engine import; child processes (the trainer) inherit it."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@contextlib.contextmanager
def steps(enabled: bool, prefix: str = "difftest", tracker: Tracker | None = None) -> Iterator[Step]:
    """Free-form phase messages. With a tracker they become the current planned step's note,
    so a whole run keeps one display; without one, a status line or plain lines of their own."""
    if tracker is not None:
        yield tracker.note
        return
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
