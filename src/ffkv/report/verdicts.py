"""One verdict per figure: does the run show the paper's trend?

Every function is pure: it takes the run's table(s) (a pyarrow Table, a pandas DataFrame or a list
of row dicts; None when the step was not run) and returns a `Verdict` (verdict, criterion,
measured). The verdict is one of SAME ("same trend"), DIFFERS ("differs"), INCONCLUSIVE
("inconclusive": the measured difference lies within its 95% interval, or cannot be told apart
from the figure's chance baseline) or NA ("not comparable": the paper's measure does not apply or
the table is missing); the criterion says what was tested, against which baseline and interval;
`measured` gives the numbers it was tested on.

Intervals (`ffkv.report.verdicts`): shares pooled over layers use the normal interval of a
difference of two proportions (n = the pooled counts); curves stored only as one number per
layer use the layers as units (Mann–Whitney U between the bottom and the top third, two-sided,
α = 0.05), so a trend carried by one or two layers stays inconclusive.

Layer-wise criteria compare parts of the network by *relative depth*, so that a 30-layer model is
read against the paper's 16 layers: layer ℓ (0-based) of an L-layer model sits at depth
(ℓ + ½) / L; the bottom third is depth ≤ 1/3, the top third depth ≥ 2/3 (`thirds`). A table that
covers only some layers (e.g. `mine --layers`) is judged on the layers it has.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import pandas as pd

from ffkv.defs import pct, wilson

SAME, DIFFERS, NA = "same trend", "differs", "not comparable"
INCONCLUSIVE = "inconclusive"
VERDICTS = (SAME, DIFFERS, INCONCLUSIVE, NA)
ALPHA = 0.05
Z = 1.959963984540054  # two-sided 95%

# Activations whose "m > 0" count means what it means for the paper's ReLU: m_i > 0 exactly when the
# pre-activation is positive. For gated FFNs m_i = f(x·g_i)·(x·u_i) is signed through x·u_i.
RELU_LIKE = ("relu", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_accurate", "quick_gelu")


class Verdict(NamedTuple):
    verdict: str
    criterion: str
    measured: str


THIRDS = "thirds by relative depth (ℓ+½)/L: bottom ≤ 1/3, top ≥ 2/3"


# ---- helpers -----------------------------------------------------------------------------------------
def as_frame(table) -> pd.DataFrame | None:
    """pyarrow Table, DataFrame, list of dicts or None -> DataFrame or None."""
    if table is None:
        return None
    if isinstance(table, pd.DataFrame):
        return table
    if hasattr(table, "to_pandas"):
        return table.to_pandas()
    return pd.DataFrame(list(table))


def missing(table: str, step: str) -> Verdict:
    return Verdict(NA, f"needs the `{table}` table, which `ffkv {step} RUN` creates", "the step was not run")


def depth(layer, n_layers: int) -> np.ndarray:
    return (np.asarray(layer, dtype=float) + 0.5) / n_layers


def thirds(layers, n_layers: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """Bottom, middle and top thirds of `layers` by relative depth (ℓ+½)/L."""
    layers = sorted({int(l) for l in layers})
    if not layers:
        return [], [], []
    n = n_layers or (max(layers) + 1)
    bottom = [l for l in layers if (l + 0.5) / n <= 1 / 3]
    top = [l for l in layers if (l + 0.5) / n >= 2 / 3]
    middle = [l for l in layers if l not in bottom and l not in top]
    return bottom, middle, top


def _n_layers(df: pd.DataFrame, n_layers: int | None) -> int:
    """The model's layer count: given, else inferred from the table *before* any row is filtered
    out (call it first), so that dropping empty layers does not change the relative depths."""
    return int(n_layers or (int(df["layer"].max()) + 1 if len(df) else 1))


def _span(ls: list[int]) -> str:
    return f"{ls[0]}–{ls[-1]}" if len(ls) > 1 else f"{ls[0]}"


def _pct(x: float, digits: int = 1) -> str:
    """`defs.pct`, with "n/a" for a missing value."""
    return "n/a" if x is None or x != x else pct(x, digits)


def _weighted(df: pd.DataFrame, layers: list[int], col: str, weight: str | None = None) -> float:
    sub = df[df["layer"].isin(layers)]
    sub = sub[sub[col].notna()]
    if sub.empty:
        return float("nan")
    if weight is None:
        return float(sub[col].mean())
    w = sub[weight].astype(float)
    return float((sub[col] * w).sum() / w.sum()) if w.sum() > 0 else float("nan")


def diff_ci(k1, n1, k2, n2) -> tuple[float, float, float]:
    """(p1 − p2, low, high): the normal 95% interval of a difference of two proportions."""
    n1, n2 = float(n1), float(n2)
    if n1 <= 0 or n2 <= 0:
        return float("nan"), float("nan"), float("nan")
    p1, p2 = k1 / n1, k2 / n2
    se = math.sqrt(max(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2, 0.0))
    d = p1 - p2
    return d, d - Z * se, d + Z * se


def wilson_ci(k, n) -> tuple[float, float]:
    """Wilson score 95% interval of k/n: `ffkv.defs.wilson`."""
    return wilson(k, n)


def by_interval(lo: float, hi: float) -> str:
    """SAME when the interval of (measured − expected-direction) lies above 0, DIFFERS below, else
    INCONCLUSIVE (also when it is NaN)."""
    if lo > 0:
        return SAME
    if hi < 0:
        return DIFFERS
    return INCONCLUSIVE


def layers_test(a, b) -> tuple[float, float]:
    """(mean(a) − mean(b), two-sided Mann–Whitney p) over per-layer values; p = 1 when either
    side has fewer than two layers or both are constant and equal."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if len(a) == 0 or len(b) == 0:
        return float("nan"), 1.0
    d = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2 or (np.ptp(np.r_[a, b]) == 0):
        return d, 1.0
    from scipy.stats import mannwhitneyu

    return d, float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


def by_test(d: float, p: float) -> str:
    """SAME when d > 0 at p < α, DIFFERS when d < 0 at p < α, else INCONCLUSIVE."""
    if p < ALPHA and d > 0:
        return SAME
    if p < ALPHA and d < 0:
        return DIFFERS
    return INCONCLUSIVE


def spearman(x, y) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either side is constant."""
    x = pd.Series(np.asarray(x, dtype=float)).rank().to_numpy()
    y = pd.Series(np.asarray(y, dtype=float)).rank().to_numpy()
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _lens(df: pd.DataFrame, lens: str | None) -> tuple[pd.DataFrame, str | None]:
    if "lens" not in df.columns:
        return df, None
    have = list(dict.fromkeys(df["lens"]))
    use = lens if lens in have else ("norm" if "norm" in have else have[0])
    return df[df["lens"] == use], use


def _thirds_or_none(df: pd.DataFrame, n_layers: int | None):
    """(n_layers, bottom, middle, top), or None when the table has no layer in the bottom or the
    top third (or no rows at all)."""
    if df.empty:
        return None
    n = _n_layers(df, n_layers)
    bottom, middle, top = thirds(df["layer"], n)
    if not bottom or not top:
        return None
    return n, bottom, middle, top


def _no_thirds(what: str) -> Verdict:
    return Verdict(NA, f"compares the bottom and top thirds of the layers ({THIRDS})",
                   f"{what} has no layer in the bottom or in the top third")


class _Early(Exception):
    """A verdict reached before the figure's own test: its table is missing, or it lacks a third."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.measured)
        self.verdict = verdict


def _judged(f):
    """Let a verdict function stop at `_frame` or `_layer_thirds` with their verdict."""
    @functools.wraps(f)
    def judged(*args, **kwargs) -> Verdict:
        try:
            return f(*args, **kwargs)
        except _Early as e:
            return e.verdict
    return judged


def _frame(table, name: str, step: str, lens: str | None = None) -> pd.DataFrame:
    """The table as a frame, on one lens when it has several; NA when its step was not run."""
    df = as_frame(table)
    if df is None:
        raise _Early(missing(name, step))
    return _lens(df, lens)[0]


def _layer_thirds(df: pd.DataFrame, n_layers: int | None, what: str):
    """(n_layers, bottom, middle, top); NA when `what` has no layer in the bottom or the top third."""
    t = _thirds_or_none(df, n_layers)
    if t is None:
        raise _Early(_no_thirds(what))
    return t


# ---- Fig 2 ---------------------------------------------------------------------------------------------
@_judged
def fig2(table, n_layers: int | None = None, semantic_ran: bool = True, source: str = "automatic") -> Verdict:
    """`patterns_fig2` (scope semantic_sample preferred, else all) or the human `fig2` rows of
    `AnnotationStore.stats()`: columns layer, shallow, semantic, both, not_covered, prefixes."""
    df = as_frame(table)
    crit = ("same trend when the share of prefixes covered only by shallow patterns is higher in the "
            "bottom third of the layers than in the top third, and the share covered only by semantic "
            f"patterns is higher in the top third than in the bottom third (shares pooled over prefixes; {THIRDS}); "
            "each difference with its 95% interval: differs when either lies below 0, inconclusive when "
            "either interval holds 0. Baseline: the other third. Only the trend is judged: the coverage "
            "level of automatic patterns is not the experts' measure and is shown, not judged")
    if df is None or df.empty:
        return missing("patterns_fig2", "patterns") if source == "automatic" else Verdict(
            NA, crit, "no annotations in annotations.sqlite")
    all_keys = None
    if "scope" in df.columns:
        if (df["scope"] == "all").any():
            all_keys = df[(df["scope"] == "all") & (df["prefixes"] > 0)]
        scope = "semantic_sample" if (df["scope"] == "semantic_sample").any() else "all"
        df = df[df["scope"] == scope]
    if not semantic_ran:
        return Verdict(NA, crit, "semantic patterns were not run (`ffkv patterns --no-semantic`), so the "
                                 "shallow/semantic split cannot be read")
    n_layers = n_layers or _n_layers(df, None)
    df = df[df["prefixes"] > 0]
    t = _layer_thirds(df, n_layers, f"the {source} Fig 2 table")
    _, bottom, _, top = t
    sh_b, sh_t = _weighted(df, bottom, "shallow", "prefixes"), _weighted(df, top, "shallow", "prefixes")
    se_b, se_t = _weighted(df, bottom, "semantic", "prefixes"), _weighted(df, top, "semantic", "prefixes")
    cov = 1 - _weighted(df, sorted(df["layer"]), "not_covered", "prefixes")
    n_b = float(df[df["layer"].isin(bottom)]["prefixes"].sum())
    n_t = float(df[df["layer"].isin(top)]["prefixes"].sum())
    d1 = diff_ci(sh_b * n_b, n_b, sh_t * n_t, n_t)  # shallow: bottom − top
    d2 = diff_ci(se_t * n_t, n_t, se_b * n_b, n_b)  # semantic: top − bottom
    v1, v2 = by_interval(d1[1], d1[2]), by_interval(d2[1], d2[2])
    verdict = DIFFERS if DIFFERS in (v1, v2) else SAME if v1 == v2 == SAME else INCONCLUSIVE
    meas = (f"shallow only {_pct(sh_b)} (layers {_span(bottom)}) vs {_pct(sh_t)} (layers {_span(top)}), "
            f"difference {d1[0]:+.3f} [{d1[1]:+.3f}, {d1[2]:+.3f}]; semantic only {_pct(se_b)} vs {_pct(se_t)}, "
            f"difference {d2[0]:+.3f} [{d2[1]:+.3f}, {d2[2]:+.3f}]; prefixes covered by any pattern: {_pct(cov)} "
            + ("(the experts' coverage on their sample; paper 65–80%)" if source != "automatic" else
               "(automatic; the paper's 65–80% is human coverage: level not comparable)"))
    if all_keys is not None and len(all_keys):
        ls = sorted(all_keys["layer"])
        shallow_all = _weighted(all_keys, ls, "shallow", "prefixes")
        if "both" in all_keys.columns:
            shallow_all += _weighted(all_keys, ls, "both", "prefixes")
        meas += f"; shallow coverage over all keys: {_pct(shallow_all)}"
    return Verdict(verdict, crit, meas)


# ---- Fig 3 ---------------------------------------------------------------------------------------------
@_judged
def fig3(mutations_layers, n_layers: int | None = None) -> Verdict:
    """`mutations_layers`: layer, mutation (first | last | random), median of the relative change."""
    df = _frame(mutations_layers, "mutations_layers", "mutate")
    crit = ("same trend when removing the last token lowers the coefficient more than removing the first "
            "one: the median relative change, averaged over layers, is lower for `last` than for `first`, "
            "with a sign test over layers (last < first in significantly more than half of them, binomial "
            "p < 0.05; inconclusive otherwise). Baseline: removing a random token")
    n_layers = n_layers or _n_layers(df, None)
    df = df[df["median"].notna()]
    have = set(df["mutation"])
    if not {"first", "last"} <= have:
        return Verdict(NA, crit, "the table lacks the `first` or `last` mutation")
    avg = {m: float(df[df["mutation"] == m]["median"].mean()) for m in ("first", "last", "random") if m in have}
    piv = df.pivot_table(index="layer", columns="mutation", values="median")
    both = piv[["first", "last"]].dropna()
    k, n = int((both["last"] < both["first"]).sum()), int((both["last"] != both["first"]).sum())
    from scipy.stats import binomtest

    p = float(binomtest(k, n).pvalue) if n else 1.0
    trend = avg["first"] - avg["last"]  # > 0: last lowers more
    if p >= ALPHA:
        verdict = INCONCLUSIVE
    else:
        verdict = SAME if (k > n - k and trend > 0) else DIFFERS if (k < n - k and trend < 0) else INCONCLUSIVE
    meas = ", ".join(f"{m} {avg[m]:+.2f}" for m in ("first", "random", "last") if m in avg)
    meas = (f"mean over layers of the median relative change: {meas}; last below first in {k} of {n} "
            f"layers (sign test p = {p:.2g})")
    t = _thirds_or_none(df, n_layers)
    if t is not None:
        _, bottom, _, top = t
        last = df[df["mutation"] == "last"]
        meas += (f"; removing the last token: {_weighted(last, bottom, 'median'):+.2f} in layers {_span(bottom)} vs "
                 f"{_weighted(last, top, 'median'):+.2f} in layers {_span(top)} (paper: weaker in upper layers)")
    return Verdict(verdict, crit, meas)


# ---- Fig 4 ---------------------------------------------------------------------------------------------
@_judged
def fig4(values_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`values_layers`: layer, n, n_agree, shuffled (and lens, when the run has both)."""
    df = _frame(values_layers, "values_layers", "values", lens)
    crit = ("same trend when the agreement rate pooled over the top third of the layers is higher than over "
            f"the bottom third ({THIRDS}; the difference's 95% interval above 0) and the top third's agreement "
            "is above its shuffled-pairing baseline (Wilson interval above the baseline's mean); differs when "
            "the interval lies below 0 or the top third is clearly below chance; inconclusive when it holds 0 "
            "or the top third cannot be told apart from chance")
    n_layers = n_layers or _n_layers(df, None)
    df = df[df["n"] > 0]
    t = _layer_thirds(df, n_layers, "values_layers")
    _, bottom, _, top = t
    b, tp = (df[df["layer"].isin(ls)] for ls in (bottom, top))
    a_b = b["n_agree"].sum() / b["n"].sum()
    a_t = tp["n_agree"].sum() / tp["n"].sum()
    sh_t = _weighted(df, top, "shuffled", "n")
    d, lo, hi = diff_ci(tp["n_agree"].sum(), tp["n"].sum(), b["n_agree"].sum(), b["n"].sum())
    w_lo, w_hi = wilson_ci(tp["n_agree"].sum(), tp["n"].sum())
    verdict = by_interval(lo, hi)
    chance = not (w_lo > sh_t) if sh_t == sh_t else False
    if sh_t == sh_t and w_hi < sh_t:
        verdict = DIFFERS  # clearly below chance
    elif chance and verdict == SAME:
        verdict = INCONCLUSIVE
    best = df.loc[df["agreement"].idxmax()]
    meas = (f"agreement {_pct(a_b, 2)} in layers {_span(bottom)} vs {_pct(a_t, 2)} in layers {_span(top)}, "
            f"difference {100 * d:+.2f} points [{100 * lo:+.2f}, {100 * hi:+.2f}]; shuffled baseline in the top "
            f"third {_pct(sh_t, 3)}{' (not above it)' if chance else ''}; best layer {int(best['layer'])}: "
            f"{_pct(float(best['agreement']), 2)} (paper: ≈0 up to layer 10 of 16, up to 3.5% above)")
    return Verdict(verdict, crit, meas)


# ---- Fig 5 ---------------------------------------------------------------------------------------------
@_judged
def fig5(values_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`values_layers`: layer, rank_median (rank 0 = the value's top token), n, shuffled_rank_median,
    frac_rank_lt10, frac_rank_lt100 (when present), and lens (when the run has both)."""
    df = _frame(values_layers, "values_layers", "values", lens)
    crit = ("same trend when the median rank of the trigger's next token in the value's distribution, "
            f"averaged over the layers of the top third, is lower (better) than over the bottom third ({THIRDS}), "
            "layers as units (Mann–Whitney p < 0.05), and the top third beats its shuffled-pairing baseline "
            "(lower median rank than shuffled in most of its layers); inconclusive otherwise unless it is "
            "significantly higher (differs)")
    n_layers = n_layers or _n_layers(df, None)
    df = df[(df["n"] > 0) & df["rank_median"].notna()]
    t = _layer_thirds(df, n_layers, "values_layers")
    _, bottom, _, top = t
    r_b, r_t = _weighted(df, bottom, "rank_median"), _weighted(df, top, "rank_median")
    d, p = layers_test(df[df["layer"].isin(bottom)]["rank_median"], df[df["layer"].isin(top)]["rank_median"])
    verdict = by_test(d, p)  # d > 0: the top third ranks better
    meas = f"median rank {r_b:,.0f} in layers {_span(bottom)} vs {r_t:,.0f} in layers {_span(top)} (p = {p:.2g})"
    if "shuffled_rank_median" in df.columns:
        t = df[df["layer"].isin(top)]
        beats = float((t["rank_median"] < t["shuffled_rank_median"]).mean()) if len(t) else float("nan")
        meas += (f"; shuffled pairing {_weighted(df, top, 'shuffled_rank_median'):,.0f} in the top third, "
                 f"beaten in {_pct(beats, 0)} of its layers")
        if verdict == SAME and not beats > 0.5:
            verdict = INCONCLUSIVE
    for col, lab in (("frac_rank_lt10", "rank < 10"), ("frac_rank_lt100", "rank < 100")):
        if col in df.columns:
            meas += f"; {lab}: {_pct(_weighted(df, bottom, col, 'n'))} vs {_pct(_weighted(df, top, col, 'n'))}"
    return Verdict(verdict, crit, meas)


# ---- Fig 6 ---------------------------------------------------------------------------------------------
@_judged
def fig6(values_fig6, lens: str | None = None) -> Verdict:
    """`values_fig6`: bin (ascending max probability), n, n_agree, agreement (and lens)."""
    df = _frame(values_fig6, "values_fig6", "values", lens)
    crit = ("same trend when agreement rises with the value's max probability: the highest bin's agreement "
            "exceeds the lowest bin's (the difference's 95% interval above 0; the lowest bin is the "
            "baseline) and Spearman's ρ between bin order and agreement is positive; differs when the "
            "interval lies below 0 or ρ ≤ 0 with a significant difference; inconclusive otherwise")
    df = df[df["n"] > 0].sort_values("bin")
    if len(df) < 2:
        return Verdict(NA, crit, "fewer than two non-empty bins")
    lo, hi = float(df["agreement"].iloc[0]), float(df["agreement"].iloc[-1])
    rho = spearman(df["bin"], df["agreement"])
    first, last = df.iloc[0], df.iloc[-1]
    k1 = float(last["n_agree"]) if "n_agree" in df.columns else hi * float(last["n"])
    k0 = float(first["n_agree"]) if "n_agree" in df.columns else lo * float(first["n"])
    d, dlo, dhi = diff_ci(k1, float(last["n"]), k0, float(first["n"]))
    verdict = by_interval(dlo, dhi)
    if verdict == SAME and not rho > 0:  # nan > 0 is False: flat agreement is not a rise
        verdict = DIFFERS
    meas = (f"agreement {_pct(lo, 2)} in the lowest of {len(df)} bins vs {_pct(hi, 2)} in the highest, "
            f"difference {100 * d:+.2f} points [{100 * dlo:+.2f}, {100 * dhi:+.2f}]; "
            f"ρ = {'n/a (constant)' if math.isnan(rho) else f'{rho:+.2f}'}")
    return Verdict(verdict, crit, meas)


# ---- Table 2 -------------------------------------------------------------------------------------------
PAPER_UPPER = 10 / 16  # the paper's layers 11–16 of 16 (0-based 10..15) start at depth 10/16


@_judged
def table2(values_table2, n_layers: int, lens: str | None = None) -> Verdict:
    """`values_table2`: layer, n_agree (per row; and lens). Upper part = relative depth ≥ 10/16, the
    paper's layers 11–16."""
    df = _frame(values_table2, "values_table2", "values", lens)
    upper = [l for l in range(n_layers) if l >= PAPER_UPPER * n_layers]
    crit = (f"same trend when most (> 50%) of the highest-max-probability values lie in the upper part of "
            f"the network, layers ≥ {PAPER_UPPER:.3f}·L (layers {_span(upper) if upper else '—'}; the paper's "
            f"layers 11–16 of 16; {len(upper)}/{n_layers} of the layers, so an even spread would give "
            f"{_pct(len(upper) / n_layers, 0)}, the chance baseline); the share's Wilson 95% interval must lie "
            f"above both 50% and the even spread; differs when it lies below 50%; inconclusive otherwise")
    if df.empty or not upper:
        return Verdict(NA, crit, "empty table" if df.empty else "the model has no layer in the upper part")
    share = float(df["layer"].isin(upper).mean())
    k = int(df["layer"].isin(upper).sum())
    lo, hi = wilson_ci(k, len(df))
    even = len(upper) / n_layers
    verdict = SAME if lo > max(0.5, even) else DIFFERS if hi < 0.5 else INCONCLUSIVE
    agreeing = int((df["n_agree"] > 0).sum())
    meas = (f"{k} of {len(df)} in the upper part ({_pct(share, 0)} [{_pct(lo, 0)}, {_pct(hi, 0)}]; paper 97/100; "
            f"even spread {_pct(even, 0)}); {agreeing} of {len(df)} have ≥1 agreeing trigger (paper 46/100)")
    return Verdict(verdict, crit, meas)


# ---- Fig 7 ---------------------------------------------------------------------------------------------
@_judged
def fig7(compose_layers, activation: str | None, gated: bool, n_layers: int | None = None,
         lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, active_mean (share of d_m with m > 0), active_eps_mean."""
    df = _frame(compose_layers, "compose_layers", "compose", lens)
    if "n90_median" in df.columns and df["n90_median"].notna().any():
        return _fig7_scale_free(df, activation, gated, n_layers)
    act = (activation or "?").lower()
    crit = ("same trend when the typical share of active memories (m > 0; median over layers of the "
            "per-layer mean) is between 10% and 50% and the middle third of the layers has a lower share "
            f"than the bottom third (the paper's dip towards layer 10 of 16; {THIRDS}); only for ReLU-like, "
            "non-gated FFNs, where m > 0 means the key fired")
    typical = float(df["active_mean"].median()) if not df.empty else float("nan")
    eps = f"; |m| > ε: {_pct(float(df['active_eps_mean'].median()))}" if "active_eps_mean" in df.columns and not df.empty else ""
    if gated or act not in RELU_LIKE:
        why = ("gated FFN: m = f(x·g)·(x·u) takes the sign of x·u, which is symmetric, so about half of the "
               "memories have m > 0 whatever the input" if gated else
               f"activation {act}: the coefficient is rarely exactly 0, so m > 0 does not mean 'fired'")
        return Verdict(NA, crit + f". Not comparable here — {why}",
                       f"typical share with m > 0: {_pct(typical)}{eps}")
    t = _layer_thirds(df, n_layers, "compose_layers")
    _, bottom, middle, _ = t
    a_b = _weighted(df, bottom, "active_mean")
    a_m = _weighted(df, middle, "active_mean") if middle else float("nan")
    ok = 0.10 <= typical <= 0.50 and a_m < a_b
    meas = (f"typical share {_pct(typical)}; bottom third {_pct(a_b)}, middle third {_pct(a_m)}{eps} "
            f"(paper: 10–50%)")
    return Verdict(SAME if ok else DIFFERS, crit, meas)


HUNDREDS = 100  # "a typical example triggers hundreds of memories"


def _fig7_scale_free(df: pd.DataFrame, activation: str | None, gated: bool, n_layers: int | None) -> Verdict:
    """Fig 7 by a scale-free count: n90, the fewest memories carrying 90% of Σ|m_i|·‖v_i‖."""
    crit = ("same trend when a typical example needs hundreds of memories (median over layers of the per-layer "
            f"median n90 ≥ {HUNDREDS}; n90 = the fewest memories carrying 90% of Σ|m_i|·‖v_i‖, which does not "
            "depend on the coefficients' scale or on a threshold, and applies to gated FFNs too) and activity dips "
            f"at mid-depth: the middle third's per-layer mean n90 below the bottom third's ({THIRDS}; layers as "
            "units, Mann–Whitney p < 0.05). Differs when fewer than hundreds or the middle third is "
            "significantly higher; inconclusive otherwise")
    t = _layer_thirds(df, n_layers, "compose_layers")
    _, bottom, middle, _ = t
    typical = float(df["n90_median"].median())
    d, p = layers_test(df[df["layer"].isin(bottom)]["n90_mean"], df[df["layer"].isin(middle)]["n90_mean"])
    dip = by_test(d, p) if middle else INCONCLUSIVE
    verdict = DIFFERS if (typical < HUNDREDS or dip == DIFFERS) else dip
    d_m = float(df["d_m"].iloc[0]) if "d_m" in df.columns else float("nan")
    eps = (f"; share with m > 0: {_pct(float(df['active_mean'].median()))}, |m| > ε: "
           f"{_pct(float(df['active_eps_mean'].median()))}" if "active_eps_mean" in df.columns else "")
    meas = (f"typical n90 {typical:,.0f} memories ({_pct(typical / d_m)} of d_m); bottom third mean "
            f"{_weighted(df, bottom, 'n90_mean'):,.0f}, middle third {_weighted(df, middle, 'n90_mean') if middle else float('nan'):,.0f} "
            f"(p = {p:.2g}){eps} (paper: hundreds of 4,096, fewer towards layer 10 of 16)")
    return Verdict(verdict, crit, meas)


# ---- Fig 8 ---------------------------------------------------------------------------------------------
PAPER_FIG8 = 0.68


@_judged
def fig8(compose_layers, gated: bool = False, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, n_examples, fig8_no_single_memory (paper's form, m > 0),
    fig8_no_single_memory_eps (signed form, used for gated FFNs)."""
    df = _frame(compose_layers, "compose_layers", "compose", lens)
    if "fig8_shuffled_rel" in df.columns:
        return _fig8_variants(df, gated)
    col = "fig8_no_single_memory_eps" if gated else "fig8_no_single_memory"
    form = ("signed form (|m| > ε, top(sign(m)·v)), since a gated FFN's negative coefficients write −v"
            if gated else "the paper's form (m > 0)")
    crit = (f"same trend when in every layer the share of examples where no single memory has the layer's "
            f"top prediction is consistent with the paper's ≥ 68%: at least 0.68 − 2·SE, "
            f"SE = √(0.68·0.32/n) for n examples; {form}")
    df = df[df["n_examples"] > 0]
    if df.empty:
        return Verdict(NA, crit, "no examples")
    n = int(df["n_examples"].min())
    thr = PAPER_FIG8 - 2 * math.sqrt(PAPER_FIG8 * (1 - PAPER_FIG8) / n)
    worst = df.loc[df[col].idxmin()]
    ok = bool((df[col] >= thr).all())
    meas = (f"lowest layer {int(worst['layer'])}: {_pct(float(worst[col]))}, mean {_pct(float(df[col].mean()))} "
            f"(threshold {_pct(thr)} with n = {n})")
    if gated:
        meas += f"; paper's form m > 0: mean {_pct(float(df['fig8_no_single_memory'].mean()))}"
    return Verdict(SAME if ok else DIFFERS, crit, meas)


FIG8_FORMS = {  # variant: (no-match column, shuffled column, description)
    "paper": ("fig8_no_single_memory", "fig8_shuffled_paper", "the paper's text: m_i > 0, top(v_i) vs top(y)"),
    "signed": ("fig8_no_match_signed", "fig8_shuffled_signed", "all m_i ≠ 0, top(sign(m_i)·v_i) vs top(y)"),
    "code": ("fig8_no_match_code", "fig8_shuffled_code",
             "the paper's released code: top(m_i·v_i) vs top(o_ℓ), the layer output"),
    "rel": ("fig8_no_match_rel", "fig8_shuffled_rel", "signed, |m_i| > 0.1·max|m| (ε relative to the scale)"),
}


def _fig8_variants(df: pd.DataFrame, gated: bool) -> Verdict:
    """Fig 8 with its variants and shuffled baselines (compose_layers from issue 14 on)."""
    use = "rel" if gated else "paper"
    col, sh, what = FIG8_FORMS[use]
    crit = (f"judged on {what}, against the shuffled pairing (each example's memories against another "
            "example's target): pooled over layers, the share of examples where no single memory has the "
            "prediction must be above the shuffled share (difference's 95% interval above 0: the matches are "
            "not chance) and consistent with the paper's ≥ 68% (every layer ≥ 0.68 − 2·SE); differs when a "
            "layer falls below that; inconclusive when the matches are not above the shuffled pairing's "
            "(the interval holds 0 or lies below it). The paper's text compares with top(y); its released code "
            "with top(o_ℓ): both are shown")
    df = df[df["n_examples"] > 0]
    if df.empty:
        return Verdict(NA, crit, "no examples")
    n = float(df["n_examples"].sum())
    nsh = float(df["fig8_shuffled_n"].sum()) if "fig8_shuffled_n" in df.columns else n
    obs, base = float((df[col] * df["n_examples"]).sum() / n), float(np.nanmean(df[sh]))
    d, lo, hi = diff_ci(base * nsh, nsh, obs * n, n)  # matches: (1 − obs) − (1 − base) = base − obs
    thr = PAPER_FIG8 - 2 * math.sqrt(PAPER_FIG8 * (1 - PAPER_FIG8) / int(df["n_examples"].min()))
    if by_interval(lo, hi) != SAME:  # single-memory matches not above chance: nothing to read
        verdict = INCONCLUSIVE
    else:
        verdict = SAME if bool((df[col] >= thr).all()) else DIFFERS
    parts = []
    for name, (c, s, _) in FIG8_FORMS.items():
        if c in df.columns and s in df.columns:
            parts.append(f"{name} {_pct(float(df[c].mean()))} (shuffled {_pct(float(np.nanmean(df[s])))})")
    meas = (f"no single memory [{use}]: {_pct(obs)} vs shuffled {_pct(base)}, matches above chance by "
            f"{100 * d:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]; lowest layer "
            f"{_pct(float(df[col].min()))} (threshold {_pct(thr)}); variants, mean over layers: " + "; ".join(parts))
    if "fig8_hub_share" in df.columns:
        meas += (f"; hub tokens (top 0.1% by e·ē/‖ē‖) make {_pct(float(np.nanmean(df['fig8_hub_share'])))} of the "
                 f"[rel] matches; without hub targets [rel] no-match is {_pct(float(np.nanmean(df['fig8_no_match_rel_nohub'])))}")
    return Verdict(verdict, crit, meas)


# ---- Fig 9 ---------------------------------------------------------------------------------------------
FIG9_LEVEL = (0.25, 0.42)  # "about a third"


@_judged
def fig9(compose_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, r_matches_final, o_matches_final."""
    df = _frame(compose_layers, "compose_layers", "compose", lens)
    crit = ("same trend when the share of examples whose residual already has the final prediction "
            "(top(r_ℓ) = top(o_L)) is higher in the top third of the layers than in the bottom third "
            f"(difference's 95% interval above 0; the bottom third is the baseline; {THIRDS}), the curve ends "
            f"at 1 (top(o) of the last layer), and the bottom third's level is about a third (its Wilson "
            f"interval meets {_pct(FIG9_LEVEL[0], 0)}–{_pct(FIG9_LEVEL[1], 0)}); differs when the trend is "
            "reversed, the end point is not 1 or the level is clearly outside; inconclusive otherwise")
    t = _layer_thirds(df, n_layers, "compose_layers")
    _, bottom, _, top = t
    m_b, m_t = _weighted(df, bottom, "r_matches_final"), _weighted(df, top, "r_matches_final")
    end = float(df.sort_values("layer")["o_matches_final"].iloc[-1])
    ne = df["n_examples"] if "n_examples" in df.columns else pd.Series(1000, index=df.index)
    n_b = float(ne[df["layer"].isin(bottom)].sum())
    n_t = float(ne[df["layer"].isin(top)].sum())
    d, lo, hi = diff_ci(m_t * n_t, n_t, m_b * n_b, n_b)
    trend = by_interval(lo, hi)
    l_lo, l_hi = wilson_ci(m_b * n_b, n_b)
    level_ok = l_hi >= FIG9_LEVEL[0] and l_lo <= FIG9_LEVEL[1]
    if end < 0.999 or trend == DIFFERS or not level_ok:
        verdict = DIFFERS
    else:
        verdict = trend
    meas = (f"{_pct(m_b)} in layers {_span(bottom)} vs {_pct(m_t)} in layers {_span(top)}, difference "
            f"{100 * d:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]; level of the bottom third {_pct(m_b)} "
            f"[{_pct(l_lo)}, {_pct(l_hi)}] vs the paper's about a third ({'consistent' if level_ok else 'differs'}); "
            f"end point {_pct(end)} (paper: about a third early, steep rise from layer 10 of 16)")
    return Verdict(verdict, crit, meas)


# ---- Fig 10 --------------------------------------------------------------------------------------------
@_judged
def fig10(compose_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, p_final_mean."""
    df = _frame(compose_layers, "compose_layers", "compose", lens)
    crit = ("same trend when the mean probability of the final prediction under the residual's distribution "
            f"is higher in the top third of the layers than in the bottom third ({THIRDS}), layers as units "
            "(Mann–Whitney p < 0.05; the bottom third is the baseline); differs when significantly lower; "
            "inconclusive otherwise")
    t = _layer_thirds(df, n_layers, "compose_layers")
    _, bottom, _, top = t
    p_b, p_t = _weighted(df, bottom, "p_final_mean"), _weighted(df, top, "p_final_mean")
    rho = spearman(df["layer"], df["p_final_mean"])
    d, p = layers_test(df[df["layer"].isin(top)]["p_final_mean"], df[df["layer"].isin(bottom)]["p_final_mean"])
    meas = (f"mean probability {p_b:.3f} in layers {_span(bottom)} vs {p_t:.3f} in layers {_span(top)} "
            f"(p = {p:.2g}); ρ(layer, p) = {'n/a' if math.isnan(rho) else f'{rho:+.2f}'}")
    return Verdict(by_test(d, p), crit, meas)


# ---- Fig 11 --------------------------------------------------------------------------------------------
@_judged
def fig11(compose_layers, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, residual, ffn, agreement, composition (shares per layer)."""
    df = _frame(compose_layers, "compose_layers", "compose", lens)
    crit = ("same trend when, averaged over layers, residual + agreement make up the majority (> 50%) of "
            "the examples, and among the examples whose prediction changes, composition is more common "
            "than ffn; each with its 95% interval over the pooled example-layers (baselines: 50%, and ffn): "
            "differs when either lies on the wrong side, inconclusive when either holds its baseline")
    if df.empty:
        return Verdict(NA, crit, "no layers")
    m = {c: float(df[c].mean()) for c in ("residual", "agreement", "composition", "ffn")}
    keep = m["residual"] + m["agreement"]
    n = float(df["n_examples"].sum()) if "n_examples" in df.columns else 1000.0 * len(df)
    k_lo, k_hi = wilson_ci(keep * n, n)
    v1 = SAME if k_lo > 0.5 else DIFFERS if k_hi < 0.5 else INCONCLUSIVE
    changed = (m["composition"] + m["ffn"]) * n  # composition vs ffn among the changed examples
    d, lo, hi = diff_ci(m["composition"] * n, changed, m["ffn"] * n, changed) if changed > 0 else (0.0, float("nan"), float("nan"))
    v2 = by_interval(lo, hi)
    verdict = DIFFERS if DIFFERS in (v1, v2) else SAME if v1 == v2 == SAME else INCONCLUSIVE
    meas = (f"residual {_pct(m['residual'])} + agreement {_pct(m['agreement'])} = {_pct(keep)} "
            f"[{_pct(k_lo)}, {_pct(k_hi)}]; composition {_pct(m['composition'])} vs ffn {_pct(m['ffn'])}")
    return Verdict(verdict, crit, meas)


# ---- §5.2 cases and Table 1 (qualitative) --------------------------------------------------------------
@_judged
def cases(compose_cases, lens: str | None = None) -> Verdict:
    """`compose_cases`: the last-layer cases (category ffn | composition)."""
    df = _frame(compose_cases, "compose_cases", "compose", lens)
    crit = ("not judged automatically: the paper's split (66 semantically distant vs 34 related changes) "
            "is a human reading of each case; read the sample below")
    n = len(df)
    comp = float((df["category"] == "composition").mean()) if n else float("nan")
    return Verdict(NA, crit, f"{n} last-layer cases; {_pct(comp)} of them composition, {_pct(1 - comp) if n else 'n/a'} ffn")


@_judged
def table1(pattern_keys) -> Verdict:
    df = _frame(pattern_keys, "pattern_keys", "patterns")
    crit = "not judged: Table 1 is a set of examples; compare by reading"
    if df.empty:
        return Verdict(NA, crit, "no keys analysed")
    with_p = float((df["n_patterns"] > 0).mean())
    return Verdict(NA, crit, f"{len(df):,} keys analysed, {_pct(with_p)} with at least one automatic pattern "
                             f"(paper: every annotated key had one)")
