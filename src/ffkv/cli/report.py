"""`ffkv report RUN`: rebuild the self-contained HTML report of a run."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ffkv.cli.options import JsonOpt, print_table


def report(run: Path = typer.Argument(..., metavar="RUN", help="A run directory made by `ffkv mine --out RUN` "
                                                                "(other steps add figures)."),
           out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where to write the report: a "
                                              ".html file, or a folder for index.html. Default: "
                                              "RUN/report/index.html. Figures go to figures/ beside it."),
           open_: bool = typer.Option(False, "--open", help="Open the report in a web browser.")):
    """Rebuild the HTML report: every figure the run supports, the paper's result and a verdict
    beside each, Tables 1–2, the last-layer cases, the manifest. Works offline (file://)."""
    from ffkv.report.build import build

    path, problems = build(run, out, log=lambda msg: print(msg, file=sys.stderr))
    print(path)
    if open_:
        import webbrowser

        webbrowser.open(path.resolve().as_uri())


def verdicts(runs: List[Path] = typer.Argument(..., metavar="RUN...", help="One or more run directories with a "
                                                "report (`ffkv report RUN` or `ffkv reproduce RUN`)."),
             changed: bool = typer.Option(False, "--changed", help="Only the verdicts that differ between the runs."),
             measured: bool = typer.Option(False, "--measured", help="Add each run's measured numbers (one run: always)."),
             as_json: bool = JsonOpt):
    """The verdict of every figure, one column per run: e.g. the default run beside `--preset full`.
    A verdict that differs under the other lens is shown in brackets; a row whose verdicts differ
    between runs (under any lens both read) is marked."""
    from ffkv.report import compare as C

    recs = [C.load(r) for r in runs]
    every = C.side_by_side(recs)
    rows = [r for r in every if r["changed"]] if changed else every
    if as_json:
        out = [{"id": r["id"], "title": r["title"], "changed": r["changed"],
                "runs": [None if x is None else {"verdict": x[0], "lenses": x[1]} for x in r["readings"]]} for r in rows]
        print(json.dumps({"runs": [str(p) for p in runs], "verdicts": out}, indent=2, ensure_ascii=False))
        return
    names = [p.name or str(p) for p in runs]
    if len(set(names)) < len(names):
        names = [str(p) for p in runs]
    measured = measured or len(runs) == 1
    by_id = [{r["id"]: r for r in rs} for rs in recs]
    table = []
    for r in rows:
        row = {"figure": r["id"], **{("verdict" if len(runs) == 1 else n): C.cell(x)
                                     for n, x in zip(names, r["readings"])}}
        if len(runs) > 1:
            row["changed"] = "yes" if r["changed"] else ""
        if measured:
            for n, d in zip(names, by_id):
                row[f"measured ({n})" if len(runs) > 1 else "measured"] = (d.get(r["id"]) or {}).get("measured") or ""
        table.append(row)
    cols = list(table[0]) if table else ["figure", *(names if len(runs) > 1 else ["verdict"])]
    print_table("verdicts vs the paper" + (" (changed only)" if changed else ""), table, cols)
    if len(runs) > 1:
        print(f"{sum(r['changed'] for r in every)} of {len(every)} verdicts differ between the runs")


def register(app: typer.Typer) -> None:
    app.command()(report)
    app.command()(verdicts)
