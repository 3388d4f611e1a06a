"""speculators adapter: its own Eagle3DraftModel, loaded the way speculators loads a draft.

`Eagle3SpeculatorConfig.from_pretrained`, the attention implementation set on the layer
config before construction (it is not stored in config.json; see speculators' train/cli.py),
`Eagle3DraftModel.from_pretrained`, then `load_verifier_weights()` for what the checkpoint
does not carry (verifier_norm, verifier_lm_head, and embed/lm_head when absent).
One test-time-training step is the training-time forward that serving's one EXTEND matches.
"""

from __future__ import annotations

import json
import tempfile
import warnings
import time
from pathlib import Path

import torch

from difftest.checkpoint import Checkpoint, CheckpointFormat
from difftest.convert import legacy_to_speculators
from difftest.engines.base import CapturePlan, ChainRun, EngineRun, LoadLedger, ParamFate, RunOptions, TensorFate
from difftest.engines.hooks import ProbeRecorder
from difftest.states import CapturedStates
from difftest.target import TargetWeights

# Training runs flex attention on GPUs. On CPU, sdpa: flex compiles its kernels on first
# use (tens of seconds there) and has no CPU backward, and sdpa's probes and chains are
# the flex kernels' own in fp32 (tests/test_engines.py runs both on CPU to hold it so).
ATTN_IMPL = {"cpu": "sdpa", "cuda": "simple_flex_attention"}
# Flex attention's block masks cover whole 128-token blocks, and speculators extends them
# block-wise for each TTT step; its collator pads every batch to max_len for this. The
# packed states are padded the same way (document id -1, which its mask excludes).
FLEX_BLOCK = 128


def _all_nan(t: torch.Tensor) -> bool:
    # The first element settles almost every tensor without a pass over all of it.
    return t.is_floating_point() and t.numel() > 0 and bool(t.view(-1)[0].isnan()) and bool(t.isnan().all())


# Draft flags of speculators' Eagle3 model that SpecForge's LlamaForCausalLMEagle3 has no
# notion of: a legacy directory that carries them was converted from a speculators draft.
SPECULATORS_ONLY_FIELDS = ("norm_before_fc", "norm_before_residual")


class SpeculatorsAdapter:
    name = "speculators"
    # The config audit writes its variants in the layout this engine reads (a legacy directory
    # is converted first, as this adapter converts it to run it).
    checkpoint_layout = CheckpointFormat.SPECULATORS

    @staticmethod
    def start_early() -> None:
        """Its import (about 3 s), done while a serving engine's worker imports beside it."""
        import speculators.models.eagle3  # noqa: F401

    @staticmethod
    def recognizes(checkpoint: Checkpoint) -> str | None:
        """Why `checkpoint` is a speculators draft, or None when the directory does not say."""
        if checkpoint.format is CheckpointFormat.SPECULATORS:
            return "speculators' format"
        fields = [f for f in SPECULATORS_ONLY_FIELDS if f in checkpoint.config]
        if fields:
            return f"SGLang's layout carrying {', '.join(fields)}, fields only speculators' draft has"
        return None

    def deployment_plan(self, checkpoint, target, options):
        return None  # a training engine: it runs the checkpoint as trained, nothing is launched

    def capture_plan(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions) -> CapturePlan:
        """The layers speculators' datagen captures for this draft: its own resolution of the
        configured ids against the verifier, indexed straight into HF hidden_states."""
        from speculators.models.utils import resolve_target_layer_ids

        with tempfile.TemporaryDirectory(prefix="difftest-spec-") as tmp:
            config = checkpoint.config
            if checkpoint.format is CheckpointFormat.LEGACY:
                legacy_to_speculators(checkpoint, Path(tmp) / "s", verifier_path=str(target.path))
                config = json.loads((Path(tmp) / "s" / "config.json").read_text())
        configured = config.get("eagle_aux_hidden_state_layer_ids")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its "using default ids" warning; the plan records it
            ids = resolve_target_layer_ids(configured, str(target.path))
        return CapturePlan(self.name, list(ids), True, "transformers " + ",".join(target.config.get("architectures") or []),
                           configured, [f"resolve_target_layer_ids({configured}) -> {list(ids)}",
                                        "datagen reads hidden_states[id] for each id (no shift)"])

    def _build(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions):
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

        with tempfile.TemporaryDirectory(prefix="difftest-spec-") as tmp:
            src = checkpoint.path
            if checkpoint.format is CheckpointFormat.LEGACY:
                # speculators only reads its own format; convert into a scratch copy, never in place.
                src = Path(tmp) / "speculators"
                legacy_to_speculators(checkpoint, src, verifier_path=str(target.path))
            config = Eagle3SpeculatorConfig.from_pretrained(str(src))
            config.transformer_layer_config._attn_implementation = ATTN_IMPL.get(options.device.split(":")[0], "sdpa")
            config.speculators_config.verifier.name_or_path = str(target.path)
            # Loaded at the stored dtype and cast afterwards, parameter by parameter: from_pretrained
            # holds about two copies while it loads, so loading a bf16 draft straight into fp32
            # peaks at twice the fp32 model (measured at the 8B shape: 9.8 GiB against 8.5).
            model = Eagle3DraftModel.from_pretrained(str(src), config=config)
        self._mark_unloaded(model, checkpoint)
        # speculators initializes embed/lm_head to NaN; whatever is still NaN now is what
        # load_verifier_weights will fill from the target.
        nan_before_verifier = {n for n, t in model.state_dict().items() if _all_nan(t)}
        model.load_verifier_weights()
        state = model.state_dict()
        nan_before_verifier = {n for n in nan_before_verifier if not _all_nan(state[n])}  # what it filled
        self._share_target_embed(model, target, options, nan_before_verifier)
        model = model.to(device=options.device, dtype=options.dtype).eval()
        stored = checkpoint.stored_dtype()
        if any(p.dtype != stored for p in model.parameters()):
            self._release_checkpoint_file(model)
        return model, config, nan_before_verifier

    @staticmethod
    def _mark_unloaded(model, checkpoint: Checkpoint) -> None:
        """speculators marks a weight not yet loaded with NaN (its __init__), and
        load_verifier_weights fills a head or embedding that still has one. Under transformers
        5's from_pretrained a key missing from the checkpoint is materialized from empty memory
        instead, so whether a draft saved without lm_head gets the verifier's rows depended on
        whether that memory happened to hold a NaN (seen both ways within one process). Putting
        speculators' own marker back makes its documented behaviour the one that runs, every time."""
        from difftest.convert import speculators_name

        stored = {speculators_name(n) for n in checkpoint.tensor_names()}
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name not in stored and not name.startswith("verifier_") and param.is_floating_point():
                    param.fill_(float("nan"))

    @staticmethod
    def _release_checkpoint_file(model) -> None:
        """from_pretrained maps the weights straight from the checkpoint file. After a cast the
        parameters are copies, but the integer buffers (d2t, t2d) are not cast and keep the
        whole mapping, and every page the load touched, resident (1.7 GiB at the 8B shape).
        Copies of those few buffers let it go."""
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[key] = buf.clone()

    @staticmethod
    def _share_target_embed(model, target: TargetWeights, options: RunOptions, from_verifier: set[str]) -> None:
        """A checkpoint without embed_tokens gets the verifier's from load_verifier_weights, a
        second copy of a tensor difftest already holds: point the parameter at the target's
        own (same file, same values) instead. A checkpoint that ships its own embedding keeps
        it: that is what training used, and whether it matches the target is for the probes."""
        if "embed_tokens.weight" not in from_verifier:
            return
        shared = target.shared("embed", options.device, options.dtype)
        if shared.shape != model.embed_tokens.weight.shape or not torch.equal(shared, model.embed_tokens.weight.to(shared)):
            return  # not the same tensor after all; keep what speculators loaded
        model.embed_tokens.weight = shared

    def run(self, checkpoint: Checkpoint, target: TargetWeights, states: CapturedStates, options: RunOptions,
            chain_steps: int = 0, chain_states: CapturedStates | None = None) -> EngineRun:
        # The training side drafts from the training states; chain_states are a serving notion.
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        import speculators.models.eagle3  # noqa: F401

        timings["import"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, config, nan_before_verifier = self._build(checkpoint, target, options)
        timings["load"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        probes, draft_steps = self._forward(model, states, options, max(chain_steps, 1))
        timings["forward"] = time.perf_counter() - t0
        details = {
            "module_graph": [f"{n}:{type(m).__name__}" for n, m in model.named_modules()],
            "attn_implementation": config.transformer_layer_config._attn_implementation,
            "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids or []),
        }
        missing = self._unmapped(checkpoint, model)
        for name in missing:
            probes.pop(name, None)
        chain = self._chain(model, checkpoint, draft_steps, timings["forward"]) if chain_steps > 0 else None
        return EngineRun(engine=self.name, probes=probes, missing=missing, timings_s=timings, details=details,
                         ledger=self._ledger(model, checkpoint, nan_before_verifier), chain=chain)

    def _chain(self, model, checkpoint: Checkpoint, draft_steps, seconds: float) -> ChainRun:
        """speculators' own test-time-training unroll, `steps` TTT steps over the packed rows
        (the probes' forward was that unroll: its first step is the one-step forward).
        Step j at row t reads the recorded token t+j (teacher forcing) and its own previous
        hidden state; on the accepted path that token is the draft's own previous guess."""
        draft = torch.stack([d[0].cpu() for d in draft_steps], dim=1)
        notes = []
        if model.d2t is not None and checkpoint.has("d2t"):
            tokens = draft + model.d2t.cpu()[draft]
        else:
            tokens = draft.clone()
            if model.d2t is not None:
                notes.append("no d2t in the checkpoint: draft ids taken as target ids")
        return ChainRun(self.name, tokens, draft, {"chain": seconds}, notes)

    @staticmethod
    def _ledger(model, checkpoint: Checkpoint, from_verifier: set[str]) -> LoadLedger:
        from difftest.convert import speculators_name

        ledger = LoadLedger()
        state = model.state_dict()
        for name in checkpoint.tensor_names():
            key = speculators_name(name)
            if key in state:
                fate = TensorFate.CONSUMED if key == name else TensorFate.RENAMED
                ledger.tensors[name] = (fate, [key], "" if key == name else "renamed by difftest's legacy->speculators converter")
            else:
                ledger.tensors[name] = (TensorFate.DROPPED, [], "no such key in Eagle3DraftModel")
        ckpt_keys = {speculators_name(n) for n in checkpoint.tensor_names()}
        for key in state:
            if key in ckpt_keys:
                ledger.params[key] = (ParamFate.WRITTEN, "")
            elif key in from_verifier or key.startswith("verifier_"):
                ledger.params[key] = (ParamFate.SHARED, "load_verifier_weights (lm_head: the verifier head's t2d rows)")
            else:
                ledger.params[key] = (ParamFate.INIT, "not in the checkpoint")
        return ledger

    @staticmethod
    def _inputs(states: CapturedStates, options: RunOptions, attn_impl: str) -> dict:
        device, dtype = options.device, options.dtype
        lens = [int(n) for n in states.seq_lens.tolist()]
        pad = (-states.num_tokens) % FLEX_BLOCK if attn_impl == "simple_flex_attention" else 0
        doc_ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lens)] + [torch.full((pad,), -1)])
        # Per-request positions from 0, as SGLang serves them; speculators' own default
        # (1 + arange over the packed batch) differs only by a RoPE shift inside a document.
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lens] + [torch.zeros(pad, dtype=torch.long)])
        hidden = torch.nn.functional.pad(states.aux_hidden_states, (0, 0, 0, pad))
        ids = torch.nn.functional.pad(states.input_ids, (0, pad))
        return {"hidden_states": hidden.to(device=device, dtype=dtype)[None],
                "input_ids": ids.to(device)[None], "document_ids": doc_ids.to(device)[None],
                "position_ids": positions.to(device)[None]}

    @torch.no_grad()
    def _forward(self, model, states: CapturedStates, options: RunOptions, ttt_steps: int):
        """Probes of the first TTT step (hooks keep a module's first call) and every step's draft."""
        T = states.num_tokens
        p = ProbeRecorder(drop_batch_dim=True, rows=T)  # padding rows (flex) are not probes
        layer0 = model.layers[0]
        p.output(model.embed_tokens, "embed")
        p.input(model.fc, "fc.input")
        p.output(model.fc, "fc.output")
        p.output(layer0.input_layernorm, "layer0.embed_norm")
        p.output(layer0.hidden_norm, "layer0.hidden_norm")
        p.output(layer0.self_attn, "layer0.attn_output", pick=lambda o: o[0])
        # The residual stream after attention is exactly what post_attention_layernorm reads.
        p.input(layer0.post_attention_layernorm, "layer0.post_attn_residual")
        p.output(layer0.mlp, "layer0.mlp_output")
        p.output(layer0, "layer0.output")
        p.output(model.norm, "final_norm")
        p.output(model.lm_head, "logits")
        # The next TTT step starts from the last layer's output, normed first under norm_output
        # (Eagle3DraftModel.forward: `if self.config.norm_output: hidden_states = self.norm(...)`).
        p.output(model.norm if model.config.norm_output else model.layers[-1], "next_step_hidden")
        try:
            inputs = self._inputs(states, options, model.config.transformer_layer_config._attn_implementation)
            draft_tokens = [d[:, :T] for d in model(**inputs, ttt_steps=ttt_steps)]
        finally:
            p.remove()
        values = p.values
        draft = draft_tokens[0][0].cpu()
        values["draft_token"] = draft
        # speculators stores d2t as offsets: target = draft + d2t[draft] (its xpress model does the same).
        values["target_token"] = draft + model.d2t.cpu()[draft] if model.d2t is not None else draft.clone()
        return values, draft_tokens

    @staticmethod
    def _unmapped(checkpoint: Checkpoint, model) -> dict[str, str]:
        # With no d2t in the checkpoint, speculators keeps the buffer transformers materialized
        # for the missing key: uninitialized memory, so its target ids are not reproducible.
        if model.d2t is not None and not checkpoint.has("d2t"):
            return {"target_token": "speculators' d2t buffer is uninitialized memory: the checkpoint has no d2t"}
        return {}
