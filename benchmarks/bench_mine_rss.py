"""Does the host memory of `ffkv mine` grow with the corpus? (issue 24: ≤ 10% from 1,000 to 10,000 sentences)

    .venv/bin/python benchmarks/bench_mine_rss.py                       # SmolLM2, layers 0-1, 1,000 vs 10,000
    .venv/bin/python benchmarks/bench_mine_rss.py --sentences 1000,10000,30000 --layers all

Each size is a fresh `ffkv mine` process on WikiText-2 train (a new run in a temporary folder);
its peak resident set is read from the kernel (wait4's ru_maxrss). Mining only the first layers
(`--layers`, default 0-1) keeps the pass short and the trackers' state small, which makes the
host side's share of the peak (corpus, sentences, token lists, batch plan) the easiest to see: a
stricter test than mining every layer. Prints one line per size and the growth as a ratio.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, WT2, out

GOAL = 1.10


def mine_peak(n: int, layers: str, model: str | None, work: Path) -> tuple[float, float]:
    """Peak RSS (MB) and wall seconds of one `ffkv mine` of n sentences."""
    cmd = [sys.executable, "-m", "ffkv.cli", "mine", "--out", str(work / f"r{n}"),
           "--corpus", str(WT2 / "wiki.train.tokens"), "--max-sentences", str(n), "--top-k", "50"]
    if layers != "all":
        cmd += ["--layers", layers]
    if model:
        cmd += ["--model", model]
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
                         env={**os.environ, "FFKV_PROGRESS": "0"})
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"bench_mine_rss: mine of {n} sentences failed: {err.strip().splitlines()[-1:]}")
    return usage.ru_maxrss / 1024, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", default="1000,10000", help="comma-separated sizes; the first is the base")
    ap.add_argument("--layers", default="0-1", help="layers to mine (`all`: every layer)")
    ap.add_argument("--model", default=None, help="HF id, folder or GGUF (default: the embedded SmolLM2)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sentences.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        peaks = {}
        for n in sizes:
            peaks[n], secs = mine_peak(n, a.layers, a.model, Path(tmp))
            out(f"mine {n:>7,} sentences (layers {a.layers}): peak RSS {peaks[n]:8.1f} MB, {secs:6.1f} s")
    base = peaks[sizes[0]]
    for n in sizes[1:]:
        r = peaks[n] / base
        out(f"peak RSS {n:,} / {sizes[0]:,} sentences: {r:.3f}x (goal <= {GOAL:.2f}x) "
            f"{'met' if r <= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
