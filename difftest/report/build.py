"""Turn a RunResult into report.json (versioned schema) and report.md, written atomically."""

from __future__ import annotations

import json
import os
import platform
import shlex
import tempfile
from importlib import metadata
from pathlib import Path

from difftest.pipeline import RunResult
from difftest.report.views import absent_params, engine_summaries, fix_label, shared_config_verdict

SCHEMA_VERSION = "1.0"
SCHEMA_FILE = Path(__file__).with_name("schema.json")
ENGINE_PACKAGES = ("torch", "sglang", "speculators", "transformers", "safetensors", "numpy")


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ENGINE_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def verdict_of(result: RunResult) -> str:
    # An audit error is a divergence too: the serving draft would compute something else
    # (other layers, other ids) even where these two runs, fed the same inputs, agree.
    return "PARITY" if result.diagnosis is None else "DIVERGED"


def build_set_report(reports: dict[str, dict], command: list[str] | None = None) -> dict:
    """Training compared with several serving engines: each comparison whole, under its engine's
    name; the verdict is PARITY only if every one is."""
    verdict = "PARITY" if all(r["verdict"] == "PARITY" for r in reports.values()) else "DIVERGED"
    return {"schema_version": SCHEMA_VERSION, "verdict": verdict, "serving_engines": list(reports),
            "comparisons": reports, "command": command or []}


def verdict_line(report: dict) -> str:
    """One line: the verdict, the cause that costs the most acceptance where it was found, and
    each other cause at its own place with its cost (a probe is never paired with a cause
    found elsewhere). For a set: every engine's accept length first, then each engine's causes."""
    if "comparisons" in report:
        lead = set_acceptance_lead(report)
        per_engine = "; ".join(f"{name}: {causes_text(rep) or rep['verdict']}"
                               for name, rep in report["comparisons"].items())
        return f"{report['verdict']}: {lead}{per_engine}"
    lead = acceptance_lead(report)
    causes = causes_text(report)
    if not causes:
        return f"{report['verdict']}: {lead.rstrip('; ')}" if lead else report["verdict"]
    return f"{report['verdict']}: {lead}{causes}"


def causes_text(report: dict) -> str:
    """The causes of one comparison, most costly first, each where it was found ('' at parity)."""
    diag = report.get("diagnosis")
    if not diag:
        return ""
    first = report.get("first_divergence")
    ranked = diag.get("ranked") or [{"cause": diag["cause"], "found_at": diag.get("found_at"), "side": "serving",
                                     "cost_accept_length": None}]

    def where(entry: dict) -> str:
        at = entry.get("found_at") or ""
        if first and at == first["probe"]:
            return f"first divergence at {at} ({entry['cause']})"
        if entry.get("side") == "serving" and not first:
            return f"audit found {entry['cause']} (probes agree)"
        if entry.get("side") == "serving" and not at.startswith("audit"):
            return f"divergence at {at} ({entry['cause']})"
        return f"{entry['cause']} (found at {at})"

    def cost(entry: dict) -> str:
        c = entry.get("cost_accept_length")
        if c is None:
            return ""
        if entry.get("within_tolerance"):
            return ", costs nothing measurable"
        if c < 0:
            return f", costs {c:+.2f} accept length (the serving engine does better here)"
        return f", costs {c:+.2f} accept length"

    head, rest = ranked[0], ranked[1:]
    return f"{where(head)}{cost(head)}" + "".join(f"; also {where(e)}{cost(e)}" for e in rest)


def acceptance_lead(report: dict) -> str:
    """What the user came for, before any probe name: each engine's predicted accept length, and
    training's, when chains were drafted and rows scored ('' otherwise)."""
    from difftest.audit.shortfall import expected_accept_length

    acc = report.get("acceptance")
    if not acc or not acc["reference"]["scored_rows"]:
        return ""
    ref, cand = acc["reference"], acc["candidate"]
    lead = (f"accept length {cand['engine']} {cand['mean_accept_length']:.2f}, "
            f"{ref['engine']} {ref['mean_accept_length']:.2f}")
    if acc.get("training"):
        expected, known = expected_accept_length(acc["training"], ref["steps"])
        if known:
            lead += f", training {expected:.2f}"
    return lead + "; "


def set_acceptance_lead(report: dict) -> str:
    """Every serving engine's predicted accept length, then training's engine and training's own,
    from the comparisons that scored rows ('' when none did)."""
    from difftest.audit.shortfall import expected_accept_length

    scored = {name: rep["acceptance"] for name, rep in report["comparisons"].items()
              if rep.get("acceptance") and rep["acceptance"]["reference"]["scored_rows"]}
    if not scored:
        return ""
    parts = [f"{acc['candidate']['engine']} {acc['candidate']['mean_accept_length']:.2f}" for acc in scored.values()]
    refs = {(acc["reference"]["engine"], acc["reference"]["steps"]): acc["reference"]["mean_accept_length"]
            for acc in scored.values()}
    several = len({steps for _, steps in refs}) > 1
    parts += [f"{engine} {value:.2f}" + (f" ({steps} steps)" if several else "")
              for (engine, steps), value in refs.items()]
    first = next(iter(scored.values()))
    if first.get("training"):
        expected, known = expected_accept_length(first["training"], first["reference"]["steps"])
        if known:
            parts.append(f"training {expected:.2f}")
    return "accept length " + ", ".join(parts) + "; "


def build_report(result: RunResult, command: list[str] | None = None, extra: dict | None = None) -> dict:
    first = result.comparison.first_divergence
    ckpt = result.inputs.checkpoint
    report = {
        "schema_version": SCHEMA_VERSION,
        "verdict": verdict_of(result),
        "diagnosis": result.diagnosis.as_dict() if result.diagnosis else None,
        "first_divergence": first.as_dict() if first else None,
        "probes": [r.as_dict() for r in result.comparison.results],
        "engines": {
            "reference": {"name": result.reference.engine, "timings_s": result.reference.timings_s, "details": result.reference.details},
            "candidate": {"name": result.candidate.engine, "timings_s": result.candidate.timings_s, "details": result.candidate.details,
                          "missing": result.candidate.missing},
        },
        "checkpoint": {"path": str(ckpt.origin), "format": ckpt.format.value, "spec": ckpt.spec.__dict__ | {
            "aux_layer_ids": list(ckpt.spec.aux_layer_ids) if ckpt.spec.aux_layer_ids else None}},
        "inputs": {
            "target": str(result.inputs.target.path),
            "states": result.inputs.states_source,
            "num_tokens": result.inputs.states.num_tokens,
            "num_requests": int(result.inputs.states.seq_lens.numel()),
            "aux_layer_ids": list(result.inputs.states.aux_layer_ids),
        },
        "serving_setup": {k: v for k, v in result.options.serving.__dict__.items() if k != "deployment"},
        "deployment": result.deployment,
        "tolerance": {"dtype": str(result.options.dtype).replace("torch.", ""), **result.tolerance.as_dict()},
        "noise_floor": result.noise_floor,
        "environment": {
            "packages": _versions(),
            "python": platform.python_version(),
            "device": result.options.device,
            "dtype": str(result.options.dtype).replace("torch.", ""),
        },
        "timings_s": result.timings_s,
        "audit": {
            "findings": [f.as_dict() for f in result.findings],
            "ledgers": {"reference": result.reference.ledger.as_dict(), "candidate": result.candidate.ledger.as_dict()},
            "vocab_mapping": _vocab_summary(ckpt),
            "config": result.config_audit,
            "conversion": result.conversion,
            "capture": result.capture,
        },
        "command": command or [],
        "target_capture": result.target_capture.as_dict() if result.target_capture else None,
        "acceptance": _acceptance(result),
    }
    if extra:
        report.update(extra)
    return json.loads(json.dumps(report, default=_jsonable))


def _acceptance(result: RunResult) -> dict | None:
    from difftest.acceptance import explain

    if result.acceptance is None:
        return None
    return result.acceptance.as_dict() | {"explanation": explain(result.acceptance, result.diagnosis)}


def _vocab_summary(ckpt) -> dict:
    from difftest.audit.vocab import mapping_summary

    return mapping_summary(ckpt.get("d2t") if ckpt.has("d2t") else None, ckpt.spec.draft_vocab_size)


def _jsonable(o):
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def validate_report(report: dict) -> None:
    import jsonschema

    jsonschema.validate(report, json.loads(SCHEMA_FILE.read_text()))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def render_markdown(report: dict) -> str:
    lines = [f"# difftest report: {report['verdict']}", ""]
    diag = report.get("diagnosis")
    if diag:
        lines += [f"**{verdict_line(report)}**", ""]
        where = f"found at `{diag['found_at']}`" if diag.get("found_at") else (
            f"first divergence at `{diag['probe']}`" if diag["probe"] else "found by the audit; the probes agree")
        lines += [f"**Root cause:** `{diag['cause']}` ({where})", "", diag["explanation"], ""]
        lines += [f"- evidence: {e}" for e in diag.get("evidence") or []]
        if diag.get("also"):
            lines.append(f"- other audit errors: {', '.join(diag['also'])}")
        lines += ["", f"**{fix_label(diag)}:** {diag['fix']}", ""]
        if len(diag.get("ranked") or []) > 1 or any(e.get("cost_accept_length") is not None for e in diag.get("ranked") or []):
            lines += ["## What costs acceptance (most first)", "", "| cause | found at | side | cost in mean accept length | measured as |",
                      "|---|---|---|---|---|"]
            for e in diag["ranked"]:
                c = e.get("cost_accept_length")
                lines.append(f"| `{e['cause']}` | {e['found_at']} | {e['side']} | {'not measured' if c is None else f'{c:+.3f}'} | {e['how']} |")
            lines.append("")
    else:
        lines += ["Every probe agrees within the "
                  f"{report['tolerance']['dtype']} tolerance.", ""]
    unreached = [f for f in (report.get("audit") or {}).get("findings", []) if f["severity"] == "not_exercised"]
    if unreached:
        lines += ["**Not exercised by these inputs** (not shown to be harmless; longer rows would measure them):", ""]
        lines += [f"- `{f['cause']}`: {f['message']}" for f in unreached]
        lines.append("")
    lines += _acceptance_markdown(report)
    lines += ["## Probes (dataflow order)", "",
              "| probe | status | rel_max | rel_diff | cosine | agreement | would pass at | detail |",
              "|---|---|---|---|---|---|---|---|"]
    for p in report["probes"]:
        m = p["metrics"]
        wp = ", ".join(f"{k}={_fmt(v)}" for k, v in p["would_pass_at"].items())
        lines.append(
            f"| {p['probe']} | {p['status']} | {_fmt(m.get('rel_max', ''))} | {_fmt(m.get('rel_diff', ''))} | "
            f"{_fmt(m.get('cosine', ''))} | {_fmt(m.get('agreement', ''))} | {wp} | {p['detail']} |"
        )
    tol = report["tolerance"]
    lines += ["", f"Tolerance ({tol['dtype']}): rel_max {tol['rel_max']}, rel_diff {tol['rel_diff']}, "
              f"token near-tie margin {tol['near_tie_margin']}.", ""]
    if report.get("noise_floor"):
        lines += ["Measured noise floor (reference engine at this dtype vs its own fp32 run):", "",
                  "| probe | rel_max | rel_diff |", "|---|---|---|"]
        lines += [f"| {k} | {_fmt(v['rel_max'])} | {_fmt(v['rel_diff'])} |" for k, v in report["noise_floor"].items()]
        lines.append("")
    audit = report.get("audit") or {}
    if audit.get("findings"):
        lines += ["## Audit findings", "", "| check | severity | cause | finding |", "|---|---|---|---|"]
        lines += [f"| {f['check']} | {f['severity']} | {f['cause']} | {f['message']} |" for f in audit["findings"]]
        lines.append("")
    lines += _deployment_markdown(report)
    if audit.get("capture"):
        cap = audit["capture"]
        lines += ["## Target capture (HF hidden_states ids)", "",
                  f"- training data: {cap['states_hf_ids']}",
                  f"- speculators resolves: {cap['training']['hf_layer_ids']}",
                  f"- {cap['serving']['target_class']} would capture: {cap['serving']['hf_layer_ids']}"]
        lines += [f"  - {step}" for step in cap["serving"]["steps"]]
        lines.append("")
    if audit.get("conversion"):
        lines += ["## Config translation (training config -> serving config)", "",
                  "| field | training | serving | carried |", "|---|---|---|---|"]
        lines += [f"| {r['field']} | `{r['training']}` | `{r['serving']}` | {'yes' if r['carried'] else '**no**'} |"
                  for r in audit["conversion"]]
        lines.append("")
    training, serving = report["engines"]["reference"]["name"], report["engines"]["candidate"]["name"]
    if audit.get("config"):
        lines += [f"## Config fields: does {serving} honor them? (measured)", ""]
        shared = shared_config_verdict(audit["config"])
        if shared:
            # One shared reason: said once, not once per field.
            lines += [f"All {len(audit['config'])} fields {shared}.", ""]
        else:
            lines += [f"| field | value | verdict | {training} effect | {serving} effect |", "|---|---|---|---|---|"]
            for r in audit["config"]:
                lines.append(f"| {r['field']} | `{r['value']}` | {r['verdict']} | {_fmt(r.get('training_effect', ''))} | "
                             f"{_fmt(r.get('serving_effect', ''))} |")
            lines.append("")
    if audit.get("ledgers"):
        lines += ["## Load ledger (checkpoint tensor -> fate per engine)", "", f"| tensor | {training} | {serving} |",
                  "|---|---|---|"]
        ref_t, cand_t = audit["ledgers"]["reference"]["tensors"], audit["ledgers"]["candidate"]["tensors"]
        for name in sorted(set(ref_t) | set(cand_t)):
            cell = lambda t: (f"{t['fate']} -> {', '.join(t['into'])}" if t.get("into") else t["fate"]) if t else "-"
            lines.append(f"| {name} | {cell(ref_t.get(name))} | {cell(cand_t.get(name))} |")
        lines.append("")
        absent = absent_params(report)
        if absent:
            lines += ["Parameters no checkpoint tensor filled:", "", "| engine | parameter | fate | why |", "|---|---|---|---|"]
            lines += [f"| {a.engine} | {a.param} | {a.fate if a.fate == 'shared' else '**' + a.fate + '**'} | {a.why} |"
                      for a in absent]
            lines.append("")
    cand = report["engines"]["candidate"]["details"]
    if cand.get("conversion_notes"):
        lines += ["## Config conversion", ""] + [f"- `{k}`: {v}" for k, v in cand["conversion_notes"].items()] + [""]
    sk = cand.get("sgl_kernel_standin")
    if sk:
        lines += ["## sgl_kernel stand-in", "",
                  f"- installed: {sk['installed']} ({sk['reason']})",
                  f"- symbols bound at import: {', '.join(sk['symbols_bound']) or 'none'}",
                  f"- calls: {sk['total_calls']} (expected 0; any call raises)", ""]
    env = report["environment"]
    ref_details = report["engines"]["reference"]["details"]
    lines += ["## Environment", "", f"- device {env['device']}, dtype {env['dtype']}, python {env['python']}",
              f"- attention: {training} `{ref_details.get('attn_implementation', '?')}`, "
              f"{serving} `{cand.get('attention_backend', '?')}`"]
    lines += [f"- {k} {v}" for k, v in env["packages"].items()]
    ref_t, cand_t = report["engines"]["reference"]["timings_s"], report["engines"]["candidate"]["timings_s"]
    lines += ["", "## Timings (s)", "", "| engine | import | load | forward |", "|---|---|---|---|",
              f"| {training} | {_fmt(ref_t.get('import', 0))} | {_fmt(ref_t.get('load', 0))} | {_fmt(ref_t.get('forward', 0))} |",
              f"| {serving} | {_fmt(cand_t.get('import', 0))} | {_fmt(cand_t.get('load', 0))} | {_fmt(cand_t.get('forward', 0))} |", ""]
    if report.get("baseline"):
        b = report["baseline"]
        lines += ["## Baseline", "", f"Against `{b['path']}` (factor {b['factor']}): "
                  + ("no regressions." if not b["regressions"] else f"{len(b['regressions'])} regression(s):"), ""]
        lines += [f"- {r}" for r in b["regressions"]] + [""]
    if report.get("command"):
        lines += ["## Reproduce", "", "```", shlex.join(report["command"]), "```", ""]
    return "\n".join(lines)


def render_set_markdown(report: dict) -> str:
    """The set's verdict and one row per serving engine, then each comparison in full under its
    engine's name (its headings one level down)."""
    lines = [f"# difftest report: {report['verdict']}", "", f"**{verdict_line(report)}**", "",
             "| serving engine | verdict | predicted accept length | first divergence | root cause | its cost |",
             "|---|---|---|---|---|---|"]
    for row in engine_summaries(report):
        lines.append(f"| [{row.engine}](#{row.engine}) | {row.verdict} | {row.accept_length} | {row.first_divergence} | "
                     f"{'`' + row.cause + '`' if row.cause else '-'} | {row.cost} |")
    lines.append("")
    for name, rep in report["comparisons"].items():
        body = render_markdown(rep).splitlines()
        body[0] = f"# {name}: {rep['verdict']} <a id='{name}'></a>"
        if "## Reproduce" in body:  # one command made the whole set: it is given once, at the end
            body = body[:body.index("## Reproduce")]
        lines += [("#" + line if line.startswith("#") else line) for line in body]
        lines.append("")
    if report.get("command"):
        lines += ["## Reproduce", "", "```", shlex.join(report["command"]), "```", ""]
    return "\n".join(lines)


def no_deployment(report: dict) -> str:
    """What was served when the user named no deployment: the serving adapter says."""
    cand = report["engines"]["candidate"]
    served_as = cand["details"].get("served_as", "what difftest makes of this checkpoint")
    return f"No deployment was given (--serve with --launch): {cand['name']} served {served_as}, at this run's dtype."


def _deployment_markdown(report: dict) -> list[str]:
    dep = report.get("deployment")
    serving = report["engines"]["candidate"]["name"]
    if not dep:
        return ["## Deployment", "", no_deployment(report), ""]

    lines = ["## Deployment: trained vs served", "", f"Served directory `{dep['served_dir']}`, launched as:", "",
             "```", shlex.join(dep["launch_argv"]), "```", ""]
    if dep.get("refused"):
        return lines + [f"**{serving} refuses this directory** before loading any weight: {dep['refused']}", ""]
    lines += ["| launch setting | value | what it changes in the draft | simulated here |", "|---|---|---|---|"]
    lines += [f"| `{r['flag']}` | `{r['value']}`{'' if r['given'] else ' (default)'} | {r['effect']} | {r['how_run']} |"
              for r in dep["launch"]]
    lines += [""] + [f"- {n}" for n in dep["plan"].get("notes") or []]
    lines += ["", f"| training tensor | served tensor | status | {serving} parameter |", "|---|---|---|---|"]
    lines += [f"| {r['training'] or '-'} | {r['served'] or '-'} | {r['status']} | {', '.join(r['into']) or '-'} |"
              for r in dep["tensors"]]
    changed = [r for r in dep["config"] if r["status"] != "carried"]
    lines += ["", f"Config fields: {sum(r['status'] == 'carried' for r in dep['config'])} carried as a conversion "
              f"writes them, {len(changed)} not:", ""]
    if changed:
        lines += ["| field | conversion writes | served | status |", "|---|---|---|---|"]
        lines += [f"| {r['field']} | `{r['expected']}` | `{r['served']}` | **{r['status']}** |" for r in changed]
    return lines + [""]


def _acceptance_markdown(report: dict) -> list[str]:
    lines: list[str] = []
    acc = report.get("acceptance")
    if acc:
        ref, cand = acc["reference"], acc["candidate"]
        k = ref["steps"]
        lines += ["## Predicted acceptance (chain draft, greedy verification)", "",
                  f"{ref['scored_rows']} rows scored against the target's greedy continuation ({acc['continuation_source']}).", "",
                  "| engine | mean accept length | " + " | ".join(f"step {j + 1}" for j in range(k)) + " |",
                  "|---|---|" + "---|" * k]
        for e in (ref, cand):
            cells = " | ".join(f"{c:.3f} (reach {r:.3f})" for c, r in zip(e["conditional"], e["reach"]))
            lines.append(f"| {e['engine']} | {e['mean_accept_length']:.3f} | {cells} |")
        train = acc.get("training") or report.get("training")
        if train:
            steps = [train[f"full_acc_{j}"] for j in range(k) if f"full_acc_{j}" in train]
            lines.append("| training (speculators full_acc, held-out) | - | "
                         + " | ".join(f"reach {v:.3f}" for v in steps) + " |" * (1 if steps else 0))
        lines += ["", f"Step j: acceptance given steps < j were accepted (reach: all of 1..j accepted). Engines "
                      f"agree if mean accept lengths are within ±{acc['tolerance_accept_length']}: "
                      f"**{'agree' if acc['agree'] else 'DISAGREE'}** (gap {acc['accept_length_gap']:+.3f}).", ""]
        lines += [f"- {line}" for line in acc["explanation"]] + [""]
    tc = report.get("target_capture")
    if tc:
        lines += ["## Target capture parity (measured)", "",
                  f"- training states' chunks are hidden_states{tc['training_hf_ids']}",
                  f"- {tc['serving_engine']}: {tc['serving_description']}; its chunks are "
                  f"hidden_states{tc['serving_hf_ids']}" if tc["serving_hf_ids"] is not None else
                  f"- {tc['serving_engine']}: {tc['serving_description']} ({tc['width']['serving']} wide, "
                  f"training {tc['width']['training']})", "",
                  "| side | chunk | target layer it equals | rel_max vs it | vs training chunk (rel_max) |", "|---|---|---|---|---|"]
        for c in tc["chunks"]:
            vs = _fmt(c["vs_training"]["rel_max"]) if c.get("vs_training") else "-"
            layer = f"hidden_states[{c['nearest_hf_layer']}]" + ("" if c["matches"] else " (closest; no match)")
            lines.append(f"| {c['side']} | {c['chunk']} | {layer} | "
                         f"{_fmt(c['vs_nearest']['rel_max'])} | {vs} |")
        lines.append("")
    return lines


def atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        # mkstemp makes the file private; a report is an ordinary file, so honor the umask.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_reports(report: dict, out_dir: str | Path) -> dict[str, Path]:
    validate_report(report)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from difftest.report.html import render_html

    from difftest.report.html import render_set_html

    is_set = "comparisons" in report
    paths = {"json": out / "report.json", "md": out / "report.md", "html": out / "report.html"}
    # Render everything before writing anything: a failure leaves the old reports whole.
    texts = {"json": json.dumps(report, indent=2) + "\n",
             "md": render_set_markdown(report) if is_set else render_markdown(report),
             "html": render_set_html(report) if is_set else render_html(report)}
    for key, path in paths.items():
        atomic_write(path, texts[key])
    return paths
