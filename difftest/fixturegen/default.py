"""The embedded default fixture that `difftest report` runs with no checkpoint argument:
the SmolLM2-135M target and the draft speculators trains on it, built on first use."""

from __future__ import annotations

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
    training_run: Path | None = None  # the trainer's saved checkpoint, for --training-run
    served: Path | None = None  # what `difftest convert` wrote for SGLang
    launch: Path | None = None  # the launch command that serves it


def tiny_fixture() -> Fixture:
    return Fixture(TINY_DIR / "speculators", TINY_DIR / "target", TINY_DIR / "states.safetensors", TINY_DIR / "legacy")


def default_fixture(progress: bool = True, tracker=None) -> Fixture:
    """Build (or find cached) the default fixture. Progress goes to `tracker` when the caller
    runs one display for a longer job; otherwise to a display of its own, unless quiet."""
    from difftest.fixturegen import smollm2
    from difftest.progress import Tracker

    if tracker is not None:
        p = smollm2.build(tracker)
    else:
        own = Tracker(progress, "difftest fixture")
        with own.live():
            p = smollm2.build(own)
    return Fixture(p.draft, p.target, p.states, p.legacy, p.training_json, p.train_out, served=p.legacy, launch=p.launch)
