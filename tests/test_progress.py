"""Progress when stderr is not a terminal: plain lines at most every 30 s (a fake clock, no sleeping),
nothing when disabled; and a real step in a process of its own with stderr to a file."""
from __future__ import annotations

import io
import os
import subprocess
import sys

from ffkv.progress import Lines, progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_lines_at_most_every_30_s_with_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    with Lines(every=30, get_time=clock, file=out) as bar:
        task = bar.add_task("compose", total=1000, tokens=0)
        for i in range(1, 1001):  # 10 items a second for 100 s
            clock.t = i / 10
            bar.update(task, advance=1, tokens=i * 20)
    lines = out.getvalue().splitlines()
    # at 30, 60 and 90 s, and once when done
    assert lines[0] == "compose: 300/1,000 (30%), 10.0 it/s, 200 tok/s, ETA 70 s", lines
    assert lines[1].startswith("compose: 600/1,000 (60%), 10.0 it/s") and lines[1].endswith("ETA 40 s")
    assert lines[2].startswith("compose: 900/1,000 (90%)") and lines[2].endswith("ETA 10 s")
    assert lines[3] == "compose: 1,000/1,000 (100%), 10.0 it/s, 200 tok/s, done in 100 s"
    assert len(lines) == 4


def test_a_short_task_prints_nothing_and_a_resumed_one_counts_its_own_rate():
    clock, out = Clock(), io.StringIO()
    with Lines(every=30, get_time=clock, file=out) as bar:
        quick = bar.add_task("values", total=5)
        for i in range(5):
            clock.t += 1
            bar.advance(quick)
        assert out.getvalue() == ""  # 5 s of work: no line
        # a resumed pass starts at 500 of 1,000: its rate is what this process did (5 items/s)
        t = bar.add_task("mine", total=1000, completed=500)
        clock.t += 40
        bar.update(t, advance=200)
    assert out.getvalue().splitlines() == ["mine: 700/1,000 (70%), 5.0 it/s, ETA 60 s"]


def test_unknown_total_and_long_durations():
    clock, out = Clock(), io.StringIO()
    with Lines(every=30, get_time=clock, file=out) as bar:
        t = bar.add_task("mutate: re-scoring", total=None, tokens=0)
        clock.t = 31
        bar.update(t, advance=62, tokens=6200)
        bar.update(t, total=10000)
        clock.t = 62
        bar.update(t, advance=0)
    assert out.getvalue().splitlines() == ["mutate: re-scoring: 62, 2.0 it/s, 200 tok/s",
                                           "mutate: re-scoring: 62/10,000 (1%), 1.0 it/s, 100 tok/s, ETA 2 h 45 min"]


def test_progress_picks_lines_bar_or_nothing(monkeypatch):
    from rich.progress import Progress

    monkeypatch.delenv("FFKV_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    assert isinstance(progress(), Lines)
    assert not isinstance(progress(disable=True), Lines) and progress(disable=True).disable
    monkeypatch.setenv("FFKV_PROGRESS", "0")
    p = progress()
    assert isinstance(p, Progress) and not isinstance(p, Lines) and p.disable
    monkeypatch.setenv("FFKV_PROGRESS", "1")
    p = progress()
    assert not isinstance(p, Lines) and not p.disable


def test_mine_with_stderr_to_a_file_prints_lines(tmp_path, tiny_dirs):
    """`ffkv mine` in its own process, stderr a file (lines every 0 s here): its progress is there
    as plain lines, the last one at 100%. (FFKV_PROGRESS=0: `test_progress_picks_lines_bar_or_nothing`.)"""
    from conftest import WT2

    script = "import ffkv.progress as p; p.LINE_EVERY = 0.0\nfrom ffkv.cli import main\nmain()"
    env = {**{k: v for k, v in os.environ.items() if k != "FFKV_PROGRESS"}, "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "err.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-c", script, "mine", "--out", str(tmp_path / "run"),
                            "--model", str(tiny_dirs["gpt2"]), "--corpus", str(WT2 / "wiki.valid.tokens"),
                            "--max-sentences", "40", "--top-k", "2", "--batch-tokens", "128"],
                           stderr=f, stdout=subprocess.DEVNULL, timeout=300, env=env)
    assert r.returncode == 0, log.read_text()[-2000:]
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("mine: ")]
    assert lines and lines[-1].startswith("mine: 40/40 (100%)") and "done in" in lines[-1], lines
    assert all("tok/s" in ln for ln in lines)
