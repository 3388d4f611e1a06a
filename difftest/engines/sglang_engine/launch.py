"""A user's SGLang launch command, read by SGLang's own server-argument parser.

Nothing here pattern-matches flags: the command goes through `ServerArgs.add_cli_args`
and `ServerArgs.from_cli_args`, exactly as `python -m sglang.launch_server` parses it, and
every resolved value is read back through SGLang's `resolving_view` and `ModelConfig`.
What this module adds is the launcher prefix (which program was named), paths made
relative to where the command lives, and the table of settings that change what the draft
computes, with what difftest could simulate of each on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from difftest.engines.base import Deployment, DeploymentPlan, LaunchFlag, LaunchRole, launch_arguments
from difftest.errors import InputError, ServingRefused

# The ways a launch command names SGLang's server, as argv prefixes.
LAUNCHERS = (("-m", "sglang.launch_server"), ("sglang", "serve"), ("sglang.launch_server",))
# The EAGLE worker's tree drafting (topk > 1) runs kernels that exist only for GPUs.
SIMULATED_TOPK = 1
PATH_FLAGS = ("model_path", "speculative_draft_model_path", "speculative_token_map", "decrypted_draft_config_file")
# Draft load formats whose SGLang loader runs on a served directory alone (the others read
# other files, quantize, or fetch from a service).
SIMULATED_LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")


@dataclass(frozen=True)
class ResolvedLaunch:
    """The launch as SGLang resolved it, and what the draft's build needs from it."""

    plan: DeploymentPlan
    server_args: object  # sglang ServerArgs
    draft_config: object  # sglang ModelConfig, is_draft_model=True
    draft_load_format: str  # the one difftest runs (a format it cannot run falls back to auto)
    draft_window: int | None  # --speculative-draft-window-size


def server_arguments(argv: tuple[str, ...], source: str) -> list[str]:
    """The arguments after the launcher: `[ENV=..] python -m sglang.launch_server ARGS`,
    `sglang serve ARGS`, or ARGS alone."""
    args = launch_arguments(argv, LAUNCHERS)
    if args is not None:
        return args
    if bare_arguments(argv):
        return list(argv)[next(i for i, t in enumerate(argv) if t.startswith("-")):]
    raise InputError(f"{source}: not an SGLang launch command (expected `python -m sglang.launch_server ...`, "
                     f"`sglang serve ...` or its arguments alone): {' '.join(argv)[:120]}")


def bare_arguments(argv: tuple[str, ...]) -> bool:
    """A command that names no program, only flags (after any `VAR=value` prefixes): read as
    SGLang's, as it always was."""
    first = next((t for t in argv if not ("=" in t and not t.startswith("-"))), "")
    return first.startswith("-")


@functools.cache
def _parser() -> argparse.ArgumentParser:
    # Built once per process: SGLang adds several hundred arguments, 0.08 s per build, and
    # a parser is not changed by parsing (the config audit parses one command per variant).
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser


def parse_launch(deployment: Deployment, target_path: Path, device: str):
    """ServerArgs for this command, as SGLang's parser reads it. The target's path is the
    local one difftest was given (a hub id in the command cannot be fetched here); the draft
    path must be the served directory being checked."""
    from sglang.srt.server_args import ServerArgs

    args = server_arguments(deployment.launch_argv, deployment.source)
    parser = _parser()
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            raw = parser.parse_args(args)
    except SystemExit:
        said = [line for line in errors.getvalue().splitlines() if "error:" in line]
        why = said[-1].split("error:", 1)[1].strip() if said else "refused"
        raise InputError(f"{deployment.source}: SGLang's server-argument parser refused the command: {why}") from None
    notes = []
    for name in PATH_FLAGS:
        value = getattr(raw, name, None)
        if value and not os.path.isabs(value) and (deployment.base_dir / value).exists():
            setattr(raw, name, str((deployment.base_dir / value).resolve()))
    if raw.speculative_algorithm is None:
        raise InputError(f"{deployment.source}: the command has no --speculative-algorithm, so SGLang would serve "
                         "the target without any draft")
    served = deployment.served_dir.resolve()
    named = raw.speculative_draft_model_path
    if named is None:
        notes.append(f"--speculative-draft-model-path not given: the served directory {served} is used")
    elif not Path(named).exists() or Path(named).resolve() != served:
        raise InputError(f"{deployment.source}: --speculative-draft-model-path {named} is not the served directory "
                         f"{served} (relative paths resolve against {deployment.base_dir})")
    raw.speculative_draft_model_path = str(served)
    if raw.model_path and Path(raw.model_path).resolve() != Path(target_path).resolve():
        notes.append(f"--model-path {raw.model_path}: the target is read from {target_path}")
    raw.model_path = str(target_path)
    raw.device = device.split(":")[0]
    server_args = ServerArgs.from_cli_args(raw)
    return server_args, {a.dest for a in parser._actions if _given(a, args)}, notes


def _check_buildable(deployment: Deployment, draft_config) -> None:
    """Build the draft's class from the served config on the meta device, as the server's
    loader would at start: a config it cannot build from (no draft_vocab_size, which
    transformers 5.19 gives no default) is a server that does not start."""
    import copy

    from sglang.srt.model_loader.utils import get_model_architecture

    model_cls, arch = get_model_architecture(draft_config)
    try:
        with torch.device("meta"):
            model_cls(config=copy.deepcopy(draft_config.hf_config))  # __init__ writes into its config
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ServingRefused("sglang", str(deployment.served_dir),
                             f"{arch} cannot be built from its config.json ({type(exc).__name__}: {exc})",
                             "served_config_not_servable") from None


def _refusal(deployment: Deployment, exc: Exception) -> Exception:
    """SGLang's config code refused the served directory. A directory in speculators' format is
    a verdict on the deployment (a server would not start); any other refusal is a served
    config difftest cannot check, so one input error naming the file."""
    from difftest.checkpoint import CheckpointFormat, detect_format

    reason = " ".join(str(exc).split())[:300]
    config = deployment.served_dir / "config.json"
    try:
        fmt = detect_format(json.loads(config.read_text()))
    except (InputError, OSError, ValueError):
        fmt = None
    if fmt is CheckpointFormat.SPECULATORS:
        return ServingRefused("sglang", str(deployment.served_dir), f"{type(exc).__name__}: {reason}",
                              "served_format_not_servable")
    return InputError(f"{config}: SGLang's config code refuses it ({type(exc).__name__}: {reason})")


def _given(action: argparse.Action, args: list[str]) -> bool:
    return any(a == opt or a.startswith(opt + "=") for a in args for opt in action.option_strings)


def deployment_plan(deployment: Deployment, target_path: Path, device: str, reference_dtype: torch.dtype):
    """The launch resolved by SGLang: the draft's dtype from its own ModelConfig, the chain
    length and tree shape from `resolving_view`, and each setting that changes the draft."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.configs.model_config import ModelConfig

    server_args, given, notes = parse_launch(deployment, target_path, device)
    try:
        # Resolution already reads the draft's config.json (the algorithm alias check), as a server's start does.
        resolved = resolving_view(server_args)
        draft_config = ModelConfig.from_server_args(server_args, model_path=str(deployment.served_dir.resolve()),
                                                    is_draft_model=True)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        raise _refusal(deployment, exc) from None
    _check_buildable(deployment, draft_config)
    algorithm = str(resolved.speculative_algorithm)
    steps = int(resolved.speculative_num_steps or 1)
    topk = int(resolved.speculative_eagle_topk or 1)
    # ModelRunner's draft load format: the draft's own flag, else the server's --load-format.
    load_format = str(getattr(resolved.speculative_draft_load_format, "value", resolved.speculative_draft_load_format)
                      or getattr(resolved.load_format, "value", resolved.load_format))
    window = resolved.speculative_draft_window_size
    flags = [
        LaunchFlag("--speculative-algorithm", algorithm,
                   "EAGLE3: the target captures the draft's aux layers and the draft keeps its own head; EAGLE: no aux "
                   "capture (one target layer, fc skipped) and the target's head replaces the draft's",
                   "speculative_algorithm" in given, simulated=algorithm in ("EAGLE", "EAGLE3"),
                   instead="difftest runs EAGLE/EAGLE3 drafts only", role=LaunchRole.ALGORITHM, expected="EAGLE3",
                   set_right=("--speculative-algorithm", "EAGLE3")),
        LaunchFlag("--dtype", str(draft_config.dtype).removeprefix("torch."),
                   "the draft's weights and activations dtype (auto: the served config's torch_dtype)", "dtype" in given,
                   role=LaunchRole.DTYPE),
        LaunchFlag("--speculative-num-steps", steps, "how many chained draft steps each round proposes (the chain "
                   "length of the predicted acceptance)", "speculative_num_steps" in given, role=LaunchRole.CHAIN),
        LaunchFlag("--speculative-eagle-topk", topk, "branches per draft step (a tree above 1)",
                   "speculative_eagle_topk" in given, simulated=topk <= SIMULATED_TOPK,
                   instead=f"SGLang's tree drafting (topk {topk}) runs GPU-only kernels; difftest simulates "
                   f"topk={SIMULATED_TOPK}, the chain along each tree's first branch"),
        LaunchFlag("--load-format" if "load_format" in given and "speculative_draft_load_format" not in given
                   else "--speculative-draft-load-format", load_format,
                   "how the draft's weights are read (dummy: random values, no file is read)",
                   "speculative_draft_load_format" in given or "load_format" in given,
                   simulated=load_format in SIMULATED_LOAD_FORMATS,
                   instead=f"difftest reads the served files with SGLang's DefaultModelLoader (auto): the {load_format} "
                   "loader needs files or services a served directory does not hold here", role=LaunchRole.LOAD_FORMAT),
    ]
    if window is not None:
        flags.append(LaunchFlag("--speculative-draft-window-size", int(window),
                                "the draft's attention sees only this many previous tokens (LlamaForCausalLMEagle3 sets "
                                "it on every layer); the served config's sliding_window is not read", True,
                                role=LaunchRole.WINDOW))
    if resolved.enable_multi_layer_eagle:
        flags.append(LaunchFlag("--enable-multi-layer-eagle", True,
                                "another worker (MultiLayerEagleWorkerV2) drives the draft", True, simulated=False,
                                instead="difftest runs EagleDraftWorker's chain: the same draft forward, without the "
                                "multi-layer worker's boundary-KV handling"))
    if server_args.decrypted_draft_config_file:
        flags.append(LaunchFlag("--decrypted-draft-config-file", server_args.decrypted_draft_config_file,
                                "replaces the served directory's config.json for the draft", True))
    if resolved.speculative_token_map is not None:
        flags.append(LaunchFlag("--speculative-token-map", resolved.speculative_token_map,
                                "SGLang's EAGLE3 worker ignores it (init_token_map) and uses the served d2t; its EAGLE "
                                "worker reads draft ids through it (the target head's rows kept)",
                                role=LaunchRole.TOKEN_MAP))
    for dest, flag, effect in (("speculative_draft_model_quantization", "--speculative-draft-model-quantization",
                                "the draft's weights quantized"),
                               ("quantization", "--quantization", "the target's (and by default the draft's) weights quantized"),
                               ("kv_cache_dtype", "--kv-cache-dtype", "the draft's attention reads a KV cache at this dtype"),
                               ("json_model_override_args", "--json-model-override-args",
                                "SGLang's ModelConfig applies it to every model it builds, the draft included")):
        value = getattr(resolved, dest, None)
        if dest in given and value not in (None, "", "auto", "{}"):
            override = dest == "json_model_override_args"
            flags.append(LaunchFlag(flag, value, effect, True, simulated=override,
                                    instead="difftest runs the draft unquantized at --dtype with a KV cache at that dtype",
                                    role=LaunchRole.CONFIG_OVERRIDE if override else LaunchRole.OTHER))
    if draft_config.dtype != reference_dtype:
        notes.append(f"the draft runs in {flags[1].value}; training's reference runs in "
                     f"{str(reference_dtype).removeprefix('torch.')}")
    plan = DeploymentPlan(dtype=draft_config.dtype, chain_steps=steps, flags=flags,
                          served_config=draft_config.hf_config.to_dict(), notes=notes,
                          served_config_file=server_args.decrypted_draft_config_file or None)
    return ResolvedLaunch(plan, server_args, draft_config, load_format if load_format in SIMULATED_LOAD_FORMATS
                          else "auto", None if window is None else int(window))
