"""One load per engine, shared target tensors, and memory that goes back when an engine is done.

The figures (peak RSS against the bytes that must be held) are in benchmarks/; these tests
pin the mechanisms those figures rest on, each of which a refactor could silently undo.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from difftest.acceptance import greedy_tokens
from difftest.engines.base import RunOptions
from difftest.pipeline import candidate_adapter, reference_adapter


@pytest.mark.parametrize("adapter", [reference_adapter, candidate_adapter], ids=["speculators", "sglang"])
def test_probes_of_a_chained_run_are_those_of_a_single_forward(tiny_inputs, adapter):
    """The chain now reuses the probed forward (its step 0), so probing must not depend on it."""
    engine = adapter()
    args = (tiny_inputs.checkpoint, tiny_inputs.target, tiny_inputs.states, RunOptions())
    single = engine.run(*args)
    chained = engine.run(*args, chain_steps=3)
    assert single.chain is None and chained.chain is not None
    assert set(single.probes) == set(chained.probes)
    for name, value in single.probes.items():
        assert torch.equal(value, chained.probes[name]), name
    # The chain's step 0 is the forward's own draft token.
    assert torch.equal(chained.chain.draft_tokens[:, 0], single.probes["draft_token"])
    assert chained.chain.draft_tokens.shape == (tiny_inputs.states.num_tokens, 3)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=6), extra=st.integers(0, 4))
def test_prefix_table_lists_each_rows_own_prefix(lens, extra):
    from difftest.engines.sglang_engine.chain import prefix_table

    seq_lens = torch.tensor(lens)
    T = int(seq_lens.sum())
    slots = torch.randperm(T) + 1
    width = max(lens) + extra
    table = prefix_table(slots, seq_lens, width)
    row, start = 0, 0
    assert table.shape == (T + 1, width) and not table[0].any()
    for n in lens:
        for t in range(n):
            want = torch.zeros(width, dtype=torch.int64)
            want[: t + 1] = slots[start: start + t + 1]
            assert torch.equal(table[row + 1], want)
            row += 1
        start += n


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 40), block=st.integers(1, 16), seed=st.integers(0, 2**16),
       ties=st.booleans())
def test_blockwise_greedy_is_the_argmax_over_the_whole_vocab(rows, vocab, block, seed, ties):
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, 4, generator=gen).bfloat16()
    if ties:  # duplicated head rows: tied logits, where any of the tied ids is a right answer
        head = head[torch.randint(0, max(vocab // 2, 1), (vocab,), generator=gen)]
    hidden = torch.randn(rows, 4, generator=gen)
    got = greedy_tokens(hidden, head, block)
    exact = hidden.double() @ head.double().T
    best = exact.max(dim=-1).values
    assert torch.allclose(exact[torch.arange(rows), got], best, rtol=1e-5, atol=1e-6)
    if not ties:
        assert torch.equal(got, exact.argmax(dim=-1))


def test_target_tensors_are_one_object_per_dtype_while_held(tiny_inputs):
    target = tiny_inputs.target
    a = target.shared("embed", "cpu", torch.bfloat16)
    assert target.shared("embed", "cpu", torch.bfloat16) is a
    assert a.dtype == torch.bfloat16 and torch.equal(a, target.embed.bfloat16())
    stored = target.shared("embed", "cpu", target.embed.dtype)
    assert stored.data_ptr() == target.embed.data_ptr()  # no copy where nothing changes


def test_an_engines_model_is_freed_when_its_run_returns(tiny):
    """In a fresh process, where the first SGLang forward is also its first KV write: that
    write's lazy import used to pin the whole model (see runtime._import_on_a_bare_stack)."""
    script = textwrap.dedent(f"""
        import gc, torch
        from difftest.cli import quiet_engines
        quiet_engines(False)
        from difftest.pipeline import prepare, reference_adapter, candidate_adapter
        from difftest.engines.base import RunOptions
        inputs = prepare({str(tiny / 'speculators')!r}, {str(tiny / 'target')!r}, {str(tiny / 'states.safetensors')!r})
        for make in (reference_adapter, candidate_adapter):
            make().run(inputs.checkpoint, inputs.target, inputs.states, RunOptions(), chain_steps=2)
        gc.collect()
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
        from speculators.models.eagle3 import Eagle3DraftModel
        alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, (LlamaForCausalLMEagle3, Eagle3DraftModel))]
        print("ALIVE", alive)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ALIVE []" in out.stdout, out.stdout[-500:]
