"""Progress, as a user sees it: one display for a whole run, a time left that shrinks once
the host's pace is known, plain timestamped lines when stderr is not a terminal, and no
engine's own bar or warning in what a report prints."""

from __future__ import annotations

import io
import types

import pytest

from difftest import progress
from difftest.progress import PLAIN_LINE, PlannedStep, Tracker


def assert_only_progress_lines(stderr: str) -> list[str]:
    """Every line a run wrote to a non-terminal stderr is one of difftest's plain progress
    lines, on one clock that never runs backwards. A tqdm bar, an engine's warning or a
    second display restarting its clock would each break this."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines, "no progress at all"
    stamps = []
    for ln in lines:
        m = PLAIN_LINE.match(ln)
        assert m and m["prefix"] == "difftest", f"not a difftest progress line: {ln!r}"
        assert "\x1b[" not in ln and "\r" not in ln, f"terminal control in a log line: {ln!r}"
        stamps.append(float(m["elapsed"]))
    assert stamps == sorted(stamps), stamps
    return lines


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


PLAN = [PlannedStep("load", "load", 10.0), PlannedStep("audit", "audit", 20.0), PlannedStep("write", "write", 5.0)]


def simulate(tracker: Tracker, clock: FakeClock, pace: float, fractions: dict[str, bool]) -> list[float]:
    """The plan run on a host `pace` times as slow as the estimates, time left read every
    simulated second. Steps in `fractions` report how far they are; the others do not."""
    seen = []
    for step in PLAN:
        tracker.start(step.name)
        actual = step.estimate_s * pace
        for second in range(1, int(actual)):
            clock.now += 1
            if fractions[step.name]:
                tracker.update(step.name, second, actual)
            seen.append(tracker.time_left())
        clock.now += actual - int(actual) + 1
        tracker.finish(step.name)
        seen.append(tracker.time_left())
    return seen


@pytest.mark.parametrize("pace", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("reports_fractions", [True, False])
def test_time_left_shrinks_once_the_pace_is_known(clock, pace, reports_fractions):
    tracker = Tracker(enabled=False)
    tracker.extend(PLAN)
    fractions = {"load": reports_fractions, "audit": reports_fractions, "write": not reports_fractions}
    seen = simulate(tracker, clock, pace, fractions)
    first_done = int(PLAN[0].estimate_s * pace)  # index of the reading just after "load" finished
    after = seen[first_done - 1:]
    # The first finished step sets the pace: what is left is the rest of the plan at that pace.
    rest = sum(s.estimate_s for s in PLAN[1:])
    assert after[0] == pytest.approx(rest * pace)
    assert all(b <= a + 1e-9 for a, b in zip(after, after[1:])), after
    assert after[-1] == 0.0


def test_plain_lines_off_a_terminal_one_per_quarter(clock, capsys):
    tracker = Tracker(enabled=True)
    with tracker.live():
        tracker.extend(PLAN)
        tracker.start("load")
        for i in range(1, 101):  # a hundred updates: a log gets a line per quarter, not a hundred
            clock.now += 0.1
            tracker.update("load", i, 100)
        tracker.finish("load")
        tracker.start("audit")
        with progress.steps(True, tracker=tracker) as say:
            say("speculators: load, forward")
            clock.now += 3
            say("sglang: load, forward")
        tracker.finish("audit")
    lines = assert_only_progress_lines(capsys.readouterr().err)
    load = [ln for ln in lines if PLAIN_LINE.match(ln)["label"] == "load"]
    assert 2 <= len(load) <= 6, load  # started, at most one per quarter, done
    assert [PLAIN_LINE.match(ln)["note"] for ln in lines if "audit" in ln] == [
        "started", "speculators: load, forward", "sglang: load, forward", "done in 3s"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_display_for_a_whole_run_on_a_terminal(clock, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    started = []
    real_start = Tracker._start_rich
    monkeypatch.setattr(Tracker, "_start_rich", lambda self: (started.append(self), real_start(self)))
    tracker = Tracker(enabled=True)
    with tracker.live():
        tracker.extend(PLAN)
        for step in PLAN:
            tracker.start(step.name)
            # the engine phases of a step speak through the same display
            with progress.steps(True, tracker=tracker) as say:
                say(f"{step.name}: phase")
            tracker.update(step.name, 1, 2)
            clock.now += step.estimate_s
            tracker.finish(step.name)
        assert tracker._rich is not None
    assert len(started) == 1
    assert tracker._rich is None  # stopped with the run
    assert "difftest: [" not in terminal.getvalue()  # no plain line printed beside the bar


def test_quiet_prints_nothing(clock, capsys):
    tracker = Tracker(enabled=False)
    with tracker.live():
        tracker.extend(PLAN)
        tracker.start("load")
        tracker.note("anything")
        tracker.finish("load")
    with progress.steps(False) as say:
        say("anything")
    assert capsys.readouterr().err == ""
