"""Both real engines on the tiny fixture: parity, serving-side faults, the bf16 noise floor."""

import pytest
import torch

from difftest.compare import Status
from difftest.engines.base import ParamFate, ServingSetup, TensorFate
from difftest.pipeline import prepare, run
from difftest.probes import PROBE_NAMES
from difftest.tolerances import TOLERANCES


@pytest.fixture(scope="module", params=["speculators", "legacy"])
def fmt_inputs(request, tiny):
    return prepare(tiny / request.param, tiny / "target", tiny / "states.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clean_fixture_is_parity(fmt_inputs, dtype):
    result = run(fmt_inputs, dtype=dtype)
    failing = [(r.probe, r.status.value, r.metrics) for r in result.comparison.results if not r.ok]
    assert result.comparison.parity, failing
    assert [r.probe for r in result.comparison.results] == list(PROBE_NAMES)
    assert result.candidate.details["sgl_kernel_standin"]["total_calls"] == 0


def test_fp32_parity_is_tight_not_just_within_tolerance(tiny_inputs):
    result = run(tiny_inputs, dtype=torch.float32)
    worst = max(r.metrics.get("rel_max", 0.0) for r in result.comparison.results)
    assert worst < 1e-6  # same math, only reduction order differs


def test_bf16_tolerance_is_justified_by_the_measured_noise_floor(tiny_inputs):
    result = run(tiny_inputs, dtype=torch.bfloat16, measure_noise=True)
    tol = TOLERANCES[torch.bfloat16]
    floor = result.noise_floor
    # The bound must sit above what bf16 rounding alone does to one engine ...
    assert floor["logits"]["rel_max"] <= tol.rel_max and floor["logits"]["rel_diff"] <= tol.rel_diff
    worst_rel_max = max(v["rel_max"] for v in floor.values())
    worst_rel_diff = max(v["rel_diff"] for v in floor.values())
    # ... and within 8x of the noisiest probe, so it can't hide a real bug.
    assert tol.rel_max <= 8 * worst_rel_max, (tol.rel_max, worst_rel_max)
    assert tol.rel_diff <= 8 * worst_rel_diff, (tol.rel_diff, worst_rel_diff)
    # Cross-engine bf16 differences are of the same order as the floor.
    logits = next(r for r in result.comparison.results if r.probe == "logits")
    assert logits.metrics["rel_max"] <= 3 * floor["logits"]["rel_max"]


def test_aux_capture_off_diverges_at_fc(tiny_inputs):
    result = run(tiny_inputs, serving=ServingSetup(aux_capture=False))
    first = result.comparison.first_divergence
    assert first.probe == "fc.input" and first.status is Status.MISSING
    assert "fc was skipped" in first.detail
    assert result.diagnosis.cause == "aux_capture_off_fc_skipped"
    embed = next(r for r in result.comparison.results if r.probe == "embed")
    assert embed.ok  # everything before fc still agrees


def test_target_head_diverges_at_logits(tiny_inputs):
    result = run(tiny_inputs, serving=ServingSetup(lm_head_from_target=True))
    first = result.comparison.first_divergence
    assert first.probe == "logits"
    assert result.diagnosis.cause == "lm_head_replaced_by_target"
    assert result.candidate.details["lm_head_path"] == "set_embed_and_head"
    before = [r for r in result.comparison.results if PROBE_NAMES.index(r.probe) < PROBE_NAMES.index("logits")]
    assert all(r.ok for r in before)


def test_sglang_ledger_sees_every_tensor(tiny_inputs):
    result = run(tiny_inputs)
    ledger = result.candidate.ledger
    assert set(ledger.tensors) == set(tiny_inputs.checkpoint.tensor_names())
    assert ledger.names(TensorFate.DROPPED) == [] and ledger.names(ParamFate.INIT) == []
    assert ledger.names(ParamFate.SHARED) == ["model.embed_tokens.weight"]
    assert ledger.tensors["d2t"][0] is TensorFate.IGNORED and ledger.tensors["d2t"][1] == ["hot_token_id"]


def test_the_cuda_attention_kernels_agree_with_the_cpu_ones(tiny_inputs, monkeypatch):
    """--device cuda runs flex attention in both engines (speculators' simple_flex_attention
    over a batch padded to whole blocks, SGLang's TorchFlexAttnBackend); no GPU here, so the
    same kernels run on CPU and must give the CPU path's probes and, up to near-tie flips, chains."""
    from difftest.engines import speculators_engine
    from difftest.engines.sglang_engine import batches

    default = run(tiny_inputs, dtype=torch.float32, chain_steps=3)
    monkeypatch.setitem(speculators_engine.ATTN_IMPL, "cpu", speculators_engine.ATTN_IMPL["cuda"])
    monkeypatch.setitem(batches.ATTENTION_BACKENDS, "cpu", batches.ATTENTION_BACKENDS["cuda"])
    flex = run(tiny_inputs, dtype=torch.float32, chain_steps=3)
    assert flex.reference.details["attn_implementation"] == "simple_flex_attention"
    assert flex.candidate.details["attention_backend"] == "torch_flex"
    assert flex.comparison.parity, [(r.probe, r.metrics) for r in flex.comparison.results if not r.ok]
    for mine, theirs in ((flex.reference, default.reference), (flex.candidate, default.candidate)):
        for name, value in theirs.probes.items():
            assert torch.allclose(mine.probes[name].float(), value.float(), rtol=1e-5, atol=1e-5), (mine.engine, name)
        # Step 0 is the probed forward: identical. Later steps feed back each kernel's own hidden
        # state, and on a random-weight draft near-tie logits are common: a rounding-level
        # difference between two attention kernels may flip one (hosts differ in which), never many.
        assert torch.equal(mine.chain.draft_tokens[:, 0], theirs.chain.draft_tokens[:, 0]), mine.engine
        # A flip at one step changes the tokens fed to the next, so count rows, not tokens.
        same_rows = (mine.chain.draft_tokens == theirs.chain.draft_tokens).all(dim=1).float().mean().item()
        assert same_rows >= 0.9, (mine.engine, same_rows)
