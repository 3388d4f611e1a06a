"""Read an EAGLE-3 draft checkpoint directory, read-only, in either on-disk format.

Two formats exist in the wild:
- speculators: config.json with `speculators_model_type: eagle3` and a nested
  `transformer_layer_config`; decoder weights under `layers.0.*`.
- legacy / SGLang: a flat Llama config with `architectures: [LlamaForCausalLMEagle3]`,
  `draft_vocab_size` and `eagle_config`; decoder weights under `midlayer.*`.

Tensors are memory-mapped through safetensors and never written back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from difftest.errors import InputError


class CheckpointFormat(str, Enum):
    SPECULATORS = "speculators"
    LEGACY = "legacy"


LEGACY_ARCHITECTURE = "LlamaForCausalLMEagle3"


def detect_format(config: dict[str, Any]) -> CheckpointFormat:
    if config.get("speculators_model_type") == "eagle3" and "transformer_layer_config" in config:
        return CheckpointFormat.SPECULATORS
    architectures = config.get("architectures")
    if not isinstance(architectures, list):  # a malformed config's field, not a reason to crash
        architectures = []
    if LEGACY_ARCHITECTURE in architectures and "draft_vocab_size" in config:
        return CheckpointFormat.LEGACY
    raise InputError(
        "unknown checkpoint format: expected config.json with speculators_model_type=eagle3 "
        f"and transformer_layer_config, or architectures=[{LEGACY_ARCHITECTURE}] with draft_vocab_size; "
        f"found keys {sorted(config)[:12]}"
    )


@dataclass(frozen=True)
class DraftSpec:
    """The draft's architecture, normalized from either format's config."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    target_vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # as stored, in the format's own convention (see convert.py)
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    rope_theta: float
    rope_scaling: dict | None
    hidden_act: str
    max_position_embeddings: int

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids) if self.aux_layer_ids else 3


def rope_of(layer_cfg: dict) -> tuple[float, dict | None]:
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
    params = layer_cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", layer_cfg.get("rope_theta", 10000.0))
    scaling = layer_cfg.get("rope_scaling")
    if scaling is None and params and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and "type" in scaling and scaling.get("rope_type", scaling["type"]) == scaling["type"]:
        # `type` is the older spelling of `rope_type`; SGLang's ModelConfig writes both.
        scaling = {"rope_type": scaling["type"], **{k: v for k, v in scaling.items() if k != "type"}}
    return float(theta), scaling


def declared_window(config: dict) -> int | None:
    """The sliding window a draft config declares for its layer, in either format (speculators
    nests the layer's config; the legacy layout is flat); None for full attention."""
    layer = config.get("transformer_layer_config", config)
    kinds = layer.get("layer_types") or []
    sliding = (kinds[0] == "sliding_attention") if kinds else bool(layer.get("use_sliding_window"))
    return layer.get("sliding_window") if sliding else None


def rope_acts_beyond(config: dict) -> int | None:
    """The position past which the declared rope scaling changes anything: dynamic NTK and
    longrope switch on past the original context; others act at every position (None)."""
    layer = config.get("transformer_layer_config", config)
    _theta, scaling = rope_of(layer)
    if not scaling or scaling.get("rope_type") not in ("dynamic", "longrope"):
        return None
    return int(scaling.get("original_max_position_embeddings") or layer.get("max_position_embeddings") or 0) or None


def _unless_none(value, default):
    return default if value is None else value


def spec_from_config(config: dict[str, Any], fmt: CheckpointFormat) -> DraftSpec:
    try:
        if fmt is CheckpointFormat.SPECULATORS:
            layer = config["transformer_layer_config"]
            top = config
            aux = config.get("eagle_aux_hidden_state_layer_ids")
        else:
            layer = config
            top = config
            aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        theta, scaling = rope_of(layer)
        eagle_cfg = config.get("eagle_config") or {}
        return DraftSpec(
            hidden_size=hidden,
            num_attention_heads=heads,
            # As transformers' LlamaConfig reads them: only an absent (None) value takes the
            # default, so a 0 reaches validation instead of becoming the default here.
            num_key_value_heads=int(_unless_none(layer.get("num_key_value_heads"), heads)),
            head_dim=int(_unless_none(layer.get("head_dim"), hidden // heads if heads else 0)),
            intermediate_size=int(layer["intermediate_size"]),
            num_hidden_layers=int(layer.get("num_hidden_layers", 1)),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            target_vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(top["draft_vocab_size"]),
            target_hidden_size=int(top.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
            norm_before_residual=bool(top.get("norm_before_residual", False)),
            norm_before_fc=bool(top.get("norm_before_fc", eagle_cfg.get("norm_before_fc", False))),
            fc_norm=bool(top.get("fc_norm", False)),
            norm_output=bool(top.get("norm_output", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            hidden_act=str(layer.get("hidden_act", "silu")),
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        )
    # AttributeError: a list where an object belongs; OverflowError: Infinity where an integer belongs;
    # ZeroDivisionError: zero heads and no head_dim
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError) as exc:
        raise InputError(f"config.json is missing or has a malformed field: {exc!r}") from None


@dataclass
class Checkpoint:
    path: Path
    format: CheckpointFormat
    config: dict[str, Any]
    spec: DraftSpec
    _files: dict[str, Path] = field(repr=False, default_factory=dict)  # tensor name -> file
    # Where the user's checkpoint is, when `path` is a scratch safetensors copy of pickled weights.
    source: Path | None = None
    _scratch: Any = field(repr=False, default=None)  # keeps that copy alive as long as the checkpoint
    # Weight files in the directory that neither engine reads (not in the index): noted, not loaded.
    ignored_files: list[str] = field(default_factory=list)

    @property
    def origin(self) -> Path:
        return self.source or self.path

    def shape(self, name: str) -> torch.Size:
        with safe_open(str(self._files[name]), framework="pt", device="cpu") as f:
            return torch.Size(f.get_slice(name).get_shape())

    def weight_files(self) -> list[Path]:
        """What an engine reads from the directory: the weight files in use, and their index."""
        used = list(dict.fromkeys(self._files.values()))
        index = self.path / INDEX_FILE
        return used + ([index] if index.is_file() else [])

    def tensor_names(self) -> list[str]:
        return list(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream (name, tensor) pairs, each memory-mapped from its file on its own: a tensor's
        pages are resident only while its consumer holds it, so walking a checkpoint (an
        engine's load_weights, a NaN scan) never holds more than one tensor of it at once."""
        for name in self._files:
            yield name, self.get(name)

    def stored_dtype(self) -> torch.dtype:
        """The dtype most floating-point tensors were saved in: the precision the draft ships at."""
        names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
        counts: dict[torch.dtype, int] = {}
        for name, file in self._files.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                dt = names.get(f.get_slice(name).get_dtype())
            if dt is not None:
                counts[dt] = counts.get(dt, 0) + 1
        return max(counts, key=counts.get) if counts else torch.float32

    def nbytes(self) -> int:
        """Bytes of all tensors as stored, from the file headers (nothing is read)."""
        sizes = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}
        total = 0
        for name, file in self._files.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                s = f.get_slice(name)
                total += sizes.get(s.get_dtype(), 8) * int(torch.Size(s.get_shape()).numel())
        return total

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors())


PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def _pickles(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise InputError(f"{file}: not a readable safetensors file ({exc})") from None


def _shards_from_index(path: Path, files: list[Path]) -> tuple[list[Path], dict[str, str]]:
    """The files an index names, as transformers and SGLang's loader follow it: every one must
    exist and hold the tensors mapped to it."""
    index = path / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise InputError(f"{index}: not a readable index ({exc})") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise InputError(f"{index}: expected a non-empty weight_map of tensor name -> shard file name")
    shards = []
    for name in dict.fromkeys(weight_map.values()):
        shard = path / name
        if Path(name).name != name or not shard.is_file():
            raise InputError(f"{index}: names shard {name!r}, which is not a file in {path}")
        shards.append(shard)
    return shards, weight_map


def _index_tensors(path: Path) -> tuple[dict[str, Path], list[str]]:
    """Tensor name -> file, and the weight files present but not read (a visible note, never an
    input). With an index, its shards; without one, model.safetensors when present (what
    transformers reads), else the only weight file."""
    files = sorted(path.glob("*.safetensors"))
    if (path / INDEX_FILE).is_file():
        shards, weight_map = _shards_from_index(path, files)
    elif not files:
        pickles = _pickles(path)
        if pickles:
            raise InputError(f"{path}: weights are pickle files ({', '.join(p.name for p in pickles[:3])}); refusing to "
                             "unpickle them; convert to safetensors or pass --allow-pickle (loads with weights_only=True)")
        raise InputError(f"{path}: no *.safetensors weights found (expected model.safetensors)")
    elif (path / SINGLE_FILE).is_file() or len(files) == 1:
        shards, weight_map = [path / SINGLE_FILE if (path / SINGLE_FILE).is_file() else files[0]], {}
    else:
        raise InputError(f"{path}: {len(files)} weight files ({', '.join(f.name for f in files[:4])}) and no "
                         f"{INDEX_FILE} saying which to read; add the index, or keep only {SINGLE_FILE}")
    names: dict[str, Path] = {}
    for shard in shards:
        for key in _keys(shard):
            if key in names:
                raise InputError(f"{path}: tensor {key} is stored in both {names[key].name} and {shard.name}; "
                                 "which copy an engine loads depends on its file order")
            names[key] = shard
    for key, name in weight_map.items():
        if names.get(key) != path / name:
            raise InputError(f"{path / INDEX_FILE}: maps {key} to {name}, which does not hold it")
    ignored = [f.name for f in files if f not in shards]
    return names, ignored


def check_weight_files(path: Path) -> None:
    """The weight files a loader would read from `path` (through its index, when it has one)
    exist and hold what the index says, whatever the config: refused with one line otherwise."""
    _index_tensors(path)


def _safetensors_copy_of_pickles(path: Path):
    """torch.load(weights_only=True) each pickle into one scratch safetensors checkpoint:
    the engines then read safetensors like any other, and nothing runs arbitrary code."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for file in _pickles(path):
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only refuses anything that is not plain tensors and containers
            raise InputError(f"{file}: not loadable with weights_only=True ({str(exc).splitlines()[0][:160]})") from None
        if isinstance(loaded, dict) and "state_dict" in loaded and isinstance(loaded["state_dict"], dict):
            loaded = loaded["state_dict"]
        if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise InputError(f"{file}: expected a dict of name -> tensor, found {type(loaded).__name__}")
        tensors.update({k: v.contiguous() for k, v in loaded.items()})
    scratch = tempfile.TemporaryDirectory(prefix="difftest-unpickled-")
    save_file(tensors, str(Path(scratch.name) / "model.safetensors"))
    shutil.copy(path / "config.json", Path(scratch.name) / "config.json")
    return scratch


ACCEPTED_CHECKPOINTS = ("a draft is a directory in speculators' format (config.json with speculators_model_type eagle3, "
                        f"*.safetensors) or SGLang's legacy layout (config.json with architectures [{LEGACY_ARCHITECTURE}])")


def load_checkpoint(path: str | Path, allow_pickle: bool = False, config_file: str | Path | None = None) -> Checkpoint:
    """`config_file`: the config a server reads in place of the directory's own config.json."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: checkpoint directory not found; {ACCEPTED_CHECKPOINTS}")
    cfg_file = Path(config_file) if config_file is not None else path / "config.json"
    if not cfg_file.is_file():
        raise InputError(f"{path}: config.json not found; {ACCEPTED_CHECKPOINTS}")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{cfg_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InputError(f"{cfg_file}: expected a JSON object, found {type(config).__name__}")
    fmt = detect_format(config)
    spec = spec_from_config(config, fmt)
    if allow_pickle and not any(path.glob("*.safetensors")) and _pickles(path):
        scratch = _safetensors_copy_of_pickles(path)
        copy = Path(scratch.name)
        return Checkpoint(path=copy, format=fmt, config=config, spec=spec, _files=_index_tensors(copy)[0],
                          source=path, _scratch=scratch)
    files, ignored = _index_tensors(path)
    return Checkpoint(path=path, format=fmt, config=config, spec=spec, _files=files, ignored_files=ignored)
