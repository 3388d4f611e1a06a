"""A build cache that git ignores: each step records checksums of what it wrote and is
skipped when its record exists and the files still match it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ROOT_ENV = "DIFFTEST_CACHE"


def cache_root() -> Path:
    default = Path(__file__).resolve().parents[2] / ".cache" / "difftest"
    return Path(os.environ.get(ROOT_ENV, default))


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


class Step:
    def __init__(self, root: Path, name: str, outputs: list[Path]):
        self.root, self.name, self.outputs = root, name, outputs
        self.record = root / f"{name}.done.json"

    def done(self) -> bool:
        if not self.record.is_file():
            return False
        try:
            rec = json.loads(self.record.read_text())
            return all(p.exists() and rec["sha256"].get(str(p.relative_to(self.root))) == _digest(p) for p in self.outputs)
        except (json.JSONDecodeError, KeyError, ValueError):
            return False

    def finish(self, seconds: float, **info) -> None:
        # The step's own info first: its keys can never shadow the record's checksums.
        rec = {**info, "step": self.name, "seconds": round(seconds, 2),
               "sha256": {str(p.relative_to(self.root)): _digest(p) for p in self.outputs}}
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=2) + "\n")
        tmp.replace(self.record)

    def info(self) -> dict:
        return json.loads(self.record.read_text())
