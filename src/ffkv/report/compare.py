"""Verdicts of one or more runs side by side (`ffkv verdicts`), from each run's `report/verdicts.json`.

A row per verdict id, in the order of the first run that has it; a row is `changed` when the runs
that have it disagree on its verdict or on its verdict under any lens both runs read. A finding
holds on a run when its verdict there is "same trend"; under a lens, when its verdict under that
lens is (a record read under one lens only holds or not whatever the lens: its figure does not
depend on it, e.g. mutate's). Pure apart from `load`, so tests feed it records.
"""
from __future__ import annotations

import json
from pathlib import Path

from ffkv.errors import FfkvError


def load(run_path) -> list[dict]:
    """The verdict records of a run's last report; a missing or damaged file is one line."""
    run_path = Path(run_path)
    if not run_path.is_dir():
        raise FfkvError(f"{run_path} is not a run directory")
    p = run_path / "report" / "verdicts.json"
    if not p.is_file():
        raise FfkvError(f"{run_path} has no report yet ({p} is missing); build it with `ffkv report {run_path}`")
    try:
        recs = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FfkvError(f"{p} is damaged ({type(e).__name__}); rebuild it with `ffkv report {run_path}`") from None
    if not isinstance(recs, list) or not all(isinstance(r, dict) and isinstance(r.get("id"), str)
                                             and isinstance(r.get("verdict"), str) for r in recs):
        raise FfkvError(f"{p} is not a list of verdict records; rebuild it with `ffkv report {run_path}`")
    return recs


def _reading(rec: dict | None) -> tuple[str, dict[str, str]] | None:
    if rec is None:
        return None
    lenses = rec.get("lenses") if isinstance(rec.get("lenses"), dict) else {}
    return rec["verdict"], {str(k): str(v) for k, v in lenses.items()}


def _differ(a, b) -> bool:
    """Two readings disagree on the verdict, or on a lens both of them read."""
    if a[0] != b[0]:
        return True
    return any(a[1][ln] != b[1][ln] for ln in a[1].keys() & b[1].keys())


def side_by_side(runs: list[list[dict]]) -> list[dict]:
    """Rows {id, title, readings: [(verdict, {lens: verdict}) or None per run], changed}."""
    order, titles, by_run = [], {}, []
    for recs in runs:
        d = {}
        for r in recs:
            if r["id"] not in titles:
                order.append(r["id"])
                titles[r["id"]] = r.get("title") or r["id"]
            d.setdefault(r["id"], r)
        by_run.append(d)
    rows = []
    for vid in order:
        readings = [_reading(d.get(vid)) for d in by_run]
        have = [x for x in readings if x is not None]
        changed = any(_differ(have[0], x) for x in have[1:])
        rows.append({"id": vid, "title": titles[vid], "readings": readings, "changed": changed})
    return rows


HOLDS = "same trend"  # ffkv.report.stats.SAME, without importing the report's plotting stack


def lenses_read(rows: list[dict]) -> list[str]:
    """Every lens some run read some verdict under, in the order first met."""
    return list(dict.fromkeys(ln for r in rows for x in r["readings"] if x is not None for ln in x[1]))


def under(reading, lens: str | None) -> str | None:
    """A reading's verdict under `lens` (None: its main verdict); a record without lenses has one
    verdict for every lens. None where the run lacks the verdict or read it under other lenses."""
    if reading is None:
        return None
    verdict, lenses = reading
    if lens is None or not lenses:
        return verdict
    return lenses.get(lens)


def holds_on(row: dict, names: list[str], lens: str | None = None) -> str:
    """Which runs the finding holds on (under `lens`): "all", "none", or the runs' names joined by
    "+" ("both" and "neither" for two runs); "—" where no run has the verdict."""
    got = [(n, under(x, lens)) for n, x in zip(names, row["readings"])]
    got = [(n, v) for n, v in got if v is not None]
    if not got:
        return "—"
    yes = [n for n, v in got if v == HOLDS]
    if len(yes) == len(got) == len(names):
        return {1: "yes", 2: "both"}.get(len(names), "all")
    if not yes:
        return {1: "no", 2: "neither"}.get(len(names), "none")
    return "+".join(yes) + " only"


def cell(reading) -> str:
    """'same trend' or 'same trend (naive: differs)': the verdict, then each lens that disagrees."""
    if reading is None:
        return "—"
    verdict, lenses = reading
    others = [f"{ln}: {v}" for ln, v in lenses.items() if v != verdict]
    return verdict + (f" ({'; '.join(others)})" if others else "")
