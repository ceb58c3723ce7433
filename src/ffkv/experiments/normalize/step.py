"""The `normalize` step: settings, the held-out text, the passes, the tables (see the package docstring)."""
from __future__ import annotations

import time
import pyarrow as pa

from ffkv.errors import FfkvError
from ffkv.model.context import sentences_note

from ffkv.steps.normalize import (CAPACITY_DEPTHS, DEFAULT_CORPUS, STEP, TABLES,  # noqa: F401
                                  NormalizeSettings, default_capacity_layers, default_capacity_n, record,
                                  reproduce_settings)


def plan_of(mm, s: NormalizeSettings):
    from ffkv.experiments.normalize.passes import Plan

    L = mm.n_layers
    for what, ls in (("--layers", s.layers), ("--capacity-layers", s.capacity_layers)):
        bad = [l for l in ls or () if not 0 <= l < L]
        if bad:
            raise FfkvError(f"{what}: layer(s) {bad} out of range 0..{L - 1}")
    ns = sorted({n for n in (s.capacity_n or default_capacity_n(mm.d_m)) if n < mm.d_m})
    if any(n < 1 for n in ns):
        raise FfkvError("--capacity-n: every n must be at least 1")
    cap = default_capacity_layers(L) if s.capacity_layers is None else sorted(set(s.capacity_layers))
    return Plan(layers=sorted(set(s.layers)) if s.layers else list(range(L)),
                capacity_layers=cap if s.sweep_tokens > 0 else [], capacity_n=ns, seed=s.seed)


# ---- the held-out text ---------------------------------------------------------------------------
def _sentences(mm, spec: str, seed: int, need: int):
    """Tokenized sentences in the source's seeded order, enough for `need` tokens (or all)."""
    from ffkv.corpus.sources import open_corpus, tokenize

    src = open_corpus(spec, seed=seed)
    k = max(64, need // 10)
    while True:
        sents = src.sentences(max_sentences=k)
        ids, n_cut = tokenize(mm.tok, sents, mm.max_length)
        if sum(map(len, ids)) >= 1.5 * need or len(sents) < k:
            return src, sents, ids, n_cut
        k *= 2


def split(mm, s: NormalizeSettings, warn=print) -> tuple[list, list, int, pa.Table]:
    """(eval token lists, fit token lists, n_sweep, `normalize_sentences`): evaluation sentences
    (2+ tokens) first, up to `tokens`; the fit split starts at the next document, up to
    `fit_tokens`; the sweep is the first sentences of the evaluation split, up to `sweep_tokens`."""
    spec = s.corpus or DEFAULT_CORPUS
    src, sents, ids, n_cut = _sentences(mm, spec, s.seed, s.tokens + s.fit_tokens)
    if note := sentences_note("normalize_sentences", n_cut, len(sents), mm.max_length):
        warn(note)  # cut at their end, as every corpus's sentences (`ffkv.model.context.fit_sentences`)
    ev, fi, n_ev, n_fi, n_sw, n_sweep = [], [], 0, 0, 0, 0
    for i, t in enumerate(ids):
        if n_ev < s.tokens:
            if len(t) >= 2:
                ev.append(i)
                n_ev += len(t)
                if n_sw < s.sweep_tokens:
                    n_sweep, n_sw = n_sweep + 1, n_sw + len(t)
        elif n_fi < s.fit_tokens and sents[i].doc_id != sents[ev[-1]].doc_id:
            fi.append(i)
            n_fi += len(t)
    if not ev or not fi:
        raise FfkvError(f"corpus {spec!r} is too small: it gives {n_ev} evaluation and {n_fi} fit tokens")
    if n_ev < s.tokens or n_fi < s.fit_tokens:
        warn(f"corpus {spec!r} has only {n_ev} evaluation and {n_fi} fit tokens "
             f"({s.tokens} and {s.fit_tokens} requested); using them all")
    order = ev + fi
    table = pa.table({
        "sentence_id": pa.array([sents[i].sentence_id for i in order], pa.int64()),
        "doc_id": pa.array([sents[i].doc_id for i in order], pa.int64()),
        "split": pa.array(["eval"] * len(ev) + ["fit"] * len(fi), pa.string()),
        "in_sweep": pa.array([j < n_sweep for j in range(len(ev))] + [False] * len(fi), pa.bool_()),
        "text": pa.array([sents[i].text for i in order], pa.string()),
        "token_ids": pa.array([ids[i] for i in order], pa.list_(pa.int32())),
        "n_tokens": pa.array([len(ids[i]) for i in order], pa.int32()),
    })
    return [ids[i] for i in ev], [ids[i] for i in fi], n_sweep, table


# ---- the step --------------------------------------------------------------------------------------
def normalize(mm, s: NormalizeSettings, warn=print, show_progress: bool | None = None) -> dict:
    """Run every measure; returns {"tables": {name: Table}, "info": {...}} (writes nothing)."""
    from ffkv.experiments.normalize import tables as T
    from ffkv.corpus.batching import resolve_step_batch
    from ffkv.experiments.normalize.passes import MAX_ROWS, evaluate, fit
    from ffkv.experiments.normalize.variance import ModelVariance, synthetic
    from ffkv.progress import progress

    from ffkv.model.onednn import fast_products

    plan = plan_of(mm, s)
    bt, rows = resolve_step_batch(mm, s.batch_tokens, 1024, MAX_ROWS)
    t0 = time.perf_counter()
    ev, fi, n_sweep, sent = split(mm, s, warn)
    with progress(None if show_progress is None else not show_progress) as bar, fast_products(getattr(mm, "device", None)):
        t1 = time.perf_counter()
        fitted = fit(mm, fi, plan, bt, bar, rows)
        t2 = time.perf_counter()
        var = ModelVariance(mm, plan.layers, s.variance_repeats, s.seed, s.gamma)
        acc, errs = evaluate(mm, ev, n_sweep, plan, fitted, bt, var, bar, rows)
    t3 = time.perf_counter()
    out = {"normalize_sentences": sent, "normalize_layers": T.layers_table(mm, plan, fitted, acc, errs),
           "normalize_capacity": T.capacity_table(mm, plan, fitted, acc, n_sweep),
           "normalize_variance": T.variance_table(synthetic(draws=s.synthetic_draws, gamma=s.gamma, seed=s.seed)
                                                  + var.rows())}
    t4 = time.perf_counter()
    info = {"eval_tokens": sum(map(len, ev)), "eval_sentences": len(ev), "fit_tokens": sum(map(len, fi)),
            "fit_sentences": len(fi), "sweep_sentences": n_sweep, "layers": len(plan.layers),
            "batch_tokens": bt, "max_rows": rows,
            "substitutions": 2 * len(plan.layers),
            "capacity_substitutions": sum(len(plan.capacity(mm, l)) for l in plan.capacity_layers),
            "capacity_layers": plan.capacity_layers, "capacity_n": plan.capacity_n + [mm.d_m],
            "seconds_prepare": round(t1 - t0, 2), "seconds_fit": round(t2 - t1, 2),
            "seconds_substitute": round(t3 - t2, 2), "seconds_tables": round(t4 - t3, 2)}
    return {"tables": out, "info": info}


def compute(ctx) -> dict:
    """Open the model (in the settings' dtype unless the caller gave one), measure, write the tables."""
    s = ctx.settings
    res = normalize(ctx.model(), s, warn=ctx.warn, show_progress=ctx.show_progress)
    for name in TABLES:
        ctx.run.write_table(name, res["tables"][name])
    ctx.result = res
    return res["info"]

