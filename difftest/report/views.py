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
