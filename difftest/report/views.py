"""Reading a report.json for display: what report.md and report.html both show, derived once."""

from __future__ import annotations

from typing import NamedTuple


class AbsentParam(NamedTuple):
    engine: str
    param: str
    fate: str  # shared | init | randomized
    why: str


def absent_params(report: dict) -> list[AbsentParam]:
    """Every parameter an engine filled from somewhere other than the checkpoint: the load
    ledger's tensor table lists only what the checkpoint holds, so a dropped lm_head has no row
    there."""
    ledgers = (report.get("audit") or {}).get("ledgers") or {}
    out = []
    for side in ("reference", "candidate"):
        engine = report["engines"][side]["name"]
        for name, p in sorted((ledgers.get(side) or {}).get("params", {}).items()):
            if p["fate"] != "written":
                out.append(AbsentParam(engine, name, p["fate"], p["note"]))
    return out


def fix_label(diag: dict) -> str:
    """A fix for a headline that costs nothing measurable is not a reason to retrain: say so."""
    if (diag.get("ranked") or [{}])[0].get("within_tolerance"):
        return "Fix (optional: this costs nothing measurable on these states)"
    return "Fix"


def shared_config_verdict(rows: list[dict]) -> str | None:
    """The one reason every config-audit row was not measured, when there is one."""
    verdicts = {r["verdict"] for r in rows}
    if len(verdicts) == 1 and next(iter(verdicts)).startswith("not measured"):
        return next(iter(verdicts))
    return None


def comparisons(report: dict) -> dict[str, dict]:
    """Each serving engine's comparison with training, by engine name, whatever the report's
    shape: one comparison, or a set of them."""
    if "comparisons" in report:
        return report["comparisons"]
    return {report["engines"]["candidate"]["name"]: report}


class EngineSummary(NamedTuple):
    engine: str
    verdict: str
    accept_length: str  # "1.403 (speculators 1.409)", or "not simulated"
    first_divergence: str  # a probe, or "-"
    cause: str | None  # the headline cause, None at parity
    cost: str  # the headline's cost: "-", "not measured", "nothing measurable" or "+0.123"


def engine_summaries(report: dict) -> list[EngineSummary]:
    """One row per serving engine of a set: its verdict, accept length, first divergence and
    headline cause with its cost."""
    rows = []
    for name, rep in comparisons(report).items():
        acc = rep.get("acceptance") or {}
        length = (f"{acc['candidate']['mean_accept_length']:.3f} ({acc['reference']['engine']} "
                  f"{acc['reference']['mean_accept_length']:.3f})" if acc.get("candidate") else "not simulated")
        diag = rep.get("diagnosis") or {}
        head = (diag.get("ranked") or [{}])[0]
        cost = head.get("cost_accept_length")
        cost_text = ("-" if not diag else "not measured" if cost is None else
                     "nothing measurable" if head.get("within_tolerance") else f"{cost:+.3f}")
        rows.append(EngineSummary(name, rep["verdict"], length, (rep.get("first_divergence") or {}).get("probe") or "-",
                                  diag.get("cause"), cost_text))
    return rows
