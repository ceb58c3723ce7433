"""Steps: what a run is made of, each one unit.

A step is a `Step` (its settings dataclass, the steps it requires, the tables it writes, its
computation, and optionally its CLI summary, report sections and browser panels), registered
once: built in (`registry.BUILTIN`), by an installed package's `ffkv.steps` entry point, or by
`register()`. Everything else (the CLI, `reproduce`, the report, the browser) iterates over the
registry, so adding a step edits no other file. See DEVELOPING.md, "How to add a step".
"""
from __future__ import annotations

from typing import NamedTuple

from ffkv.steps.registry import get, known, ordered, register  # noqa: F401
from ffkv.steps.settings import at_least, between, setting  # noqa: F401
from ffkv.steps.lifecycle import Context, Outcome, Step, execute  # noqa: F401


class ReportSection(NamedTuple):
    """A report section a step adds after the paper's figures. `html` is trusted markup made by the
    step (escape corpus text with `ffkv.report.html.esc`); `verdicts` go into verdicts.json."""
    id: str
    title: str
    html: str
    verdicts: tuple = ()


class Panel(NamedTuple):
    """A table a step shows on a memory's browser page: plain values, escaped when rendered."""
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    note: str = ""
