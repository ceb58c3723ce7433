"""Benchmark of the prediction explorer (issue 17) on SmolLM2, once the model is loaded.

    .venv/bin/python benchmarks/bench_explore.py [--repeats 5]
    PYTHONPATH=src python3 benchmarks/bench_explore.py --model MODEL_DIR --device cuda --corpus .dev/wt2_train_ids.parquet

(the second on a bare GPU box: a model folder, the text decoded from a Parquet of token ids, and
the HTTP rows skipped where FastAPI is not installed; a CUDA figure syncs the device in each call)

Goals: a 64-token text with per-layer attribution (`ffkv.web.explain.explain`, what
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


def text_of(mm, n_tokens: int, corpus: str | None = None) -> str:
    """A WikiText-2 passage cut to exactly `n_tokens` tokens (from `corpus`, a Parquet of token id
    lists, decoded, where given)."""
    from ffkv.corpus.sources import open_corpus

    if corpus:
        from pathlib import Path

        from ffkv.corpus.tokens import read_tokens

        ids = read_tokens(Path(corpus), "parquet")  # its list-of-integers column, as `ffkv mine` reads it
        rows = [ids.row(i) for i in range(min(40, ids.n_rows))]
        words = " ".join(mm.tok.decode(r, skip_special_tokens=True) for r in rows)
    else:
        words = " ".join(s.text for s in open_corpus(str(WT2 / "wiki.valid.tokens")).sentences(40))
    for cut in range(n_tokens * 2, n_tokens - 1, -1):
        t = mm.tok.decode(mm.tok(words)["input_ids"][:cut])
        if len(mm.tok(t)["input_ids"]) == n_tokens:
            return t
    raise RuntimeError("no cut gives exactly that many tokens")


SYNC = None  # torch.cuda.synchronize where the model is on CUDA: a call's time includes its device work


def timed(fn) -> tuple[float, float]:
    """Wall seconds and CPU seconds of this process (all its threads)."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    if SYNC is not None:
        SYNC()
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
    ap.add_argument("--model", default=None, help="HF id, folder or GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    ap.add_argument("--corpus", default=None, help="a Parquet of token id lists to take the text from "
                    "(default: WikiText-2 valid)")
    a = ap.parse_args()

    import torch

    from ffkv.web.explain import explain

    global SYNC
    cuda_s = None
    if a.device.startswith("cuda") and torch.cuda.is_available():  # the driver's start apart from the load
        t0 = time.perf_counter()
        torch.zeros(1, device=a.device).sum().item()
        cuda_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if a.model is None and a.device == "cpu":
        mm = load_default()
    else:
        from ffkv.model.memories import open_model

        mm = open_model(a.model, device=a.device)
    if torch.device(mm.device).type == "cuda":
        SYNC = torch.cuda.synchronize
    out(f"model loaded in {time.perf_counter() - t0:.1f} s on {mm.device} ({mm.dtype})"
        + (f", after CUDA started in {cuda_s:.1f} s" if cuda_s is not None else "") + "; "
        f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}")
    text = text_of(mm, a.tokens, a.corpus)
    ids, mask = mm.batch([mm.tok(text)["input_ids"]])
    res = explain(mm, text, 3)
    top = res["top_memories"]["up"][0]
    edit = [(top["layer"], top["dim"], "scale", 0.0)]

    def plain():
        with torch.no_grad():
            mm.hf(input_ids=ids, attention_mask=mask, use_cache=False)

    fns = {"forward": plain, "explain": lambda: explain(mm, text, 3), "edit": lambda: explain(mm, text, 3, edit)}
    try:
        from fastapi import FastAPI
        from fastapi.testclient import TestClient

        from ffkv.web.routers import explorer as explore
    except ImportError:
        out("  the HTTP rows: skipped (no FastAPI here)")
    else:
        app = FastAPI()
        app.include_router(explore.router)
        app.state.explore_model = mm
        c = TestClient(app, base_url="http://127.0.0.1")
        k = iter(range(1, 1_000_000))

        def http(**extra):  # `top` varies so that the cache never answers
            r = c.get("/api/explore", params={"text": text, "top": 3 + next(k) % 15, **extra})
            assert r.status_code == 200, r.text

        sup = f"{top['layer']}:{top['dim']}"
        fns.update(http=http, http_edit=lambda: http(suppress=sup))
    res = interleaved(fns, a.repeats)
    wall = {n: [w for w, _ in v] for n, v in res.items()}
    cpu = {n: [c for _, c in v] for n, v in res.items()}
    med = {n: statistics.median(v) for n, v in wall.items()}
    best = {n: min(v) for n, v in wall.items()}
    ratio = {n: statistics.median([x / f for x, f in zip(wall[n], wall["forward"])]) for n in wall}
    extra = statistics.median([e - x for e, x in zip(wall["edit"], wall["explain"])])
    extra_best = min(e - x for e, x in zip(wall["edit"], wall["explain"]))

    out(f"{a.tokens}-token text, {mm.n_layers} layers × {mm.d_m} memories, {a.repeats} interleaved "
        f"rounds; load average now {os.getloadavg()[0]:.1f} (on 2 cores: anything above 2 slows every figure)")
    out(f"  {'':36s} {'best s':>7s} {'median s':>9s} {'CPU s':>7s} {'× forward':>10s}")
    names = {"forward": "plain forward with logits", "explain": "explain (attribution, both lenses)",
             "edit": "explain + one intervention (at last)", "http": "/api/explore",
             "http_edit": "/api/explore&suppress=L:D"}
    for n, label in [(n, lab) for n, lab in names.items() if n in wall]:
        out(f"  {label:36s} {best[n]:7.3f} {med[n]:9.3f} {statistics.median(cpu[n]):7.3f} {ratio[n]:10.2f}")
    out(f"  attribution: best {best['explain']:.3f} s, median {med['explain']:.3f} s; goal ≤ {GOAL_ATTR:.1f} s: "
        f"{'met' if med['explain'] <= GOAL_ATTR else ('met at best' if best['explain'] <= GOAL_ATTR else 'NOT met')}")
    out(f"  intervention: +{extra_best:.3f} s best, +{extra:.3f} s median; goal ≤ +{GOAL_EDIT:.1f} s: "
        f"{'met' if extra <= GOAL_EDIT else ('met at best' if extra_best <= GOAL_EDIT else 'NOT met')}")


if __name__ == "__main__":
    main()
