"""A gated memory's strongest examples in each sign regime, for its page (issue 46, item 1: the
examples GLUScope shows for each of the four (gate sign, input sign) combinations).

A gated memory's coefficient is m_i = f(g_i)·u_i (`MemoryModel.coefficients`, the one definition;
with a post-FFN norm also divided by the token's scale s), g_i = x·g_i (+ bias) its gate
pre-activation and u_i = x·u_i (+ bias) its input. A token with m ≠ 0 falls in one regime by the
signs of g_i and u_i, named (gate, input) as `ffkv.mine.regimes` (whose shares over every mined
token the census records as regime_*) names them: pp (+,+), pn (+,−), np (−,+), nn (−,−), a
gate counting as + when g > 0. A token with m = 0 (padding, a zero gate) is in no regime.

`scan(mm, layer, dim, seqs)` runs the model over `seqs` (padded batches, each forward stopped after
`layer`: `MemoryModel.capture`) and reads, at that one dim, g where the model computes it
(`hook_g`), m where the model computes it (`hook_m`) and u from the FFN input x and the up
projection's row (`MemoryModel.up_keys`, `up_bias`). In a mixture of experts (`ffkv.model.arch.MoE`)
x is the MoE block's input, the up row is expert e's, and g and m are 0 on the tokens not routed to
e (in no regime); m = w_e·f(g)·u with the router's weight w_e > 0 (the shared expert's sigmoid gate),
so the signs of g and u still name the regime. `regimes(...)` then gives, over the searched
tokens, each regime's token count and share of the activation mass Σ|m| (shares sum to 1 when any
token has m ≠ 0) and its `PER_REGIME` strongest examples by |m|, one per sentence (its strongest
token; ties: the first), ordered by |m| descending, then sentence_id, then position.

Which sentences (`searched`): the memory's top-trigger sentences (rank ≤ `TOP_RANK` of each of
its lists) and a seeded sample of `SAMPLE` of the run's sentences (`numpy.random.default_rng(SEED)`,
the same for every memory), each read up to `MAX_TOKENS` tokens: a bounded forward, so the page
stays fast. `memory_regimes(run, layer, dim)` does all of it for a memory page (the model opened
once per run, the results kept for `CACHE` memories); the census's `later_panels` draw it
(fetched by the page once its colours are done).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ffkv.mine.regimes import REGIMES as _NAMED, regime_of  # noqa: E402  the one rule and order

REGIMES = tuple(_NAMED)  # (gate sign, input sign): pp, pn, np, nn
TOP_RANK = 8  # the memory's trigger sentences searched: ranks ≤ this of each list (+ and −)
SAMPLE = 48  # sentences of the run searched besides them (seeded, the same for every memory)
SEED = 0
MAX_TOKENS = 256  # tokens read of each sentence
PER_REGIME = 3  # examples shown per regime
BEFORE, AFTER = 10, 4  # tokens shown before and after an example's token
BATCH_TOKENS = 4096  # padded tokens per forward (as the page's coloured examples)
CACHE = 256  # memories whose results are kept


def scan(mm, layer: int, dim: int, seqs: list[list[int]], lock=None) -> list[dict]:
    """{"g", "u", "m"} (float32, one value per token) of memory (layer, dim) over each sequence."""
    import torch

    from ffkv.corpus.batching import pack
    from ffkv.model.onednn import products_of

    U = mm.up_keys(layer)
    if U is None:
        raise ValueError("an ungated FFN has no input projection: its memories have no sign regimes")
    u_row = U[dim].detach().float()
    ub = mm.up_bias(layer)
    u_bias = 0.0 if ub is None else float(ub[dim])
    out: list[dict] = [{} for _ in seqs]
    for idx in pack([len(s) for s in seqs], batch_tokens=BATCH_TOKENS, max_batch=64, ratio=1.5):
        idx = [int(i) for i in idx]
        got = {}

        def keep(l, name, t):  # (B, T, d_m) or x (B, T, d): the one dim at once
            if name == "x":
                got["u"] = (t.float() @ u_row.to(t.device) + u_bias).cpu().numpy()
            else:
                got[name] = t[..., dim].float().cpu().numpy()

        ids, mask = mm.batch([seqs[i] for i in idx])
        with (lock or threading.Lock()), torch.no_grad(), products_of(mm):
            mm.capture(ids, mask, layers=[layer], what=("x", "g", "m"), callback=keep)
        for j, i in enumerate(idx):
            n = len(seqs[i])
            out[i] = {k: got[k][j, :n].astype(np.float32) for k in ("g", "u", "m")}
    return out


def regimes(sids: list[int], seqs: list[list[int]], scanned: list[dict], per_regime: int = PER_REGIME) -> dict:
    """Over the scanned tokens: {"tokens": valid tokens, "active": tokens with m ≠ 0, "shares":
    {regime: share of Σ|m|, None without mass}, "counts": {regime: tokens with m ≠ 0},
    "examples": {regime: [{sentence_id, position, m, gate, input, start, tokens: [token ids],
    values: [(m, g, u) at each token shown]}]}} (module docstring: the order)."""
    mass = np.zeros(len(REGIMES))
    counts = np.zeros(len(REGIMES), np.int64)
    cands: dict[int, list] = {r: [] for r in range(len(REGIMES))}
    tokens = 0
    for sid, seq, s in zip(sids, seqs, scanned):
        g, u, m = s["g"], s["u"], s["m"]
        tokens += len(m)
        act = np.isfinite(m) & (m != 0)
        reg = regime_of(g, u)
        a = np.abs(m.astype(np.float64))
        for r in range(len(REGIMES)):
            sel = act & (reg == r)
            if not sel.any():
                continue
            mass[r] += a[sel].sum()
            counts[r] += int(sel.sum())
            pos = int(np.flatnonzero(sel)[np.argmax(a[sel])])  # argmax: the first of ties
            cands[r].append((-a[pos], int(sid), pos, seq, s))
    total = mass.sum()
    out = {"tokens": int(tokens), "active": int(counts.sum()),
           "shares": {name: (float(mass[r] / total) if total > 0 else None) for r, name in enumerate(REGIMES)},
           "counts": {name: int(counts[r]) for r, name in enumerate(REGIMES)}, "examples": {}}
    for r, name in enumerate(REGIMES):
        best = sorted(cands[r], key=lambda c: c[:3])[:per_regime]
        out["examples"][name] = [_example(sid, pos, seq, s) for _, sid, pos, seq, s in best]
    return out


def _example(sid: int, pos: int, seq: list[int], s: dict) -> dict:
    start, end = max(0, pos - BEFORE), min(len(seq), pos + 1 + AFTER)
    return {"sentence_id": sid, "position": pos, "m": float(s["m"][pos]), "gate": float(s["g"][pos]),
            "input": float(s["u"][pos]), "start": start, "length": len(seq), "tokens": [int(t) for t in seq[start:end]],
            "values": [(float(s["m"][i]), float(s["g"][i]), float(s["u"][i])) for i in range(start, end)]}


# ---- what a memory page asks ---------------------------------------------------------------------
_lock = threading.Lock()
_samples: OrderedDict = OrderedDict()  # run folder -> the sampled sentence ids
_vocabs: OrderedDict = OrderedDict()  # run folder -> token texts
_results: OrderedDict = OrderedDict()  # (run folder, layer, dim) -> memory_regimes' answer


def applies(run) -> bool:
    """Whether the run's model has sign regimes: a gated FFN (dense, or a mixture of experts)."""
    m = run.manifest.get("model") or {}
    return bool(m.get("gated"))


def _keep(cache: OrderedDict, key, value, size: int):
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > size:
            cache.popitem(last=False)
    return value


def _get(cache: OrderedDict, key):
    with _lock:
        v = cache.get(key)
        if v is not None:
            cache.move_to_end(key)
        return v


def sample_ids(run) -> tuple[np.ndarray, int]:
    """The run's seeded sample of `SAMPLE` sentence ids (sorted) and how many sentences it has."""
    key = str(run.path)
    got = _get(_samples, key)
    if got is None:
        from ffkv.store import query

        ids = np.sort(query.table(run, "sentences", columns=["sentence_id"]).column("sentence_id")
                      .to_numpy().astype(np.int64))
        pick = np.random.default_rng(SEED).choice(len(ids), size=min(SAMPLE, len(ids)), replace=False)
        got = _keep(_samples, key, (np.sort(ids[pick]), len(ids)), 2)
    return got


def vocab(run) -> list[str]:
    """token id -> its text (the run's `vocab` table), kept for the last two runs."""
    key = str(run.path)
    got = _get(_vocabs, key)
    if got is None:
        from ffkv.store import query

        got = _keep(_vocabs, key, query.vocab_texts(run), 2)
    return got


def top_sentences(run, layer: int, dim: int) -> list[int]:
    """The memory's trigger sentences of rank ≤ TOP_RANK (each list), in rank order, each once."""
    from ffkv.store import query

    if not run.has_table("triggers"):
        return []
    t = query.table(run, "triggers", columns=["sign", "rank", "sentence_id"],
                    filters=[("layer", "=", int(layer)), ("dim", "=", int(dim)), ("rank", "<=", TOP_RANK)])
    rows = sorted(t.to_pylist(), key=lambda r: (-r["sign"], r["rank"]))
    return list(dict.fromkeys(int(r["sentence_id"]) for r in rows))


def memory_regimes(run, layer: int, dim: int) -> dict:
    """`regimes` of memory (layer, dim) over its searched sentences (module docstring), with
    "searched": {top: its trigger sentences, sample: sampled ones not among them, sentences: the
    run's count, max_tokens}. Kept for the last `CACHE` memories asked."""
    key = (str(run.path), int(layer), int(dim))
    got = _get(_results, key)
    if got is not None:
        return got
    from ffkv.store import query

    top = top_sentences(run, layer, dim)
    sample, n = sample_ids(run)
    extra = [int(s) for s in sample.tolist() if int(s) not in set(top)]
    sids = top + extra
    toks = query.sentence_lookup(run, sids) if sids else {}
    seqs = [list(toks[s][:MAX_TOKENS]) for s in sids]
    keep = [i for i, s in enumerate(seqs) if s]
    sids, seqs = [sids[i] for i in keep], [seqs[i] for i in keep]
    from ffkv.model.identity import forward_lock, shared_model

    mm, lock = shared_model(run), forward_lock(run)  # the browser's own copy, not a second one
    out = regimes(sids, seqs, scan(mm, layer, dim, seqs, lock))
    out["searched"] = {"top": len(top), "sample": len(extra), "sentences": n, "max_tokens": MAX_TOKENS,
                       "top_rank": TOP_RANK}
    return _keep(_results, key, out, CACHE)
