"""The SpecForge fixture: a draft on the default fixture's SmolLM2 target, trained by SpecForge's own
trainer on the default fixture's conversations.

Steps, each cached under .cache/difftest/smollm2/specforge with checksums (after the default
fixture's own steps, whose target and conversations it reads):
  features  the training conversations through the target, written in SpecForge's offline layout
            (what its runtime/data_plane/offline_reader.py and algorithms/eagle3/data.py read)
  train     `specforge train` itself, offline, in one process: its config schema, its feature
            reader, its vocab mapping (from the features), its Eagle3 strategy, its optimizer
  export    `specforge export --to sglang`: the directory a SpecForge user serves

The trainer runs on CPU with what CPU forces and nothing else changed (`run_config`). Training
takes minutes here, so its result ships in fixtures/smollm2-specforge/ with a manifest of
checksums, and a first run verifies and uses it. `difftest build-fixtures specforge
--from-scratch` runs every step for real, and `--ship` writes its result back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from difftest.fixturegen import smollm2

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "smollm2-specforge"
EPOCHS_ENV = "DIFFTEST_SPECFORGE_EPOCHS"
# As many passes as the speculators draft gets (smollm2.DEFAULT_EPOCHS): SpecForge's own default is
# one epoch, sized for datasets far larger than 144 conversations.
DEFAULT_EPOCHS = 10
# SpecForge's eagle3 default draft vocab is 32000 (algorithms/eagle3/providers.py); the speculators
# draft on the same target has 8192, and the two fixtures are compared side by side.
DRAFT_VOCAB = smollm2.DRAFT_VOCAB
# SpecForge's default aux ids for a 30-layer target, [1, N//2 - 1, N - 4] (model_providers.py),
# written into the config as SpecForge's own example configs do, so no engine falls back to a default.
AUX_IDS = [1, 14, 26]
RUN_ID = "smollm2-specforge"


@dataclass
class Paths:
    root: Path  # .cache/difftest/smollm2/specforge

    @property
    def fixture(self) -> smollm2.Paths: return smollm2.Paths(self.root.parent)
    @property
    def features(self) -> Path: return self.root / "features"
    @property
    def target_view(self) -> Path: return self.root / "target-view"
    @property
    def run_dir(self) -> Path: return self.root / "train_run"
    @property
    def draft(self) -> Path: return self.root / "draft"
    @property
    def states(self) -> Path: return self.root / "states.safetensors"  # found as ../states.safetensors from draft/
    @property
    def launch(self) -> Path: return self.root / smollm2.LAUNCH_FILE  # serves draft/ as exported


def epochs() -> int:
    return int(os.environ.get(EPOCHS_ENV, DEFAULT_EPOCHS))


def draft_config(target_config: dict) -> dict:
    """What SpecForge derives from the target for an eagle3 draft (training/model_loading.py
    _generate_draft_config: the target's architecture fields, one layer, untied), with the draft
    vocab and aux ids said explicitly."""
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "vocab_size")
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "tie_word_embeddings": False, "use_cache": True, "pad_token_id": 0,
            **{k: target_config[k] for k in fields if k in target_config},
            "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": target_config["hidden_size"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS}}


@torch.no_grad()
def features(p: Paths, progress: Callable[[int, int], None]) -> dict:
    """The training conversations in SpecForge's offline layout: per conversation a torch.save'd dict
    of input_ids [T], loss_mask [T], aux_hidden_state [1, T, 3H] (its ids' layers, low to high) and
    hidden_state [1, T, H], the target's final-norm output that its TargetHead turns into the teacher.
    SpecForge id i is layer i's output, HF hidden_states[i + 1]."""
    from difftest.fixturegen.capture import capture_states

    convs = json.loads(p.fixture.conversations.read_text())
    n_train = int(len(convs) * smollm2.TRAIN_RATIO)
    model, _ = smollm2.load_target_model(p.fixture)
    tmp = p.features.with_name("features.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    rows = tmp / f"rows_0-{n_train}"
    rows.mkdir(parents=True)
    for i in range(n_train):
        st = capture_states(model, [convs[i]["input_ids"]], [k + 1 for k in AUX_IDS])
        # SpecForge's model and TargetHead run in bf16 (model.torch_dtype, target_head.py), and its
        # fc does not cast its input: the features are stored the way they are read.
        torch.save({"input_ids": st.input_ids, "loss_mask": torch.tensor(convs[i]["loss_mask"], dtype=torch.long),
                    "aux_hidden_state": st.aux_hidden_states[None].to(torch.bfloat16).contiguous(),
                    "hidden_state": model.model.norm(st.verifier_last_hidden_states)[None].to(torch.bfloat16).contiguous()},
                   rows / f"data_{i}.ckpt")
        if i % 16 == 0 or i == n_train - 1:
            progress(i + 1, n_train)
    shutil.rmtree(p.features, ignore_errors=True)
    tmp.rename(p.features)
    return {"conversations": n_train, "aux_ids": AUX_IDS, "hf_layers": [k + 1 for k in AUX_IDS]}


def _target_view(p: Paths) -> None:
    """SpecForge's TargetHead finds the head through a *.index.json beside the weights
    (target_head.py); the fixture's target is one unsharded file. A view of links and an index,
    so the target itself is never written."""
    target = p.fixture.target
    shutil.rmtree(p.target_view, ignore_errors=True)
    p.target_view.mkdir(parents=True)
    for f in target.iterdir():
        os.symlink(f.resolve(), p.target_view / f.name)
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (p.target_view / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))


def run_config(p: Paths, n_epochs: int) -> dict:
    """`specforge train`'s config. What CPU forces: sdpa attention (flex has no CPU backward), DDP
    instead of FSDP (FSDP refuses a CPU device). SmolLM2 ties its head to the embedding, which
    SpecForge reads through lm_head_key. Everything else is SpecForge's default."""
    return {
        "model": {"target_model_path": str(p.target_view), "draft_model_config": str(p.root / "draft_config.json"),
                  "lm_head_key": "model.embed_tokens.weight", "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(p.features), "max_length": 2048, "cache_dir": str(p.root / "sf-cache")},
        "training": {"strategy": "eagle3", "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD",
                     "num_epochs": n_epochs, "log_interval": 16},
        "output_dir": str(p.run_dir), "run_id": RUN_ID,
    }


def train(p: Paths, progress: Callable[[float, float, str], None]) -> dict:
    import yaml

    n_epochs = epochs()
    _target_view(p)
    target_config = json.loads((p.fixture.target / "config.json").read_text())
    (p.root / "draft_config.json").write_text(json.dumps(draft_config(target_config), indent=2) + "\n")
    config = run_config(p, n_epochs)
    (p.root / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.rmtree(p.run_dir, ignore_errors=True)
    shutil.rmtree(p.root / "sf-cache", ignore_errors=True)
    cmd = [sys.executable, "-W", "ignore", "-m", "difftest.fixturegen.specforge_train_cpu", "train", "--config",
           str(p.root / "run.yaml")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=smollm2.single_process_env())
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-60:]
        if "epoch" in line.lower():
            progress(0, n_epochs, line.strip()[-80:])
    if proc.wait() != 0:
        raise RuntimeError("SpecForge's trainer failed:\n" + "\n".join(tail))
    final = final_checkpoint(p)
    return {"epochs": n_epochs, "config": config, "final_checkpoint": final.name, "last_logged": last_logged(tail)}


def last_logged(lines: list[str]) -> dict:
    """The trainer's last logged step ("step N: {...}"): its accuracy per TTT step on the last
    training batches, SpecForge's own figures (noisy: a few batches, not a held-out set)."""
    import ast

    for line in reversed(lines):
        head, _, body = line.partition(": ")
        if head.startswith("step ") and body.startswith("{"):
            logged = ast.literal_eval(body)
            return {"step": int(head.split()[1]), **{k: round(v, 4) for k, v in logged.items()
                                                      if k.startswith(("acc_", "ploss_0")) or k == "acceptance_rate"}}
    return {}


def final_checkpoint(p: Paths) -> Path:
    steps = sorted((d for d in p.run_dir.glob(f"{RUN_ID}-step*") if (d / "training_state.pt").is_file()),
                   key=lambda d: int(d.name.rsplit("step", 1)[1]))
    if not steps:
        raise RuntimeError(f"SpecForge's trainer wrote no checkpoint under {p.run_dir}")
    return steps[-1]


def export(p: Paths) -> dict:
    """`specforge export --to sglang` on the final checkpoint, then the default fixture's held-out
    states beside it (the same layers: SpecForge's ids plus one are speculators' default ids)."""
    tmp = p.draft.with_name("draft.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "specforge.cli", "export", "--to", "sglang",
                           "--checkpoint", str(final_checkpoint(p)), "--draft-config", str(p.root / "draft_config.json"),
                           "--output-dir", str(tmp)], capture_output=True, text=True, env=smollm2.single_process_env())
    if proc.returncode != 0:
        raise RuntimeError("SpecForge's exporter failed:\n" + proc.stdout[-2000:] + proc.stderr[-2000:])
    shutil.rmtree(p.draft, ignore_errors=True)
    tmp.rename(p.draft)
    _beside_the_draft(p)
    return {"files": sorted(f.name for f in p.draft.iterdir())}


def _beside_the_draft(p: Paths) -> None:
    """The default fixture's held-out states (SpecForge's ids plus one are speculators' default
    ids: the same layers), and the command a SpecForge user serves the export with: SGLang reads
    the exported directory as it is, at the dtype the exporter wrote."""
    from difftest.convert import launch_command

    shutil.copyfile(p.fixture.states, p.states)
    p.launch.write_text(" ".join(launch_command(p.draft.name, "../target", torch.bfloat16)) + "\n")


def shipped_manifest(from_scratch: bool = False) -> dict | None:
    path = SHIPPED_DIR / "manifest.json"
    if from_scratch or not path.is_file():
        return None
    return json.loads(path.read_text())


def restore(p: Paths, manifest: dict) -> dict:
    """The exported directory as shipped, each file checked against the manifest."""
    tmp = p.draft.with_name("draft.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, sha in manifest["files"].items():
        shutil.copyfile(smollm2.verified(SHIPPED_DIR / name, sha, SHIPPED_DIR / "manifest.json", "specforge"), tmp / name)
    shutil.rmtree(p.draft, ignore_errors=True)
    tmp.rename(p.draft)
    _beside_the_draft(p)
    return {"shipped": True, "trained": manifest["training"]}


def _file_hashes(directory: Path) -> dict[str, str]:
    return {f.name: smollm2.file_sha256(f) for f in sorted(directory.iterdir())}


def matches_shipped(p: Paths) -> bool | None:
    """Whether a build's export is the shipped one, file for file (None: nothing shipped)."""
    manifest = shipped_manifest()
    if manifest is None:
        return None
    return _file_hashes(p.draft) == manifest["files"]


def ship(p: Paths) -> Path:
    record = json.loads((p.root / f"train-e{epochs()}.done.json").read_text())
    tmp = SHIPPED_DIR.with_name("smollm2-specforge.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(p.draft, tmp)
    manifest = {
        "about": "The SpecForge fixture's trained draft, as built by `difftest build-fixtures specforge --from-scratch "
                 "--ship`: SpecForge 0.2.0's own trainer on the default fixture's training conversations, exported "
                 "by its own `export --to sglang`.",
        "files": _file_hashes(tmp),
        "training": {"epochs": record["epochs"], "seconds": record["seconds"],
                     "config": json.loads(json.dumps(record["config"]).replace(str(p.root), "$CACHE")),
                     "last_logged": record["last_logged"]},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(SHIPPED_DIR, ignore_errors=True)
    tmp.rename(SHIPPED_DIR)
    return SHIPPED_DIR


def plan(p: Paths, from_scratch: bool = False) -> list[smollm2.BuildStep]:
    manifest = shipped_manifest(from_scratch)
    if manifest is not None:
        sha = manifest["files"]["model.safetensors"][:12]
        return [smollm2.BuildStep(f"draft-shipped-{sha}", "SpecForge draft: shipped, checksums verified", 2,
                                  [p.draft, p.states, p.launch], lambda say: restore(p, manifest))]
    n = epochs()
    return [
        smollm2.BuildStep("features", "SpecForge features: the training conversations through the target", 60,
                          [p.features], lambda say: features(p, lambda a, b: say(a, b, f"{a}/{b} conversations"))),
        smollm2.BuildStep(f"train-e{n}", f"train: `specforge train`, {n} epochs", 40 * n + 30, [p.run_dir],
                          lambda say: train(p, say)),
        smollm2.BuildStep("export", "export: `specforge export --to sglang`", 15, [p.draft, p.states, p.launch],
                          lambda say: export(p)),
    ]


def build(tracker=None, from_scratch: bool = False) -> Paths:
    """The default fixture first (its target, conversations and held-out states), then this one.
    from_scratch: train and export instead of restoring the shipped draft."""
    from difftest.fixturegen.default import default_fixture

    fx = default_fixture(progress=tracker is None, tracker=tracker)
    p = Paths(fx.target.parent / "specforge")
    p.root.mkdir(parents=True, exist_ok=True)
    smollm2.run_steps(p.root, plan(p, from_scratch), tracker)
    return p
