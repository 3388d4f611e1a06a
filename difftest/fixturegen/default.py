"""The embedded default fixture that `difftest report` runs with no checkpoint argument."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TINY_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"


@dataclass
class Fixture:
    checkpoint: Path
    target: Path
    states: Path


def tiny_fixture() -> Fixture:
    return Fixture(TINY_DIR / "speculators", TINY_DIR / "target", TINY_DIR / "states.safetensors")


def default_fixture(progress: bool = True) -> Fixture:
    return tiny_fixture()
