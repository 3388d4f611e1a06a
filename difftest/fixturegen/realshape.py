"""Random-weight EAGLE-3 drafts at the shapes real drafts are published with, in both formats.

Only shapes matter here (time and memory at real size), so the weights are random and the
target is a stand-in holding just what a draft shares with its verifier: a config with the
real target's layer count and widths, and its embedding, final norm and head. The draft is
built by speculators itself (its trainer's layer-config path, then from_training_args) and
saved by it, so the checkpoint is what a user of speculators would have on disk.

Shapes, from the published draft configs:
  llama3.1-8b  yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: hidden 4096, 32 heads, 8 kv heads,
               intermediate 14336, vocab 128256, draft vocab 32000; target 32 layers.
  kimi-k2.5    the Kimi-K2.5 EAGLE-3 draft config (LlamaForCausalLMEagle3): hidden 7168,
               64 heads, 64 kv heads, head_dim 128, intermediate 12288, vocab 163840,
               rope_theta 1e6; target 61 layers. Its config names no draft vocab; 32000,
               the size its trainers use, is taken.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_layers: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @property
    def aux_layer_ids(self) -> list[int]:
        # speculators' default for an n-layer target (and SGLang's set_eagle3_layers_to_capture's).
        n = self.target_layers
        return [2, n // 2, n - 3]


SHAPES: dict[str, DraftShape] = {
    "llama3.1-8b": DraftShape(4096, 32, 8, 128, 14336, 128256, 32000, 32, 1e-5, 500000.0, 2048),
    "kimi-k2.5": DraftShape(7168, 64, 64, 128, 12288, 163840, 32000, 61, 1e-6, 1000000.0, 262144),
}
DTYPE = torch.bfloat16
SEQ_LENS = (96, 64, 96)


def build_target_standin(shape: DraftShape, out: Path, gen: torch.Generator) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.target_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size,
        "rms_norm_eps": shape.rms_norm_eps, "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.max_position_embeddings, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    V, H = shape.vocab_size, shape.hidden_size
    save_file({
        "model.embed_tokens.weight": (0.02 * torch.randn(V, H, generator=gen)).to(DTYPE),
        "lm_head.weight": (0.02 * torch.randn(V, H, generator=gen)).to(DTYPE),
        "model.norm.weight": torch.ones(H, dtype=DTYPE),
    }, str(out / "model.safetensors"))


def build_states(shape: DraftShape, out: Path, gen: torch.Generator) -> None:
    from difftest.states import CapturedStates, save_states

    T, H = sum(SEQ_LENS), shape.hidden_size
    save_states(CapturedStates(
        input_ids=torch.randint(0, shape.vocab_size, (T,), generator=gen),
        seq_lens=torch.tensor(SEQ_LENS),
        aux_hidden_states=torch.randn(T, 3 * H, generator=gen).to(DTYPE),
        verifier_last_hidden_states=torch.randn(T, H, generator=gen).to(DTYPE),
        aux_layer_ids=tuple(shape.aux_layer_ids),
        loss_mask=torch.ones(T, dtype=torch.uint8),
    ), out)


def build(name: str, root: Path) -> Path:
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    from difftest.convert import speculators_to_legacy

    shape = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    build_target_standin(shape, root / "target", gen)
    build_states(shape, root / "states.safetensors", gen)

    layer_cfg = create_transformer_layer_config(str(root / "target"), num_layers=1, draft_arch="llama", hidden_act=None,
                                                sliding_window=2048, full_attention_indices=[0])
    # The published drafts' own widths, where the trainer's defaults would copy the target's.
    layer_cfg.intermediate_size = shape.intermediate_size
    layer_cfg.num_key_value_heads = shape.num_key_value_heads
    layer_cfg.max_position_embeddings = shape.max_position_embeddings
    # A frequency ranking over random ids is as good as any for a random draft: d2t offsets
    # onto the first draft_vocab_size ids, spread over the target vocab.
    hot = torch.randperm(shape.vocab_size, generator=gen)[: shape.draft_vocab_size].sort().values
    d2t = hot - torch.arange(shape.draft_vocab_size)
    t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)  # built at the dtype it is saved in: half the memory of fp32
    try:
        draft = Eagle3DraftModel.from_training_args(
            layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=shape.draft_vocab_size,
            norm_before_residual=False, norm_before_fc=False, ttt_steps=3,
            verifier_name_or_path=str(root / "target"), draft_attn_impl="sdpa", target_layer_ids=shape.aux_layer_ids,
        )
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if n.startswith(("verifier_", "embed_tokens")):
                continue
            p.copy_(torch.ones_like(p) if "norm" in n else 0.02 * torch.randn(p.shape, generator=gen).to(p.dtype))
    spec_dir = root / "speculators"
    draft.save_pretrained(spec_dir, safe_serialization=True)
    del draft
    cfg = json.loads((spec_dir / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "../target"
    (spec_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    speculators_to_legacy(spec_dir, root / "legacy")
    return root
