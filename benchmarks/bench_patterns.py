"""`ffkv patterns` on a mined run: this checkout (its default workers, and one process) against
another source tree, interleaved, with the tables compared.

    .venv/bin/python benchmarks/bench_patterns.py --run runs/default --base /tmp/base --rounds 3

Each arm runs `ffkv patterns RUN --no-semantic --force` in a fresh process on its own copy of the
run (the shallow patterns are the step's cost; semantic ones are the encoder's). Prints each arm's
median wall time, its ratio to the base tree, and whether its `patterns`, `pattern_keys` and
`patterns_fig2` tables equal the base tree's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
TABLES = ("patterns", "pattern_keys", "patterns_fig2")


def run_patterns(tree: Path, run: Path, extra: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1", "FFKV_PROGRESS": "0"}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ffkv.cli", "patterns", str(run), "--no-semantic", "--force", *extra],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a mined run (copied; the original is not touched)")
    ap.add_argument("--base", type=Path, required=True, help="the source tree to compare against (has src/ffkv)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import pyarrow.parquet as pq

    arms = {"base": (a.base.resolve(), []), "new": (ROOT, []), "new, one process": (ROOT, ["--workers", "0"])}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name in arms:
            runs[name] = Path(tmp) / name.replace(", ", "_").replace(" ", "_")
            shutil.copytree(a.run, runs[name], ignore=shutil.ignore_patterns("report", "*.lock"))
        times: dict[str, list[float]] = {n: [] for n in arms}
        for i in range(a.rounds):
            order = list(arms) if i % 2 == 0 else list(arms)[::-1]
            for name in order:
                tree, extra = arms[name]
                times[name].append(run_patterns(tree, runs[name], extra))
                print(f"round {i + 1}: {name} {times[name][-1]:.1f} s", flush=True)
        base = statistics.median(times["base"])
        print(f"\n{'arm':<18}{'median s':>10}{'x base':>8}  tables equal to base")
        for name in arms:
            same = all(pq.read_table(runs[name] / f"{t}.parquet").equals(pq.read_table(runs["base"] / f"{t}.parquet"))
                       for t in TABLES)
            med = statistics.median(times[name])
            print(f"{name:<18}{med:>10.1f}{med / base:>8.2f}  {same}")
    # the limit: the shallow patterns run no model and multiply no matrices (token counts, prefix
    # matches, binomial tails), so their essential products are 0 FLOP and no GEMM ratio exists;
    # the machine's GEMM rate still goes beside the absolute times
    import limit

    print(f"\nlimit [patterns --no-semantic]: 0 TFLOP of products (no model, no matrix products): "
          f"the times above are all bookkeeping, step / GEMM undefined")
    print(f"  {limit.machine_line()}")


if __name__ == "__main__":
    main()
