"""Baseline mode: compare a fresh report with a checked-in one, so CI catches an engine
upgrade that makes things worse even when the verdict was DIVERGED all along."""

from __future__ import annotations

import json
from pathlib import Path

from difftest.errors import InputError

# Growth is judged against the old error or this fraction of the tolerance, whichever is
# larger: 0 -> 1e-9 at fp32 is reduction-order noise, not a regression.
FLOOR_FRACTION_OF_TOLERANCE = 1e-2
ERROR_METRICS = ("rel_max", "rel_diff")


def load_baseline(path: str | Path) -> dict:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: baseline report not found") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory; --baseline takes an earlier report.json") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the baseline ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: baseline is not valid JSON ({exc})") from None
    from difftest.report.build import validate_report

    try:
        validate_report(doc)
    except Exception as exc:  # jsonschema.ValidationError: say which field, in one line
        raise InputError(f"{path}: not a difftest report ({str(exc).splitlines()[0][:160]})") from None
    return doc


def regressions(new: dict, old: dict, factor: float) -> list[str]:
    """What got worse, engine by engine: each serving engine's comparison against the baseline's
    comparison with the same engine (a report of one engine or a set, either side)."""
    from difftest.report.views import comparisons

    new_by_engine, old_by_engine = comparisons(new), comparisons(old)
    if "comparisons" not in new and "comparisons" not in old:
        return _regressions(new, old, factor)
    # An engine the baseline did not run has nothing to regress against.
    return [f"{name}: {line}" for name in new_by_engine if name in old_by_engine
            for line in _regressions(new_by_engine[name], old_by_engine[name], factor)]


def _regressions(new: dict, old: dict, factor: float) -> list[str]:
    out: list[str] = []
    if old["verdict"] == "PARITY" and new["verdict"] != "PARITY":
        out.append(f"verdict went from PARITY to {new['verdict']}")
    old_probes = {p["probe"]: p for p in old["probes"]}
    tol = new["tolerance"]
    for p in new["probes"]:
        before = old_probes.get(p["probe"])
        if before is None:
            continue
        if before["status"] == "pass" and p["status"] != "pass":
            out.append(f"{p['probe']}: {before['status']} -> {p['status']}")
            continue
        for metric in ERROR_METRICS:
            now, then = p["metrics"].get(metric), before["metrics"].get(metric)
            if now is None or then is None:
                continue
            floor = FLOOR_FRACTION_OF_TOLERANCE * tol[metric]
            if now > factor * max(then, floor):
                out.append(f"{p['probe']}: {metric} {then:.3g} -> {now:.3g} (more than {factor:g}x)")
        agree_now, agree_then = p["metrics"].get("agreement"), before["metrics"].get("agreement")
        if agree_now is not None and agree_then is not None and (1 - agree_now) > factor * max(1 - agree_then, 1e-3):
            out.append(f"{p['probe']}: agreement {agree_then:.3f} -> {agree_now:.3f}")
    old_errors = {(f["check"], f["cause"]) for f in (old.get("audit") or {}).get("findings", []) if f["severity"] == "error"}
    for f in (new.get("audit") or {}).get("findings", []):
        if f["severity"] == "error" and (f["check"], f["cause"]) not in old_errors:
            out.append(f"new finding {f['check']}:{f['cause']}: {f['message'][:160]}")
    return out
