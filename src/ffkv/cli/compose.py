"""`ffkv compose`: the paper's §5 (Figs 7-11 and last-layer cases) on held-out prefixes.

The command is generated from the step's settings (`ffkv.steps.compose`), so its flags, help and
checks are the ones the library and `reproduce` use."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from ffkv.steps.cli import command
    from ffkv.steps.compose import STEP

    app.command(name="compose", help=STEP.help)(command(STEP))
