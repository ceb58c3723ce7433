"""One progress style for all long work: items, tokens/s and ETA.

On a terminal it is a rich bar. When stderr is a file or a pipe (a log, `nohup`, a job
scheduler) a bar would print nothing, and a 20-minute step looked hung, so there it is a plain
line per task at most every `LINE_EVERY` seconds (`Lines`). FFKV_PROGRESS=1 forces the bar,
FFKV_PROGRESS=0 silences both; a caller's `disable=True` (show_progress=False) silences both.
"""
from __future__ import annotations

import sys
import time

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text

LINE_EVERY = 30.0  # seconds between two plain lines of one task


class _Rate(ProgressColumn):
    def render(self, task) -> Text:
        tok = task.fields.get("tokens")
        el = task.elapsed or 0
        if tok is None or not el:
            return Text("")
        return Text(f"{tok / el:,.0f} tok/s", style="cyan")


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60:02d} s" if s < 7200 else f"{s // 3600} h {s % 3600 // 60:02d} min"


class Lines(Progress):
    """The same tasks as a bar (rich tracks them with its display off), reported as plain lines on
    stderr: `compose: 412/1,000 (41%), 11.6 it/s, 2,310 tok/s, ETA 51 s`, at most every `every`
    seconds per task, and a last line when a task that printed one completes. A task shorter
    than `every` prints nothing. `get_time` is the clock (tests pass a fake one)."""

    def __init__(self, every: float | None = None, get_time=None, file=None):
        super().__init__(disable=True, get_time=get_time or time.monotonic)
        self.every = LINE_EVERY if every is None else every
        self._file = file
        self._last: dict = {}  # task -> time of its last line (its start before the first)
        self._base: dict = {}  # task -> (time, completed, tokens) when added: the rate is this process's
        self._done: set = set()

    def add_task(self, description, start=True, total=100.0, completed=0, visible=True, **fields):
        tid = super().add_task(description, start=start, total=total, completed=completed,
                               visible=visible, **fields)
        now = self.get_time()
        self._last[tid] = now
        self._base[tid] = (now, completed, fields.get("tokens") or 0)
        return tid

    def update(self, task_id, **kw):
        super().update(task_id, **kw)
        self._report(task_id)

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._report(task_id)

    def line(self, task_id) -> str:
        """The task's progress as one line."""
        t = self._tasks[task_id]
        now = self.get_time()
        t0, c0, tok0 = self._base[task_id]
        el = now - t0
        done, total = t.completed, t.total
        parts = [f"{t.description}: {done:,.0f}" + (f"/{total:,.0f} ({100 * done / total:.0f}%)" if total else "")]
        rate = (done - c0) / el if el > 0 else 0.0
        if rate > 0:
            parts.append(f"{rate:,.1f} it/s")
        tok = t.fields.get("tokens")
        if tok is not None and el > 0:
            parts.append(f"{(tok - tok0) / el:,.0f} tok/s")
        if total and done >= total:
            parts.append(f"done in {_duration(el)}")
        elif total and rate > 0:
            parts.append(f"ETA {_duration((total - done) / rate)}")
        return ", ".join(parts)

    def _report(self, task_id) -> None:
        if task_id in self._done:
            return
        t = self._tasks[task_id]
        now = self.get_time()
        finished = bool(t.total) and t.completed >= t.total
        printed = self._last[task_id] > self._base[task_id][0]
        if finished:
            self._done.add(task_id)
        if (finished and printed) or now - self._last[task_id] >= self.every:
            self._last[task_id] = now
            f = self._file or sys.stderr
            print(self.line(task_id), file=f, flush=True)


def progress(disable: bool | None = None) -> Progress:
    """A rich bar on a terminal; plain lines (`Lines`) when stderr is not one; nothing when the
    caller disables it or FFKV_PROGRESS=0 (FFKV_PROGRESS=1: the bar whatever stderr is)."""
    import os

    env = os.environ.get("FFKV_PROGRESS")
    if env == "0":
        disable = True
    if disable is None and not (sys.stderr.isatty() or env == "1"):
        return Lines()
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    _Rate(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    disable=bool(disable), transient=False)
