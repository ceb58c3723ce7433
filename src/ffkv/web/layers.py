"""A layer page (`/layer/N`, `/api/layer/N`): what the run knows of one layer's memories.

- density: the key statistics of `ffkv mine` (`query.key_stats_by_layer`: mean, quartiles and
  max of each key's share of tokens with m > 0, per sign) and a histogram over the layer's keys of
  their share of tokens with |m| ≥ ε (`ffkv.web.measures.eps_shares`, from `key_hist`; m > 0,
  `key_stats.frac_active`, only for a run without the histogram);
- agreement (Fig 4) from `values_layers`, and the layer's best memories by agreement (rank of the
  top-1 trigger's next token in the value's distribution, then its probability) and by value
  sharpness (the value's max probability), from the browser's per-memory table;
- the pattern mix: `patterns_fig2` rows of the layer and the keys' labels (`pattern_keys`);
- the layer's memories, paged, each with its one-line summary, by dim or (`?sort=worth`) by worth,
  the largest first (`ffkv worth`'s memory_worth; each row's `worth` whenever the run has it).

The lists (memories and best memories) take the memory filters every search takes
(`ffkv.web.measures.memory_filter`: ?pos0=hide, ?class=, ?regime= with ?min_regime_share=, ?min_worth=).

A table the run lacks gives `None` and the command that makes it (`MAKES`).
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow.compute as pc

from ffkv.steps.worth.report import of_browser
from ffkv.store import query
from ffkv.web.measures import (EPS_HIST, REGIMES, census_classes, class_members, eps_shares, first_position,
                               has_regimes, memory_filter, regime_members, row_signs)
from ffkv.web.tables import BadQuery, NotFound

BEST = 10  # rows of each "best memories" list
DENSITY_BINS = 20  # histogram of the keys' density, bins of 1/20
MAKES = {
    "key_stats": "`ffkv mine` (key statistics are on unless it ran with --no-stats)",
    "values": "`ffkv values RUN`",
    "patterns": "`ffkv patterns RUN`",
}
MEMORY_COLUMNS = ("layer", "dim", "mined", "n_triggers", "top_coef", "max_prob", "entropy", "top_token",
                  "top_token_text", "max_prob_neg", "top_token_neg", "top_token_neg_text", "precision",
                  "precision_neg", "rank", "target_prob", "direction", "agree", "label", "n_patterns", "coverage",
                  "summary")


def _f(x):
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


def _col(t, name) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False)


def layer_memories(b, layer: int, summaries: bool = True, hide_first: bool = False, classes=None,
                   sort: str = "dim", regimes=None, min_worth: float | None = None) -> list[dict]:
    """Every memory of the layer that was mined or has a value row, by dim, with its measures and
    (unless `summaries` is off: the page adds them to the rows it shows) its one-line summary
    (the rows of the layer page's list and of its CSV), through the memory filters
    (`measures.memory_filter`: `hide_first`, `classes`, `regimes`, `min_worth`). With `classes`
    (?class=) the list is the layer's memories in one of these census classes, mined or not (the
    census covers every memory), so that it holds as many as the class mix counts. Each row has its
    `worth` when the run has the worth table; `sort` "worth" orders the rows by it, the largest first,
    then by dim (a memory without a worth last); "dim" (the default) by dim. The caller checks that
    the table is there (`ffkv.web.params.layer_sort`)."""
    t = b.memories.slice(layer * b.d_m, b.d_m)
    mp = _col(t, "max_prob").astype(np.float64)
    keep = _col(t, "mined").astype(bool) | ~np.isnan(mp)
    if classes:
        keep = class_members(b, classes)[layer * b.d_m:(layer + 1) * b.d_m]
    chosen = memory_filter(b, hide_first, classes, regimes, min_worth)
    if chosen is not None:
        keep = keep & chosen[layer * b.d_m:(layer + 1) * b.d_m]
    rows = t.filter(keep).to_pylist()
    worth = of_browser(b)
    if worth is not None:
        for r in rows:
            r["worth"] = _f(worth[r["layer"] * b.d_m + r["dim"]])
    if sort == "worth":
        rows.sort(key=lambda r: (r["worth"] is None, -(r["worth"] or 0.0), r["dim"]))
    elif sort != "dim":
        raise BadQuery(f"sort must be dim or worth (got {sort!r})")
    signs = row_signs(b, [b.code(r["layer"], r["dim"]) for r in rows], [r["direction"] or 0 for r in rows])
    for r, s in zip(rows, signs.tolist()):
        r["top_token_text"] = b.tok(r["top_token"])
        r["top_token_neg_text"] = b.tok(r["top_token_neg"])
        # what the page's list shows: the side of its rank (see `row_signs`), every number of s·v
        sfx = "" if s == 1 else "_neg"
        r["sign"] = s
        r["side"] = {"max_prob": r["max_prob" + sfx], "top_token": r["top_token" + sfx],
                     "top_token_text": r["top_token" + sfx + "_text"], "precision": r["precision" + sfx]}
    return b.add_summaries(rows) if summaries else rows


def _density(b, layer: int) -> dict | None:
    if b.key_stats is None:
        return None
    by_layer = b._lazy("_key_stats_by_layer", lambda: query.key_stats_by_layer(b.run))
    rows = [r for r in (by_layer.to_pylist() if by_layer is not None else []) if r["layer"] == layer]
    ks = b.key_stats.table
    col = "frac_active" if "frac_active" in ks.column_names else None
    hist = None
    es = eps_shares(b)[layer * b.d_m:(layer + 1) * b.d_m]
    es = es[~np.isnan(es)]
    if len(es):  # the keys by |m| ≥ ε (`eps_shares`): m > 0 is ~50% for every key of a gated FFN
        counts = np.histogram(np.clip(es, 0, 1), bins=DENSITY_BINS, range=(0, 1))[0]
        return {"rows": rows, "eps": EPS_HIST, "hist": {
            "counts": counts.tolist(), "total": int(len(es)), "measure": f"|m| ≥ {EPS_HIST:g}",
            "labels": [f"{i / DENSITY_BINS:.2f}–{(i + 1) / DENSITY_BINS:.2f}" for i in range(DENSITY_BINS)]}}
    if col is not None:
        sel = pc.equal(ks.column("layer"), layer)
        if "sign" in ks.column_names:
            sel = pc.and_(sel, pc.equal(ks.column("sign"), 1))
        x = _col(ks.filter(sel), col).astype(np.float64)
        x = x[~np.isnan(x)]
        if len(x):
            counts = np.histogram(np.clip(x, 0, 1), bins=DENSITY_BINS, range=(0, 1))[0]
            hist = {"counts": counts.tolist(), "total": int(len(x)), "measure": "m > 0",
                    "labels": [f"{i / DENSITY_BINS:.2f}–{(i + 1) / DENSITY_BINS:.2f}" for i in range(DENSITY_BINS)]}
    return {"rows": rows, "hist": hist, "eps": None}


def _best(b, layer: int, hide_first: bool = False, classes=None, regimes=None, min_worth: float | None = None) -> dict:
    t = b.memories.slice(layer * b.d_m, b.d_m)
    chosen = memory_filter(b, hide_first, classes, regimes, min_worth)
    shown = np.ones(b.d_m, bool) if chosen is None else chosen[layer * b.d_m:(layer + 1) * b.d_m]
    out: dict = {"agreement": None, "sharpness": None}
    if b.values is None:
        return out
    dims = _col(t, "dim").astype(np.int64)
    rank = t.column("rank").fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    tp = _col(t, "target_prob").astype(np.float64)
    # one sign per row: rank and p(next) are of the agreement's direction, so the value's top token,
    # max p and entropy are of that same s·v (`row_signs`)
    sign = row_signs(b, layer * b.d_m + dims, t.column("direction").fill_null(0).to_numpy(zero_copy_only=False))
    pos = sign == 1
    mp = np.where(pos, _col(t, "max_prob"), _col(t, "max_prob_neg")).astype(np.float64)
    ent = np.where(pos, _col(t, "entropy"), _col(t, "entropy_neg")).astype(np.float64)
    top = np.where(pos, t.column("top_token").fill_null(-1).to_numpy(zero_copy_only=False),
                   t.column("top_token_neg").fill_null(-1).to_numpy(zero_copy_only=False))

    def row(i):
        return {"layer": layer, "dim": int(dims[i]), "sign": int(sign[i]),
                "rank": int(rank[i]) if rank[i] >= 0 else None,
                "target_prob": _f(tp[i]), "max_prob": _f(mp[i]), "entropy": _f(ent[i]),
                "top_token": int(top[i]) if top[i] >= 0 else None,
                "top_token_text": b.tok(top[i]) if top[i] >= 0 else None}

    ok = np.nonzero((rank >= 0) & shown)[0]
    if b.agreement is not None:
        # best: the top-1 trigger's next token ranked highest in the value (rank 1 = agrees), then its p
        o = ok[np.lexsort((dims[ok], -np.nan_to_num(tp[ok], nan=-1.0), rank[ok]))]
        out["agreement"] = b.add_summaries([row(i) for i in o[:BEST]])
    ok = np.nonzero(~np.isnan(mp) & shown)[0]
    o = ok[np.lexsort((dims[ok], -mp[ok]))]
    out["sharpness"] = b.add_summaries([row(i) for i in o[:BEST]])
    return out


def _patterns(b, layer: int) -> dict | None:
    if b.pattern_keys is None and b.patterns_fig2 is None:
        return None
    fig2 = []
    if b.patterns_fig2 is not None:
        fig2 = [r for r in b.patterns_fig2.to_pylist() if r["layer"] == layer]
    labels: dict[str, int] = {}
    if b.pattern_keys is not None:
        pk = b.pattern_keys.table
        sel = pc.and_(pc.equal(pk.column("layer"), layer), pc.equal(pk.column("sign"), 1))
        for lab in pk.filter(sel).column("label").to_pylist():
            labels[lab or "none"] = labels.get(lab or "none", 0) + 1
    return {"fig2": fig2, "labels": labels, "keys": sum(labels.values())}


def census_mix(b, layer: int) -> dict | None:
    """The layer's class mix: per census class its memories (`measures.class_members`, the count a
    `?class=` list holds) and its share as `census_layers` states it (dead, rare and positional of
    the mined memories, the detectors of those with triggers, self-suppressing of the token
    detectors, the rest of all memories), and with sign regimes (`measures.has_regimes`) the count of
    each dominant regime (the `?regime=` list it links to); None without a census."""
    names = census_classes(b)
    if not names:
        return None
    shares = {}
    if b.census_layers is not None:
        rows = [r for r in b.census_layers.to_pylist() if r["layer"] == layer]
        shares = rows[0] if rows else {}
    lo, hi = layer * b.d_m, (layer + 1) * b.d_m
    regimes = None
    if has_regimes(b):
        regimes = [{"regime": r, "signs": s, "count": int(np.count_nonzero(regime_members(b, [r])[lo:hi])),
                    "href": f"/layer/{layer}?regime={r}#memories"} for r, s in REGIMES.items()]
    return {"classes": [{"class": c, "count": int(np.count_nonzero(class_members(b, [c])[lo:hi])),
                         "share": _f(shares.get(c)), "href": f"/layer/{layer}?class={c}#memories"}
                        for c in names], "regimes": regimes,
            "memories": b.d_m, "mined": shares.get("mined"), "tokens": shares.get("tokens")}


def layer_data(b, layer: int, page: int = 1, per_page: int = 100, hide_first: bool = False,
               classes=None, sort: str = "dim", regimes=None, min_worth: float | None = None) -> dict:
    """Everything a layer page shows, as plain data (`/api/layer/N` returns it as is); its lists go
    through the memory filters (`measures.memory_filter`; `hide_first` ?pos0=hide, `classes` ?class=,
    `regimes` ?regime=, `min_worth` ?min_worth=), each said back (`pos0`, `class`, `regime`,
    `min_regime_share`, `min_worth`); `sort` orders the list of memories ("dim", or "worth": the
    largest first). `has_regimes` says whether ?regime= can filter this run."""
    if not 0 <= layer < b.L:
        raise NotFound(f"layer {layer} does not exist: the model has layers 0–{b.L - 1}")
    if not 1 <= per_page <= 1000:
        raise BadQuery("per_page must be in 1..1000")
    if page < 1:
        raise BadQuery("page must be ≥ 1")
    mems = layer_memories(b, layer, summaries=False, hide_first=hide_first, classes=classes, sort=sort,
                          regimes=regimes, min_worth=min_worth)
    last = max(1, -(-len(mems) // per_page))
    if page > last:
        raise NotFound(f"page {page} does not exist: layer {layer} has {last} page{'s' if last > 1 else ''} "
                       f"of {per_page} memories")
    agreement = None
    if b.values_layers is not None:
        rows = [r for r in b.values_layers.to_pylist() if r["layer"] == layer]
        agreement = rows[0] if rows else None
    missing = {k: v for k, v in MAKES.items()
               if (k == "key_stats" and b.key_stats is None) or (k == "values" and b.values is None)
               or (k == "patterns" and b.pattern_keys is None and b.patterns_fig2 is None)}
    mined = int(np.count_nonzero(b.keys // b.d_m == layer))
    first = (int(np.count_nonzero(first_position(b)[layer * b.d_m:(layer + 1) * b.d_m]))
             if b.key_stats is not None else None)  # unknown without key statistics
    return {"layer": layer, "layers": b.L, "d_m": b.d_m, "model": b.model_id, "lens": b.lens, "mined": mined,
            "first_position": first, "pos0": "hide" if hide_first else "show", "class": list(classes or []),
            "regime": list(regimes.names) if regimes else [],
            "min_regime_share": regimes.min_share if regimes else None,
            "min_worth": min_worth, "sort": sort, "has_worth": of_browser(b) is not None,
            "has_regimes": has_regimes(b),
            "census": census_mix(b, layer),
            "density": _density(b, layer), "agreement": agreement,
            "best": _best(b, layer, hide_first, classes, regimes, min_worth),
            "patterns": _patterns(b, layer), "missing": missing,
            "memories": {"total": len(mems), "page": page, "per_page": per_page, "pages": last,
                         "rows": b.add_summaries(mems[(page - 1) * per_page: page * per_page])}}
