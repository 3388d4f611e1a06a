"""Predicted acceptance and measured target capture.

The scoring math is checked against a brute-force count; the figures themselves come from
both engines on the real SmolLM2 fixture, clean and with serving faults.
"""

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from difftest.acceptance import (ACCEPT_LENGTH_TOLERANCE, UNKNOWN, TargetContinuation, acceptance, scored_rows)
from difftest.engines.base import ChainRun, ServingSetup
from difftest.states import CapturedStates


def _states(lens, ids, mask=None):
    T = sum(lens)
    return CapturedStates(input_ids=torch.tensor(ids), seq_lens=torch.tensor(lens), aux_hidden_states=torch.zeros(T, 2),
                          verifier_last_hidden_states=None, aux_layer_ids=(1,),
                          loss_mask=torch.tensor(mask if mask is not None else [1] * T, dtype=torch.uint8))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), k=st.integers(1, 4))
def test_acceptance_matches_a_brute_force_count(data, k):
    lens = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
    T = sum(lens)
    vocab = 3  # small, so guesses collide with the truth often
    nxt = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=T, max_size=T)))
    # Recorded tokens follow the greedy continuation except where the draw says otherwise.
    ids = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=T, max_size=T)))
    states = _states(lens, ids.tolist())
    cont = TargetContinuation(nxt, "target head over the verifier states", 0.0)
    guesses = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k),
                                              min_size=T, max_size=T)))
    rows = scored_rows(states, cont, k)
    fig = acceptance(ChainRun("e", guesses, guesses), cont, rows)

    starts = [sum(lens[:i]) for i in range(len(lens))]
    lengths = []
    for s, n in zip(starts, lens):
        for t in range(s, s + n):
            if t + k > s + n:  # the chain's last reference (row t+k-1) must be in the request
                continue
            if t + 1 >= s + n:  # the first predicted token must be a recorded response token
                continue
            if any(int(ids[t + 1 + i]) != int(nxt[t + i]) for i in range(k - 1)):
                continue
            accepted = 0
            while accepted < k and int(guesses[t, accepted]) == int(nxt[t + accepted]):
                accepted += 1
            lengths.append(1 + accepted)
    assert fig.scored_rows == len(lengths)
    if lengths:
        assert fig.mean_accept_length == pytest.approx(sum(lengths) / len(lengths))
        for j in range(k):
            assert fig.reach[j] == pytest.approx(sum(L > j + 1 for L in lengths) / len(lengths))


def test_perfect_chain_accepts_everything_and_prompt_rows_are_not_scored():
    ids = [5, 6, 7, 8, 9, 10]
    states = _states([6], ids, mask=[0, 0, 1, 1, 1, 1])
    nxt = torch.tensor(ids[1:] + [UNKNOWN])
    cont = TargetContinuation(nxt, "target head over the verifier states", 1.0)
    k = 2
    chain = torch.stack([nxt.clamp(min=0), torch.cat([nxt[1:], nxt[:1]]).clamp(min=0)], dim=1)
    rows = scored_rows(states, cont, k)
    # Row 0 predicts token 1, a prompt token; rows 4 and 5 run past the request.
    assert rows.tolist() == [False, True, True, True, False, False]
    fig = acceptance(ChainRun("e", chain, chain), cont, rows)
    assert fig.mean_accept_length == 1 + k and fig.reach == [1.0, 1.0]


# --- the real fixture ----------------------------------------------------------------

@pytest.fixture(scope="module")
def fx():
    from difftest.fixturegen.default import default_fixture

    return default_fixture(progress=False)


@pytest.fixture(scope="module")
def inputs(fx):
    from difftest.pipeline import prepare

    return prepare(fx.checkpoint, fx.target, fx.states)


@pytest.fixture(scope="module")
def training(fx):
    import json

    return json.loads(fx.training.read_text())


@pytest.fixture(scope="module")
def clean(inputs, training):
    from difftest.pipeline import run

    return run(inputs, chain_steps=3, measure_target_capture=True, training_metrics=training)


def test_clean_draft_engines_predict_the_same_acceptance(clean, training):
    acc = clean.acceptance
    assert acc.reference.scored_rows >= 100
    assert abs(acc.gap) <= ACCEPT_LENGTH_TOLERANCE, acc.as_dict()
    # The draft is trained: far above chance, and speculators' own step-0 figure is reproduced
    # within the sampling error of this many rows (plus the held-out split's own noise).
    n, p0 = acc.reference.scored_rows, training["full_acc_0"]
    assert acc.reference.reach[0] > 100 * training["chance"]
    assert abs(acc.reference.reach[0] - p0) <= 2 * (p0 * (1 - p0) / n) ** 0.5 + 0.05
    assert acc.reference.mean_accept_length > 1.0 + acc.reference.reach[0] - 1e-9


def test_clean_target_capture_is_the_training_capture(clean, inputs):
    tc = clean.target_capture
    assert tc.training_hf_ids == list(inputs.states.aux_layer_ids)
    assert tc.serving_hf_ids == tc.training_hf_ids
    served = [c for c in tc.chunks if c.side == "sglang"]
    assert len(served) == len(inputs.states.aux_layer_ids) and all(c.matches for c in served)
    assert all(c.vs_training["rel_max"] <= clean.tolerance.rel_max for c in served)
    assert not [f for f in clean.findings if f.check == "target_capture"]


def test_aux_capture_off_collapses_serving_acceptance(inputs, training, clean):
    from difftest.acceptance import explain
    from difftest.pipeline import run

    off = run(inputs, serving=ServingSetup(aux_capture=False), chain_steps=3, measure_target_capture=True,
              training_metrics=training)
    acc = off.acceptance
    # speculators (training time) is untouched; SGLang's drafts lose most of their hits.
    assert acc.reference.mean_accept_length == pytest.approx(clean.acceptance.reference.mean_accept_length)
    assert acc.candidate.reach[0] < 0.5 * acc.reference.reach[0]
    assert acc.candidate.mean_accept_length - 1 < 0.5 * (acc.reference.mean_accept_length - 1)
    assert not acc.agree
    assert off.diagnosis.cause == "aux_capture_off_fc_skipped"
    measured = [f for f in off.findings if f.check == "target_capture"]
    assert [f.cause for f in measured] == ["aux_capture_off"]
    assert off.target_capture.serving_hf_ids is None
    assert any("aux_capture_off_fc_skipped" in line for line in explain(acc, off.diagnosis))


def test_verbatim_speculators_ids_are_measured_off_by_one(inputs):
    from difftest.engines.base import RunOptions
    from difftest.pipeline import candidate_adapter, target_capture_parity

    ids = list(inputs.states.aux_layer_ids)
    serving = ServingSetup(config_edits=(("eagle_config.eagle_aux_hidden_state_layer_ids", ids),))
    parity, findings = target_capture_parity(inputs, candidate_adapter(), RunOptions(serving=serving), lambda _m: None)
    assert parity.training_hf_ids == ids
    assert parity.serving_hf_ids == [i + 1 for i in ids]  # SGLang adds 1 to explicit ids
    assert [f.cause for f in findings] == ["aux_layers_off_by_one"]


def test_reversed_training_capture_is_measured_as_wrong_order(inputs):
    from difftest.engines.base import RunOptions
    from difftest.pipeline import candidate_adapter, target_capture_parity

    st = inputs.states
    H = st.target_hidden_size
    reversed_states = replace(st, aux_layer_ids=tuple(reversed(st.aux_layer_ids)),
                              aux_hidden_states=torch.cat(st.aux_hidden_states.split(H, dim=-1)[::-1], dim=-1))
    parity, findings = target_capture_parity(replace(inputs, states=reversed_states), candidate_adapter(),
                                             RunOptions(), lambda _m: None)
    assert parity.training_hf_ids == list(reversed(st.aux_layer_ids))
    assert [f.cause for f in findings] == ["aux_layers_wrong_order"]
