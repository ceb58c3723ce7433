"""The `normalize` step: settings, the held-out text, the passes, the tables (see the package docstring)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow as pa

from ffkv.errors import FfkvError
from ffkv.store.steps import Step

DEFAULT_CORPUS = "wikipedia:valid"
TABLES = ("normalize_sentences", "normalize_layers", "normalize_capacity", "normalize_variance")
CAPACITY_DEPTHS = (1 / 6, 1 / 2, 5 / 6)  # low, middle, high


@dataclass(frozen=True)
class NormalizeSettings:
    """`ffkv normalize`'s options. All but `batch_tokens` (speed only) are recorded."""
    corpus: str | None = None  # held-out text; default wikipedia:valid
    tokens: int = 10_000  # evaluation split (tokens fed to the model)
    fit_tokens: int = 2_000  # fit split (τ, scales), disjoint documents
    sweep_tokens: int = 3_000  # the first tokens of the evaluation split: capacity sweep, variance on the model
    layers: tuple[int, ...] | None = None  # None: every layer
    capacity_layers: tuple[int, ...] | None = None  # None: low, middle, high; (): no sweep
    capacity_n: tuple[int, ...] | None = None  # None: 16, 64, 256, … below d_m (d_m is always added)
    variance_repeats: int = 4  # random subsets per size on the model
    synthetic_draws: int = 2_000
    gamma: float = 1.0  # γ of the synthetic scaled ReLU and of the scaled variance on the model
    seed: int = 0
    batch_tokens: int = 1024
    dtype: str = "auto"


def default_capacity_layers(L: int) -> list[int]:
    return sorted({min(L - 1, max(0, round(q * L - 0.5))) for q in CAPACITY_DEPTHS})


def default_capacity_n(d_m: int) -> list[int]:
    out, n = [], 16
    while n < d_m:
        out.append(n)
        n *= 4
    return out


def reproduce_settings(n_layers: int, corpus: str | None = None, seed: int = 0,
                       dtype: str = "auto") -> NormalizeSettings:
    """What `ffkv reproduce` runs: sized to add ≤ 2 minutes on SmolLM2 on a 2-core CPU
    (`benchmarks/bench_normalize.py --only reproduce`). Every ⌈L/8⌉-th layer, the capacity sweep
    on the studied layers nearest to low, middle and high, fewer tokens and slot counts."""
    stride = -(-n_layers // 8)
    layers = tuple(range(0, n_layers, stride))
    cap = tuple(sorted({min(layers, key=lambda l: (abs(l - c), l)) for c in default_capacity_layers(n_layers)}))
    return NormalizeSettings(corpus=corpus, tokens=2_000, fit_tokens=600, sweep_tokens=600, layers=layers,
                             capacity_layers=cap, capacity_n=(16, 128, 1024), variance_repeats=2,
                             synthetic_draws=1_000, seed=seed, dtype=dtype)


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


def record(run, s: NormalizeSettings) -> dict:
    """The manifest's settings; raises FfkvError on bad ones before any model is loaded."""
    for name, v, lo in (("--tokens", s.tokens, 1), ("--fit-tokens", s.fit_tokens, 1),
                        ("--sweep-tokens", s.sweep_tokens, 0), ("--variance-repeats", s.variance_repeats, 2),
                        ("--synthetic-draws", s.synthetic_draws, 10), ("--batch-tokens", s.batch_tokens, 1)):
        if v < lo:
            raise FfkvError(f"{name} must be at least {lo} (got {v})")
    if not s.gamma > 0:
        raise FfkvError(f"--gamma must be positive (got {s.gamma})")
    if s.capacity_n and min(s.capacity_n) < 1:
        raise FfkvError(f"--capacity-n: every n must be at least 1 (got {min(s.capacity_n)})")
    L = (run.manifest.get("model") or {}).get("layers")
    if L:
        for what, ls in (("--layers", s.layers), ("--capacity-layers", s.capacity_layers)):
            bad = [l for l in ls or () if not 0 <= l < int(L)]
            if bad:
                raise FfkvError(f"{what}: layer(s) {bad} out of range 0..{int(L) - 1}")
    return {"corpus": s.corpus or DEFAULT_CORPUS, "tokens": s.tokens, "fit_tokens": s.fit_tokens,
            "sweep_tokens": s.sweep_tokens, "layers": sorted(s.layers) if s.layers else None,
            "capacity_layers": None if s.capacity_layers is None else sorted(s.capacity_layers),
            "capacity_n": sorted(s.capacity_n) if s.capacity_n else None,
            "variance_repeats": s.variance_repeats, "synthetic_draws": s.synthetic_draws,
            "gamma": float(s.gamma), "seed": s.seed, "dtype": s.dtype}


# ---- the held-out text ---------------------------------------------------------------------------
def _sentences(mm, spec: str, seed: int, need: int):
    """Tokenized sentences in the source's seeded order, enough for `need` tokens (or all)."""
    from ffkv.corpus.sources import open_corpus, tokenize

    src = open_corpus(spec, seed=seed)
    k = max(64, need // 10)
    while True:
        sents = src.sentences(max_sentences=k)
        ids, _ = tokenize(mm.tok, sents, mm.max_length)
        if sum(map(len, ids)) >= 1.5 * need or len(sents) < k:
            return src, sents, ids
        k *= 2


def split(mm, s: NormalizeSettings, warn=print) -> tuple[list, list, int, pa.Table]:
    """(eval token lists, fit token lists, n_sweep, `normalize_sentences`): evaluation sentences
    (2+ tokens) first, up to `tokens`; the fit split starts at the next document, up to
    `fit_tokens`; the sweep is the first sentences of the evaluation split, up to `sweep_tokens`."""
    spec = s.corpus or DEFAULT_CORPUS
    src, sents, ids = _sentences(mm, spec, s.seed, s.tokens + s.fit_tokens)
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
    from ffkv.experiments.normalize.passes import evaluate, fit
    from ffkv.experiments.normalize.variance import ModelVariance, synthetic
    from ffkv.progress import progress

    plan = plan_of(mm, s)
    t0 = time.perf_counter()
    ev, fi, n_sweep, sent = split(mm, s, warn)
    with progress(None if show_progress is None else not show_progress) as bar:
        t1 = time.perf_counter()
        fitted = fit(mm, fi, plan, s.batch_tokens, bar)
        t2 = time.perf_counter()
        var = ModelVariance(mm, plan.layers, s.variance_repeats, s.seed, s.gamma)
        acc, errs = evaluate(mm, ev, n_sweep, plan, fitted, s.batch_tokens, var, bar)
    t3 = time.perf_counter()
    out = {"normalize_sentences": sent, "normalize_layers": T.layers_table(mm, plan, fitted, acc, errs),
           "normalize_capacity": T.capacity_table(mm, plan, fitted, acc, n_sweep),
           "normalize_variance": T.variance_table(synthetic(draws=s.synthetic_draws, gamma=s.gamma, seed=s.seed)
                                                  + var.rows())}
    t4 = time.perf_counter()
    info = {"eval_tokens": sum(map(len, ev)), "eval_sentences": len(ev), "fit_tokens": sum(map(len, fi)),
            "fit_sentences": len(fi), "sweep_sentences": n_sweep, "layers": len(plan.layers),
            "substitutions": 2 * len(plan.layers),
            "capacity_substitutions": sum(len(plan.capacity(mm, l)) for l in plan.capacity_layers),
            "capacity_layers": plan.capacity_layers, "capacity_n": plan.capacity_n + [mm.d_m],
            "seconds_prepare": round(t1 - t0, 2), "seconds_fit": round(t2 - t1, 2),
            "seconds_substitute": round(t3 - t2, 2), "seconds_tables": round(t4 - t3, 2)}
    return {"tables": out, "info": info}


def compute(ctx) -> dict:
    """Open the model (in the settings' dtype unless the caller gave one), measure, write the tables."""
    s = ctx.settings
    warn = ctx.extra.get("warn") or ctx.log
    res = normalize(ctx.model(), s, warn=warn, show_progress=ctx.show_progress)
    for name in TABLES:
        ctx.run.write_table(name, res["tables"][name])
    ctx.extra["result"] = res
    return res["info"]


STEP = Step(name="normalize", settings=NormalizeSettings, requires=(), tables=TABLES, compute=compute,
            record=record)
