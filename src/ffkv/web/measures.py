"""The per-memory table `memories` (one row per memory of the model: the measures the browser
searches and sorts by), built from the run's tables on first use."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ffkv.mine import stats
from ffkv.mine.regimes import REGIMES
from ffkv.store import query
from ffkv.web.tables import PRECISION_K, BadQuery


def memories_table(b) -> pa.Table:
    """One row per memory of the model (code = layer × d_m + dim): mined, triggers, top coefficient,
    the value's max-probability, entropy and top token per direction, precision@50, agreement, label,
    and whether it is a first-position memory (`first_position`)."""
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
    direction = np.zeros(N, np.int8)  # the sign rank and target_prob are of (0: not compared)
    tprob = nan()
    if b.agreement is not None:
        at = b.agreement.table
        c = b.agreement.code
        a = at.column("agree")
        agree_null[c] = a.is_null().to_numpy(zero_copy_only=False)
        agree[c] = a.fill_null(False).to_numpy(zero_copy_only=False)
        rank[c] = at.column("rank").fill_null(-1).to_numpy()
        tprob[c] = at.column("target_prob").fill_null(np.nan).to_numpy()
        if "direction" in at.column_names:
            direction[c] = at.column("direction").fill_null(0).to_numpy(zero_copy_only=False)
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
    arrays["direction"] = pa.array(direction, pa.int8(), mask=direction == 0)
    arrays["label"] = pa.array(label.tolist(), pa.string())
    arrays["n_patterns"] = pa.array(n_pat)
    arrays["coverage"] = pa.array(cov, mask=np.isnan(cov))
    for k in ("max_prob", "max_prob_neg", "entropy", "entropy_neg", "precision", "precision_neg", "top_coef"):
        arrays[k] = pa.array(cols[k], mask=np.isnan(cols[k]))
    fs = first_shares(b)  # searched by `?pos0=hide`
    arrays["first_share"] = pa.array(fs.astype(np.float32), mask=np.isnan(fs))
    arrays["first_position"] = pa.array(first_position(b))
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


# ---- a memory's sides: activation mass, dominant sign, per-sign moments -------------------------------
def bin_moments(lay: dict, top: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per `key_hist` bin of a run's layout, E|m| and E m² of the tokens in it (the bin model of
    `ffkv.mine.stats.bin_moments`; 0 in the zero bin). An unbounded bin (and, given `top` = the
    side's exact max |m|, any bin reaching past it) runs up to `top` (its lower edge when unknown)."""
    sign = np.asarray(lay["sign"], np.int64)
    lo = np.asarray(lay["lo"], np.float64)
    hi = np.array([np.inf if h is None else float(h) for h in lay["hi"]])
    if top is not None and np.isfinite(top) and top > 0:
        hi = np.where((hi > top) & (lo < top), top, hi)
    hi = np.where(np.isinf(hi), lo, hi)
    e1, e2 = stats.bin_moments(lo, hi)
    zero = sign == 0
    e1[zero], e2[zero] = 0.0, 0.0
    return e1, e2


def side_moments(counts, lay: dict, top: dict | None = None) -> dict[int, dict]:
    """Per sign (+1, −1), from one key's histogram counts: n (tokens with sign·m > 0), mean and
    (population) std of m among them, signed. `top` {sign: exact max |m|} caps the top bin.
    Estimates from the bins (the mined tables hold mean and std over all tokens only)."""
    counts = np.asarray(counts, np.float64)
    sign = np.asarray(lay["sign"], np.int64)
    out = {}
    for s in (1, -1):
        e1, e2 = bin_moments(lay, (top or {}).get(s))
        sel = sign == s
        n = counts[sel].sum()
        if n <= 0:
            out[s] = {"n": 0, "mean": None, "std": None}
            continue
        m1 = float((counts[sel] * e1[sel]).sum() / n)
        m2 = float((counts[sel] * e2[sel]).sum() / n)
        out[s] = {"n": int(n), "mean": s * m1, "std": float(np.sqrt(max(m2 - m1 * m1, 0.0)))}
    return out


def side_mass(b) -> tuple[np.ndarray, np.ndarray, str]:
    """Per memory code, the activation mass Σ|m| of its positive and of its negative side over the
    mined tokens (from `key_hist`, bins read by `bin_moments`), and where it came from; a run
    without key statistics falls back to Σ|coef| of its trigger lists ("triggers")."""
    N = b.L * b.d_m
    lay = query.stats_layout(b.run) if b.key_hist is not None else None
    pos, neg = np.zeros(N), np.zeros(N)
    if lay is not None:
        kh = b.key_hist
        e1, _ = bin_moments(lay)
        sgn = np.asarray(lay["sign"], np.int64)
        bins = kh.table.column("bin").to_numpy().astype(np.int64)
        ok = (bins >= 0) & (bins < len(sgn))
        w = kh.table.column("count").to_numpy().astype(np.float64) * np.where(ok, e1[np.clip(bins, 0, len(sgn) - 1)], 0)
        s = np.where(ok, sgn[np.clip(bins, 0, len(sgn) - 1)], 0)
        code = kh.code.astype(np.int64)
        pos += np.bincount(code[s > 0], weights=w[s > 0], minlength=N)[:N]
        neg += np.bincount(code[s < 0], weights=w[s < 0], minlength=N)[:N]
        return pos, neg, "key_hist"
    coef = np.abs(b.trig.table.column("coef").to_numpy(zero_copy_only=False).astype(np.float64))
    code = b.trig.code.astype(np.int64)
    p = b.trig_sign == 1
    pos += np.bincount(code[p], weights=coef[p], minlength=N)[:N]
    neg += np.bincount(code[~p], weights=coef[~p], minlength=N)[:N]
    return pos, neg, "triggers"


def dominant_signs(b) -> np.ndarray:
    """THE dominant side of every memory (int8 per code: −1 where the negative side's activation
    mass over the mined tokens is larger, else +1): what its summary, its "set m =" control and
    its first trigger list follow. Cached on the browser."""
    def make():
        if not b.negative:  # no negative lists: nothing to show of a − side
            return np.ones(b.L * b.d_m, np.int8)
        pos, neg, _ = side_mass(b)
        return np.where(neg > pos, -1, 1).astype(np.int8)

    return b._lazy("_dominant", make)


def dominant_sign(b, layer: int, dim: int) -> int:
    return int(dominant_signs(b)[b.code(layer, dim)])


def row_signs(b, codes, direction) -> np.ndarray:
    """The sign a table row of memories shows (its ranks, probabilities and top tokens all of
    s·v): the agreement's direction where the memory was compared (its rank is of that side
    only), else its dominant side."""
    d = np.asarray(direction, np.int64)
    return np.where(d != 0, d, dominant_signs(b)[np.asarray(codes, np.int64)]).astype(np.int8)


EPS_HIST = 0.125  # the density's ε read from `key_hist`: an octave edge (2^-3, near compose's 0.1), so exact


def eps_shares(b) -> np.ndarray:
    """Per memory code, the share of mined tokens with |m| ≥ EPS_HIST, read exactly from `key_hist`
    (NaN for a key without a histogram): the density the browser leads with. m > 0 sits near 50%
    on every layer of a gated FFN (SiLU is rarely exactly 0), so it says nothing there."""
    def make():
        N = b.L * b.d_m
        out = np.full(N, np.nan)
        lay = query.stats_layout(b.run) if b.key_hist is not None else None
        if lay is None:
            return out
        big = np.asarray(lay["lo"], np.float64) >= EPS_HIST
        bins = b.key_hist.table.column("bin").to_numpy().astype(np.int64)
        cnt = b.key_hist.table.column("count").to_numpy().astype(np.float64)
        hit = big[np.clip(bins, 0, len(big) - 1)] & (bins >= 0) & (bins < len(big))
        code = b.key_hist.code.astype(np.int64)
        tot = np.bincount(code, weights=cnt, minlength=N)[:N]
        above = np.bincount(code[hit], weights=cnt[hit], minlength=N)[:N]
        with np.errstate(invalid="ignore", divide="ignore"):
            out = np.where(tot > 0, above / tot, np.nan)
        return out

    return b._lazy("_eps_shares", make)


# ---- first-position memories ------------------------------------------------------------------------
FIRST_POSITION = 0.5  # a first-position memory: over half of the sentences peak at position 0


def first_shares(b) -> np.ndarray:
    """Per memory code, on its dominant side (`dominant_signs`), the share of corpus sentences whose
    best coefficient sits at position 0: `key_stats.first_share` (= pos_hist bucket 0 / sentences,
    `ffkv.mine.stats`). NaN for a key without key statistics (a run mined with --no-stats)."""
    def make():
        N = b.L * b.d_m
        out = np.full(N, np.nan)
        ks = b.key_stats
        if ks is None:
            return out
        t, names = ks.table, ks.table.column_names
        if "first_share" in names:
            share = t.column("first_share").to_numpy(zero_copy_only=False).astype(np.float64)
        elif "pos_hist" in names and "sentences" in names:  # a run written before first_share
            first = pc.list_element(t.column("pos_hist"), 0).to_numpy(zero_copy_only=False).astype(np.float64)
            sent = t.column("sentences").to_numpy(zero_copy_only=False).astype(np.float64)
            with np.errstate(invalid="ignore", divide="ignore"):
                share = np.where(sent > 0, first / sent, np.nan)
        else:
            return out
        code = ks.code.astype(np.int64)
        sign = t.column("sign").to_numpy(zero_copy_only=False).astype(np.int64) if "sign" in names \
            else np.ones(len(code), np.int64)
        keep = (sign == dominant_signs(b)[code]) & (code < N)
        out[code[keep]] = share[keep]
        return out

    return b._lazy("_first_shares", make)


def first_position(b) -> np.ndarray:
    """THE first-position memories (bool per code): those whose dominant side peaks at position 0
    (the first token of a sentence) in more than FIRST_POSITION of the sentences (`first_shares`).
    The badge, `?pos0=hide` on search and layer lists, and the memory page all read this; a key
    without key statistics is never one."""
    return b._lazy("_first_position", lambda: np.nan_to_num(first_shares(b), nan=0.0) > FIRST_POSITION)


# ---- census classes (`ffkv census`; who is in a class: `ffkv.steps.census.compute.in_class`) ------------
NO_CENSUS = "this run has no census: run `ffkv census RUN`"


def census_classes(b) -> tuple[str, ...]:
    """The class names `?class=` accepts on this run: the census's classes its table has columns for
    (a census from before the detector columns has fewer); () without a census."""
    from ffkv.steps.census.compute import CLASSES, IO_CLASSES

    if b.census is None:
        return ()
    cols = set(b.census.column_names)
    return tuple(c for c in CLASSES if (c in IO_CLASSES and "io_class" in cols) or c in cols)


def class_members(b, names) -> np.ndarray:
    """Per memory code, whether it is in any of the census classes `names` (bool), each class by
    `in_class`; cached per class."""
    from ffkv.steps.census.compute import in_class

    N = b.L * b.d_m
    out = np.zeros(N, bool)
    for name in names:
        def make(name=name):
            t = b.census
            code = t.column("layer").to_numpy().astype(np.int64) * b.d_m + t.column("dim").to_numpy().astype(np.int64)
            m = np.zeros(N, bool)
            ok = code < N
            m[code[ok]] = in_class(t, name)[ok]
            return m
        out |= b._lazy(f"_census_{name}", make)
    return out


# ---- sign regimes (`ffkv mine --regimes`, joined by `ffkv census` as regime_* and regime) ---------------
NO_REGIMES = ("this run has no sign regimes: mine a gated FFN with `ffkv mine --regimes`, "
              "then run `ffkv census RUN`")


def has_regimes(b) -> bool:
    """Whether `?regime=` can filter this run: its census has the regime columns and some memory's
    dominant regime (a run mined without --regimes, or an ungated FFN, has them all null)."""
    def make():
        t = b.census
        return (t is not None and {"regime", *(f"regime_{r}" for r in REGIMES)} <= set(t.column_names)
                and t.column("regime").null_count < len(t))
    return b._lazy("_has_regimes", make)


def _by_code(b, col) -> np.ndarray:
    """A census column per memory code (float64; NaN where null or absent from the census)."""
    t = b.census
    N = b.L * b.d_m
    code = t.column("layer").to_numpy().astype(np.int64) * b.d_m + t.column("dim").to_numpy().astype(np.int64)
    ok = code < N
    out = np.full(N, np.nan)
    out[code[ok]] = np.asarray(col, np.float64)[ok]
    return out


def regime_shares(b) -> dict[str, np.ndarray]:
    """Each regime's share of a memory's activation mass, per memory code (float64, NaN without mass)."""
    return b._lazy("_regime_shares", lambda: {
        r: _by_code(b, b.census.column(f"regime_{r}").to_numpy(zero_copy_only=False)) for r in REGIMES})


class RegimeFilter(NamedTuple):
    """A parsed `?regime=` (`ffkv.web.params.regime_filter`): regime names in `REGIMES`' order and the
    least share of the mass in them (None: the dominant regime is one of them)."""
    names: tuple[str, ...]
    min_share: float | None = None


def regime_members(b, names, min_share: float | None = None) -> np.ndarray:
    """Per memory code, whether it passes `?regime=` (bool): with `min_share` None, its dominant
    regime (the census's `regime`) is one of `names`; with `min_share` x, the share of its activation
    mass in the named regimes together (the sum of their regime_NAME) is at least x, so `regime=pp,nn`
    with 0.6 keeps memories with 60% of their mass where gate and input agree in sign, dominant or
    not. A memory without mass (null shares) never passes. The caller checks `has_regimes`."""
    if min_share is None:
        dominant = b._lazy("_regime_dominant", lambda: _by_code(b, pc.index_in(
            b.census.column("regime"), pa.array(list(REGIMES), pa.string())).to_numpy(zero_copy_only=False)))
        return np.isin(dominant, [list(REGIMES).index(r) for r in names])
    shares = regime_shares(b)
    share = sum(shares[r] for r in names)
    with np.errstate(invalid="ignore"):
        return share >= min_share  # NaN: False


def memory_filter(b, hide_first: bool = False, classes=None, regimes: RegimeFilter | None = None,
                  min_worth: float | None = None) -> np.ndarray | None:
    """THE memory filters every search and layer list applies, per memory code (bool), None when
    none is set: ?pos0=hide (not `first_position`), ?class= (`class_members`), ?regime= (`regime_members`)
    and ?min_worth= (worth at least that; a memory without a worth never passes), all of them."""
    keep = None

    def cut(mask):
        nonlocal keep
        keep = mask.copy() if keep is None else keep & mask

    if hide_first:
        cut(~first_position(b))
    if classes:
        cut(class_members(b, classes))
    if regimes:
        cut(regime_members(b, *regimes))
    if min_worth is not None:
        with np.errstate(invalid="ignore"):
            cut(worths(b, "min_worth") >= min_worth)  # NaN (no worth) is False
    return keep


def worths(b, what: str):
    """Each memory's worth by code (`of_browser`); a run without the worth table: one line naming the
    fix, beginning with `what` (the parameter that asked for it)."""
    from ffkv.steps.worth.report import NO_WORTH, of_browser

    w = of_browser(b)
    if w is None:
        raise BadQuery(f"{what}: {NO_WORTH}")
    return w
