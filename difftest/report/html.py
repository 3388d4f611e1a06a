"""report.html: one self-contained page (inline CSS, the plot as an inline PNG), read from
the same dict report.json holds, so the two can never disagree."""

from __future__ import annotations

import base64
import html
import io
import json
import shlex

from difftest.probes import PROBES, ProbeKind
from difftest.report.views import absent_params, comparisons, engine_summaries, fix_label, shared_config_verdict

# An exact zero has no place on a log axis; draw it at the bottom edge and say so.
LOG_FLOOR = 1e-12

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1b1f24;background:#fff}
main{max-width:1100px;margin:0 auto;padding:0 24px 48px}
.banner{padding:18px 24px;color:#fff;font-size:28px;font-weight:700}
.banner.PARITY{background:#1f7a3a}.banner.DIVERGED{background:#b3261e}
.banner.DIVERGED.free{background:#8a6d00}
.banner small{display:block;font-size:15px;font-weight:400;opacity:.95;margin-top:4px}
h2{margin-top:32px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.diag{background:#fff4e5;border-left:6px solid #d9822b;padding:12px 16px;margin-top:20px}
.fix{background:#eef6ff;border-left:6px solid #2f6fb3;padding:10px 16px;margin-top:10px}
table{border-collapse:collapse;width:100%;font-size:13px;margin-top:8px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}
tr.first td{background:#ffe3e0;font-weight:600}
td.fail,td.missing,td.shape_mismatch,td.error{color:#b3261e;font-weight:700}
td.pass{color:#1f7a3a}
td.benign{color:#8a6d00}
td.not_exercised{color:#a04a00;font-style:italic}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
pre{background:#f6f8fa;padding:10px;overflow-x:auto}
img.plot{max-width:100%;border:1px solid #d0d7de}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else _e(x)


def _table(headers: list[str], rows: list[list], row_classes: list[str] | None = None, cell_classes=None) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        cells = []
        for j, cell in enumerate(row):
            cc = cell_classes(i, j, cell) if cell_classes else ""
            cells.append(f'<td class="{cc}">{cell}</td>' if cc else f"<td>{cell}</td>")
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    return "\n".join(out + ["</table>"])


def _figure(size: tuple[float, float]):
    # A bare Figure on the Agg canvas: pyplot's state machine and backend selection cost a
    # third of a second of import on every report, for two images saved straight to bytes.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=110)
    FigureCanvasAgg(fig)
    return fig


def error_plot_png(report: dict) -> bytes:
    """Each activation probe's rel_max and rel_diff against its tolerance, dataflow order, log scale."""
    kinds = {p.name: p.kind for p in PROBES}
    rows = [p for p in report["probes"] if kinds.get(p["probe"]) is ProbeKind.ACTIVATION]
    names = [p["probe"] for p in rows]
    first = (report.get("first_divergence") or {}).get("probe")
    tol = report["tolerance"]
    fig = _figure((11, 4.2))
    ax = fig.subplots()
    x = range(len(rows))
    for key, marker, color, tol_key in (("rel_max", "o", "#2f6fb3", "rel_max"), ("rel_diff", "s", "#d9822b", "rel_diff")):
        ys = []
        for p in rows:
            v = p["metrics"].get(key)
            # A probe one engine never computed is a gap in the line, labelled below.
            ys.append(float("nan") if v is None or v != v else max(v, LOG_FLOOR))
        ax.plot(list(x), ys, marker=marker, color=color, label=f"{key} (engines' difference)")
        ax.axhline(tol[tol_key], color=color, linestyle="--", linewidth=1, label=f"{key} tolerance {tol[tol_key]:g}")
    for i, p in enumerate(rows):
        if p["status"] in ("missing", "shape_mismatch"):
            ax.annotate(p["status"].replace("_", " "), (i, LOG_FLOOR), textcoords="offset points", xytext=(0, 12),
                        ha="center", color="#b3261e", fontsize=8)
    if first in names:
        i = names.index(first)
        ax.axvspan(i - 0.4, i + 0.4, color="#b3261e", alpha=0.15, label=f"first divergence: {first}")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"relative error (zeros drawn at {LOG_FLOOR:g})")
    ax.set_title(f"Probe error vs tolerance ({tol['dtype']}), dataflow order")
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def acceptance_plot_png(acc: dict) -> bytes:
    """Each engine's chain reach (P(steps 1..j all accepted)) per step, with training's full_acc_j."""
    fig = _figure((7, 3.6))
    ax = fig.subplots()
    for side, marker in (("reference", "o"), ("candidate", "s")):
        e = acc[side]
        steps = range(1, e["steps"] + 1)
        ax.plot(list(steps), e["reach"], marker=marker,
                label=f"{e['engine']} (mean accept length {e['mean_accept_length']:.3f})")
    train = acc.get("training") or {}
    tr = [train[f"full_acc_{j}"] for j in range(acc["reference"]["steps"]) if f"full_acc_{j}" in train]
    if tr:
        ax.plot(list(range(1, len(tr) + 1)), tr, linestyle="--", marker="x", color="#555", label="training full_acc (held-out)")
    ax.set_xlabel("draft step j")
    ax.set_ylabel("P(steps 1..j accepted)")
    ax.set_xticks(list(range(1, acc["reference"]["steps"] + 1)))
    ax.set_ylim(0, max(0.05, max(acc["reference"]["reach"] + acc["candidate"]["reach"] + tr) * 1.15))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"Predicted acceptance on {acc['reference']['scored_rows']} rows")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _acceptance_html(report: dict, anchor: str = "") -> list[str]:
    parts = []
    acc = report.get("acceptance")
    if acc:
        k = acc["reference"]["steps"]
        rows = [[_e(e["engine"]), _fmt(e["mean_accept_length"])] +
                [f"{c:.3f} (reach {r:.3f})" for c, r in zip(e["conditional"], e["reach"])]
                for e in (acc["reference"], acc["candidate"])]
        train = acc.get("training") or {}
        if train:
            rows.append(["training (full_acc, held-out)", "-"] +
                        [f"reach {train[f'full_acc_{j}']:.3f}" if f"full_acc_{j}" in train else "-" for j in range(k)])
        png = base64.b64encode(acceptance_plot_png(acc)).decode()
        verdict = "agree" if acc["agree"] else "DISAGREE"
        parts.append(f"<h2 id='{anchor}acceptance'>Predicted acceptance (chain draft, greedy verification)</h2>"
                     f"<p>{acc['reference']['scored_rows']} rows scored against the target's greedy continuation "
                     f"({_e(acc['continuation_source'])}). Engines <b>{verdict}</b>: gap {acc['accept_length_gap']:+.3f}, "
                     f"tolerance ±{acc['tolerance_accept_length']}.</p>"
                     + _table(["engine", "mean accept length"] + [f"step {j + 1}" for j in range(k)], rows)
                     + "<ul>" + "".join(f"<li>{_e(x)}</li>" for x in acc["explanation"]) + "</ul>"
                     + f"<img class='plot' alt='acceptance plot' src='data:image/png;base64,{png}'>")
    tc = report.get("target_capture")
    if tc:
        rows = [[_e(c["side"]), c["chunk"], f"hidden_states[{c['nearest_hf_layer']}]" + ("" if c["matches"] else " (closest; no match)"),
                 _fmt(c["vs_nearest"]["rel_max"]), _fmt(c["vs_training"]["rel_max"]) if c.get("vs_training") else "-"]
                for c in tc["chunks"]]
        parts.append(f"<h2 id='{anchor}target-capture'>Target capture parity (measured)</h2>"
                     f"<p>{_e(tc['serving_engine'])}: {_e(tc['serving_description'])}. Training chunks: "
                     f"hidden_states{_e(tc['training_hf_ids'])}; serving chunks: {_e(tc['serving_hf_ids'])}.</p>"
                     + _table(["side", "chunk", "target layer it equals", "rel_max vs it", "vs training chunk (rel_max)"], rows))
    return parts


def _page(verdict: str, inner: list[str]) -> str:
    return "\n".join([f"<!doctype html><html><head><meta charset='utf-8'><title>difftest: {_e(verdict)}</title>"
                      f"<style>{CSS}</style></head><body>", *inner, "</body></html>"])


def _banner(report: dict, sub: str, anchor: str) -> str:
    verdict = report["verdict"]
    # The banner's weight follows the cost: a headline that costs nothing measurable is a
    # difference to read, not a collapse.
    heads = [(rep.get("diagnosis") or {}).get("ranked") or [{}] for rep in comparisons(report).values()
             if rep.get("diagnosis")]
    weight = " free" if heads and all(h[0].get("within_tolerance") for h in heads) else ""
    return f"<div class='banner {_e(verdict)}{weight}' id='{anchor}'>{_e(verdict)}<small>{_e(sub)}</small></div>"


def render_html(report: dict) -> str:
    from difftest.report.build import acceptance_lead, verdict_line

    if report.get("diagnosis"):
        sub = verdict_line(report).split(": ", 1)[-1]
    else:
        sub = (acceptance_lead(report) + f"every probe agrees within the {report['tolerance']['dtype']} tolerance; "
               "no audit errors")
    parts = [_banner(report, sub, "verdict"), "<main>", *_comparison_html(report, ""), "</main>"]
    if report.get("command"):
        parts.insert(-1, f"<h2>Reproduce</h2><pre id='command'>{_e(shlex.join(report['command']))}</pre>")
    return _page(report["verdict"], parts)


def render_set_html(report: dict) -> str:
    """The set's banner and one row per serving engine, then each comparison whole, under its
    engine's name (ids prefixed with it, so each section's anchors stay its own)."""
    from difftest.report.build import causes_text, verdict_line

    rows = [[f"<a href='#{_e(r.engine)}'>{_e(r.engine)}</a>", _e(r.verdict), _e(r.accept_length),
             _e(r.first_divergence), f"<code>{_e(r.cause)}</code>" if r.cause else "-", _e(r.cost)]
            for r in engine_summaries(report)]
    parts = [_banner(report, verdict_line(report).split(": ", 1)[-1], "verdict"), "<main>",
             "<h2>Serving engines</h2>" + _table(["serving engine", "verdict", "predicted accept length",
                                                 "first divergence", "root cause", "its cost"], rows,
                                                cell_classes=lambda i, j, c: "pass" if j == 1 and c == "PARITY" else
                                                ("fail" if j == 1 else ""))]
    for name, rep in report["comparisons"].items():
        sub = causes_text(rep) or "every probe agrees; no audit errors"
        parts += [f"<section id='{_e(name)}'><h1>{_e(name)}</h1>", _banner(rep, sub, f"{name}-verdict"),
                  *_comparison_html(rep, f"{name}-"), "</section>"]
    if report.get("command"):
        parts.append(f"<h2>Reproduce</h2><pre id='command'>{_e(shlex.join(report['command']))}</pre>")
    parts.append("</main>")
    return _page(report["verdict"], parts)


def _comparison_html(report: dict, anchor: str) -> list[str]:
    """One comparison's body: diagnosis, probes, acceptance, audit, deployment, ledger."""
    diag = report.get("diagnosis")
    first = report.get("first_divergence")
    parts: list[str] = []
    if diag:
        parts.append(f"<div class='diag'><b>Root cause: <code>{_e(diag['cause'])}</code></b><p>{_e(diag['explanation'])}</p>")
        if diag.get("evidence"):
            parts.append("<ul>" + "".join(f"<li>{_e(e)}</li>" for e in diag["evidence"]) + "</ul>")
        if diag.get("also"):
            parts.append(f"<p>Other audit errors: {_e(', '.join(diag['also']))}</p>")
        parts.append(f"</div><div class='fix'><b>{_e(fix_label(diag))}:</b> {_e(diag['fix'])}</div>")
        if diag.get("ranked"):
            parts.append("<h2>What costs acceptance (most first)</h2>" + _table(
                ["cause", "found at", "side", "cost in mean accept length", "measured as"],
                [[f"<code>{_e(e['cause'])}</code>", _e(e["found_at"]), _e(e["side"]),
                  "not measured" if e.get("cost_accept_length") is None else f"{e['cost_accept_length']:+.3f}", _e(e["how"])]
                 for e in diag["ranked"]]))
    ck = report["checkpoint"]
    parts.append(f"<p>Checkpoint <code>{_e(ck['path'])}</code> ({_e(ck['format'])} format), "
                 f"{report['inputs']['num_tokens']} tokens in {report['inputs'].get('num_requests', '?')} requests, "
                 f"dtype {_e(report['tolerance']['dtype'])}, device {_e(report['environment']['device'])}.</p>")

    png = base64.b64encode(error_plot_png(report)).decode()
    parts.append(f"<h2>Probe error against tolerance</h2><img class='plot' alt='probe error plot' src='data:image/png;base64,{png}'>")

    rows, classes = [], []
    for p in report["probes"]:
        m = p["metrics"]
        rows.append([f"<code>{_e(p['probe'])}</code>", _e(p["status"]), _fmt(m.get("rel_max", "")), _fmt(m.get("rel_diff", "")),
                     _fmt(m.get("cosine", "")), _fmt(m.get("agreement", "")),
                     _e(", ".join(f"{k}={v:.3g}" for k, v in p["would_pass_at"].items())), _e(p["detail"])])
        classes.append("first" if first and p["probe"] == first["probe"] else "")
    parts.append("<h2>Probes (dataflow order)</h2>" + _table(
        ["probe", "status", "rel_max", "rel_diff", "cosine", "agreement", "would pass at", "detail"], rows, classes,
        lambda i, j, c: report["probes"][i]["status"] if j == 1 else ""))
    tol = report["tolerance"]
    parts.append(f"<p>Tolerance ({_e(tol['dtype'])}): rel_max {tol['rel_max']}, rel_diff {tol['rel_diff']}, "
                 f"token near-tie margin {tol['near_tie_margin']}.</p>")

    parts += _acceptance_html(report, anchor)

    audit = report.get("audit") or {}
    if audit.get("findings"):
        parts.append("<h2>Audit findings</h2>" + _table(
            ["check", "severity", "cause", "finding", "measured"],
            [[_e(f["check"]), _e(f["severity"]), f"<code>{_e(f['cause'])}</code>", _e(f["message"]),
              _e(json.dumps(f.get("measured") or {}, default=str)[:300])] for f in audit["findings"]],
            cell_classes=lambda i, j, c: audit["findings"][i]["severity"] if j == 1 else ""))
    dep = report.get("deployment")
    training, serving = report["engines"]["reference"]["name"], report["engines"]["candidate"]["name"]
    if not dep:
        from difftest.report.build import no_deployment

        parts.append(f"<h2 id='{anchor}deployment'>Deployment</h2><p>{_e(no_deployment(report))}</p>")
    else:
        parts.append(f"<h2 id='{anchor}deployment'>Deployment: trained vs served</h2>"
                     f"<p>Served directory <code>{_e(dep['served_dir'])}</code>, launched as:</p>"
                     f"<pre>{_e(shlex.join(dep['launch_argv']))}</pre>" + (
                         f"<p><b>{_e(serving)} refuses this directory</b> before loading any weight: {_e(dep['refused'])}</p>"
                         if dep.get("refused") else "") + _table(
                         ["launch setting", "value", "what it changes in the draft", "simulated here"],
                         [[f"<code>{_e(r['flag'])}</code>", _e(r["value"]) + ("" if r["given"] else " (default)"),
                           _e(r["effect"]), _e(r["how_run"])] for r in dep["launch"]]))
        parts.append(_table(["training tensor", "served tensor", "status", f"{serving} parameter"],
                            [[_e(r["training"] or "-"), _e(r["served"] or "-"), _e(r["status"]), _e(", ".join(r["into"]) or "-")]
                             for r in dep["tensors"]]))
        changed = [r for r in dep["config"] if r["status"] != "carried"]
        if changed:
            parts.append("<p>Config fields not as a conversion writes them:</p>" + _table(
                ["field", "conversion writes", "served", "status"],
                [[_e(r["field"]), f"<code>{_e(r['expected'])}</code>", f"<code>{_e(r['served'])}</code>",
                  f"<b>{_e(r['status'])}</b>"] for r in changed]))
    cap = audit.get("capture")
    if cap:
        parts.append("<h2>Target capture (HF hidden_states ids)</h2>" + _table(
            ["side", "layers"],
            [["training data (states file)", _e(cap["states_hf_ids"])],
             ["speculators resolves", _e(cap["training"]["hf_layer_ids"])],
             [_e(f"{cap['serving']['target_class']} would capture"), _e(cap["serving"]["hf_layer_ids"])]]))
        parts.append("<ul>" + "".join(f"<li><code>{_e(s)}</code></li>" for s in cap["serving"]["steps"]) + "</ul>")
    if audit.get("conversion"):
        parts.append("<h2>Config translation (training config → serving config)</h2>" + _table(
            ["field", "training", "serving", "carried"],
            [[_e(r["field"]), f"<code>{_e(r['training'])}</code>", f"<code>{_e(r['serving'])}</code>",
              "yes" if r["carried"] else "<b>no</b>"] for r in audit["conversion"]]))
    if audit.get("config"):
        shared = shared_config_verdict(audit["config"])
        parts.append(f"<h2>Config fields: does {_e(serving)} honor them? (measured)</h2>" + (
            f"<p>All {len(audit['config'])} fields {_e(shared)}.</p>" if shared else _table(
                ["field", "value", "verdict", f"{training} effect", f"{serving} effect"],
                [[_e(r["field"]), f"<code>{_e(r['value'])}</code>", _e(r["verdict"]),
                  _fmt(r.get("training_effect", "")), _fmt(r.get("serving_effect", ""))] for r in audit["config"]])))
    ledgers = audit.get("ledgers")
    if ledgers:
        ref_t, cand_t = ledgers["reference"]["tensors"], ledgers["candidate"]["tensors"]

        def cell(t):
            return "-" if not t else _e(f"{t['fate']} → {', '.join(t['into'])}" if t.get("into") else t["fate"])

        parts.append("<h2>Load ledger</h2>" + _table(
            ["checkpoint tensor", training, serving],
            [[f"<code>{_e(n)}</code>", cell(ref_t.get(n)), cell(cand_t.get(n))] for n in sorted(set(ref_t) | set(cand_t))],
            cell_classes=lambda i, j, c: "error" if j and "dropped" in c else ""))
        absent = absent_params(report)
        if absent:
            parts.append("<p>Parameters no checkpoint tensor filled:</p>" + _table(
                ["engine", "parameter", "fate", "why"],
                [[_e(a.engine), f"<code>{_e(a.param)}</code>", _e(a.fate), _e(a.why)] for a in absent],
                cell_classes=lambda i, j, c: "error" if j == 2 and absent[i].fate != "shared" else ""))
    if report.get("baseline"):
        b = report["baseline"]
        parts.append(f"<h2>Baseline</h2><p>Against <code>{_e(b['path'])}</code> (factor {b['factor']}): "
                     f"{'no regressions' if not b['regressions'] else ''}</p>")
        if b["regressions"]:
            parts.append("<ul>" + "".join(f"<li>{_e(r)}</li>" for r in b["regressions"]) + "</ul>")
    env = report["environment"]
    parts.append("<h2>Environment</h2><p>" + _e(", ".join(f"{k} {v}" for k, v in env["packages"].items())) +
                 f", python {_e(env['python'])}</p>")
    return parts
