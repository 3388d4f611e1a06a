"""Server-captured inputs: speculators datagen files and SGLang server responses, read into the
same rows the draft consumes, checked against speculators' own shift and against the CLI."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from difftest.errors import InputError
from difftest.readers import read_datagen, read_sglang_server, write_datagen, write_sglang_server
from difftest.states import CapturedStates, load_states, save_states


def synthetic(lens, A=3, H=8, seed=0, prompt=2) -> CapturedStates:
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    mask = torch.cat([torch.tensor([0] * min(prompt, n - 1) + [1] * (n - min(prompt, n - 1))) for n in lens])
    return CapturedStates(
        input_ids=torch.randint(0, 100, (T,), generator=g), seq_lens=torch.tensor(lens),
        aux_hidden_states=torch.randn(T, A * H, generator=g), verifier_last_hidden_states=torch.randn(T, H, generator=g),
        aux_layer_ids=tuple(range(1, 1 + A)), loss_mask=mask.to(torch.uint8),
        first_token_ids=torch.randint(0, 100, (len(lens),), generator=g))


def assert_same_rows(a: CapturedStates, b: CapturedStates, verifier=True):
    for name in ("input_ids", "seq_lens", "aux_hidden_states", "loss_mask", "first_token_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    if verifier:
        assert torch.equal(a.verifier_last_hidden_states, b.verifier_last_hidden_states)
    assert a.aux_layer_ids == b.aux_layer_ids


@settings(max_examples=15, deadline=None)
@given(lens=st.lists(st.integers(2, 9), min_size=1, max_size=4), seed=st.integers(0, 99))
def test_datagen_round_trip(tmp_path_factory, lens, seed):
    s = synthetic(lens, seed=seed)
    d = tmp_path_factory.mktemp("datagen")
    write_datagen(s, d)
    assert_same_rows(read_datagen(d, s.aux_layer_ids), s)


def test_datagen_reader_agrees_with_speculators_shift_batch(tmp_path):
    """speculators' own loader + shift_batch on the raw files must give the reader's rows."""
    from safetensors.torch import load_file
    from speculators.models.eagle3.data import shift_batch

    s = synthetic([5, 7])
    write_datagen(s, tmp_path)
    got = read_datagen(tmp_path, s.aux_layer_ids)
    import datasets

    ds = datasets.load_from_disk(str(tmp_path))
    for i, start in enumerate([0, 5]):  # synthetic lens are row counts: request 1 starts at row 5
        hs = load_file(str(tmp_path / "hidden_states" / f"hs_{i}.safetensors"))
        n = hs["token_ids"].shape[0]
        b = shift_batch({"input_ids": hs["token_ids"], "hidden_states": hs["hidden_states"][:, :-1].flatten(1),
                         "verifier_last_hidden_states": hs["hidden_states"][:, -1],
                         "loss_mask": torch.tensor(ds[i]["loss_mask"]), "lengths": torch.tensor([n]),
                         "position_ids": torch.arange(n)})
        rows = slice(start, start + n - 1)
        assert torch.equal(b["input_ids"], got.input_ids[rows])
        assert torch.equal(b["hidden_states"], got.aux_hidden_states[rows])
        assert torch.equal(b["verifier_last_hidden_states"], got.verifier_last_hidden_states[rows])
        assert torch.equal(b["loss_mask"].to(torch.uint8), got.loss_mask[rows])


def test_datagen_reader_reads_the_real_fixture_files():
    """The SmolLM2 fixture's training data is in the datagen layout; its first file must read
    into the rows the fixture's own states file holds for the same conversation."""
    from difftest.fixturegen import smollm2
    from difftest.fixturegen.cache import cache_root

    from difftest.fixturegen.default import default_fixture

    default_fixture(progress=False)  # builds it when this test runs first
    p = smollm2.Paths(cache_root() / "smollm2")
    ids = smollm2.aux_layer_ids(p)
    got = read_datagen(p.data, ids, max_requests=2)
    which = json.loads((p.data / "capture.json").read_text())["conversations"][:2]
    convs = [json.loads(p.conversations.read_text())[i] for i in which]
    assert got.sequences() == [c["input_ids"] for c in convs]
    assert got.loss_mask.tolist() == [m for c in convs for m in c["loss_mask"][1:]]
    assert got.aux_hidden_states.shape[1] == len(ids) * 576


@settings(max_examples=15, deadline=None)
@given(lens=st.lists(st.integers(2, 9), min_size=1, max_size=4), prompt=st.integers(1, 5))
def test_sglang_server_round_trip(tmp_path_factory, lens, prompt):
    s = synthetic(lens, prompt=prompt)
    f = tmp_path_factory.mktemp("srv") / "responses.jsonl"
    write_sglang_server(s, f)
    got = read_sglang_server(f, s.aux_layer_ids, target_hidden=8)
    assert got.verifier_last_hidden_states is None  # a server returns aux states only
    assert_same_rows(got, s, verifier=False)
    # One hidden-state entry per completion token, prefill block first (as SGLang's own test kit checks).
    for line in f.read_text().splitlines():
        rec = json.loads(line)
        assert len(rec["meta_info"]["hidden_states"]) == len(rec["output_ids"]) == rec["meta_info"]["completion_tokens"]


def test_sglang_server_single_layer_rows_name_aux_capture_off(tmp_path):
    s = synthetic([6])
    one_layer = replace(s, aux_hidden_states=s.verifier_last_hidden_states, aux_layer_ids=(1,))
    f = tmp_path / "r.json"
    write_sglang_server(one_layer, f.with_suffix(".jsonl"))
    f.write_text(json.dumps([json.loads(x) for x in f.with_suffix(".jsonl").read_text().splitlines()]))
    with pytest.raises(InputError, match="not capturing aux hidden states"):
        read_sglang_server(f, (1, 2, 3), target_hidden=8)


@pytest.mark.parametrize("bad,match", [
    ({"input_ids": [1, 2]}, "not SGLang server responses"),
    ({"input_ids": [1, 2], "meta_info": {}}, "needs input_ids, output_ids"),
    ({"input_ids": [1, 2], "output_ids": [3], "meta_info": {"hidden_states": [[[0.0] * 24] * 5]}}, "5 hidden-state rows"),
    ({"input_ids": [1, 2], "output_ids": [3], "meta_info": {"hidden_states": [[0.0] * 24]}}, "prefill block"),
])
def test_sglang_server_bad_records(tmp_path, bad, match):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(InputError, match=match):
        read_sglang_server(f, (1, 2, 3), target_hidden=8)


def test_report_reads_both_layouts_like_the_states_file(tiny, tmp_path):
    """The same rows through each layout give the same report: the readers add nothing."""
    s = load_states(tiny / "states.safetensors")
    s = replace(s, first_token_ids=torch.zeros(len(s.seq_lens), dtype=torch.int64),
                loss_mask=torch.ones(s.num_tokens, dtype=torch.uint8))
    save_states(s, tmp_path / "states.safetensors")
    write_datagen(s, tmp_path / "datagen")
    write_sglang_server(s, tmp_path / "server.jsonl")
    verdicts = {}
    for name in ("states.safetensors", "datagen", "server.jsonl"):
        out = tmp_path / f"out-{name}"
        proc = subprocess.run([sys.executable, "-m", "difftest.cli", "report", str(tiny / "speculators"),
                               "--target", str(tiny / "target"), "--states", str(tmp_path / name), "--out", str(out)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode in (0, 1), proc.stderr[-2000:]
        rep = json.loads((out / "report.json").read_text())
        verdicts[name] = (rep["verdict"], [(p["probe"], p["status"], p["metrics"]) for p in rep["probes"]])
    assert verdicts["datagen"] == verdicts["states.safetensors"] == verdicts["server.jsonl"]
