"""The per-memory table `memories` (one row per memory of the model: the measures the browser
searches and sorts by), built from the run's tables on first use."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ffkv.web.tables import PRECISION_K


def memories_table(b) -> pa.Table:
    """One row per memory of the model (code = layer × d_m + dim): mined, triggers, top coefficient,
    the value's max-probability, entropy and top token per direction, precision@50, agreement, label."""
    N = b.L * b.d_m
    code = np.arange(N)
    nan = lambda: np.full(N, np.nan, np.float32)  # noqa: E731
    cols: dict[str, np.ndarray] = {"layer": (code // b.d_m).astype(np.int16),
                                   "dim": (code % b.d_m).astype(np.int32)}
    mined = np.zeros(N, bool)
    mined[b.keys] = True
    cols["mined"] = mined
    n_trig = np.bincount(b.trig.code, minlength=N)[:N]
    cols["n_triggers"] = n_trig.astype(np.int32)
    top_coef = nan()
    first = (b.trig_sign == 1) & (b.trig_rank == 1)
    top_coef[b.trig.code[first]] = b.trig.table.column("coef").to_numpy()[first]
    cols["top_coef"] = top_coef
    masks = {}
    top_tok = {"value": np.full(N, -1, np.int64), "neg_value": np.full(N, -1, np.int64)}
    for kind in ("value", "neg_value"):
        mp, en = nan(), nan()
        if b.values is not None:
            vt = b.values.table
            sel = pc.equal(vt.column("kind"), kind)
            sub = vt.filter(sel)
            c = (sub.column("layer").to_numpy().astype(np.int64) * b.d_m
                 + sub.column("dim").to_numpy().astype(np.int64))
            mp[c] = sub.column("max_prob").to_numpy()
            en[c] = sub.column("entropy").to_numpy()
            first_tok = pc.list_element(sub.column("top_tokens"), 0).to_numpy(zero_copy_only=False)
            top_tok[kind][c] = first_tok.astype(np.int64)
        suffix = "" if kind == "value" else "_neg"
        cols["max_prob" + suffix] = mp
        cols["entropy" + suffix] = en
        cols["top_token" + suffix] = top_tok[kind].astype(np.int32)
        masks["top_token" + suffix] = top_tok[kind] < 0
    cols.update(precision_at_k(b, top_tok, N))
    agree = np.zeros(N, bool)
    agree_null = np.ones(N, bool)
    rank = np.full(N, -1, np.int64)
    tprob = nan()
    if b.agreement is not None:
        at = b.agreement.table
        c = b.agreement.code
        a = at.column("agree")
        agree_null[c] = a.is_null().to_numpy(zero_copy_only=False)
        agree[c] = a.fill_null(False).to_numpy(zero_copy_only=False)
        rank[c] = at.column("rank").fill_null(-1).to_numpy()
        tprob[c] = at.column("target_prob").fill_null(np.nan).to_numpy()
    label = np.full(N, None, object)
    n_pat = np.zeros(N, np.int32)
    cov = nan()
    if b.pattern_keys is not None:
        pk = b.pattern_keys.table
        sel = pc.equal(pk.column("sign"), 1)
        sub = pk.filter(sel)
        c = (sub.column("layer").to_numpy().astype(np.int64) * b.d_m
             + sub.column("dim").to_numpy().astype(np.int64))
        label[c] = sub.column("label").to_numpy(zero_copy_only=False)
        n_pat[c] = sub.column("n_patterns").to_numpy()
        cov[c] = sub.column("coverage").to_numpy()
    arrays = {k: pa.array(v) for k, v in cols.items() if not k.startswith("top_token")}
    for k in ("top_token", "top_token_neg"):
        arrays[k] = pa.array(cols[k], mask=masks[k])
    arrays["agree"] = pa.array(agree, mask=agree_null)
    arrays["rank"] = pa.array(rank, pa.int32(), mask=rank < 0)
    arrays["target_prob"] = pa.array(tprob, mask=np.isnan(tprob))
    arrays["label"] = pa.array(label.tolist(), pa.string())
    arrays["n_patterns"] = pa.array(n_pat)
    arrays["coverage"] = pa.array(cov, mask=np.isnan(cov))
    for k in ("max_prob", "max_prob_neg", "entropy", "entropy_neg", "precision", "precision_neg", "top_coef"):
        arrays[k] = pa.array(cols[k], mask=np.isnan(cols[k]))
    return pa.table(arrays)

def precision_at_k(b, top_tok: dict, N: int) -> dict:
    """precision@50: share of a key's rank ≤ 50 triggers (sign +1 for v, −1 for −v) whose
    next token is the direction's top token (the values step's Table 2 definition)."""
    out = {}
    nxt = b.trig.table.column("next_token").fill_null(-1).to_numpy().astype(np.int64)
    for s, kind, name in ((1, "value", "precision"), (-1, "neg_value", "precision_neg")):
        sel = (b.trig_sign == s) & (b.trig_rank <= PRECISION_K)
        c = b.trig.code[sel]
        hit = (nxt[sel] == top_tok[kind][c]) & (top_tok[kind][c] >= 0)
        n = np.bincount(c, minlength=N)[:N]
        h = np.bincount(c, weights=hit, minlength=N)[:N]
        with np.errstate(invalid="ignore", divide="ignore"):
            pr = np.where((n > 0) & (top_tok[kind] >= 0), h / np.maximum(n, 1), np.nan)
        out[name] = pr.astype(np.float32)
    return out
