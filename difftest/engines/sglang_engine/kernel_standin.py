"""A strict import-time stand-in for `sgl_kernel`, used only where the real one can't load.

On CPU, `import sgl_kernel` fails (`No module named 'common_ops'`), but a few sglang
modules import symbols from it at import time without ever calling them on the
draft's construct/load/EXTEND path. MagicMock would silently swallow math, so every
symbol here raises when called, and every bind and call is counted for the report.
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass, field


class KernelStandInCalled(RuntimeError):
    pass


@dataclass
class StandInLedger:
    installed: bool = False
    reason: str = ""
    bound: set[str] = field(default_factory=set)
    calls: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "installed": self.installed,
            "reason": self.reason,
            "symbols_bound": sorted(self.bound),
            "calls": dict(self.calls),
            "total_calls": sum(self.calls.values()),
        }


LEDGER = StandInLedger()


def _make_symbol(name: str):
    def refuse(*_args, **_kwargs):
        LEDGER.calls[name] = LEDGER.calls.get(name, 0) + 1
        raise KernelStandInCalled(
            f"sgl_kernel.{name} was called, but sgl_kernel is a stand-in on this machine: "
            "this sglang path needs a real GPU kernel"
        )

    refuse.__name__ = name
    refuse.__qualname__ = f"sgl_kernel_standin.{name}"
    return refuse


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        LEDGER.bound.add(name)
        symbol = _make_symbol(name)
        setattr(self, name, symbol)
        return symbol


def install_if_needed() -> StandInLedger:
    """Import the real sgl_kernel if it works; otherwise put the strict stand-in in its place."""
    if LEDGER.installed or "sgl_kernel" in sys.modules:
        return LEDGER
    try:
        importlib.import_module("sgl_kernel")
        return LEDGER
    except Exception as exc:  # the real package fails with ImportError or OSError on CPU
        for key in [k for k in sys.modules if k == "sgl_kernel" or k.startswith("sgl_kernel.")]:
            del sys.modules[key]
        module = _StandInModule("sgl_kernel")
        module.__path__ = []  # a package, so `import sgl_kernel.x` fails cleanly instead of oddly
        sys.modules["sgl_kernel"] = module
        LEDGER.installed = True
        # sgl_kernel's message is a long multi-line diagnostic; keep its headline.
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        LEDGER.reason = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        return LEDGER
