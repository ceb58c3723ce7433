"""`ffkv normalize`: normalized vs unnormalized memories (softmax, ReLU, scaled ReLU) on the model's own FFNs.

The command is generated from the step's settings (`ffkv.steps.normalize`)."""
from __future__ import annotations

import typer


def print_normalize(run, out, as_json: bool = False) -> None:
    from ffkv.steps.normalize.summary import print_normalize as show

    show(run, out, as_json)


def register(app: typer.Typer) -> None:
    from ffkv.steps.cli import command
    from ffkv.steps.normalize import STEP

    app.command(name="normalize", help=STEP.help)(command(STEP))
