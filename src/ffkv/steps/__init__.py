"""Steps: what a run is made of, each one unit.

A step is a `Step` (its settings dataclass, the steps it requires, the tables it writes, its
computation, and optionally its CLI summary, report sections and browser panels), registered
once: built in (`registry.BUILTIN`), by an installed package's `ffkv.steps` entry point, or by
`register()`. Everything else (the CLI, `reproduce`, the report, the browser) iterates over the
registry, so adding a step edits no other file. See DEVELOPING.md, "How to add a step".
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ffkv.steps.registry import get, known, ordered, register  # noqa: F401
from ffkv.steps.settings import Flag, at_least, between, setting  # noqa: F401
from ffkv.steps.lifecycle import Context, Outcome, Step, execute  # noqa: F401


class ReportSection(NamedTuple):
    """A section of the report, from a step's `sections(run, fig_dir)`. `html` is trusted markup made
    by the step (escape corpus text with `ffkv.report.html.esc`; embed a figure saved into fig_dir
    with `ffkv.report.build.figure_html`): the section's body under the heading `title`, or, with
    `whole`, the whole `<section>`, heading included. `verdicts` go into verdicts.json (and, with
    a verdict, into the overview); `short` is the contents' link when shorter than `title`.

    A section reproducing one of the paper's figures carries it as `paper` (a
    `ffkv.report.build.Section`: verdict, lens readings, figure; `Builder.paper_section` makes the
    whole thing) and `place`, its number in the paper: those come first, in the paper's order, the
    other sections after them in the registry's order."""
    id: str
    title: str
    html: str
    verdicts: tuple = ()
    short: str = ""
    whole: bool = False
    paper: Any = None
    place: float | None = None


def lazy(target: str):
    """"module:function" as a callable that imports its module when first called: a step's report
    (pandas, matplotlib) loads only when a report is built, never for `ffkv --help`."""
    mod, attr = target.split(":")

    def call(*args, **kw):
        import importlib

        return getattr(importlib.import_module(mod), attr)(*args, **kw)

    call.__qualname__ = call.__name__ = attr
    call.__module__ = mod
    return call


class Panel(NamedTuple):
    """A table a step shows on a memory's browser page: plain values, escaped when rendered."""
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple, ...]
    note: str = ""
