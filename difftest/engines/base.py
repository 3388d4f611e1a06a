"""The small interface every engine adapter implements, and the records it returns.

An adapter takes a checkpoint, the target's shared weights and a packed batch of
captured states, runs its engine's own model code, and returns probe tensors keyed by
the names in `difftest.probes`. Nothing outside an adapter knows how its engine works.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Protocol

import torch

from difftest.checkpoint import Checkpoint
from difftest.states import CapturedStates
from difftest.target import TargetWeights


DROP = "<dropped>"  # a config_edits value: remove the field


def apply_config_edits(cfg: dict, edits: tuple[tuple[str, object], ...]) -> dict[str, str]:
    """ServingSetup.config_edits applied to a config dict in place: each a dotted field, set to
    its value (parents created as needed) or removed when the value is DROP. Returns a note per
    field, for the report's conversion notes."""
    notes = {}
    for path, value in edits:
        node = cfg
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is DROP:
            node.pop(leaf, None)
        else:
            node[leaf] = value
        notes[path] = "serving setup: dropped" if value is DROP else f"serving setup: set to {value!r}"
    return notes


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint tensor's name after ServingSetup.key_renames (prefix renames, in order)."""
    for old, new in renames:
        if name.startswith(old):
            name = new + name[len(old):]
    return name


def launch_arguments(argv: tuple[str, ...], launchers: tuple[tuple[str, ...], ...]) -> list[str] | None:
    """The arguments after the first of `launchers` (argv prefixes such as ("vllm", "serve"))
    that the command names, past any `VAR=value` environment prefixes; None if it names none."""
    args = list(argv)
    while args and "=" in args[0] and not args[0].startswith("-"):
        args.pop(0)
    for i in range(len(args)):
        for launcher in launchers:
            if tuple(args[i:i + len(launcher)]) == launcher:
                return args[i + len(launcher):]
    return None


@dataclass(frozen=True)
class Deployment:
    """What the user actually serves: a draft directory and the serving engine's launch
    command, exactly as given. Only the serving engine's adapter reads the command (with
    that engine's own parser); relative paths in it resolve against `base_dir`."""

    served_dir: Path
    launch_argv: tuple[str, ...]
    base_dir: Path
    source: str = "--launch"  # where the command came from, for messages
    engine: str = "sglang"  # the serving engine whose server the command starts (engines.launch_engine)

    def with_flag(self, flag: str, value: str | None) -> "Deployment":
        """The same deployment launched with `flag` set to `value` (None: without the flag),
        as a user would edit the command line; what the flag means stays the engine's to read."""
        argv, out, i = list(self.launch_argv), [], 0
        while i < len(argv):
            token = argv[i]
            if token == flag:
                i += 2  # the flag and its value
                continue
            if token.startswith(flag + "="):
                i += 1
                continue
            out.append(token)
            i += 1
        if value is not None:
            out += [flag, value]
        return replace(self, launch_argv=tuple(out),
                       source=f"{self.source}, with {flag} " + (value if value is not None else "removed"))

    def with_served_dir(self, served_dir: Path, why: str) -> "Deployment":
        """The same command serving another directory: every argument that names the served
        directory (as given, relative to base_dir or absolute) names the new one instead."""
        old = self.served_dir.resolve()

        def names_served(token: str) -> bool:
            path = Path(token) if Path(token).is_absolute() else self.base_dir / token
            return not token.startswith("-") and path.exists() and path.resolve() == old

        def rewrite(token: str) -> str:
            flag, eq, value = token.partition("=")
            if token.startswith("--") and eq:
                return f"{flag}={served_dir}" if names_served(value) else token
            return str(served_dir) if names_served(token) else token

        argv = tuple(rewrite(t) for t in self.launch_argv)
        return replace(self, served_dir=Path(served_dir), launch_argv=argv, source=f"{self.source}, serving {why}")


class LaunchRole(str, Enum):
    """What a launch setting decides about the draft, whatever the engine calls it: the
    deployment audit checks settings by role, so it reads no engine's flag names."""

    ALGORITHM = "algorithm"  # which speculative method drives the draft
    DTYPE = "dtype"
    CHAIN = "chain"  # draft steps per round
    LOAD_FORMAT = "load_format"  # how the draft's weights are read
    WINDOW = "window"  # the draft's attention window
    TOKEN_MAP = "token_map"  # a hot-token map given beside the checkpoint
    CONFIG_OVERRIDE = "config_override"  # config fields the launch overrides for the draft
    OTHER = "other"


@dataclass(frozen=True)
class LaunchFlag:
    """One launch setting that changes what the draft computes, as the engine resolved it."""

    flag: str  # as the user writes it (a JSON field of a flag: `--flag field`)
    value: object
    effect: str  # what it changes in the draft's computation
    given: bool = True  # set on the command line (False: the engine's default)
    simulated: bool = True  # run here as the server would run it
    instead: str = ""  # when not simulated: what difftest ran instead, and why
    role: LaunchRole = LaunchRole.OTHER
    # The value a correct EAGLE-3 deployment has, where one value is right whatever was trained
    # (the algorithm), and the command-line edit that sets it: (flag, value; None drops the flag).
    expected: object = None
    set_right: tuple[str, str | None] | None = None

    @property
    def how_run(self) -> str:
        return "as given" if self.simulated else f"not simulated: {self.instead}"

    def as_row(self) -> dict:
        value = self.value if isinstance(self.value, (int, float, str, bool, type(None), list)) else str(self.value)
        row = {k: v for k, v in self.__dict__.items() if k not in ("expected", "set_right")}
        return dict(row, value=value, how_run=self.how_run, role=self.role.value)


@dataclass
class DeploymentPlan:
    """How the serving engine would run the draft under a launch command."""

    dtype: torch.dtype
    chain_steps: int
    flags: list[LaunchFlag] = field(default_factory=list)
    served_config: dict = field(default_factory=dict)  # as the engine's own config code read it
    served_config_file: str | None = None  # read in place of the served directory's config.json
    notes: list[str] = field(default_factory=list)

    def by_role(self, role: LaunchRole) -> LaunchFlag | None:
        return next((f for f in self.flags if f.role is role), None)

    def as_dict(self) -> dict:
        return {"dtype": str(self.dtype).removeprefix("torch."), "chain_steps": self.chain_steps,
                "served_config_file": self.served_config_file,
                "flags": [f.as_row() for f in self.flags],
                "notes": self.notes}


@dataclass(frozen=True)
class ServingSetup:
    """How the serving side is wired around the draft. Defaults are a correct deployment.

    Faults that live in the serving stack, not in the checkpoint, flip these; an
    adapter that has no such knob ignores it.
    """

    # False: the target was not set up to capture aux layers, so the draft is fed the
    # target's single last hidden state instead of the aux concatenation.
    aux_capture: bool = True
    # True: the worker's `set_embed_and_head` path, the target's full head replaces the draft's.
    lm_head_from_target: bool = False
    # False: the draft keeps its own (randomly initialized) embedding.
    share_target_embed: bool = True
    # Edits to the config the serving engine reads, as (dotted field, value or DROP): what a
    # converter or a hand-written serving config gets wrong.
    config_edits: tuple[tuple[str, object], ...] = ()
    # Prefix renames of the checkpoint's tensor names on their way to the serving engine,
    # as (old prefix, new prefix): what a converter that names keys wrongly produces.
    key_renames: tuple[tuple[str, str], ...] = ()
    # A served directory and launch command: the serving engine then reads those, as its
    # server would, and the fields above are not used.
    deployment: Deployment | None = None


@dataclass(frozen=True)
class RunOptions:
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    serving: ServingSetup = ServingSetup()


class TensorFate(str, Enum):
    CONSUMED = "consumed"  # copied into a parameter under its own name
    RENAMED = "renamed"  # copied into a parameter after the engine renamed it
    IGNORED = "ignored"  # skipped on purpose, with the engine's reason
    DROPPED = "dropped"  # skipped without a word


class ParamFate(str, Enum):
    WRITTEN = "written"  # from the checkpoint
    SHARED = "shared"  # from the target (embedding, head)
    INIT = "init"  # left at initialization
    RANDOMIZED = "randomized"  # random values the launch asked the engine's loader for (a dummy load format)


@dataclass
class LoadLedger:
    """Where every checkpoint tensor went and where every parameter came from."""

    tensors: dict[str, tuple[TensorFate, list[str], str]] = field(default_factory=dict)  # name -> (fate, into, note)
    params: dict[str, tuple[ParamFate, str]] = field(default_factory=dict)  # param -> (fate, note)
    # checkpoint tensors that wrote the engine's draft-to-target token map, in load order: the
    # last one is the map the engine drafts with
    token_map_writers: list[str] = field(default_factory=list)

    def names(self, fate) -> list[str]:
        table = self.tensors if isinstance(fate, TensorFate) else self.params
        return sorted(n for n, v in table.items() if v[0] is fate)

    def as_dict(self) -> dict:
        return {
            "tensors": {n: {"fate": f.value, "into": into, "note": note} for n, (f, into, note) in sorted(self.tensors.items())},
            "params": {n: {"fate": f.value, "note": note} for n, (f, note) in sorted(self.params.items())},
        }


@dataclass
class EngineRun:
    """What one engine produced: probe tensors on CPU plus what it noticed while loading."""

    engine: str
    probes: dict[str, torch.Tensor]
    # probe name -> why the engine never computed it (e.g. fc skipped by a shape check)
    missing: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    ledger: LoadLedger = field(default_factory=LoadLedger)
    chain: "ChainRun | None" = None  # when run with chain_steps > 0: the same loaded model's chain draft


@dataclass
class ChainRun:
    """k chained draft steps from every row: what the engine would propose at serving time.

    Row t, step j is the draft's guess for the token j+1 places after row t's token, given
    that its guesses for steps < j were right (each engine feeds its previous step in its
    own way; on the accepted path both see the same tokens).
    """

    engine: str
    target_tokens: torch.Tensor  # [T, k] int64, target-vocab ids
    draft_tokens: torch.Tensor  # [T, k] int64, draft-vocab ids
    timings_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class TargetCapture:
    """The hidden states an engine's target hands its draft, one row per token of the
    full sequences (unshifted), as that engine's code produces them."""

    engine: str
    hidden: torch.Tensor  # [tokens, width]
    hf_layer_ids: list[int] | None  # what the engine says it captured, in HF ids; None: no aux capture
    description: str
    timings_s: dict[str, float] = field(default_factory=dict)


@dataclass
class CapturePlan:
    """Which target hidden states an engine feeds (or was trained on) for this draft.

    `hf_layer_ids` are in one neutral convention, HF's: id k is `hidden_states[k]` of the
    target's HF forward (0 = embedding output, n = last layer before the final norm),
    listed in the order the engine concatenates them. Each adapter translates its own
    engine's convention into this one.
    """

    engine: str
    hf_layer_ids: list[int] | None  # None: the engine captures no aux layers
    supports_aux_capture: bool = True
    target_class: str = ""
    configured_ids: list[int] | None = None  # what the engine's config resolution produced
    steps: list[str] = field(default_factory=list)  # how the ids were resolved, in the engine's own words

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class EngineAdapter(Protocol):
    name: str

    def capture_plan(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions) -> CapturePlan: ...

    def run(
        self,
        checkpoint: Checkpoint,
        target: TargetWeights,
        states: CapturedStates,
        options: RunOptions,
        chain_steps: int = 0,
        chain_states: CapturedStates | None = None,
    ) -> EngineRun:
        """Load the draft once, record the probes of one draft forward and, with chain_steps > 0,
        draft that many chained steps from every row with the same model (EngineRun.chain).
        One load per engine: at real shapes a second load costs a minute and a second copy.
        `chain_states`, when given, are what this engine's own target would hand the draft at
        serving time (they differ from `states` when its capture differs from training's):
        the chain is drafted from them, the probes from `states`."""
        ...

    def claims_launch(self, argv: tuple[str, ...]) -> bool:
        """For a serving engine: whether this launch command starts its server."""
        ...

    def start_early(self) -> None:
        """Optional: begin what can run beside the other engines' work before this engine is
        first asked for anything. An engine in a worker launches it and returns; an engine in
        this process imports itself, which is done after every worker has been launched."""
        ...

    def recognizes(self, checkpoint: Checkpoint) -> str | None:
        """For a training engine: why this directory is one its trainer wrote, or None when the
        directory does not say (engines.training_engine_for then asks for --training)."""
        ...

    def deployment_plan(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions) -> DeploymentPlan | None:
        """For a serving engine given `options.serving.deployment`: what its launch command
        resolves to. None for an engine that does not serve."""
        ...
