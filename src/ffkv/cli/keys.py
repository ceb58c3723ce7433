"""`ffkv mutate` and `ffkv patterns`: the keys experiments (paper §3).

Both commands are generated from their steps' settings (`ffkv.steps.mutate`, `ffkv.steps.patterns`)."""
from __future__ import annotations

import typer


def print_mutate(run, out, as_json: bool = False) -> None:
    from ffkv.steps.mutate.summary import summary

    summary(run, out, None, as_json)


def print_patterns(run, out, top: int = 25, as_json: bool = False) -> None:
    from ffkv.steps.patterns import PatternsSettings
    from ffkv.steps.patterns.summary import summary

    summary(run, out, PatternsSettings(top=top), as_json)


def register(app: typer.Typer) -> None:
    from ffkv.steps.cli import command
    from ffkv.steps.mutate import STEP as MUTATE
    from ffkv.steps.patterns import STEP as PATTERNS

    for step in (MUTATE, PATTERNS):
        app.command(name=step.name, help=step.help)(command(step))
