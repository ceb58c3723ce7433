"""Time `ffkv reproduce` step by step for two source trees, one after the other, on the same machine.

    .venv/bin/python benchmarks/bench_reproduce.py --base /tmp/base            # base tree vs this checkout
    .venv/bin/python benchmarks/bench_reproduce.py --base /tmp/base --mined runs/default --rounds 2
    .venv/bin/python benchmarks/bench_reproduce.py --base /tmp/base --mined runs/default --parallel

Each side runs `python -m ffkv.cli reproduce COPY` in a subprocess with PYTHONPATH=TREE/src (and
checks that it really imports that tree's ffkv). Without --mined every run starts from nothing
(mine included); with --mined each side starts from a copy of that run's mining step only (its
tables and manifest entries), so the steps after mining are compared on the same triggers.
Rounds alternate the order (base first, then new first), so load from other processes that
drifts during a measurement hits both sides alike. Prints the per-step wall seconds that each
run's manifest records (`reproduce.wall_seconds`), their ratios new/base, and whether the two
runs' verdicts (`report/verdicts.json`) agree: verdicts identical, and every other field equal
(measured figures are printed rounded, so they are compared as printed).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check_tree(tree: Path, python: str) -> None:
    """Refuse a tree whose ffkv is not the one a subprocess imports with PYTHONPATH=TREE/src."""
    got = subprocess.run([python, "-c", "import ffkv; print(ffkv.__file__)"], env=env_for(tree),
                         capture_output=True, text=True, check=True).stdout.strip()
    if not Path(got).resolve().is_relative_to((tree / "src").resolve()):
        sys.exit(f"{tree}: the subprocess imports {got}, not that tree's ffkv")


def env_for(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("MKL_CBWR", None)  # ffkv sets it itself, as for a user
    return env


def copy_mined(src: Path, dst: Path) -> None:
    """dst: a run holding only what the mine step of `src` wrote (tables and manifest entries)."""
    m = json.loads((src / "manifest.json").read_text())
    if (m.get("steps", {}).get("mine") or {}).get("status") != "done":
        sys.exit(f"{src}: its mine step is not done")
    dst.mkdir(parents=True)
    tables = {k: v for k, v in (m.get("tables") or {}).items() if v.get("step") == "mine"}
    for name in tables:
        shutil.copy2(src / f"{name}.parquet", dst / f"{name}.parquet")
    for d in ("checkpoints",):
        if (src / d).is_dir():
            shutil.copytree(src / d, dst / d)
    m["tables"] = tables
    m["steps"] = {"mine": m["steps"]["mine"]}
    m["settings"] = {"mine": m["settings"]["mine"]}
    m.pop("reproduce", None)
    (dst / "manifest.json").write_text(json.dumps(m, indent=2))


def start_side(tree: Path, python: str, run: Path, mined: Path | None, log: Path):
    """(process, start time, log file) of one side's `reproduce`, started."""
    if mined is not None:
        copy_mined(mined, run)
    f = open(log, "w")
    p = subprocess.Popen([python, "-m", "ffkv.cli", "reproduce", str(run)], env=env_for(tree),
                         stdout=f, stderr=subprocess.STDOUT, cwd=tree)
    return p, time.perf_counter(), f


def finish_side(started, tree: Path, run: Path, log: Path) -> dict:
    p, t0, f = started
    rc = p.wait()
    wall = time.perf_counter() - t0
    f.close()
    if rc != 0:
        sys.exit(f"reproduce with {tree} failed (exit {rc}); see {log}")
    times = json.loads((run / "manifest.json").read_text())["reproduce"]["wall_seconds"]
    return {"times": times, "process": wall}


def run_side(tree: Path, python: str, run: Path, mined: Path | None, log: Path) -> dict:
    return finish_side(start_side(tree, python, run, mined, log), tree, run, log)


def verdict_diffs(a: Path, b: Path) -> list[str]:
    """Lines naming each verdict record that differs between two runs' verdicts.json."""
    def read(run: Path) -> dict:  # a hint naming its own run's folder is the same hint
        text = (run / "report" / "verdicts.json").read_text().replace(json.dumps(str(run))[1:-1], "RUN")
        return {r["id"]: r for r in json.loads(text)}

    va, vb = read(a), read(b)
    out = [f"{k}: only in one run" for k in sorted(va.keys() ^ vb.keys())]
    for k in va.keys() & vb.keys():
        for f in sorted(set(va[k]) | set(vb[k])):
            if va[k].get(f) != vb[k].get(f):
                kind = "VERDICT" if f in ("verdict", "lenses") else "field"
                out.append(f"{kind} {k}.{f}: {va[k].get(f)!r} vs {vb[k].get(f)!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the source tree to compare against (has src/ffkv)")
    ap.add_argument("--new", type=Path, default=ROOT, help="the other tree (default: this checkout)")
    ap.add_argument("--mined", type=Path, help="start each side from this run's mining step")
    ap.add_argument("--rounds", type=int, default=1, help="pairs of runs; the order alternates")
    ap.add_argument("--work", type=Path, help="where the runs go (default: a temporary folder, removed)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--parallel", action="store_true",
                    help="run both sides of a round at the same time (a loaded machine: both see the same load; "
                         "the side that ends first leaves the other the machine, which favours the slower one)")
    a = ap.parse_args()
    trees = {"base": a.base.resolve(), "new": a.new.resolve()}
    for t in trees.values():
        check_tree(t, a.python)
    work = a.work or Path(tempfile.mkdtemp(prefix="bench_reproduce_"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, list[dict]] = {"base": [], "new": []}
    try:
        for i in range(a.rounds):
            order = ("base", "new") if i % 2 == 0 else ("new", "base")
            started = {}
            for side in order:
                run = work / f"{side}{i}"
                if run.exists():
                    shutil.rmtree(run)
                print(f"round {i + 1}: {side} ({trees[side]}) -> {run}", flush=True)
                started[side] = start_side(trees[side], a.python, run, a.mined, work / f"{side}{i}.log")
                if not a.parallel:
                    res[side].append(finish_side(started.pop(side), trees[side], run, work / f"{side}{i}.log"))
                    print("  " + ", ".join(f"{k} {v:.0f}s" for k, v in res[side][-1]["times"].items()), flush=True)
            for side in started:
                res[side].append(finish_side(started[side], trees[side], work / f"{side}{i}", work / f"{side}{i}.log"))
                print(f"  {side}: " + ", ".join(f"{k} {v:.0f}s" for k, v in res[side][-1]["times"].items()),
                      flush=True)
            diffs = verdict_diffs(work / f"base{i}", work / f"new{i}")
            print(f"  verdicts: {'identical' if not diffs else f'{len(diffs)} differences'}")
            for d in diffs:
                print(f"    {d}")
        steps = list(res["base"][0]["times"])
        print(f"\n{'step':<12}{'base s':>9}{'new s':>9}{'new/base':>10}   (sum over {a.rounds} round(s))")
        tot = {"base": 0.0, "new": 0.0}
        for s in steps:
            b = sum(r["times"].get(s, 0.0) for r in res["base"])
            n = sum(r["times"].get(s, 0.0) for r in res["new"])
            tot["base"] += b
            tot["new"] += n
            print(f"{s:<12}{b:>9.1f}{n:>9.1f}{(n / b if b else float('nan')):>10.2f}")
        print(f"{'total':<12}{tot['base']:>9.1f}{tot['new']:>9.1f}{tot['new'] / tot['base']:>10.2f}")
        pb = sum(r["process"] for r in res["base"])
        pn = sum(r["process"] for r in res["new"])
        print(f"{'process':<12}{pb:>9.1f}{pn:>9.1f}{pn / pb:>10.2f}   (the whole command: imports, model load)")
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
