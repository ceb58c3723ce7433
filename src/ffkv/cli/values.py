"""`ffkv values RUN`: values (and keys) as distributions over the vocabulary (paper §4).

The command is generated from the step's settings (`ffkv.steps.values`)."""
from __future__ import annotations

import typer


def print_values(out, as_json: bool = False) -> None:
    from ffkv.steps.values.summary import summary

    summary(None, out, None, as_json)


def register(app: typer.Typer) -> None:
    from ffkv.steps.cli import command
    from ffkv.steps.values import STEP

    app.command(name="values", help=STEP.help)(command(STEP))
