"""The target (verifier) weights the draft shares: embedding, head and final norm.

Loaded once per run and handed to both engines as the same tensors, the way a serving
worker shares the target's embedding with its draft instead of copying it.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from difftest.errors import InputError


@dataclass
class TargetWeights:
    path: Path
    config: dict
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    norm: torch.Tensor  # [hidden]
    # (tensor name, device, dtype) -> the converted tensor, alive only while an engine holds it
    _converted: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary, repr=False)

    def shared(self, name: str, device, dtype: torch.dtype) -> torch.nn.Parameter:
        """`embed`, `lm_head` or `norm` as a frozen parameter on a device and dtype, the same
        object for every engine that asks while one holds it: the stored tensor itself where
        nothing changes (memory-mapped from the target's file), else one conversion both
        engines share instead of one copy each."""
        key = (name, str(torch.device(device)), dtype)
        param = self._converted.get(key)
        if param is None:
            param = torch.nn.Parameter(getattr(self, name).to(device=device, dtype=dtype), requires_grad=False)
            self._converted[key] = param
        return param

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])


def _tensor_files(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(path.glob("*.safetensors"))
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def load_target(path: str | Path) -> TargetWeights:
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        raise InputError(f"target {path}: config.json not found (pass --target DIR with an HF Llama model)")
    try:
        config = json.loads(cfg.read_text())
        files = _tensor_files(path)
    except Exception as exc:
        raise InputError(f"target {path}: unreadable ({exc})") from None

    def get(name: str) -> torch.Tensor | None:
        if name not in files:
            return None
        with safe_open(str(files[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    embed = get("model.embed_tokens.weight")
    norm = get("model.norm.weight")
    if embed is None or norm is None:
        raise InputError(f"target {path}: needs model.embed_tokens.weight and model.norm.weight")
    head = get("lm_head.weight")
    if head is None:
        if not config.get("tie_word_embeddings", False):
            raise InputError(f"target {path}: no lm_head.weight and tie_word_embeddings is false")
        head = embed
    return TargetWeights(path=path, config=config, embed=embed, lm_head=head, norm=norm)


def target_tensors(path: str | Path):
    """(name, tensor) for every tensor of the target's safetensors, one at a time."""
    for name, file in _tensor_files(Path(path)).items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield name, f.get_tensor(name)


@torch.no_grad()
def layer_boundaries(model, ids: list[int]) -> torch.Tensor:
    """One sequence through a transformers Llama: [n + 1, L, H], index k = HF hidden_states[k]
    for k < n, index n = the last layer's output BEFORE the final norm (HF's own
    hidden_states[-1] is after it)."""
    pre_norm: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: pre_norm.append(args[0].detach()))
    try:
        # The decoder alone: the boundaries are all that is read, and the head over a 49k vocab
        # would cost a fifth of the forward.
        out = model.model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    n = len(out.hidden_states) - 1
    return torch.stack([h[0] for h in out.hidden_states[:n]] + [pre_norm[-1][0]]).float()


@torch.no_grad()
def hf_layer_states(path: str | Path, sequences: list[list[int]]) -> torch.Tensor:
    """Every layer boundary of the target's transformers forward over the packed sequences:
    [n + 1, tokens, H], in the neutral convention of layer_boundaries."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return torch.cat([layer_boundaries(model, ids) for ids in sequences], dim=1)
