"""SpecForge adapter: its own LlamaForCausalLMEagle3, loaded and unrolled the way SpecForge trains.

specforge 0.2.0 pins an older stack, but the pieces used here import cleanly beside sglang
0.5.23 (installed with --no-deps). The draft's config is read by `AutoDraftModelConfig.from_file`,
the model built by `AutoDraftModel.from_config` with the sdpa attention backend, the weights
loaded by `warm_start_draft_model` (SpecForge's own warm start: it refuses a tensor the draft has
no parameter for, and any missing one but the embedding) and the embedding by `load_embedding`
from the target. The forward is `OnlineEagle3Model`, the training-time-test unroll itself: its
first step is what serving's one EXTEND matches, and every step's `compute_logits` is a chain step.

SpecForge checkpoints are SGLang's legacy layout (`export/to_sglang.py` writes the identity map).
Its aux ids count like SGLang's: id i is decoder layer i's output, HF hidden_states[i + 1].
"""

from __future__ import annotations

import contextlib
import io
import time

import torch

from difftest.checkpoint import Checkpoint, CheckpointFormat
from difftest.engines.base import CapturePlan, ChainRun, EngineRun, LoadLedger, ParamFate, RunOptions, TensorFate
from difftest.engines.hooks import ProbeRecorder
from difftest.errors import InputError
from difftest.states import CapturedStates
from difftest.target import TargetWeights

# SpecForge trains with flex attention or flash attention on GPUs; sdpa is its backend that
# runs anywhere, and the one its tests compare the others against.
ATTENTION_BACKEND = "sdpa"
# specforge 0.2.0 pins torch 2.11 and sglang 0.5.14; the modules difftest runs import fine
# beside the pinned stack, so it goes in without its pins (the README's set-up commands do this).
INSTALL = ".venv/bin/pip install --no-deps specforge==0.2.0"
# SpecForge's draft defaults when the exported config does not say (llama3_eagle.py).
DEFAULT_AUX_IDS = "[1, N//2 - 1, N - 4] (algorithms/model_providers.py)"


@contextlib.contextmanager
def trainer_on(device: str):
    """What SpecForge needs to run off a GPU. Its loss is a Triton kernel (core/loss.py
    LogSoftmaxLoss) with no CPU driver: on CPU a plain log-softmax of the same math stands in for it
    (the loss never reaches the logits difftest records; the fixture's training run backpropagates it). Its rotary and norm helpers are torch.compile'd at
    import; eager runs them without a first-call compile (their outputs differ by 1e-7 in fp32)."""
    import specforge.algorithms.eagle3.model as trainer

    class _LossOffGPU:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return -(position_mask * target_p * logits.float().log_softmax(-1)).sum(-1).mean()

    original = trainer.LogSoftmaxLoss
    if not device.startswith("cuda"):
        trainer.LogSoftmaxLoss = _LossOffGPU
    try:
        with torch.compiler.set_stance("force_eager"):
            yield trainer
    finally:
        trainer.LogSoftmaxLoss = original


def _check_format(checkpoint: Checkpoint) -> None:
    if checkpoint.format is not CheckpointFormat.LEGACY:
        raise InputError(f"{checkpoint.path}: SpecForge reads the directory its export writes (SGLang's layout, "
                         "`midlayer.*`, architectures LlamaForCausalLMEagle3); this one is in speculators' format")


class SpecForgeAdapter:
    name = "specforge"
    # The config audit writes its variants in the layout this engine reads: its export's.
    checkpoint_layout = CheckpointFormat.LEGACY

    def deployment_plan(self, checkpoint, target, options):
        return None  # a training engine: it runs the checkpoint as trained, nothing is launched

    @staticmethod
    def start_early() -> None:
        """Its import, done while a serving engine's worker imports beside it."""
        try:
            import specforge.algorithms.eagle3.model  # noqa: F401
        except ImportError:
            pass  # run() says how to install it, as one line, when it is first needed

    @staticmethod
    def recognizes(checkpoint: Checkpoint) -> str | None:
        """SpecForge 0.2.0's export carries no provenance (to_sglang.py writes the draft config as
        transformers saves it): no directory says by itself that SpecForge trained it."""
        return None

    def capture_plan(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions) -> CapturePlan:
        """The layers SpecForge trains this draft on: its configured ids (model_providers reads
        eagle_config's), captured by SGLang's set_eagle3_layers_to_capture, which adds one."""
        _check_format(checkpoint)
        configured = (checkpoint.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        steps = [f"eagle_config.eagle_aux_hidden_state_layer_ids: {configured}"]
        if configured is None:
            n = target.num_layers
            configured = [1, n // 2 - 1, n - 4]
            steps = [f"no ids configured: SpecForge's default {DEFAULT_AUX_IDS} -> {configured}"]
        ids = [i + 1 for i in configured]
        steps.append(f"captured through SGLang's set_eagle3_layers_to_capture (id + 1): hidden_states{ids}")
        return CapturePlan(self.name, ids, True, "sglang (SpecForge's capture backend)", list(configured), steps)

    def _build(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions):
        from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
        from specforge.training.model_loading import warm_start_draft_model

        _check_format(checkpoint)
        try:
            # from_file prints what it forces (tie_word_embeddings off); the report says what was read.
            with contextlib.redirect_stdout(io.StringIO()):
                config = AutoDraftModelConfig.from_file(str(checkpoint.path / "config.json"))
            model = AutoDraftModel.from_config(config, attention_backend=ATTENTION_BACKEND)
            report = warm_start_draft_model(model, str(checkpoint.path), draft_config=config, strategy="eagle3",
                                            allow_missing_embedding=True)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{checkpoint.path}: SpecForge refuses it ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:300]})") from None
        model.load_embedding(str(target.path))
        return model.to(device=options.device, dtype=options.dtype).eval(), report

    def run(self, checkpoint: Checkpoint, target: TargetWeights, states: CapturedStates, options: RunOptions,
            chain_steps: int = 0, chain_states: CapturedStates | None = None) -> EngineRun:
        # The training side drafts from the training states; chain_states are a serving notion.
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            import specforge.algorithms.eagle3.model  # noqa: F401
        except ImportError as exc:
            raise InputError(f"SpecForge cannot be imported ({exc}); install it beside difftest with: "
                             f"{INSTALL}") from None

        timings["import"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, report = self._build(checkpoint, target, options)
        timings["load"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        probes, step_drafts = self._forward(model, states, options, max(chain_steps, 1))
        timings["forward"] = time.perf_counter() - t0
        details = {"module_graph": [f"{n}:{type(m).__name__}" for n, m in model.named_modules()],
                   "attn_implementation": ATTENTION_BACKEND, "norm_output": bool(model.norm_output),
                   "warm_start": {"loaded_keys": report.loaded_keys, "missing_keys": list(report.missing_keys)}}
        chain = None
        if chain_steps > 0:
            draft = torch.stack(step_drafts, dim=1)
            chain = ChainRun(self.name, draft + model.d2t.cpu()[draft], draft, {"chain": timings["forward"]})
        return EngineRun(engine=self.name, probes=probes, timings_s=timings, details=details,
                         ledger=self._ledger(model, checkpoint, report), chain=chain)

    @staticmethod
    def _ledger(model, checkpoint: Checkpoint, report) -> LoadLedger:
        """warm_start_draft_model loads by name (load_state_dict, strict about unexpected keys):
        every checkpoint tensor it kept is a parameter or buffer of the same name."""
        ledger = LoadLedger()
        state = model.state_dict()
        for name in checkpoint.tensor_names():
            ledger.tensors[name] = (TensorFate.CONSUMED, [name], "") if name in state else (
                TensorFate.DROPPED, [], "no such key in LlamaForCausalLMEagle3")
        stored = set(checkpoint.tensor_names())
        for key, _ in model.named_parameters():
            if key in stored:
                ledger.params[key] = (ParamFate.WRITTEN, "")
            elif key == "embed_tokens.weight":
                ledger.params[key] = (ParamFate.SHARED, "load_embedding: the target's model.embed_tokens.weight")
            else:
                ledger.params[key] = (ParamFate.INIT, "not in the checkpoint")
        if checkpoint.has("d2t"):
            ledger.token_map_writers.append("d2t")
        return ledger

    @staticmethod
    def _batch(states: CapturedStates, options: RunOptions):
        """SpecForge's batch layout: one request per row, right-padded, an attention mask over the
        real tokens, positions from 0 in each row (OnlineEagle3Model's default position ids)."""
        lens = [int(n) for n in states.seq_lens.tolist()]
        T = max(lens)
        valid = torch.zeros(len(lens), T, dtype=torch.bool)
        for r, n in enumerate(lens):
            valid[r, :n] = True
        ids = torch.zeros(len(lens), T, dtype=torch.long)
        ids[valid] = states.input_ids.long()
        hidden = torch.zeros(len(lens), T, states.aux_hidden_states.shape[-1])
        hidden[valid] = states.aux_hidden_states.float()
        return ids, hidden.to(options.dtype), valid

    @torch.no_grad()
    def _forward(self, model, states: CapturedStates, options: RunOptions, steps: int):
        """Probes of the unroll's first step (hooks keep a module's first call) and every step's draft
        token, from OnlineEagle3Model.forward itself."""
        device = options.device
        ids, hidden, valid = self._batch(states, options)
        p = ProbeRecorder()
        layer0 = model.midlayer
        p.output(model.embed_tokens, "embed")
        p.input(model.fc, "fc.input")
        p.output(model.fc, "fc.output")
        p.output(layer0.input_layernorm, "layer0.embed_norm")
        p.output(layer0.hidden_norm, "layer0.hidden_norm")
        p.output(layer0.self_attn, "layer0.attn_output")
        # The residual stream after attention is exactly what post_attention_layernorm reads.
        p.input(layer0.post_attention_layernorm, "layer0.post_attn_residual")
        p.output(layer0.mlp, "layer0.mlp_output")
        p.output(layer0, "layer0.output")
        p.output(model.norm, "final_norm")
        p.output(model.lm_head, "logits")
        # OnlineEagle3Model hands the next step the midlayer's output as it is (model.py:
        # `hidden_states = hidden_states_out`), whatever norm_output says.
        p.output(layer0, "next_step_hidden")
        step_logits: list[torch.Tensor] = []
        hook = model.lm_head.register_forward_hook(lambda _m, _a, out: step_logits.append(out.detach()))
        mask = valid.to(device)
        # The teacher only enters the loss and the accuracy metric, never the logits: a zero target
        # (through the compact path, so no [rows, vocab] tensor is built) is enough to run the unroll.
        target_hidden = torch.zeros(*ids.shape, model.config.hidden_size, dtype=options.dtype, device=device)
        head = torch.zeros(model.vocab_size, model.config.hidden_size, dtype=options.dtype, device=device)
        try:
            with trainer_on(device) as trainer:
                unroll = trainer.OnlineEagle3Model(model, length=steps, attention_backend=ATTENTION_BACKEND)
                unroll(input_ids=ids.to(device), attention_mask=mask, target=None, loss_mask=mask[..., None].float(),
                       hidden_states=hidden.to(device), target_hidden_for_compact=target_hidden,
                       target_head_weight=head)
        finally:
            p.remove()
            hook.remove()
        values = {name: t[valid] for name, t in p.values.items()}
        drafts = [logits.argmax(dim=-1).cpu()[valid] for logits in step_logits]
        values["draft_token"] = drafts[0]
        # SpecForge's d2t is an offset, as SGLang's: target = draft + d2t[draft] (preprocessing.py).
        values["target_token"] = drafts[0] + model.d2t.cpu()[drafts[0]]
        return values, drafts
