"""Benchmark of the facts tools on SmolLM2 (issue 47's targets), each as a ratio measured in one run:

    .venv/bin/python benchmarks/bench_facts.py [--sentences 60] [--layers 7] [--rounds 2] [--skip-trace]
    .venv/bin/python benchmarks/bench_facts.py --only edit --run RUN [--layers 7] [--rounds 2]

1. The covariance tracker: `ffkv mine` of the same sentences with and without `--covariance LAYERS`,
   side by side (alternating, best of `--rounds`); goal: ≤ 1.10× (≤ 10% of mining time).
2. One ROME edit of SmolLM2 once C exists (`ffkv.steps.facts.edit.rome`: the key over the context
   prefixes, the target's 20 Adam steps, the closed form), wall seconds against the 10 s goal, with
   the machine's GEMM rate beside it (an absolute time names the machine).
3. Causal tracing of one fact against the forward passes it needs: `trace()` against plain forwards
   of the same rows (the same batches, no hooks, no restoration); goal ≤ 1.5×.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (ffkv before torch; offline)
from _common import WT2, load_default, out


def mine(out_dir: Path, sentences: int, extra: list[str]) -> tuple[float, float]:
    """(the whole command's seconds, the pass's own: the manifest's mine_seconds, no model load)."""
    import json

    t0 = time.time()
    subprocess.run([sys.executable, "-m", "ffkv.cli", "mine", "--out", str(out_dir), "--corpus",
                    str(WT2 / "wiki.valid.tokens"), "--max-sentences", str(sentences), "--top-k", "5", *extra],
                   check=True, capture_output=True)
    info = json.loads((out_dir / "manifest.json").read_text())["steps"]["mine"]
    return time.time() - t0, float(info.get("mine_seconds") or info.get("info", {}).get("mine_seconds"))


def covariance_cost(tmp: Path, sentences: int, layers: str, rounds: int) -> Path:
    best = {"plain": [float("inf")] * 2, "covariance": [float("inf")] * 2}
    keep = None
    for r in range(rounds):  # alternating, so that both arms see the same machine
        for name, extra in (("plain", []), ("covariance", ["--covariance", layers])):
            d = tmp / f"{name}{r}"
            best[name] = [min(a, b) for a, b in zip(best[name], mine(d, sentences, extra))]
            if name == "covariance":
                keep = d
            else:
                shutil.rmtree(d, ignore_errors=True)
    (w0, p0), (w1, p1) = best["plain"], best["covariance"]
    out(f"[1] mine {sentences} sentences (SmolLM2, CPU), best of {rounds}, alternating: the pass {p0:.1f} s plain, "
        f"{p1:.1f} s with --covariance {layers} -> {p1 / p0:.3f}x ({(p1 / p0 - 1) * 100:+.1f}% of mining; goal ≤ +10%); "
        f"whole commands {w0:.1f} s and {w1:.1f} s ({w1 / w0:.3f}x)")
    return keep


def rome_time(run_dir: Path, layer: int, rounds: int = 1):
    """One ROME edit timed whole, in three arms side by side, alternating, best of `rounds`: every
    step running every token through every block (`cache_below` and `cache_prefix` off); the blocks
    below the edited one run once (`cache_prefix` off: the path before the prefixes were cached);
    and as it runs by default, each row's tokens before the subject's last one cached too. Then the
    parts of the default (the key, the target, the closed form)."""
    from limit import machine_line

    import numpy as np

    from ffkv.model import identity
    from ffkv.steps.facts import edit as E
    from ffkv.store import query
    from ffkv.store.run import Run

    run = Run(run_dir)
    mm = identity.open_model(run, device="cpu")
    _, C, _ = query.key_covariance(run, layer)
    req = E.Request("{} is located in the city of", "The Eiffel Tower", " Rome", " Paris")
    templates = E.prefixes_from(run, mm.tok)
    E.rome(mm, layer, req, C, templates[:2], {"steps": 1})  # warm: first-call allocations
    arms = {"every block": {"cache_below": False, "cache_prefix": False},
            "blocks below reused": {"cache_prefix": False}, "prefixes cached": {}}
    best = dict.fromkeys(arms, float("inf"))
    edits = {}
    for _ in range(rounds):
        for name, hp in arms.items():
            t0 = time.time()
            edits[name] = E.rome(mm, layer, req, C, templates, hp)
            best[name] = min(best[name], time.time() - t0)
    a = edits["every block"].delta(layer).numpy()
    diff = max(float(np.abs(edits[k].delta(layer).numpy() - a).max() / max(np.abs(a).max(), 1e-30)) for k in arms)
    t0 = time.time()
    kbar = E.keys_at(mm, layer, [E.fill(t, req.text) for t in templates], req.subject).mean(0)
    t1 = time.time()
    vstar, k0, y0 = E.target_output(mm, layer, req, templates)
    t2 = time.time()
    E.rome_factors(np.asarray(C), kbar, k0, vstar, y0)
    t3 = time.time()
    s0, s1, s2 = best.values()
    out(f"[2] one ROME edit of SmolLM2 at layer {layer} (C of {mm.d_m}², {len(templates)} prefixes, 20 steps), "
        f"best of {rounds}, alternating: {s0:.1f} s with every token through every block at every step, {s1:.1f} s "
        f"with the blocks below reused, {s2:.1f} s with the prefixes cached too ({s2 / s1:.2f}x the time of the "
        f"path before, {s2 / s0:.2f}x every block's; ΔV's largest relative difference {diff:.1e}) -> {s2 / 10:.2f}x "
        f"the 10 s goal (rank {edits['prefixes cached'].rank(layer)}); parts: key {t1 - t0:.1f} s, target "
        f"{t2 - t1:.1f} s, closed form {t3 - t2:.2f} s; {machine_line()}")
    return mm


def trace_ratio(mm) -> None:
    import numpy as np
    import torch

    from ffkv.steps.facts import trace as T

    prompt, subject, target = "The Eiffel Tower is located in the city of", "The Eiffel Tower", " Paris"
    kw = dict(samples=3, kinds=("ffn",), batch=256)
    T.trace(mm, prompt, subject, target, samples=1, kinds=("ffn",))  # warm
    t0 = time.time()
    r = T.trace(mm, prompt, subject, target, **kw)
    traced = time.time() - t0
    ids = torch.tensor([list(mm.tok(prompt)["input_ids"])])
    rows, B = r.rows, kw["batch"]
    t0 = time.time()
    with torch.no_grad():
        mm.hf(input_ids=ids, use_cache=False)  # the clean pass
        for a in range(0, rows, B):
            mm.hf(input_ids=ids.expand(min(B, rows - a), -1), use_cache=False)
    plain = time.time() - t0
    out(f"[3] causal trace of one fact ({len(r.tokens)} tokens × {mm.n_layers} layers × ffn × {kw['samples']} "
        f"samples = {rows} rows in {r.forwards} forwards): {traced:.1f} s against {plain:.1f} s of plain forwards "
        f"of the same rows -> {traced / plain:.2f}x (goal ≤ 1.5x); peak ffn effect at the last subject token "
        f"{float(np.max(r.effect['ffn'][r.last_subject])):+.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=60)
    ap.add_argument("--layers", default="7", help="--covariance layers of the mining comparison")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--only", choices=("mine", "edit", "trace"),
                    help="run only this part; edit and trace need --run (a mined run with the layer's covariance)")
    ap.add_argument("--run", type=Path, help="an existing run to edit and trace in, instead of the one mined here")
    a = ap.parse_args()
    if a.only in ("edit", "trace") and not a.run:
        ap.error(f"--only {a.only} needs --run")
    layer = int(a.layers.split(",")[0].split("-")[0])
    tmp = Path(tempfile.mkdtemp(prefix="bench_facts_"))
    try:
        run_dir = a.run
        if a.only == "mine" or (a.only is None and not a.run):
            run_dir = covariance_cost(tmp, a.sentences, a.layers, a.rounds)
            if a.only == "mine":
                return
        if a.only == "trace":
            from ffkv.model import identity
            from ffkv.store.run import Run

            trace_ratio(identity.open_model(Run(run_dir), device="cpu"))
            return
        mm = rome_time(run_dir, layer, a.rounds)
        if not a.skip_trace and a.only is None:
            trace_ratio(mm)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
