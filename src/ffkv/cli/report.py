"""`ffkv report RUN`: rebuild the self-contained HTML report of a run."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer


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


def register(app: typer.Typer) -> None:
    app.command()(report)
