"""`ffkv normalize`: normalized vs unnormalized memories, measured on the model's own FFNs.

The paper's §2 reads a FFN as a key-value memory without the softmax. This step tests five claims
about what a normalization would do (seed 004), on held-out text (default `wikipedia:valid`):
C1 softmax concentrates the weight on a few slots; C2 so it degrades as the slots grow; C3 an
unnormalized ReLU memory's output variance grows like n/2; C4 a ReLU scaled by 1/(γ·√(n/2))
keeps it constant; C5 a key-value memory followed by a layer norm is a FFN. The verdicts are in
`ffkv.steps.normalize.report`.

Text. Sentences of the corpus in its seeded order: the evaluation split (`tokens`) first, then,
from the next document on, the fit split (`fit_tokens`); τ and every scale are fit on the fit
split and everything is reported on the evaluation split. The first `sweep_tokens` of the
evaluation split also get the capacity sweep and the variance on the model.

Variants (`variants.py`): a layer's coefficient vector m becomes m', its output m'·V + b.
softmax: s·softmax(m/τ), for gated FFNs s·sign(m)⊙softmax(|m|/τ); scaled_relu: the activation
replaced by ReLU (gated: ReLU(x·g)·(x·u)), times 1/(γ·√(d_m/2)); original: m on the kept slots.
τ is a grid value (1/16…256 × the layer's RMS |m|, half-octave steps) chosen for the smallest
relative squared error of the output; s and γ make the output's RMS norm equal the original's
(one number per layer: the layer-norm reading of C5).

Substitution (`tail.py`): one layer at a time; the blocks below it are not rerun: the residual
stream cached by one intact forward per batch is reused and only blocks ℓ+1..L−1 (and the
model's own final norm and head) run. Loss = mean −log p(next token) over the predicted positions
of the evaluation sentences (each sentence its own context). Intervals: standard errors
clustered by sentence, of paired differences against the intact model.

Tables (public contract):
- `normalize_sentences`: sentence_id int64, doc_id int64, split string (eval | fit), in_sweep bool,
  text string, token_ids list<int32>, n_tokens int32. Evaluation sentences first, in order.
- `normalize_layers`: one row per layer × variant (softmax | scaled_relu): layer int16, variant,
  d_m int32, gated bool, tau (softmax; null otherwise), tau_rel (τ / RMS |m|), scale (the factor on
  the normalized coefficients: s, or 1/(γ·√(d_m/2))), gamma (scaled_relu), fit_rel_err and
  eval_rel_err (Σ‖y' − y‖² / Σ‖y − b‖² on each split), loss, loss_intact, delta_loss,
  delta_loss_se, ppl, ppl_intact (nats and perplexity on the evaluation split), tokens int64
  (predicted positions), sentences int32; concentration on the evaluation tokens, for the model's
  own coefficients (`_m`: p = |m|/Σ|m|) and the variant's (`_w`: p = |m'|/Σ|m'|), means over
  tokens: entropy_m, entropy_w (nats), top1_m, top1_w, top10_m, top10_w, top100_m, top100_w (share
  of p on the k largest slots), and entropy_diff_se, top1_diff_se, top10_diff_se, top100_diff_se
  (SE of the paired mean difference _w − _m); entropy_uniform = log d_m.
- `normalize_capacity`: per capacity layer × selection (random: one fixed draw of n slots; top: each
  token's n largest |m|) × n (…, d_m): layer int16, selection, n int32, tau, tau_rel, scale (the
  softmax variant's fit over the n slots), loss_softmax, loss_original (the model's own activation
  on the n slots, unscaled), loss_intact, gap = loss_softmax − loss_original, gap_se, gap_change =
  gap − gap at the smallest n, gap_change_se, fit_rel_err_softmax, fit_rel_err_original, tokens
  int64, sentences int32 (the sweep's). At n = d_m both selections keep every slot: the softmax
  variant is the full one and the original is the intact model.
- `normalize_variance`: source string (synthetic | model), layer int16 (null for synthetic),
  n int32 (slots summed), kind string (raw | scaled: divided by γ²·n/2), variance, se, expected
  (synthetic: n/2 raw, 1/γ² scaled; null for the model), draws int64 (samples, or tokens ×
  subsets), repeats int32 (random subsets per size), gamma. See `variance.py`.
"""
from __future__ import annotations

import time
import pyarrow as pa

from ffkv.errors import FfkvError
from ffkv.model.context import sentences_note

from ffkv.steps.normalize import (DEFAULT_CORPUS, TABLES, NormalizeSettings, default_capacity_layers,
                                  default_capacity_n)


def plan_of(mm, s: NormalizeSettings):
    from ffkv.steps.normalize.passes import Plan

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
    # after the refusal above, which must stay one line
    if note := sentences_note("normalize_sentences", n_cut, len(sents), mm.max_length):
        warn(note)  # cut at their end, as every corpus's sentences (`ffkv.model.context.fit_sentences`)
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
    from ffkv.steps.normalize import tables as T
    from ffkv.corpus.batching import resolve_step_batch
    from ffkv.steps.normalize.passes import MAX_ROWS, evaluate, fit
    from ffkv.steps.normalize.variance import ModelVariance, synthetic
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

