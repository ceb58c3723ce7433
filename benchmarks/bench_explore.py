"""Benchmark of the prediction explorer (issue 17) on SmolLM2, once the model is loaded.

    .venv/bin/python benchmarks/bench_explore.py [--repeats 5]

Goals: a 64-token text with per-layer attribution (`ffkv.experiments.explain.explain`, what
`/api/explore` computes) in ≤ 1.0 s on this CPU; an intervention (a second, edited forward pass
and its reading) ≤ 1.0 s more. Printed beside a plain transformers forward pass with logits of
the same 64 tokens, measured in the same run, and the same two requests through HTTP
(`/api/explore` in a FastAPI app with the explorer's router; the cache is bypassed by varying
`top`, which costs nothing). The five are timed in interleaved rounds (after a warm-up round)
so that they share the load of the moment; printed: the best and the median wall time, the CPU
time, and the median ratio to the forward pass of the same round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from _common import WT2, load_default, out

GOAL_ATTR, GOAL_EDIT = 1.0, 1.0


def text_of(mm, n_tokens: int) -> str:
    """A WikiText-2 passage cut to exactly `n_tokens` tokens."""
    from ffkv.corpus.sources import open_corpus

    words = " ".join(s.text for s in open_corpus(str(WT2 / "wiki.valid.tokens")).sentences(40))
    for cut in range(n_tokens * 2, n_tokens - 1, -1):
        t = mm.tok.decode(mm.tok(words)["input_ids"][:cut])
        if len(mm.tok(t)["input_ids"]) == n_tokens:
            return t
    raise RuntimeError("no cut gives exactly that many tokens")


def timed(fn) -> tuple[float, float]:
    """Wall seconds and CPU seconds of this process (all its threads)."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def interleaved(fns: dict, repeats: int) -> dict:
    """Each repeat runs every fn once, back to back, so that they share the machine's load of
    the moment; one warm-up round first. Returns {name: [(wall, cpu), ...]}.

    Everything runs in one worker thread, as the server runs the explorer's model calls (in its
    thread pool). On this 2-core machine under a load average of 14, torch called from the main
    thread ran the same forward pass 10-25x slower than from a worker thread (3.8-7.5 s vs
    0.28-0.30 s), so the main thread would not measure what the server does."""
    from concurrent.futures import ThreadPoolExecutor

    def rounds():
        for fn in fns.values():
            fn()
        res = {k: [] for k in fns}
        for _ in range(repeats):
            for k, fn in fns.items():
                res[k].append(timed(fn))
        return res

    with ThreadPoolExecutor(1) as ex:
        return ex.submit(rounds).result()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()

    import torch
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from ffkv.experiments.explain import explain
    from ffkv.web import explore

    t0 = time.perf_counter()
    mm = load_default()
    out(f"model loaded in {time.perf_counter() - t0:.1f} s; {torch.get_num_threads()} threads; "
        f"load average {os.getloadavg()[0]:.1f}")
    text = text_of(mm, a.tokens)
    ids, mask = mm.batch([mm.tok(text)["input_ids"]])
    res = explain(mm, text, 3)
    top = res["top_memories"]["up"][0]
    edit = [(top["layer"], top["dim"], "scale", 0.0)]

    def plain():
        with torch.no_grad():
            mm.hf(input_ids=ids, attention_mask=mask, use_cache=False)

    app = FastAPI()
    app.include_router(explore.router)
    app.state.explore_model = mm
    c = TestClient(app, base_url="http://127.0.0.1")
    k = iter(range(1, 1_000_000))

    def http(**extra):  # `top` varies so that the cache never answers
        r = c.get("/api/explore", params={"text": text, "top": 3 + next(k) % 15, **extra})
        assert r.status_code == 200, r.text

    sup = f"{top['layer']}:{top['dim']}"
    res = interleaved({"forward": plain, "explain": lambda: explain(mm, text, 3),
                       "edit": lambda: explain(mm, text, 3, edit),
                       "http": http, "http_edit": lambda: http(suppress=sup)}, a.repeats)
    wall = {n: [w for w, _ in v] for n, v in res.items()}
    cpu = {n: [c for _, c in v] for n, v in res.items()}
    med = {n: statistics.median(v) for n, v in wall.items()}
    best = {n: min(v) for n, v in wall.items()}
    ratio = {n: statistics.median([x / f for x, f in zip(wall[n], wall["forward"])]) for n in wall}
    extra = statistics.median([e - x for e, x in zip(wall["edit"], wall["explain"])])
    extra_best = min(e - x for e, x in zip(wall["edit"], wall["explain"]))

    out(f"{a.tokens}-token text, SmolLM2 ({mm.n_layers} layers × {mm.d_m} memories), {a.repeats} interleaved "
        f"rounds; load average now {os.getloadavg()[0]:.1f} (on 2 cores: anything above 2 slows every figure)")
    out(f"  {'':36s} {'best s':>7s} {'median s':>9s} {'CPU s':>7s} {'× forward':>10s}")
    names = {"forward": "plain forward with logits", "explain": "explain (attribution, both lenses)",
             "edit": "explain + one intervention (at last)", "http": "/api/explore",
             "http_edit": "/api/explore&suppress=L:D"}
    for n, label in names.items():
        out(f"  {label:36s} {best[n]:7.3f} {med[n]:9.3f} {statistics.median(cpu[n]):7.3f} {ratio[n]:10.2f}")
    out(f"  attribution: best {best['explain']:.3f} s, median {med['explain']:.3f} s; goal ≤ {GOAL_ATTR:.1f} s: "
        f"{'met' if med['explain'] <= GOAL_ATTR else ('met at best' if best['explain'] <= GOAL_ATTR else 'NOT met')}")
    out(f"  intervention: +{extra_best:.3f} s best, +{extra:.3f} s median; goal ≤ +{GOAL_EDIT:.1f} s: "
        f"{'met' if extra <= GOAL_EDIT else ('met at best' if extra_best <= GOAL_EDIT else 'NOT met')}")


if __name__ == "__main__":
    main()
