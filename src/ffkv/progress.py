"""One progress bar style for all long work: items, tokens/s and ETA."""
from __future__ import annotations

import sys

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text


class _Rate(ProgressColumn):
    def render(self, task) -> Text:
        tok = task.fields.get("tokens")
        el = task.elapsed or 0
        if tok is None or not el:
            return Text("")
        return Text(f"{tok / el:,.0f} tok/s", style="cyan")


def progress(disable: bool | None = None) -> Progress:
    """A rich progress bar; quiet when stderr is not a terminal unless FFKV_PROGRESS=1."""
    import os

    if disable is None:
        disable = not (sys.stderr.isatty() or os.environ.get("FFKV_PROGRESS") == "1")
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    _Rate(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    disable=disable, transient=False)
