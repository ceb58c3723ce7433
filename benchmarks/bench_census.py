"""Benchmark of `ffkv census` on SmolLM2: the step's time beyond the mining pass it reuses.

    .venv/bin/python benchmarks/bench_census.py            # mines 30 WikiText-2 sentences first
    .venv/bin/python benchmarks/bench_census.py --run RUN  # a mined run (copied; RUN is not written)

Goal (issue 46): ≤ 60 s for the census of SmolLM2's 46,080 memories (30 × 49,152-token cosine vectors
each, their scipy moments, the key-value cosines, dead and rare from the key statistics) on the 2-core
CPU. Printed: the step's wall time and CPU seconds, their ratio to the goal, and one layer's split
between torch's products and scipy's moments (CPU seconds), with the load average beside it: on a
shared machine the wall time depends on what else runs; the CPU seconds do not.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (ffkv before torch; offline)
from _common import WT2, out

GOAL_S = 60.0


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="a mined SmolLM2 run (default: mine 30 sentences into a temp folder)")
    ap.add_argument("--sentences", type=int, default=30)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_census_"))
    try:
        run_dir = tmp / "run"
        if a.run is not None:
            shutil.copytree(a.run, run_dir)
        else:
            subprocess.run([sys.executable, "-m", "ffkv.cli", "mine", "--out", str(run_dir), "--corpus",
                            str(WT2 / "wiki.valid.tokens"), "--max-sentences", str(a.sentences), "--top-k", "5"],
                           check=True, capture_output=True)
        from ffkv.model import identity
        from ffkv.steps.census import CensusSettings
        from ffkv.steps.census.compute import compute_census
        from ffkv.store.run import Run

        run = Run(run_dir)
        mm = identity.open_model(run, device="cpu")
        load0 = os.getloadavg()[0]
        c0, t0 = cpu_s(), time.time()
        summ = compute_census(run, mm, CensusSettings(), show_progress=False, force=True)
        wall, cpu = time.time() - t0, cpu_s() - c0
        out(f"census of {summ['memories']:,} memories ({summ['layers']} layers), |V| = {mm.vocab_size:,}: "
            f"{wall:.1f} s wall ({wall / GOAL_S:.2f}x the {GOAL_S:.0f} s goal), {cpu:.1f} CPU-s "
            f"({cpu / 2 / GOAL_S:.2f}x the goal at 2 busy cores); load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
        split(mm)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def split(mm) -> None:
    """One layer's CPU seconds: torch's products with the vocabulary, then scipy's moments of them."""
    import torch

    from ffkv.steps.census.compute import _moments, _unit, unembedding_rows

    W = unembedding_rows(mm, mm.lens.name)
    Vn = _unit(mm.values(mm.n_layers // 2))
    c0 = cpu_s()
    with torch.no_grad():
        C = (Vn @ W.T).numpy()
    c1 = cpu_s()
    _moments(C)
    c2 = cpu_s()
    out(f"one layer: products {c1 - c0:.2f} CPU-s, scipy's skew/kurtosis/variance {c2 - c1:.2f} CPU-s "
        f"({(c2 - c1) / max(c2 - c0, 1e-9):.0%} of the two)")


if __name__ == "__main__":
    main()
