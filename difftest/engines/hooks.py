"""Forward-hook plumbing shared by the adapters: record a module's input or output as a probe.

Which module feeds which probe is engine knowledge and stays in each adapter; this only
stores tensors (first call wins: a probe names one point in one forward).
"""

from __future__ import annotations

from typing import Callable

import torch


class ProbeRecorder:
    def __init__(self, drop_batch_dim: bool = False, rows: int | None = None):
        self.values: dict[str, torch.Tensor] = {}
        self._handles = []
        self._drop_batch_dim = drop_batch_dim
        self._rows = rows  # keep only the first rows (an engine's padding is not a probe)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.values:
            return
        t = tensor.detach()
        t = t[0] if self._drop_batch_dim else t
        t = t if self._rows is None else t[: self._rows]
        # One copy, whatever the source: .float().cpu().clone() copies twice from low precision.
        self.values[name] = t.to(device="cpu", dtype=torch.float32, copy=True)

    def output(self, module: torch.nn.Module, name: str, pick: Callable = lambda o: o) -> None:
        self._handles.append(module.register_forward_hook(lambda _m, _a, out: self.put(name, pick(out))))

    def input(self, module: torch.nn.Module, name: str) -> None:
        self._handles.append(module.register_forward_pre_hook(lambda _m, args: self.put(name, args[0])))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
