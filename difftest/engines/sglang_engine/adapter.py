"""SGLang adapter: its own LlamaForCausalLMEagle3, its own load_weights, its own forward.

The model is built from the Llama config a user must write to serve the checkpoint on
SGLang, loaded through `load_weights` (which skips names it doesn't know without a word,
so every weight_loader call is recorded), given the target's embedding the way the EAGLE
worker's `init_lm_head` does, and run once over a real ForwardBatch.

The forward mode is DRAFT_EXTEND_V2, the EAGLE v2 worker's own draft-extend mode: same
model and attention path as EXTEND, but its LogitsProcessor keeps every row, so logits
for all positions come from SGLang's code rather than from a copy of its lm_head math.
"""

from __future__ import annotations

import contextlib
import copy
import time
import types
from dataclasses import replace
from types import SimpleNamespace

import torch

from difftest.checkpoint import Checkpoint, CheckpointFormat
from difftest.convert import legacy_config, legacy_name
from difftest.engines.base import (CapturePlan, ChainRun, EngineRun, TargetCapture, LoadLedger, ParamFate, RunOptions,
                                   TensorFate, apply_config_edits, launch_arguments, renamed)
from difftest.errors import InputError
from difftest.engines.hooks import ProbeRecorder
from difftest.engines.sglang_engine.runtime import ensure_runtime
from difftest.states import CapturedStates
from difftest.target import TargetWeights


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


@contextlib.contextmanager
def _without_cache_flush(device: str):
    """set_embed and set_embed_and_head end with the platform's empty_cache, which on CPU is a
    full gc.collect (about 0.9 s with both engines imported): a server pays it once at start,
    difftest once per model it builds, the config audit's variants included. It frees
    memory and computes nothing, so on CPU it is skipped while the weights are shared."""
    if not device.startswith("cpu"):
        yield
        return
    from sglang.srt.platforms import current_platform

    flush = current_platform.empty_cache
    current_platform.empty_cache = lambda: None
    try:
        yield
    finally:
        current_platform.empty_cache = flush


@contextlib.contextmanager
def _loader_bars_follow_tqdm_disable():
    """SGLang's weight iterators pass tqdm an explicit disable= (rank 0 shows the bar), which
    outranks TQDM_DISABLE; difftest's own display sets that variable and owns the terminal."""
    import os

    from sglang.srt.model_loader import weight_utils

    shown = weight_utils.tqdm
    if os.environ.get("TQDM_DISABLE") in ("1", "true", "True"):
        def hidden(*args, **kwargs):
            return shown(*args, **{**kwargs, "disable": True})

        hidden._get_free_pos = shown._get_free_pos
        weight_utils.tqdm = hidden
    try:
        yield
    finally:
        weight_utils.tqdm = shown


@contextlib.contextmanager
def _draft_spec(window: int | None):
    """LlamaForCausalLMEagle3.__init__ reads --speculative-draft-window-size from the
    published server args; hand it this launch's value without publishing a speculative
    config process-wide (other models in this process must not see it)."""
    from sglang.srt.models import llama_eagle3

    published = llama_eagle3.get_spec
    llama_eagle3.get_spec = lambda: SimpleNamespace(speculative_draft_window_size=window)
    try:
        yield
    finally:
        llama_eagle3.get_spec = published


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def serving_config(checkpoint: Checkpoint, options: RunOptions | None = None) -> tuple[dict, dict[str, str]]:
    """The legacy/SGLang config for this checkpoint, plus notes on fields that didn't carry."""
    if checkpoint.format is CheckpointFormat.LEGACY:
        cfg, notes = copy.deepcopy(checkpoint.config), {}
    else:
        conv = legacy_config(checkpoint.config)
        cfg, notes = conv.config, conv.notes
    if options is not None:
        notes.update(apply_config_edits(cfg, options.serving.config_edits))
    return cfg, notes


def write_served_copy(checkpoint: Checkpoint, out: "Path", options: RunOptions) -> dict[str, str]:
    """The served directory difftest's converter makes for this checkpoint, with the serving
    setup's edits (a fault's config edit or key rename) applied. The config is the converter's.
    Weights keep their stored names unless a rename is asked for: SGLang's load_weights maps
    `layers.0.` and `midlayer.` onto the same parameters, so the files are linked, not copied
    (at real shapes a copy is gigabytes); a rename writes the renamed tensors."""
    import json
    import os

    from difftest.convert import DTYPE_FLAG

    cfg, notes = serving_config(checkpoint, options)
    cfg.setdefault("torch_dtype", DTYPE_FLAG.get(checkpoint.stored_dtype(), "float32"))
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    if options.serving.key_renames:
        from safetensors.torch import save_file

        save_file({served: tensor.contiguous() for served, _, tensor in
                   serving_tensors(checkpoint, options.serving.key_renames)}, str(out / "model.safetensors"))
    else:
        for f in checkpoint.weight_files():
            os.symlink(f.resolve(), out / f.name)  # read only: the loader never opens weights for writing
    return notes


def serving_tensors(checkpoint: Checkpoint, renames: tuple[tuple[str, str], ...] = ()):
    rename = checkpoint.format is CheckpointFormat.SPECULATORS
    for name, tensor in checkpoint.tensors():
        served = renamed(name, renames)
        yield (legacy_name(served) if rename else served), name, tensor


class _LoadRecorder:
    """Wraps every parameter's weight_loader to see which checkpoint names SGLang consumed."""

    def __init__(self, model: torch.nn.Module):
        self.current: str | None = None
        self.consumed: dict[str, list[str]] = {}  # checkpoint name -> parameter names
        self.written: set[str] = set()
        for pname, param in model.named_parameters():
            original = getattr(param, "weight_loader", None)
            param.weight_loader = self._wrap(pname, original)

    def _wrap(self, pname, original):
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        loader = original or default_weight_loader

        def recording_loader(param, loaded, *args):
            if self.current is not None:
                self.consumed.setdefault(self.current, []).append(pname)
            self.written.add(pname)
            return loader(param, loaded, *args)

        return recording_loader


class SGLangAdapter:
    name = "sglang"

    def capture_plan(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions) -> CapturePlan:
        """Which target layers a server would capture for this draft, from SGLang's own code:
        its spec aux-hidden-state config resolution over ServerArgs/ModelConfig, its model
        registry's class for the target, and that class's set_eagle3_layers_to_capture."""
        ensure_runtime(options.device)
        import json
        import tempfile

        import sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state as aux_resolution
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader.utils import get_model_architecture
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        steps: list[str] = []
        deployment = options.serving.deployment
        with tempfile.TemporaryDirectory(prefix="difftest-sgl-") as scratch:
            if deployment is not None:
                from difftest.engines.sglang_engine.launch import parse_launch

                args, _, _ = parse_launch(deployment, target.path, options.device)
                draft_dir = args.speculative_draft_model_path
                algorithm = str(args.speculative_algorithm)
            else:
                draft_dir, algorithm = scratch, "EAGLE3"
                cfg, _ = serving_config(checkpoint, options)
                with open(f"{draft_dir}/config.json", "w") as f:
                    json.dump(cfg, f)
                args = ServerArgs(model_path=str(target.path), speculative_algorithm=algorithm,
                                  speculative_draft_model_path=draft_dir, device=options.device.split(":")[0])
            target_config = ModelConfig.from_server_args(args)
            # The resolver reads the draft path from the published server args; hand it this
            # one directly rather than publishing a speculative config process-wide.
            published = aux_resolution.get_spec
            aux_resolution.get_spec = lambda: SimpleNamespace(speculative_draft_model_path=draft_dir,
                                                              speculative_draft_model_revision=None)
            try:
                resolved = aux_resolution.resolve_spec_aux_hidden_state_config(
                    server_args=args, model_config=target_config,
                    spec_algorithm=SpeculativeAlgorithm.from_string(algorithm), is_draft_worker=False)
            finally:
                aux_resolution.get_spec = published
        ids = resolved.eagle_aux_hidden_state_layer_ids
        steps.insert(0, f"--speculative-algorithm {algorithm}")
        steps.append(f"resolve_spec_aux_hidden_state_config: use_aux_hidden_state={resolved.eagle_use_aux_hidden_state}, "
                     f"eagle_aux_hidden_state_layer_ids={ids}")
        model_cls, arch = get_model_architecture(target_config)
        supports = hasattr(model_cls, "set_eagle3_layers_to_capture")
        plan = CapturePlan(self.name, None, supports, f"sglang {model_cls.__name__}", ids, steps)
        if not options.serving.aux_capture:
            steps.append("serving setup: the target was not set up to capture aux hidden states")
            return plan
        if not resolved.eagle_use_aux_hidden_state:
            steps.append(f"no aux capture resolved for {algorithm} with this draft config "
                         "(EAGLE3 with eagle_config.use_aux_hidden_state true is what enables it)")
            return plan
        if not supports:
            steps.append(f"{model_cls.__name__} has no set_eagle3_layers_to_capture: the draft gets one layer")
            return plan
        # On the meta device: the method only sets attributes, no weights are needed.
        with torch.device("meta"):
            model = model_cls(config=target_config.hf_config)
        model.set_eagle3_layers_to_capture(ids)
        layers = list(model.model.layers_to_capture)
        steps.append(f"{model_cls.__name__}.set_eagle3_layers_to_capture({ids}) -> layers_to_capture {layers}")
        # LlamaModel.forward captures at the input of layer i (hidden_states[i] in HF terms),
        # walking layers in order, so the draft receives them ascending whatever the list order.
        plan.hf_layer_ids = sorted(layers)
        steps.append(f"captured at the input of each listed layer, in layer order: hidden_states{plan.hf_layer_ids}")
        return plan

    def claims_launch(self, argv: tuple[str, ...]) -> bool:
        from difftest.engines.sglang_engine.launch import LAUNCHERS, bare_arguments

        return launch_arguments(argv, LAUNCHERS) is not None or bare_arguments(argv)

    def deployment_plan(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions):
        if options.serving.deployment is None:
            return None
        ensure_runtime(options.device)
        from difftest.engines.sglang_engine.launch import deployment_plan

        return deployment_plan(options.serving.deployment, target.path, options.device, options.dtype).plan

    @torch.no_grad()
    def capture_target(self, checkpoint: Checkpoint, target: TargetWeights, sequences: list[list[int]],
                       options: RunOptions) -> TargetCapture:
        """The target as an EAGLE-3 server runs it: the registry's class for the target, its
        own load_weights over the target's safetensors, set_eagle3_layers_to_capture with
        the ids SGLang's config resolution gives this draft, one EXTEND with full hidden
        capture; the LogitsProcessor's hidden states are what the worker hands the draft."""
        ensure_runtime(options.device)  # before any sglang import: it caches the platform at import
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_loader.utils import get_model_architecture
        from sglang.srt.server_args import ServerArgs

        from difftest.engines.sglang_engine import batches
        from difftest.target import target_tensors

        plan = self.capture_plan(checkpoint, target, options)
        t0 = time.perf_counter()
        config = ModelConfig.from_server_args(ServerArgs(model_path=str(target.path), device=options.device.split(":")[0]))
        model_cls, _ = get_model_architecture(config)
        with _default_dtype(options.dtype), torch.device(options.device):
            model = model_cls(config=config.hf_config).eval()
        model.load_weights(target_tensors(target.path))
        if plan.hf_layer_ids is not None:
            model.set_eagle3_layers_to_capture(plan.configured_ids)
        lens = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
        kv = batches.KVSpace(config.hf_config, sum(lens), options.device, options.dtype)
        batch, backend, _ = batches.extend_batch(kv, ids, lens, None, mode=ForwardMode.EXTEND)
        out = batches.forward(model, batch, backend)
        hidden = out.hidden_states.float().cpu()
        layers = list(model.model.layers_to_capture) if plan.hf_layer_ids is not None else []
        what = (f"aux capture at the input of layers {sorted(layers)}, packed in layer order" if layers else
                "no aux capture: the hidden state the LogitsProcessor keeps (after the final norm)")
        return TargetCapture(self.name, hidden, sorted(layers) or None, what, {"target": time.perf_counter() - t0})

    def _build(self, checkpoint: Checkpoint, target: TargetWeights, options: RunOptions):
        """SGLang's model as its server builds it, from a served directory and a launch command:
        the user's (--serve/--launch), or else the directory difftest's converter writes for
        this checkpoint, served by the command `difftest convert` prints. One path either way."""
        if options.serving.deployment is not None:
            return self._build_deployed(target, options)
        import tempfile
        from pathlib import Path

        from difftest.convert import launch_command
        from difftest.engines.base import Deployment

        with tempfile.TemporaryDirectory(prefix="difftest-served-") as scratch:
            served_dir = Path(scratch) / "served"
            conversion_notes = write_served_copy(checkpoint, served_dir, options)
            argv = launch_command(str(served_dir), str(target.path), options.dtype)
            deployment = Deployment(served_dir, tuple(argv), Path(scratch), "difftest convert's launch command")
            model, ledger, details = self._build_deployed(
                target, replace(options, serving=replace(options.serving, deployment=deployment)))
        details["conversion_notes"] = conversion_notes
        details["served_as"] = ("the directory `difftest convert` writes for this checkpoint, launched as the command "
                                "it prints")
        # transformers records where it read the config: a scratch directory gone after this
        # call, and another one on every run. Name what it was instead.
        details["served_config"] = {**details["served_config"], "_name_or_path": "difftest convert's copy (scratch)"}
        details.pop("deployment", None)  # nothing was deployed by the user: the report has no deployment section
        return model, ledger, details

    def _build_deployed(self, target: TargetWeights, options: RunOptions):
        """The served directory as a server started with the launch command builds it: the
        draft's ModelConfig from SGLang's own config code, the model class its registry picks,
        the weight files its DefaultModelLoader iterates, then the model's load_weights."""
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import DefaultModelLoader
        from sglang.srt.model_loader.utils import get_model_architecture
        from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

        from difftest.engines.sglang_engine.launch import deployment_plan

        launch = deployment_plan(options.serving.deployment, target.path, options.device, options.dtype)
        plan, server_args, draft_config = launch.plan, launch.server_args, launch.draft_config
        model_cls, arch = get_model_architecture(draft_config)
        try:
            with _default_dtype(draft_config.dtype), torch.device(options.device), _draft_spec(launch.draft_window):
                model = model_cls(config=draft_config.hf_config).eval()
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            # e.g. a config without draft_vocab_size: transformers 5.19 gives the attribute no default
            served = options.serving.deployment.served_dir / "config.json"
            raise InputError(f"{served}: SGLang's {arch} cannot be built from it ({type(exc).__name__}: {exc})") from None
        files = DefaultModelLoader(LoadConfig(load_format=launch.draft_load_format
                                              if launch.draft_load_format != "dummy" else "auto"))
        served = ((name, name, tensor) for name, tensor in files._get_all_weights(draft_config, model))
        with _loader_bars_follow_tqdm_disable():
            if launch.draft_load_format == "dummy":
                # DummyModelLoader.load_model: random values in every parameter, no file read
                # (the names are listed, for the ledger, through the same iterator and its bar).
                unread = [name for name, _, _ in served]
                with torch.device(options.device):
                    initialize_dummy_weights(model)
                served = iter(())
            model, ledger, share = self._load(model, served, target, options, str(server_args.speculative_algorithm),
                                              server_args.speculative_token_map,
                                              randomized=launch.draft_load_format == "dummy")
        if launch.draft_load_format == "dummy":
            for name in unread:
                ledger.tensors[name] = (TensorFate.IGNORED, [], "--speculative-draft-load-format dummy reads no file")
        details = {"conversion_notes": {}, "served_config": plan.served_config, "lm_head_path": share["path"],
                   "architecture": arch, "deployment": plan.as_dict()}
        return model, ledger, details

    def _load(self, model, served, target: TargetWeights, options: RunOptions, algorithm: str, token_map=None,
              randomized: bool = False):
        """load_weights over (served name, checkpoint name, tensor), every weight_loader call
        recorded, then the worker's embedding and head sharing; unwritten parameters poisoned."""
        recorder = _LoadRecorder(model)
        served_names: dict[str, str] = {}

        # load_weights turns any name containing "d2t" into hot_token_id: which tensor did is
        # observed (the attribute changes while that tensor is being loaded), not assumed.
        token_map_from: list[str] = []

        def weights():
            for served_name, original, tensor in served:
                served_names[original] = served_name
                recorder.current = original
                before = getattr(model, "hot_token_id", None)
                yield served_name, tensor
                if getattr(model, "hot_token_id", None) is not before:
                    token_map_from.append(original)
            recorder.current = None

        model.load_weights(weights())
        recorder.token_map_from = token_map_from
        share = self._share_target(model, target, options, algorithm, token_map)
        ledger = self._ledger(model, served_names, recorder, share["shared"])
        if randomized:  # the loader's own random values, kept: they are what the server would serve
            for name in ledger.names(ParamFate.INIT):
                ledger.params[name] = (ParamFate.RANDOMIZED, "random values from the dummy load format")
        else:
            self._poison_unwritten(model, ledger)
        return model, ledger, share

    def run(self, checkpoint: Checkpoint, target: TargetWeights, states: CapturedStates, options: RunOptions,
            chain_steps: int = 0, chain_states: CapturedStates | None = None) -> EngineRun:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        standin = ensure_runtime(options.device)
        timings["import"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        model, ledger, details = self._build(checkpoint, target, options)
        timings["load"] = time.perf_counter() - t0

        if options.serving.deployment is not None:
            # What the launch resolves, not a setup knob: EAGLE captures no aux layers.
            captures = self.capture_plan(checkpoint, target, options).hf_layer_ids is not None
            options = RunOptions(dtype=model_dtype(model), device=options.device,
                                 serving=replace(options.serving, aux_capture=captures))
        t0 = time.perf_counter()
        own_chain = chain_steps > 0 and chain_states is not None
        probes, missing, extend = self._forward(model, target, states, options, 1 if own_chain else max(chain_steps, 1))
        timings["forward"] = time.perf_counter() - t0
        chain = None
        if chain_steps > 0:
            t0 = time.perf_counter()
            if own_chain:
                # The chain starts from what this deployment's target would capture: a draft
                # EXTEND of its own over those states, then the decode steps.
                *_, extend = self._forward(model, target, chain_states, options, chain_steps, fed_as_captured=True)
            chain = self._chain(model, chain_states or states, extend, chain_steps)
            chain.timings_s["chain"] = time.perf_counter() - t0 + (0 if own_chain else timings["forward"])
            if own_chain:
                chain.notes.append(f"drafted from the states this deployment's target captures (layers "
                                   f"{list(chain_states.aux_layer_ids)}), not the training states")

        if chain is not None:
            details["chain_notes"] = list(chain.notes)
        details["attention_backend"] = extend.kv.attention
        details["sgl_kernel_standin"] = standin.as_dict()
        details["module_graph"] = [f"{n}:{type(m).__name__}" for n, m in model.named_modules()]
        return EngineRun(engine=self.name, probes=probes, missing=missing, timings_s=timings, details=details,
                         ledger=ledger, chain=chain)

    def _chain(self, model, states: CapturedStates, extend, steps: int) -> ChainRun:
        """The EAGLE worker's topk=1 chain: the probes' draft EXTEND over the prompt rows is its
        step 0, then decode steps that each feed back the draft's own token (as a target id,
        through hot_token_id) and its own hidden state, every row a request sharing the prefix KV."""
        from difftest.engines.sglang_engine.chain import continue_chain

        draft = continue_chain(model, states, extend, steps)
        hot = model.get_hot_token_id()
        notes = []
        if hot is not None and int(draft.max()) >= hot.numel():
            notes.append("draft ids index past hot_token_id: the head is not draft-vocab; ids taken as target ids")
            hot = None
        tokens = hot.cpu()[draft] if hot is not None else draft
        return ChainRun(self.name, tokens, draft, {}, notes)

    @staticmethod
    def _ledger(model, served_names: dict[str, str], recorder: "_LoadRecorder", shared: list[str]) -> LoadLedger:
        token_map_from = getattr(recorder, "token_map_from", [])
        ledger = LoadLedger(token_map_writers=list(token_map_from))
        for original, served in served_names.items():
            if original in token_map_from:
                last = original == token_map_from[-1]
                note = ("not a parameter: hot_token_id = this + arange" if last else
                        f"set hot_token_id, then overwritten by {token_map_from[-1]}")
                ledger.tensors[original] = (TensorFate.IGNORED if original == "d2t" and last else TensorFate.RENAMED,
                                            ["hot_token_id"], note)
            elif "t2d" in served:  # load_weights skips every name containing "t2d" (llama_eagle3.py)
                ledger.tensors[original] = (TensorFate.IGNORED, [], "load_weights skips names containing t2d")
            elif original in recorder.consumed:
                fate = TensorFate.RENAMED if served != original else TensorFate.CONSUMED
                ledger.tensors[original] = (fate, recorder.consumed[original], f"served as {served}" if served != original else "")
            else:
                ledger.tensors[original] = (TensorFate.DROPPED, [], f"served as {served}; no parameter took it")
        for pname, _ in model.named_parameters():
            if pname in shared:
                ledger.params[pname] = (ParamFate.SHARED, "from the target")
            elif pname in recorder.written:
                ledger.params[pname] = (ParamFate.WRITTEN, "")
            else:
                ledger.params[pname] = (ParamFate.INIT, "no checkpoint tensor reached its weight_loader")
        for pname in shared:
            ledger.params.setdefault(pname, (ParamFate.SHARED, "from the target"))
        return ledger

    @staticmethod
    def _poison_unwritten(model, ledger: LoadLedger) -> None:
        """SGLang allocates parameters with torch.empty; one no checkpoint tensor reached holds
        whatever memory it got (sometimes a just-freed copy of the right weights). NaN makes
        the effect deterministic and impossible to miss."""
        params = dict(model.named_parameters())
        for name in ledger.names(ParamFate.INIT):
            if name in params and params[name].is_floating_point():
                with torch.no_grad():
                    params[name].fill_(float("nan"))
            ledger.params[name] = (ParamFate.INIT, "no checkpoint tensor reached its weight_loader; poisoned with NaN")

    @staticmethod
    def _share_target(model, target: TargetWeights, options: RunOptions, algorithm: str = "EAGLE3",
                      token_map: str | None = None) -> dict:
        """The EAGLE worker's own init_token_map and init_lm_head (eagle_worker_v2.py), run on
        this draft with a stand-in for the target runner that hands out the target's embedding
        and head. What the worker maps draft ids with (its hot_token_id) is what the draft is
        then read through: under EAGLE3 the d2t-based map load_weights built, under EAGLE the
        --speculative-token-map or nothing."""
        from sglang.srt.speculative import eagle_worker_v2
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        dtype = model_dtype(model)
        embed = target.shared("embed", options.device, dtype)
        head = target.shared("lm_head", options.device, dtype)
        if not options.serving.share_target_embed:
            embed = model.model.embed_tokens.weight  # fault: the target hands out no embedding to share
        if options.serving.lm_head_from_target:
            model.load_lm_head_from_target = True  # fault: the flag the worker reads to share the target's head
        standin_target = SimpleNamespace(get_embed_and_head=lambda: (embed, head), lm_head=None)
        worker = SimpleNamespace(
            target_worker=SimpleNamespace(model_runner=SimpleNamespace(
                model=standin_target, model_config=SimpleNamespace(model_path=str(target.path), revision=None),
                load_config=None)),
            draft_runner=SimpleNamespace(model=model), hot_token_id=None,
            speculative_algorithm=SpeculativeAlgorithm.from_string(algorithm))
        worker._resolve_shared_embed_and_head = types.MethodType(EagleDraftWorker._resolve_shared_embed_and_head, worker)
        before_embed, before_head = model.model.embed_tokens.weight, model.lm_head.weight
        # The worker reads the token-map flag from the published server args; hand it this
        # launch's value directly rather than publishing a speculative config process-wide.
        published = eagle_worker_v2.get_spec
        eagle_worker_v2.get_spec = lambda: SimpleNamespace(speculative_token_map=token_map)
        try:
            with _without_cache_flush(options.device):
                EagleDraftWorker.init_token_map(worker)
                EagleDraftWorker.init_lm_head(worker)
        finally:
            eagle_worker_v2.get_spec = published
        # Every later read of the draft's ids (probes, chains) goes through the worker's map.
        model.hot_token_id = worker.hot_token_id
        shared = []
        if model.model.embed_tokens.weight is not before_embed:
            shared.append("model.embed_tokens.weight")
        # A tied config makes lm_head the embedding module itself: sharing the embedding is all
        # that happened (the conversion audit names the tying), not a head taken from the target.
        if model.lm_head.weight is not before_head and model.lm_head is not model.model.embed_tokens:
            shared.append("lm_head.weight")
        took_head = algorithm != "EAGLE3" or getattr(model, "load_lm_head_from_target", False)
        path = ("set_embed_and_head" + (" (rows of --speculative-token-map)" if token_map and algorithm != "EAGLE3" else "")
                if took_head else "set_embed")
        return {"shared": shared, "path": path}

    @staticmethod
    def _draft_input_states(states: CapturedStates, options: RunOptions) -> torch.Tensor:
        if options.serving.aux_capture:
            return states.aux_hidden_states
        if states.verifier_last_hidden_states is None:
            from difftest.errors import InputError

            raise InputError("serving without aux capture feeds the target's last hidden state, which these states lack")
        return states.verifier_last_hidden_states

    @torch.no_grad()
    def _forward(self, model, target: TargetWeights, states: CapturedStates, options: RunOptions, kv_rounds: int,
                 fed_as_captured: bool = False):
        """The draft EXTEND, probed. The KV pool has room for kv_rounds tokens per row, so a
        chain can continue from this very EXTEND (its step 0) instead of running it again.
        fed_as_captured: the states are already what the serving target hands the draft."""
        from difftest.engines.sglang_engine import batches

        device, dtype = options.device, options.dtype
        hidden = states.aux_hidden_states if fed_as_captured else self._draft_input_states(states, options)
        kv = batches.KVSpace(model.config, states.num_tokens * kv_rounds, device, dtype)
        batch, backend, slots = batches.extend_batch(kv, states.input_ids, [int(n) for n in states.seq_lens.tolist()],
                                                     hidden.to(device=device, dtype=dtype))

        probes = ProbeRecorder()
        inner = model.model
        layer0 = inner.layers[0]
        probes.output(inner.embed_tokens, "embed")
        probes.input(inner.fc, "fc.input")
        probes.output(inner.fc, "fc.output")
        probes.output(layer0.input_layernorm, "layer0.embed_norm")
        probes.output(layer0.hidden_norm, "layer0.hidden_norm")
        probes.output(layer0.self_attn, "layer0.attn_output")
        # post_attention_layernorm fuses the residual add: (normed, residual + attn).
        probes.output(layer0.post_attention_layernorm, "layer0.post_attn_residual", pick=lambda o: o[1])
        probes.output(layer0.mlp, "layer0.mlp_output")
        # The next fused add-norm returns layer 0's output (mlp + residual) as its second value.
        nxt = inner.layers[1].hidden_norm if len(inner.layers) > 1 else inner.norm
        probes.output(nxt, "layer0.output", pick=lambda o: o[1])
        probes.output(inner.norm, "final_norm", pick=lambda o: o[0])
        try:
            out = batches.forward(model, batch, backend)
        finally:
            probes.remove()

        values = probes.values
        missing: dict[str, str] = {}
        if "fc.output" not in values:
            why = (f"fc was skipped: hidden_states width {hidden.shape[-1]} equals the embedding width, "
                   "so SGLang's shape check assumed they were already fused")
            missing["fc.input"] = missing["fc.output"] = why
        logits = out.next_token_logits.float().cpu()
        values["logits"] = logits
        # What the worker feeds the next draft step (LlamaForCausalLMEagle3 returns it as the aux
        # state: normed under norm_output, pre-norm otherwise).
        values["next_step_hidden"] = out.hidden_states.float().cpu()
        draft = logits.argmax(dim=-1)
        values["draft_token"] = draft
        hot = model.get_hot_token_id()
        if hot is not None and int(draft.max()) >= hot.numel():
            # A full-vocab head's ids index past the draft-vocab map; on a GPU this is a
            # device-side assert, here it is recorded rather than raised.
            missing["target_token"] = (f"draft ids up to {int(draft.max())} index past hot_token_id "
                                       f"({hot.numel()} entries): the head is not draft-vocab")
        else:
            values["target_token"] = hot.cpu()[draft] if hot is not None else draft.clone()
        return values, missing, batches.Extended(kv, slots, draft.to(out.next_token_logits.device), out.hidden_states)
