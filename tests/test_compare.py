import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from difftest.compare import Status, activation_metrics, compare_runs, make_activation_check, make_token_check
from difftest.probes import PROBE_NAMES, PROBES, ProbeKind
from difftest.tolerances import TOLERANCES, Tolerance

FP32 = TOLERANCES[torch.float32]


def fake_run(seed=0, tokens=8, width=16, vocab=12):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in PROBES:
        if p.kind is ProbeKind.ACTIVATION:
            out[p.name] = torch.randn(tokens, vocab if p.name == "logits" else width, generator=g)
    out["draft_token"] = out["logits"].argmax(-1)
    out["target_token"] = out["draft_token"] + 100
    return out


def test_rel_diff_matches_sglang_definition():
    x = torch.tensor([1.0, 2.0, 3.0])
    y = torch.tensor([1.0, 2.0, 3.5])
    expected = 1 - 2 * (x.double() @ y.double()) / (x.double() @ x.double() + y.double() @ y.double())
    assert abs(activation_metrics(x, y)["rel_diff"] - expected.item()) < 1e-15


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       st.sampled_from([0.0, 1e-3, 1.0]))
def test_activation_metrics_agree_with_elementwise_definitions(seed, n, dtype, noise):
    """The fused metrics against the plain elementwise formulas, in float64, on any probe."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, 7, generator=g).to(dtype)
    cand = (ref.double() + noise * torch.randn(n, 7, generator=g, dtype=torch.float64)).to(dtype)
    before = ref.clone()
    m = activation_metrics(ref, cand)
    assert torch.equal(ref, before)  # a float64 probe is not overwritten by its own metrics
    r, c = ref.double(), cand.double()
    diff = (r - c).abs()
    assert m["max_abs"] == diff.max().item() and abs(m["mean_abs"] - diff.mean().item()) <= 1e-15
    assert m["scale"] == r.abs().max().item()
    cos = torch.nn.functional.cosine_similarity(r.flatten(), c.flatten(), dim=0).item()
    assert abs(m["cosine"] - cos) <= 1e-12
    expected_rel_diff = max(0.0, 1 - 2 * (r * c).sum().item() / ((r * r).sum() + (c * c).sum()).item())
    assert abs(m["rel_diff"] - expected_rel_diff) <= 1e-12
    if noise == 0.0:
        assert m["rel_diff"] == 0.0 and m["max_abs"] == 0.0


def test_identical_runs_are_parity():
    run = fake_run()
    comp = compare_runs(run, {k: v.clone() for k, v in run.items()}, FP32)
    assert comp.parity and [r.probe for r in comp.results] == list(PROBE_NAMES)


def test_first_divergence_is_first_in_dataflow_order():
    ref = fake_run()
    cand = {k: v.clone() for k, v in ref.items()}
    cand["layer0.mlp_output"] += 1.0
    cand["logits"] += 1.0  # later probes failing too must not move the first divergence
    comp = compare_runs(ref, cand, FP32)
    assert comp.first_divergence.probe == "layer0.mlp_output"


def test_missing_probe_carries_the_engines_reason():
    ref = fake_run()
    cand = {k: v for k, v in ref.items() if not k.startswith("fc.")}
    comp = compare_runs(ref, cand, FP32, {"fc.input": "fc was skipped"})
    assert comp.first_divergence.probe == "fc.input"
    assert comp.first_divergence.status is Status.MISSING and "skipped" in comp.first_divergence.detail


@settings(max_examples=40, deadline=None)
@given(scale=st.floats(1e-3, 1e3), eps=st.floats(1e-4, 1e-1), seed=st.integers(0, 2**16))
def test_would_pass_at_is_the_tightest_passing_tolerance(scale, eps, seed):
    g = torch.Generator().manual_seed(seed)
    ref = scale * torch.randn(6, 10, generator=g)
    cand = ref + eps * scale * torch.randn(6, 10, generator=g)
    res = make_activation_check(FP32)("x", ref, cand)
    assert res.status is Status.FAIL  # eps >= 1e-4 is far above fp32 tolerance
    at = res.would_pass_at
    loose = Tolerance(rel_max=at["rel_max"] * 1.0001, rel_diff=at["rel_diff"] * 1.0001 + 1e-300, near_tie_margin=0)
    assert make_activation_check(loose)("x", ref, cand).ok
    tight = Tolerance(rel_max=at["rel_max"] * 0.99, rel_diff=at["rel_diff"] * 1.0001 + 1e-300, near_tie_margin=0)
    assert not make_activation_check(tight)("x", ref, cand).ok


def test_token_flip_is_allowed_only_at_a_near_tie():
    logits = torch.tensor([[5.0, 4.9999, 0.0], [5.0, 1.0, 0.0]])
    ref = logits.argmax(-1)
    tol = Tolerance(rel_max=1e-3, rel_diff=1e-6, near_tie_margin=1e-3)
    flipped_tie = torch.tensor([1, 0])
    assert make_token_check(tol, logits, logits)("draft_token", ref, flipped_tie).ok
    flipped_clear = torch.tensor([0, 1])
    res = make_token_check(tol, logits, logits)("draft_token", ref, flipped_clear)
    assert not res.ok and res.metrics["unexplained_mismatches"] == 1
