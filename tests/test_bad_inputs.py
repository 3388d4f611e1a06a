"""Bad input fails closed: the CLI, as a subprocess, on a corpus of broken inputs.

Every case must exit 2 with exactly one line on stderr that says what was found, leave
the inputs byte-for-byte unchanged and write no report. The readers are also fuzzed:
corrupted bytes and configs may only yield the clean InputError or a valid result.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from difftest.checkpoint import load_checkpoint
from difftest.errors import InputError
from difftest.states import load_states, save_states
from tests.conftest import tree_hash
from tests.test_cli import difftest


def _config(ckpt, edit):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _tensors(ckpt, edit):
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f))


def _layer(c):
    return c["transformer_layer_config"]


def _truncate(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _states(tmp, edit):
    st_ = load_states(tmp / "tiny" / "states.safetensors")
    edit(st_)
    path = tmp / "bad_states.safetensors"
    save_states(st_, path)
    return path


def _tiny_sequences(tmp):
    """Tiny's states with first tokens (it stores none), so the capture layouts can be written."""
    from dataclasses import replace

    s = load_states(tmp / "tiny" / "states.safetensors")
    return replace(s, first_token_ids=torch.ones(len(s.seq_lens), dtype=torch.int64))


def _server(tmp, edit):
    """Tiny's states as SGLang /generate responses (.jsonl), one request edited."""
    from difftest.readers import write_sglang_server

    path = tmp / "responses.jsonl"
    write_sglang_server(_tiny_sequences(tmp), path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    edit(records[1])
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return ["--states", path]


def _datagen(tmp, edit):
    """Tiny's states in speculators' datagen layout, file hs_1 edited."""
    from difftest.readers import write_datagen

    path = tmp / "datagen"
    write_datagen(_tiny_sequences(tmp), path)
    f = path / "hidden_states" / "hs_1.safetensors"
    t = load_file(str(f))
    edit(t)
    save_file(t, str(f))
    return ["--states", path]


def _set_row_value(rec, row, value):
    blocks = rec["meta_info"]["hidden_states"]
    (blocks[0][row] if row < len(blocks[0]) else blocks[row - len(blocks[0]) + 1])[3] = value


# name -> (how to break a scratch copy of tiny (returns extra CLI args), words the error must contain)
CORPUS = {
    "truncated_safetensors": (lambda d, t: _truncate(d), "not a readable safetensors file"),
    "garbage_safetensors": (lambda d, t: (d / "model.safetensors").write_bytes(b"\x00" * 64), "not a readable safetensors file"),
    "config_missing": (lambda d, t: (d / "config.json").unlink(), "config.json not found; a draft is a directory in speculators"),
    "config_unparsable": (lambda d, t: (d / "config.json").write_text("{\"a\": "), "not valid JSON"),
    "config_not_object": (lambda d, t: (d / "config.json").write_text("[1, 2]"), "expected a JSON object"),
    "config_field_missing": (lambda d, t: _config(d, lambda c: _layer(c).pop("hidden_size")), "malformed field"),
    # JSON's Infinity parses to a float that int() cannot take (found by the config fuzz below).
    "config_field_infinite": (lambda d, t: _config(d, lambda c: _layer(c).__setitem__("head_dim", float("inf"))), "malformed field"),
    "zero_heads_no_head_dim": (lambda d, t: _config(d, lambda c: (_layer(c).pop("head_dim", None),
                                                                   _layer(c).update(num_attention_heads=0))),
                               "num_attention_heads is 0, expected a positive integer"),
    # transformers keeps a 0 it is given (only None takes the default), and then divides by it
    # (found by the config-size fuzz below).
    "zero_head_dim": (lambda d, t: _config(d, lambda c: _layer(c).update(head_dim=0)), "head_dim is 0, expected a positive"),
    "zero_kv_heads": (lambda d, t: _config(d, lambda c: _layer(c).update(num_key_value_heads=0)),
                      "num_key_value_heads is 0, expected a positive"),
    "heads_vs_kv_heads": (lambda d, t: _config(d, lambda c: _layer(c).update(num_key_value_heads=3)), "not a multiple of"),
    "heads_vs_weights": (lambda d, t: _config(d, lambda c: _layer(c).update(num_attention_heads=8, num_key_value_heads=8)),
                         "q_proj.weight has shape"),
    "vocab_vs_embedding_rows": (lambda d, t: _config(d, lambda c: _layer(c).update(vocab_size=300)), "embed_tokens.weight has shape"),
    "draft_vocab_vs_lm_head_rows": (lambda d, t: _config(d, lambda c: c.update(draft_vocab_size=90)), "lm_head.weight has shape"),
    "draft_vocab_above_target": (lambda d, t: _config(d, lambda c: c.update(draft_vocab_size=999)), "exceeds the target vocab_size"),
    "nan_in_weights": (lambda d, t: _tensors(d, lambda x: x["fc.weight"].view(-1)[:3].fill_(float("nan"))), "NaN/Inf"),
    "inf_in_weights": (lambda d, t: _tensors(d, lambda x: x["lm_head.weight"].view(-1)[7:9].fill_(float("inf"))), "NaN/Inf"),
    "d2t_float": (lambda d, t: _tensors(d, lambda x: x.__setitem__("d2t", x["d2t"].float())), "d2t has dtype float32"),
    "d2t_wrong_length": (lambda d, t: _tensors(d, lambda x: x.__setitem__("d2t", x["d2t"][:-4])), "d2t has shape"),
    "d2t_out_of_range": (lambda d, t: _tensors(d, lambda x: x.__setitem__("d2t", x["d2t"] + 10_000)), "expected inside [0, 256)"),
    "t2d_float": (lambda d, t: _tensors(d, lambda x: x.__setitem__("t2d", x["t2d"].float() * 0.5)), "t2d has dtype float32"),
    "t2d_wrong_length": (lambda d, t: _tensors(d, lambda x: x.__setitem__("t2d", x["t2d"][:100])), "t2d has shape"),
    "states_width": (lambda d, t: ["--states", _states(t, lambda s: setattr(s, "aux_hidden_states", s.aux_hidden_states[:, :-8]))],
                     "aux_hidden_states width"),
    "states_length": (lambda d, t: ["--states", _states(t, lambda s: setattr(s, "seq_lens", s.seq_lens + 1))], "must be positive and sum to"),
    "states_missing": (lambda d, t: ["--states", t / "nope.safetensors"],
                       "hidden-states file not found; --states takes a difftest states file"),
    "states_not_safetensors": (lambda d, t: ((t / "junk.safetensors").write_text("not tensors"), ["--states", t / "junk.safetensors"])[-1],
                               "not a readable safetensors file"),
    "states_json_not_server_responses": (lambda d, t: ["--states", t / "tiny" / "target" / "config.json"],
                                         "not SGLang server responses"),
    "states_server_rows_one_layer": (lambda d, t: ((t / "r.jsonl").write_text(json.dumps(
        {"input_ids": [1, 2], "output_ids": [3], "meta_info": {"hidden_states": [[[0.5] * 64] * 2]}}) + "\n"),
        ["--states", t / "r.jsonl"])[-1], "not capturing aux hidden states"),
    # Every states layout is checked like the difftest states file, naming the file and the row.
    "server_nan_row": (lambda d, t: _server(t, lambda r: _set_row_value(r, 2, float("nan"))),
                       "request 1: hidden-state row 2 holds NaN or Inf"),
    "server_ragged_rows": (lambda d, t: _server(t, lambda r: r["meta_info"]["hidden_states"][0][1].pop()),
                           "request 1: hidden-state row 1 has"),
    "server_float_id": (lambda d, t: _server(t, lambda r: r["output_ids"].__setitem__(0, 3.5)),
                        "request 1: output_ids[0] is 3.5"),
    "server_id_outside_vocab": (lambda d, t: _server(t, lambda r: r["input_ids"].__setitem__(1, 99999)),
                                "token id 99999 at position 1 is outside the target vocab"),
    "datagen_nan_row": (lambda d, t: _datagen(t, lambda x: x["hidden_states"][3, 0, 5].fill_(float("inf"))),
                        "hs_1.safetensors: hidden_states row 3 holds NaN or Inf"),
    "datagen_float_ids": (lambda d, t: _datagen(t, lambda x: x.__setitem__("token_ids", x["token_ids"].float())),
                          "hs_1.safetensors: token_ids must be integer ids"),
    "datagen_id_outside_vocab": (lambda d, t: _datagen(t, lambda x: x["token_ids"].__setitem__(2, -4)),
                                 "token id -4 at position 2 is outside the target vocab"),
    "states_nan_row": (lambda d, t: ["--states", _states(t, lambda s: s.aux_hidden_states[7, 1].fill_(float("nan")))],
                       "aux_hidden_states row 7 holds NaN or Inf"),
    "states_id_outside_vocab": (lambda d, t: ["--states", _states(t, lambda s: s.input_ids.__setitem__(5, 10 ** 6))],
                                "input_ids[5] is 1000000, outside the target vocab"),
    # A dtype label the stored weights cannot be cast to exactly: the engines would run different weights.
    "dtype_label_over_other_weights": (lambda d, t: (_tensors(d, lambda x: x.update(
        {k: v.half() for k, v in x.items() if v.is_floating_point()})), _config(d, lambda c: c.update(dtype="bfloat16")))[-1],
        "config dtype says bfloat16 but the weights are stored as float16"),
    "target_missing": (lambda d, t: ["--target", t / "no_target"], "no_target"),
    "unknown_format": (lambda d, t: (d / "config.json").write_text(json.dumps({"model_type": "llama"})), "unknown checkpoint format"),
    "pickle_refused": (lambda d, t: (torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin"),
                                     (d / "model.safetensors").unlink()), "pass --allow-pickle"),
    "pickle_with_code": (lambda d, t: (torch.save({"x": torch.zeros(1), "f": shutil.rmtree}, d / "pytorch_model.bin"),
                                       (d / "model.safetensors").unlink(), ["--allow-pickle"])[-1], "weights_only=True"),
    "checkpoint_missing": (lambda d, t: shutil.rmtree(d), "checkpoint directory not found"),
    # Size fields are bounded before anything is built (a million layers grew memory without bound).
    "layers_beyond_the_weights": (lambda d, t: _config(d, lambda c: _layer(c).update(num_hidden_layers=1_000_000)),
                                  "num_hidden_layers is 1000000"),
    "positions_unbounded": (lambda d, t: _config(d, lambda c: _layer(c).update(max_position_embeddings=1e12)),
                            "max_position_embeddings is 1000000000000"),
    "layer_types_vs_layers": (lambda d, t: _config(d, lambda c: _layer(c).update(layer_types=["full_attention"] * 3)),
                              "layer_types has 3 entries"),
    "intermediate_unbacked": (lambda d, t: (_tensors(d, lambda x: [x.pop(k) for k in list(x) if ".mlp." in k]),
                                            _config(d, lambda c: _layer(c).update(intermediate_size=10 ** 9)))[-1],
                              "imply"),
    # These machines have no GPU: asking for one is the user's mistake, not an internal error.
    "cuda_without_a_gpu": (lambda d, t: ["--device", "cuda"], "no CUDA device"),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_broken_input_is_one_line_exit_2_and_inputs_unchanged(tiny_copy, tmp_path, case):
    break_it, words = CORPUS[case]
    ckpt = tiny_copy / "speculators"
    extra = break_it(ckpt, tmp_path)
    extra = extra if isinstance(extra, list) else []
    before = tree_hash(tmp_path)
    out = tmp_path / "out"
    proc = difftest("report", ckpt, *map(str, extra), "--no-audit-config", "--out", out)
    assert proc.returncode == 2, (case, proc.stdout[-500:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("difftest: error:"), proc.stderr[-2000:]
    assert words in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())
    assert tree_hash(tmp_path) == before


def test_pickled_weights_load_with_the_flag_and_give_the_same_verdict(tiny_copy, tmp_path):
    ckpt = tiny_copy / "speculators"
    torch.save(load_file(str(ckpt / "model.safetensors")), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    before = tree_hash(tiny_copy)
    proc = difftest("report", ckpt, "--allow-pickle", "--no-audit-config", "--out", tmp_path / "out", "-q")
    assert proc.returncode == 0 and proc.stdout.startswith("PARITY"), proc.stderr[-2000:]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["checkpoint"]["path"] == str(ckpt)
    assert tree_hash(tiny_copy) == before


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_bytes_give_a_clean_error_or_a_checkpoint(tiny, tmp_path_factory, data):
    from difftest.validate import validate_checkpoint

    d = tmp_path_factory.mktemp("fz")
    shutil.copytree(tiny / "speculators", d / "c")
    f = d / "c" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    # Header (length + JSON) and body both: flip bytes, or cut the file short.
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, min(len(raw) - 1, data.draw(st.sampled_from([64, 512, len(raw) - 1])))))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    f.write_bytes(bytes(raw))
    try:
        ckpt = load_checkpoint(d / "c")
        validate_checkpoint(ckpt)
        dict(ckpt.tensors())
    except InputError:
        pass


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_configs_give_a_clean_error_or_a_checkpoint(tiny, tmp_path_factory, data):
    from difftest.validate import validate_checkpoint

    d = tmp_path_factory.mktemp("fzc")
    shutil.copytree(tiny / "speculators", d / "c")
    cfg = json.loads((d / "c" / "config.json").read_text())
    for _ in range(data.draw(st.integers(1, 4))):
        layer = cfg.get("transformer_layer_config")
        node = layer if isinstance(layer, dict) and data.draw(st.booleans()) else cfg
        if not isinstance(node, dict) or not node:
            break
        key = data.draw(st.sampled_from(sorted(node)))
        if data.draw(st.booleans()):
            node.pop(key)
        else:
            node[key] = data.draw(json_values)
    (d / "c" / "config.json").write_text(json.dumps(cfg))
    try:
        validate_checkpoint(load_checkpoint(d / "c"))
    except InputError:
        pass


@FUZZ
@given(data=st.data())
def test_fuzzed_states_files_give_a_clean_error_or_states(tiny, tmp_path_factory, data):
    d = tmp_path_factory.mktemp("fzs")
    raw = bytearray((tiny / "states.safetensors").read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, min(len(raw) - 1, data.draw(st.sampled_from([64, 1024, len(raw) - 1])))))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    (d / "s.safetensors").write_bytes(bytes(raw))
    try:
        load_states(d / "s.safetensors")
    except InputError:
        pass


SIZE_FIELDS = ("num_hidden_layers", "intermediate_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "max_position_embeddings", "vocab_size")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_config_sizes_are_refused_or_backed_by_the_weights(tiny, tmp_path_factory, data):
    """A config that passes validation builds no more than the weights (plus the shared embedding
    and a poisoned head) back: measured on speculators' own model class, built on the meta device."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from difftest.validate import SLACK_PARAMS, validate_checkpoint

    d = tmp_path_factory.mktemp("fzsize") / "c"
    shutil.copytree(tiny / "speculators", d)
    cfg = json.loads((d / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    for name in data.draw(st.lists(st.sampled_from(SIZE_FIELDS), min_size=1, max_size=3, unique=True)):
        layer[name] = data.draw(st.one_of(st.integers(-2, 4), st.sampled_from([layer[name], 2 * layer[name], 10 ** 6, 10 ** 12])))
    if data.draw(st.booleans()):
        layer["layer_types"] = ["full_attention"] * data.draw(st.integers(0, 3))
    (d / "config.json").write_text(json.dumps(cfg))
    try:
        ckpt = load_checkpoint(d)
        validate_checkpoint(ckpt)
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    config = Eagle3SpeculatorConfig.from_pretrained(str(d))
    with torch.device("meta"):
        built = sum(p.numel() for p in Eagle3DraftModel(config).parameters())
    s = ckpt.spec
    held = sum(ckpt.shape(n).numel() for n in ckpt.tensor_names())
    assert built <= held + (s.target_vocab_size + s.draft_vocab_size) * s.hidden_size + SLACK_PARAMS, (layer, built, held)


ROW_VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans(), st.none(),
                       st.text(max_size=2), st.lists(st.floats(), max_size=2))


@FUZZ
@given(data=st.data())
def test_fuzzed_server_rows_give_a_clean_error_or_finite_states(tmp_path_factory, data):
    """Ragged rows, odd values, odd ids: the server reader returns finite, in-vocab states or one clean error."""
    from difftest.readers import read_sglang_server, write_sglang_server
    from difftest.states import CapturedStates

    path = tmp_path_factory.mktemp("fzr") / "r.jsonl"
    g = torch.Generator().manual_seed(0)
    write_sglang_server(CapturedStates(
        input_ids=torch.randint(0, 100, (9,), generator=g), seq_lens=torch.tensor([4, 5]),
        aux_hidden_states=torch.randn(9, 8, generator=g), verifier_last_hidden_states=None, aux_layer_ids=(1, 2),
        loss_mask=torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.uint8),
        first_token_ids=torch.tensor([3, 4])), path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for _ in range(data.draw(st.integers(1, 4))):
        rec = data.draw(st.sampled_from(records))
        what = data.draw(st.sampled_from(["value", "drop_value", "add_row", "id", "drop_block"]))
        blocks = rec["meta_info"]["hidden_states"]
        rows = blocks[0] + blocks[1:]
        row = data.draw(st.sampled_from(rows))
        if what == "value":
            row[data.draw(st.integers(0, len(row) - 1))] = data.draw(ROW_VALUES)
        elif what == "drop_value" and row:
            row.pop()
        elif what == "add_row":
            blocks.append(data.draw(st.lists(st.floats(-2, 2), max_size=9)))
        elif what == "id":
            ids = rec[data.draw(st.sampled_from(["input_ids", "output_ids"]))]
            ids[data.draw(st.integers(0, len(ids) - 1))] = data.draw(st.one_of(st.integers(-5, 200), ROW_VALUES))
        elif what == "drop_block" and len(blocks) > 1:
            blocks.pop()
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    try:
        states = read_sglang_server(path, (1, 2), target_hidden=4, vocab_size=100)
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    assert bool(torch.isfinite(states.aux_hidden_states).all())
    assert int(states.input_ids.min()) >= 0 and int(states.input_ids.max()) < 100
