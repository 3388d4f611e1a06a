"""The embedded default fixture that `difftest report` runs with no checkpoint argument:
the SmolLM2-135M target and the draft speculators trains on it, built on first use."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

TINY_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"


@dataclass
class Fixture:
    checkpoint: Path
    target: Path
    states: Path
    legacy: Path | None = None
    training: Path | None = None


def tiny_fixture() -> Fixture:
    return Fixture(TINY_DIR / "speculators", TINY_DIR / "target", TINY_DIR / "states.safetensors", TINY_DIR / "legacy")


def _reporter(progress: bool):
    """Progress bars on a terminal, plain lines elsewhere (CI logs), nothing when quiet."""
    if not progress:
        return None, None
    if not sys.stderr.isatty():
        seen: set[tuple[str, str]] = set()

        def plain(step, done, total, note=""):
            key = (step, note if total <= 1 else str(done * 4 // max(total, 1)))
            if key not in seen:
                seen.add(key)
                print(f"difftest: fixture {step}: " + (note or f"{done}/{total}"), file=sys.stderr, flush=True)

        return plain, None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[note]}"),
                   TimeElapsedColumn(), transient=False)
    tasks: dict[str, int] = {}

    def rich_progress(step, done, total, note=""):
        if step not in tasks:
            tasks[step] = bar.add_task(f"building {step}", total=max(total, 1), note="")
        bar.update(tasks[step], completed=done, total=max(total, 1), note=note[-60:])

    return rich_progress, bar


def default_fixture(progress: bool = True) -> Fixture:
    from difftest.fixturegen import smollm2

    report, bar = _reporter(progress)
    if bar is not None:
        with bar:
            p = smollm2.build(report)
    else:
        p = smollm2.build(report)
    return Fixture(p.draft, p.target, p.states, p.legacy, p.training_json)
