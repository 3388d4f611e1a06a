"""Real SGLang ForwardBatches outside a server: the draft EXTEND a worker runs over the
target's states, and the chain's decode steps.

Memory is SGLang's own: a ReqToTokenPool maps each request's positions to slots of one
MHATokenToKVPool, and the attention backend reads keys through it, so a decode request
that lists a prefix's slots attends to exactly the KV the EXTEND wrote.

The attention backend is the one device-specific choice, and it is made here: on CPU,
TorchNativeAttnBackend (SDPA per request); on CUDA, TorchFlexAttnBackend (flex attention,
compiled to Triton kernels), the CUDA backend whose constructor needs only the pools,
not a whole ModelRunner. Both read the same pools, so the choice changes kernels only.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch


ATTENTION_BACKENDS = {"cpu": "torch_native", "cuda": "torch_flex"}


def attention_backend_class(name: str):
    if name == "torch_native":
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend
    if name == "torch_flex":
        from sglang.srt.layers.attention.torch_flex_backend import TorchFlexAttnBackend

        return TorchFlexAttnBackend
    raise ValueError(f"unknown SGLang attention backend {name!r}; known: torch_native, torch_flex")


class KVSpace:
    """One KV pool for a run, handing out slots in order; slot 0 is SGLang's padding slot."""

    def __init__(self, cfg, num_slots: int, device: str, dtype: torch.dtype, attention: str | None = None):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        self.device = device
        self.attention = attention or ATTENTION_BACKENDS.get(torch.device(device).type, "torch_native")
        self.pool = MHATokenToKVPool(
            size=num_slots + 1, page_size=1, dtype=dtype, head_num=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            layer_num=cfg.num_hidden_layers, device=device, enable_memory_saver=False,
        )
        self._next = 1

    def take(self, n: int) -> torch.Tensor:
        slots = torch.arange(self._next, self._next + n, dtype=torch.int64, device=self.device)
        self._next += n
        return slots

    def backend(self, req_to_token: torch.Tensor):
        """An attention backend whose requests are the rows of req_to_token (row 0 unused)."""
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        rows, width = req_to_token.shape
        req_pool = ReqToTokenPool(size=rows - 1, max_context_len=width, device=self.device, enable_memory_saver=False)
        req_pool.req_to_token[:, :width] = req_to_token.to(device=self.device, dtype=req_pool.req_to_token.dtype)
        backend = attention_backend_class(self.attention)
        return backend(SimpleNamespace(device=self.device, req_to_token_pool=req_pool, token_to_kv_pool=self.pool))


@dataclass
class Extended:
    """What a draft EXTEND leaves behind for the decode steps after it."""

    kv: KVSpace
    slots: torch.Tensor  # [T] the KV slots its rows were written to
    draft: torch.Tensor  # [T] its argmax draft ids
    hidden: torch.Tensor | None  # [T, H] the hidden states it hands the next step


def extend_batch(kv: KVSpace, input_ids: torch.Tensor, lens: list[int], hidden: torch.Tensor, mode=None,
                 capture_full: bool = True, spec: bool = True):
    """Every request's rows in one EXTEND from position 0; returns (batch, backend, slots [T])."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    device = kv.device
    num_reqs, num_tokens = len(lens), sum(lens)
    slots = kv.take(num_tokens)
    table = torch.zeros(num_reqs + 1, max(lens) + 1, dtype=torch.int64)
    start = 0
    for i, n in enumerate(lens):
        table[i + 1, :n] = slots[start:start + n].cpu()
        start += n
    backend = kv.backend(table)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    batch = ForwardBatch(
        forward_mode=mode if mode is not None else ForwardMode.DRAFT_EXTEND_V2,
        batch_size=num_reqs,
        input_ids=input_ids.to(device),
        req_pool_indices=torch.arange(1, num_reqs + 1, dtype=torch.int64, device=device),
        seq_lens=seq_lens,
        out_cache_loc=slots,
        seq_lens_sum=num_tokens,
        seq_lens_cpu=seq_lens.cpu(),
        positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device),
        extend_num_tokens=num_tokens,
        extend_seq_lens=seq_lens,
        extend_prefix_lens=torch.zeros_like(seq_lens),
        extend_start_loc=starts,
        extend_prefix_lens_cpu=[0] * num_reqs,
        extend_seq_lens_cpu=lens,
        extend_logprob_start_lens_cpu=[0] * num_reqs,
        capture_hidden_mode=CaptureHiddenMode.FULL if capture_full else CaptureHiddenMode.NULL,
        spec_algorithm=SpeculativeAlgorithm.EAGLE3 if spec else SpeculativeAlgorithm.NONE,
        spec_info=EagleDraftExtendInput(hidden_states=hidden) if hidden is not None else None,
        return_logprob=False,
    )
    backend.init_forward_metadata(_as_seen_by(backend, batch))
    return batch, backend, slots


def decode_batch(kv: KVSpace, table: torch.Tensor, kv_lens: torch.Tensor, input_ids: torch.Tensor,
                 positions: torch.Tensor, hidden: torch.Tensor, new_slots: torch.Tensor):
    """One decode step for requests whose KV so far is table[r, :kv_lens[r]-1] plus new_slots[r]."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    device = kv.device
    R = int(kv_lens.shape[0])
    backend = kv.backend(table)
    seq_lens = kv_lens.to(device)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=R,
        input_ids=input_ids.to(device),
        req_pool_indices=torch.arange(1, R + 1, dtype=torch.int64, device=device),
        seq_lens=seq_lens,
        out_cache_loc=new_slots,
        seq_lens_sum=int(kv_lens.sum()),
        seq_lens_cpu=kv_lens.cpu(),
        positions=positions.to(device),
        capture_hidden_mode=CaptureHiddenMode.LAST,
        spec_algorithm=SpeculativeAlgorithm.EAGLE3,
        spec_info=EagleDraftInput(hidden_states=hidden, capture_hidden_mode=CaptureHiddenMode.LAST),
        return_logprob=False,
    )
    backend.init_forward_metadata(batch)
    return batch, backend


def _as_seen_by(backend, batch):
    """TorchFlexAttnBackend builds its masks only for modes whose is_extend() is true, and
    that leaves out DRAFT_EXTEND_V2 (forward still takes the extend path, and finds no
    mask). Its metadata for an EXTEND over the same requests is what that path needs."""
    import dataclasses

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if type(backend).__name__ == "TorchFlexAttnBackend" and batch.forward_mode == ForwardMode.DRAFT_EXTEND_V2:
        return dataclasses.replace(batch, forward_mode=ForwardMode.EXTEND)
    return batch


def forward(model, batch, backend):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    with forward_context(ForwardContext(attn_backend=backend), forward_batch=batch):
        return model(batch.input_ids, batch.positions, batch)
