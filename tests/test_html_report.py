"""report.html rendered in headless Chromium, the report schema, and baseline mode."""

import json
import re
import shutil
import subprocess

import pytest
from PIL import Image

from difftest.engines.base import ServingSetup
from difftest.pipeline import run
from difftest.report import build_report, validate_report, write_reports
from difftest.report.baseline import regressions
from tests.test_cli import difftest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def screenshot(html_file, png, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "headless Chromium is needed (Debian package chromium; the README's test command installs it)"
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600",
                    f"--screenshot={png}", html_file.as_uri()], capture_output=True, timeout=120, check=True)
    return Image.open(png).convert("RGB")


@pytest.fixture(scope="module")
def reports(tiny_inputs, tmp_path_factory):
    out = {}
    for name, serving in (("clean", ServingSetup()), ("fault", ServingSetup(aux_capture=False))):
        rep = build_report(run(tiny_inputs, serving=serving), command=["difftest", "report", name])
        validate_report(rep)
        out[name] = (rep, write_reports(rep, tmp_path_factory.mktemp(name)))
    return out


def test_html_is_self_contained(reports):
    for _, paths in reports.values():
        page = paths["html"].read_text()
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)|url\(\s*["']?https?:""", page)
        assert "data:image/png;base64," in page


@pytest.mark.parametrize("name,banner_rgb", [("clean", (0x1F, 0x7A, 0x3A)), ("fault", (0xB3, 0x26, 0x1E))])
def test_html_renders_in_chromium_with_the_verdict_on_top(reports, tmp_path, name, banner_rgb):
    rep, paths = reports[name]
    img = screenshot(paths["html"], tmp_path / "shot.png", tmp_path)
    assert img.size[0] >= 1000
    # What a reader sees first: the verdict banner, green for PARITY, red for DIVERGED.
    assert img.getpixel((600, 8)) == banner_rgb
    page = paths["html"].read_text()
    assert f"id='verdict'>{rep['verdict']}" in page
    if rep["first_divergence"]:
        first = rep["first_divergence"]["probe"]
        assert re.search(rf"<tr class=\"first\"><td><code>{re.escape(first)}</code>", page)
    assert "difftest report " + name in page  # the reproduce command


def test_baseline_passes_against_itself_and_catches_a_regression(reports):
    clean, fault = reports["clean"][0], reports["fault"][0]
    assert regressions(clean, clean, 2.0) == []
    found = regressions(fault, clean, 2.0)
    assert "verdict went from PARITY to DIVERGED" in found
    assert any(r.startswith("fc.input: pass -> missing") for r in found)
    assert any(r.startswith("new finding capture:aux_capture_off") for r in found)
    # The faulted run as its own baseline: a known divergence that did not grow passes.
    assert regressions(fault, fault, 2.0) == []


def test_baseline_catches_growth_beyond_the_factor(reports):
    clean = reports["clean"][0]
    grown = json.loads(json.dumps(clean))
    probe = next(p for p in grown["probes"] if p["probe"] == "logits")
    probe["metrics"]["rel_max"] = 50 * max(probe["metrics"]["rel_max"], clean["tolerance"]["rel_max"] * 1e-2)
    assert any(r.startswith("logits: rel_max") for r in regressions(grown, clean, 2.0))
    assert regressions(grown, clean, 100.0) == []


def test_baseline_mode_exit_codes(tiny, tmp_path):
    base = tmp_path / "base"
    assert difftest("report", tiny / "speculators", "--no-audit-config", "--out", base, "-q").returncode == 0
    same = difftest("report", tiny / "speculators", "--no-audit-config", "--out", tmp_path / "a",
                    "--baseline", base / "report.json")
    assert same.returncode == 0 and "baseline: 0 regression(s)" in same.stdout, same.stderr[-1500:]
    worse = difftest("report", tiny / "speculators", "--no-audit-config", "--serve-without-aux-capture",
                     "--out", tmp_path / "b", "--baseline", base / "report.json")
    assert worse.returncode == 1 and "verdict went from PARITY to DIVERGED" in worse.stdout
    rep = json.loads((tmp_path / "b" / "report.json").read_text())
    validate_report(rep)
    assert rep["baseline"]["regressions"]
    bad = difftest("report", tiny / "speculators", "--out", tmp_path / "c", "--baseline", tmp_path / "nope.json")
    assert bad.returncode == 2 and "baseline report not found" in bad.stderr


def test_the_banner_weight_follows_the_cost(reports, tmp_path):
    """A headline that costs nothing measurable is drawn as a difference to read (amber), not a
    collapse (red); the verdict word, and so the exit code's meaning, stays DIVERGED."""
    from difftest.report.html import render_html

    rep = json.loads(json.dumps(reports["fault"][0]))
    assert "class='banner DIVERGED'" in render_html(rep) and "<b>Fix:</b>" in render_html(rep)
    rep["diagnosis"]["ranked"][0].update(cost_accept_length=0.01, within_tolerance=True)
    assert "<b>Fix (optional: this costs nothing measurable on these states):</b>" in render_html(rep)
    html_file = tmp_path / "free.html"
    html_file.write_text(render_html(rep))
    assert "class='banner DIVERGED free'" in html_file.read_text()
    assert screenshot(html_file, tmp_path / "free.png", tmp_path).getpixel((600, 8)) == (0x8A, 0x6D, 0x00)
