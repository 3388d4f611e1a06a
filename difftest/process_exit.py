"""Ending a difftest process without Python's interpreter teardown.

Once the engines are imported, a process holds thousands of modules (SGLang alone brings
about 7,600) and finalizing them takes about 2 s on these hosts, after every output is
written, with nothing for the user to see. So the command line and the venv workers end
the way multiprocessing's children do: run the exit handlers (which close workers, remove
scratch directories and flush logging), flush the standard streams, then `os._exit`.
Library and pytest use never come here.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_after_handlers(code: int) -> None:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
    os._exit(code)
