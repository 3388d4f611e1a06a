"""Where difftest writes: checked before any work, never inside an input, one run at a time.

Every command that writes (report, convert, selftest, fuzz, build-fixtures) goes through
`output_dir`, so an unusable path is one error line up front instead of an internal error
after minutes of engine time.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from difftest.errors import InputError

REPORT_FILES = ("report.json", "report.md", "report.html")


def refuse_inside_inputs(out: Path, inputs: Iterable[Path | None], flag: str = "--out") -> None:
    """The inputs are promised never to be written: an output inside one is refused."""
    resolved = out.resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).resolve()
        if resolved == source or source in resolved.parents:
            raise InputError(f"{flag} {out}: inside the input {given}; difftest never writes into its inputs")


def check_writable(out: Path, flag: str = "--out") -> bool:
    """Create `out` if needed and prove a file can be made in it (an immutable directory or a
    /proc path passes os.access for root, so only a real write tells). True if it was created."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{flag} {out}: exists and is not a directory")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".difftest-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if created:
            _remove_if_empty(out)
        raise InputError(f"{flag} {out}: cannot write there ({exc.strerror or exc})") from None
    return created


@contextmanager
def output_dir(out: Path, inputs: Iterable[Path | None] = (), owned: tuple[str, ...] = REPORT_FILES,
               flag: str = "--out") -> Iterator[Path]:
    """Hold `out` for one run. Refused up front when unusable or inside an input; a second run
    on the same directory is refused while this one holds it (its files would interleave);
    this command's earlier outputs are removed first, so a run that then fails leaves nothing
    that could pass for its result; a directory this run created and left empty is removed."""
    refuse_inside_inputs(out, inputs, flag)
    created = check_writable(out, flag)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"{flag} {out}: another difftest run is writing there; wait for it or choose another directory") from None
        for name in owned:
            (out / name).unlink(missing_ok=True)
        try:
            yield out
        except BaseException:
            if created:
                _remove_if_empty(out)
            raise
    finally:
        os.close(fd)


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # not empty, or already gone: leave it
        pass
