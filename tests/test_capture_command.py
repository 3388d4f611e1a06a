"""`difftest capture` through the CLI: it writes states a report reads, refuses prompts that do
not fit the target in one line (exit 2, no file), and never writes inside an input."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tree_hash
from tests.test_cli import difftest
from tests.test_outputs_and_cli_surface import one_error_line


def _capture(tiny, prompts, out, *extra):
    return difftest("capture", tiny / "speculators", "--target", tiny / "target", "--prompts", prompts, "--out", out,
                    *extra)


def test_captured_states_are_what_a_report_reads(tiny, tmp_path):
    before = tree_hash(tiny)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": list(range(5 + i, 40 + 3 * i))}) for i in range(3)))
    proc = _capture(tiny, prompts, tmp_path / "s.safetensors")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 requests" in proc.stdout
    report = difftest("report", tiny / "speculators", "--target", tiny / "target", "--states", tmp_path / "s.safetensors",
                      "--out", tmp_path / "out", "-q")
    assert report.returncode == 0 and report.stdout.startswith("PARITY"), report.stdout + report.stderr[-2000:]
    assert tree_hash(tiny) == before


@pytest.mark.parametrize("content,words", [
    ("", ["no prompts"]),
    ("{not json", ["not JSON or JSONL"]),
    (json.dumps([{"text": "hi"}]), ["neither input_ids nor messages", "input_ids"]),
    (json.dumps([{"input_ids": [1, 2, 10 ** 6]}]), ["outside the target's vocabulary"]),
    (json.dumps([{"input_ids": [3]}]), ["at least two"]),
    (json.dumps([{"input_ids": [1, 2, 3], "loss_mask": [1, 0]}]), ["one per input id"]),
    (json.dumps([{"input_ids": list(range(2, 60)) * 10}]), ["max_position_embeddings"]),
    (json.dumps([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]),
     ["no tokenizer", "give input_ids instead"]),
])
def test_prompts_that_do_not_fit_are_one_line_and_write_nothing(tiny, tmp_path, content, words):
    prompts = tmp_path / "p.json"
    prompts.write_text(content)
    one_error_line(_capture(tiny, prompts, tmp_path / "s.safetensors"), *words)
    assert not (tmp_path / "s.safetensors").exists()


def test_capture_never_writes_inside_an_input_or_over_a_file(tiny_copy, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"input_ids": [5, 6, 7, 8]}]))
    one_error_line(_capture(tiny_copy, prompts, tiny_copy / "speculators" / "s.safetensors"), "inside an input")
    (tmp_path / "s.safetensors").write_text("keep")
    one_error_line(_capture(tiny_copy, prompts, tmp_path / "s.safetensors"), "exists", "--force")
    assert (tmp_path / "s.safetensors").read_text() == "keep"
