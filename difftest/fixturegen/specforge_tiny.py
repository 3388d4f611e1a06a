"""The tiny SpecForge draft (fixtures/tiny/specforge): built with SpecForge's own model class and
written by SpecForge's own exporter, on the tiny target.

The tiny target is random, so there is nothing for a trainer to learn (the SmolLM2 SpecForge
fixture, difftest/fixturegen/specforge_smollm2.py, is trained by SpecForge's trainer). The draft is
initialized with LlamaForCausalLMEagle3, its weights spread as the tiny speculators draft's are
(SpecForge's 0.02 init leaves activations too small to tell probes apart), its vocab map taken
from the tiny draft, then saved as a training state and exported with `export_to_sglang`, exactly
as a SpecForge run's final checkpoint would be.

    python -m difftest.fixturegen.specforge_tiny [OUT]   (default: fixtures/tiny/specforge)
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from difftest.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "fixtures" / "tiny"
SEED = 11


def draft_config(legacy: dict) -> dict:
    """SpecForge's draft config for the tiny target: the tiny draft's shape and aux ids, no
    norm_output (SpecForge's and the serving engines' readings agree only without it)."""
    keep = ("hidden_size", "num_attention_heads", "head_dim", "num_key_value_heads", "intermediate_size", "vocab_size",
            "draft_vocab_size", "target_hidden_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
            "rope_parameters")
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "tie_word_embeddings": False, **{k: legacy[k] for k in keep},
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": legacy["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}}


def build(out: Path, legacy_dir: Path = TINY / "legacy", config_edits: dict | None = None) -> Path:
    from transformers import LlamaConfig

    from specforge.export.to_sglang import export_to_sglang
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    legacy = load_checkpoint(legacy_dir)
    cfg_json = {**draft_config(legacy.config), **(config_edits or {})}
    gen = torch.Generator().manual_seed(SEED)
    cfg = LlamaConfig(**{k: v for k, v in cfg_json.items() if k not in ("architectures", "model_type")})
    cfg.architectures = cfg_json["architectures"]
    model = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or name.startswith("norm"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
        model.d2t.copy_(legacy.get("d2t"))
        model.t2d.copy_(legacy.get("t2d"))
    state = {k: v for k, v in model.state_dict().items() if "embed" not in k}  # SpecForge's checkpoint filter
    with tempfile.TemporaryDirectory(prefix="difftest-specforge-") as tmp:
        (Path(tmp) / "draft_config.json").write_text(json.dumps(cfg_json))
        torch.save({"draft_state_dict": state, "strategy": "eagle3", "global_step": 1}, Path(tmp) / "training_state.pt")
        if out.exists():
            shutil.rmtree(out)
        with contextlib.redirect_stdout(io.StringIO()):  # its config reader prints what it forces
            export_to_sglang(str(Path(tmp) / "training_state.pt"), str(Path(tmp) / "draft_config.json"), str(out))
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else TINY / "specforge"))
