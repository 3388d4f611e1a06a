"""The tiny committed fixture: a random 8-layer Llama target, captured states, and an
EAGLE-3 draft built and saved by speculators itself, in both on-disk formats.

Weights are drawn with a larger spread than HF's default init, so that logits have
clear argmax margins and token probes are not decided by ties (noise-floor safety).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TINY_TARGET = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention backend runs head sizes of 32 and up
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
DRAFT_VOCAB = 96
SEQ_LENS = (23, 9, 32)
SEED = 0


def _spread_init(model: torch.nn.Module, gen: torch.Generator, std: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".hidden_norm." in name or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def build_target(out: Path, gen: torch.Generator):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**TINY_TARGET)
    model = LlamaForCausalLM(cfg)
    _spread_init(model, gen, std=0.08)
    model.save_pretrained(out, safe_serialization=True)
    return model


def build(root: Path) -> None:
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from speculators.train.cli import create_transformer_layer_config

    from difftest.convert import speculators_to_legacy
    from difftest.fixturegen.capture import capture_states
    from difftest.states import save_states

    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    target_dir = root / "target"
    target = build_target(target_dir, gen)

    seqs = [torch.randint(0, TINY_TARGET["vocab_size"], (n,), generator=gen).tolist() for n in SEQ_LENS]
    aux_ids = [2, TINY_TARGET["num_hidden_layers"] // 2, TINY_TARGET["num_hidden_layers"] - 3]
    states = capture_states(target, seqs, aux_ids)
    save_states(states, root / "states.safetensors")

    freq: dict[int, int] = {}
    for t in states.input_ids.tolist():
        freq[t] = freq.get(t, 0) + 1
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, TINY_TARGET["vocab_size"])

    # speculators' own trainer builds the draft's layer config this way (1 layer, its defaults).
    layer_cfg = create_transformer_layer_config(
        str(target_dir), num_layers=1, draft_arch="llama", hidden_act=None,
        sliding_window=2048, full_attention_indices=[],
    )
    draft = Eagle3DraftModel.from_training_args(
        layer_cfg,
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=False,
        norm_before_fc=True,
        ttt_steps=3,
        verifier_name_or_path=str(target_dir),
        draft_attn_impl="sdpa",
        target_layer_ids=aux_ids,
    )
    trainable = {n: p for n, p in draft.named_parameters() if not n.startswith(("verifier_", "embed_tokens"))}
    with torch.no_grad():
        for name, p in trainable.items():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    spec_dir = root / "speculators"
    draft.save_pretrained(spec_dir, safe_serialization=True)
    _relativize_verifier(spec_dir / "config.json")
    speculators_to_legacy(spec_dir, root / "legacy")
    from difftest.fixturegen.specforge_tiny import build as build_specforge

    build_specforge(root / "specforge", root / "legacy")  # SpecForge's own draft on the same target


def _relativize_verifier(cfg_file: Path) -> None:
    # The builder's absolute path means nothing on another machine; point at the sibling target.
    cfg = json.loads(cfg_file.read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "../target"
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
