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
             by_lens: bool = typer.Option(False, "--by-lens", help="Several runs: one row per figure and lens, with "
                                          "the verdict of each run under that lens and which runs it holds on."),
             as_json: bool = JsonOpt):
    """The verdict of every figure, one column per run: e.g. the default run beside `--preset full`, or
    SmolLM2's run beside Gemma 3's. A verdict that differs under the other lens is shown in brackets;
    a row whose verdicts differ between runs (under any lens both read) is marked; with several runs,
    `holds on` names the runs where the figure's verdict is "same trend" (--by-lens: under each lens)."""
    from ffkv.report import compare as C

    recs = [C.load(r) for r in runs]
    every = C.side_by_side(recs)
    rows = [r for r in every if r["changed"]] if changed else every
    names = [p.name or str(p) for p in runs]
    if len(set(names)) < len(names):
        names = [str(p) for p in runs]
    several = len(runs) > 1
    lenses = C.lenses_read(every)
    if as_json:
        out = []
        for r in rows:
            o = {"id": r["id"], "title": r["title"], "changed": r["changed"],
                 "runs": [None if x is None else {"verdict": x[0], "lenses": x[1]} for x in r["readings"]]}
            if several:
                o["holds_on"] = C.holds_on(r, names)
                o["by_lens"] = {ln: {"verdicts": [C.under(x, ln) for x in r["readings"]],
                                     "holds_on": C.holds_on(r, names, ln)} for ln in lenses}
            out.append(o)
        print(json.dumps({"runs": [str(p) for p in runs], **({"names": names, "lenses": lenses} if several else {}),
                          "verdicts": out}, indent=2, ensure_ascii=False))
        return
    measured = measured or not several
    by_id = [{r["id"]: r for r in rs} for rs in recs]
    table = []
    for r in rows:
        lens_rows = [ln for ln in lenses if any(x is not None and x[1] for x in r["readings"])] if by_lens and several else []
        for ln in lens_rows or [None]:
            row = {"figure": r["id"]}
            if by_lens and several:
                row["lens"] = ln or "any"
                row.update({n: C.under(x, ln) or "—" for n, x in zip(names, r["readings"])})
            else:
                row.update({("verdict" if not several else n): C.cell(x) for n, x in zip(names, r["readings"])})
            if several:
                row["holds on"] = C.holds_on(r, names, ln)
                row["changed"] = "yes" if r["changed"] else ""
            if measured:
                for n, d in zip(names, by_id):
                    row[f"measured ({n})" if several else "measured"] = (d.get(r["id"]) or {}).get("measured") or ""
            table.append(row)
    cols = list(table[0]) if table else ["figure", *(names if several else ["verdict"])]
    print_table("verdicts vs the paper" + (" (changed only)" if changed else ""), table, cols)
    if several:
        print(f"{sum(r['changed'] for r in every)} of {len(every)} verdicts differ between the runs")


def register(app: typer.Typer) -> None:
    app.command()(report)
    app.command()(verdicts)
