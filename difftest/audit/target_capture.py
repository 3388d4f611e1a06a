"""Measured target capture: the states the serving target really hands its draft, against
the training capture, chunk by chunk, each chunk named by the target layer it equals.

The plan-based check (capture.py) reads each engine's configuration; this one runs the
serving engine's own target forward and looks at the numbers. Every chunk, on both sides,
is matched against every layer boundary of the target's transformers forward (the neutral
HF convention of CapturePlan), so an off-by-one or a reordered concatenation is named
from measurements, not from what a config claims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from difftest.audit.capture import classify_layers
from difftest.audit.findings import Finding, Severity
from difftest.compare import activation_metrics
from difftest.engines.base import TargetCapture
from difftest.states import CapturedStates
from difftest.tolerances import Tolerance

CHECK = "target_capture"


@dataclass
class ChunkMatch:
    side: str  # "training" (the states) or the serving engine's name
    chunk: int
    nearest_hf_layer: int
    vs_nearest: dict  # metrics against that HF layer
    matches: bool  # within the tolerance of that layer: the chunk IS that layer
    vs_training: dict | None = None  # serving chunks: metrics against the training chunk at the same slot

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CaptureParity:
    serving_engine: str
    serving_description: str
    training_hf_ids: list[int]  # nearest layers of the states' chunks
    serving_hf_ids: list[int] | None  # nearest layers of the serving chunks; None: no aux capture
    chunks: list[ChunkMatch] = field(default_factory=list)
    tolerance: dict = field(default_factory=dict)
    width: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"serving_engine": self.serving_engine, "serving_description": self.serving_description,
                "training_hf_ids": self.training_hf_ids, "serving_hf_ids": self.serving_hf_ids,
                "chunks": [c.as_dict() for c in self.chunks], "tolerance": self.tolerance, "width": self.width}


def draft_row_index(states: CapturedStates) -> torch.Tensor:
    """Which tokens of the full sequences the states' rows hold: every token but each
    request's last (row t of a request is token t+1 with the states at token t)."""
    keep, start = [], 0
    for n in states.seq_lens.tolist():
        keep.append(torch.arange(start, start + n))
        start += n + 1
    return torch.cat(keep)


def draft_rows(capture: TargetCapture, states: CapturedStates) -> torch.Tensor:
    return capture.hidden[draft_row_index(states)]


def nearest_layer(x: torch.Tensor, layers: torch.Tensor) -> tuple[int, dict]:
    scored = [(activation_metrics(layers[k], x), k) for k in range(layers.shape[0])]
    metrics, k = min(scored, key=lambda mk: (mk[0]["rel_diff"], mk[0]["rel_max"]))
    return k, metrics


def within(m: dict, tol: Tolerance) -> bool:
    return m["rel_max"] <= tol.rel_max and m["rel_diff"] <= tol.rel_diff


def measure_capture(states: CapturedStates, serving: TargetCapture, hf_layers: torch.Tensor,
                    tol: Tolerance) -> tuple[CaptureParity, list[Finding]]:
    """hf_layers: [n + 1, tokens, H] over the same rows as the states."""
    H = hf_layers.shape[-1]
    trained = states.aux_hidden_states.split(H, dim=-1)
    served_all = draft_rows(serving, states)
    served = served_all.split(H, dim=-1)
    chunks, training_ids, serving_ids = [], [], []
    for i, x in enumerate(trained):
        k, m = nearest_layer(x, hf_layers)
        training_ids.append(k if within(m, tol) else None)
        chunks.append(ChunkMatch("training", i, k, m, within(m, tol)))
    for i, x in enumerate(served):
        k, m = nearest_layer(x, hf_layers)
        serving_ids.append(k if within(m, tol) else None)
        vs = activation_metrics(trained[i], x) if i < len(trained) and x.shape == trained[i].shape else None
        chunks.append(ChunkMatch(serving.engine, i, k, m, within(m, tol), vs))
    parity = CaptureParity(serving.engine, serving.description, training_ids,
                           serving_ids if serving.hf_layer_ids is not None else None, chunks, tol.as_dict(),
                           {"training": int(states.aux_hidden_states.shape[1]), "serving": int(served_all.shape[1])})
    measured = {"trained_hf_ids": training_ids, "served_hf_ids": parity.serving_hf_ids,
                "training_width": parity.width["training"], "serving_width": parity.width["serving"]}
    findings: list[Finding] = []
    if None not in training_ids and list(states.aux_layer_ids) != training_ids:
        findings.append(Finding(CHECK, "states_not_from_this_config", Severity.ERROR,
                                f"the states file says hidden_states{list(states.aux_layer_ids)}, its chunks measure as "
                                f"hidden_states{training_ids}", measured))
    if serving.hf_layer_ids is None or served_all.shape[1] != states.aux_hidden_states.shape[1]:
        findings.append(Finding(CHECK, "aux_capture_off", Severity.ERROR,
                                f"{serving.engine}'s target hands the draft {served_all.shape[1]}-wide states "
                                f"({serving.description}); the draft was trained on {len(trained)} layers, "
                                f"{states.aux_hidden_states.shape[1]} wide", measured))
        return parity, findings
    if None in serving_ids or None in training_ids:
        findings.append(Finding(CHECK, "target_capture_values_differ", Severity.ERROR,
                                f"not every chunk equals a layer of this target (training: {training_ids}, "
                                f"{serving.engine}: {serving_ids}; None: no layer within tolerance)", measured))
        return parity, findings
    named = classify_layers(serving.engine, serving_ids, training_ids, measured, "measurably captures", CHECK)
    if named:
        return parity, findings + [named]
    off = [c for c in chunks if c.vs_training is not None and not within(c.vs_training, tol)]
    if off:
        worst = max(off, key=lambda c: c.vs_training["rel_max"])
        findings.append(Finding(CHECK, "target_capture_values_differ", Severity.ERROR,
                                f"{serving.engine} captures the right layers but chunk {worst.chunk} differs from the "
                                f"training capture by rel_max {worst.vs_training['rel_max']:.2e} (tolerance {tol.rel_max:g})",
                                measured))
    return parity, findings
