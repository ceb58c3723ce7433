"""One verdict per figure: does the run show the paper's trend?

Every function is pure: it takes the run's table(s) (a pyarrow Table, a pandas DataFrame or a list
of row dicts; None when the step was not run) and returns a `Verdict` (verdict, criterion,
measured). The verdict is one of SAME ("same trend"), DIFFERS ("differs") or NA ("not
comparable"); the criterion says in one sentence what was tested; `measured` gives the numbers it
was tested on.

Layer-wise criteria compare parts of the network by *relative depth*, so that a 30-layer model is
read against the paper's 16 layers: layer ℓ (0-based) of an L-layer model sits at depth
(ℓ + ½) / L; the bottom third is depth ≤ 1/3, the top third depth ≥ 2/3 (`thirds`). A table that
covers only some layers (e.g. `mine --layers`) is judged on the layers it has.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pandas as pd

from ffkv.defs import pct

SAME, DIFFERS, NA = "same trend", "differs", "not comparable"
VERDICTS = (SAME, DIFFERS, NA)

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


# ---- Fig 2 ---------------------------------------------------------------------------------------------
def fig2(table, n_layers: int | None = None, semantic_ran: bool = True, source: str = "automatic") -> Verdict:
    """`patterns_fig2` (scope semantic_sample preferred, else all) or the human `fig2` rows of
    `AnnotationStore.stats()`: columns layer, shallow, semantic, both, not_covered, prefixes."""
    df = as_frame(table)
    crit = ("same trend when the share of prefixes covered only by shallow patterns is higher in the "
            "bottom third of the layers than in the top third, and the share covered only by semantic "
            f"patterns is higher in the top third than in the bottom third (shares pooled over prefixes; {THIRDS})")
    if df is None or df.empty:
        return missing("patterns_fig2", "patterns") if source == "automatic" else Verdict(
            NA, crit, "no annotations in annotations.sqlite")
    if "scope" in df.columns:
        scope = "semantic_sample" if (df["scope"] == "semantic_sample").any() else "all"
        df = df[df["scope"] == scope]
    if not semantic_ran:
        return Verdict(NA, crit, "semantic patterns were not run (`ffkv patterns --no-semantic`), so the "
                                 "shallow/semantic split cannot be read")
    n_layers = n_layers or _n_layers(df, None)
    df = df[df["prefixes"] > 0]
    t = _thirds_or_none(df, n_layers)
    if t is None:
        return _no_thirds(f"the {source} Fig 2 table")
    _, bottom, _, top = t
    sh_b, sh_t = _weighted(df, bottom, "shallow", "prefixes"), _weighted(df, top, "shallow", "prefixes")
    se_b, se_t = _weighted(df, bottom, "semantic", "prefixes"), _weighted(df, top, "semantic", "prefixes")
    cov = 1 - _weighted(df, sorted(df["layer"]), "not_covered", "prefixes")
    ok = sh_b > sh_t and se_t > se_b
    meas = (f"shallow only {_pct(sh_b)} (layers {_span(bottom)}) vs {_pct(sh_t)} (layers {_span(top)}); "
            f"semantic only {_pct(se_b)} vs {_pct(se_t)}; prefixes covered by any pattern: {_pct(cov)} "
            f"(paper 65–80%)")
    return Verdict(SAME if ok else DIFFERS, crit, meas)


# ---- Fig 3 ---------------------------------------------------------------------------------------------
def fig3(mutations_layers, n_layers: int | None = None) -> Verdict:
    """`mutations_layers`: layer, mutation (first | last | random), median of the relative change."""
    df = as_frame(mutations_layers)
    if df is None:
        return missing("mutations_layers", "mutate")
    crit = ("same trend when removing the last token lowers the coefficient more than removing the first "
            "one: the median relative change, averaged over layers, is lower for `last` than for `first`")
    n_layers = n_layers or _n_layers(df, None)
    df = df[df["median"].notna()]
    have = set(df["mutation"])
    if not {"first", "last"} <= have:
        return Verdict(NA, crit, "the table lacks the `first` or `last` mutation")
    avg = {m: float(df[df["mutation"] == m]["median"].mean()) for m in ("first", "last", "random") if m in have}
    ok = avg["last"] < avg["first"]
    meas = ", ".join(f"{m} {avg[m]:+.2f}" for m in ("first", "random", "last") if m in avg)
    meas = f"mean over layers of the median relative change: {meas}"
    t = _thirds_or_none(df, n_layers)
    if t is not None:
        _, bottom, _, top = t
        last = df[df["mutation"] == "last"]
        meas += (f"; removing the last token: {_weighted(last, bottom, 'median'):+.2f} in layers {_span(bottom)} vs "
                 f"{_weighted(last, top, 'median'):+.2f} in layers {_span(top)} (paper: weaker in upper layers)")
    return Verdict(SAME if ok else DIFFERS, crit, meas)


# ---- Fig 4 ---------------------------------------------------------------------------------------------
def fig4(values_layers, n_layers: int | None = None) -> Verdict:
    """`values_layers`: layer, n, n_agree, shuffled."""
    df = as_frame(values_layers)
    if df is None:
        return missing("values_layers", "values")
    crit = ("same trend when the agreement rate pooled over the top third of the layers is higher than over "
            f"the bottom third and higher than the top third's shuffled-pairing baseline ({THIRDS})")
    n_layers = n_layers or _n_layers(df, None)
    df = df[df["n"] > 0]
    t = _thirds_or_none(df, n_layers)
    if t is None:
        return _no_thirds("values_layers")
    _, bottom, _, top = t
    b, tp = (df[df["layer"].isin(ls)] for ls in (bottom, top))
    a_b = b["n_agree"].sum() / b["n"].sum()
    a_t = tp["n_agree"].sum() / tp["n"].sum()
    sh_t = _weighted(df, top, "shuffled", "n")
    ok = a_t > a_b and a_t > sh_t
    best = df.loc[df["agreement"].idxmax()]
    meas = (f"agreement {_pct(a_b, 2)} in layers {_span(bottom)} vs {_pct(a_t, 2)} in layers {_span(top)}; "
            f"shuffled baseline in the top third {_pct(sh_t, 3)}; best layer {int(best['layer'])}: "
            f"{_pct(float(best['agreement']), 2)} (paper: ≈0 up to layer 10 of 16, up to 3.5% above)")
    return Verdict(SAME if ok else DIFFERS, crit, meas)


# ---- Fig 5 ---------------------------------------------------------------------------------------------
def fig5(values_layers, n_layers: int | None = None) -> Verdict:
    """`values_layers`: layer, rank_median (rank 0 = the value's top token), n."""
    df = as_frame(values_layers)
    if df is None:
        return missing("values_layers", "values")
    crit = ("same trend when the median rank of the trigger's next token in the value's distribution, "
            f"averaged over the layers of the top third, is lower (better) than over the bottom third ({THIRDS})")
    n_layers = n_layers or _n_layers(df, None)
    df = df[(df["n"] > 0) & df["rank_median"].notna()]
    t = _thirds_or_none(df, n_layers)
    if t is None:
        return _no_thirds("values_layers")
    _, bottom, _, top = t
    r_b, r_t = _weighted(df, bottom, "rank_median"), _weighted(df, top, "rank_median")
    meas = f"median rank {r_b:,.0f} in layers {_span(bottom)} vs {r_t:,.0f} in layers {_span(top)}"
    if "shuffled_rank_median" in df.columns:
        meas += f" (shuffled pairing: {_weighted(df, top, 'shuffled_rank_median'):,.0f} in the top third)"
    return Verdict(SAME if r_t < r_b else DIFFERS, crit, meas)


# ---- Fig 6 ---------------------------------------------------------------------------------------------
def fig6(values_fig6) -> Verdict:
    """`values_fig6`: bin (ascending max probability), n, agreement."""
    df = as_frame(values_fig6)
    if df is None:
        return missing("values_fig6", "values")
    crit = ("same trend when agreement rises with the value's max probability: the highest bin's agreement "
            "exceeds the lowest bin's and Spearman's ρ between bin order and agreement is positive")
    df = df[df["n"] > 0].sort_values("bin")
    if len(df) < 2:
        return Verdict(NA, crit, "fewer than two non-empty bins")
    lo, hi = float(df["agreement"].iloc[0]), float(df["agreement"].iloc[-1])
    rho = spearman(df["bin"], df["agreement"])
    ok = hi > lo and rho > 0  # nan > 0 is False: flat agreement is not a rise
    meas = (f"agreement {_pct(lo, 2)} in the lowest of {len(df)} bins vs {_pct(hi, 2)} in the highest; "
            f"ρ = {'n/a (constant)' if math.isnan(rho) else f'{rho:+.2f}'}")
    return Verdict(SAME if ok else DIFFERS, crit, meas)


# ---- Table 2 -------------------------------------------------------------------------------------------
PAPER_UPPER = 10 / 16  # the paper's layers 11–16 of 16 (0-based 10..15) start at depth 10/16


def table2(values_table2, n_layers: int) -> Verdict:
    """`values_table2`: layer, n_agree (per row). Upper part = relative depth ≥ 10/16, the paper's
    layers 11–16."""
    df = as_frame(values_table2)
    if df is None:
        return missing("values_table2", "values")
    upper = [l for l in range(n_layers) if l >= PAPER_UPPER * n_layers]
    crit = (f"same trend when most (> 50%) of the highest-max-probability values lie in the upper part of "
            f"the network, layers ≥ {PAPER_UPPER:.3f}·L (layers {_span(upper) if upper else '—'}; the paper's "
            f"layers 11–16 of 16; {len(upper)}/{n_layers} of the layers, so an even spread would give "
            f"{_pct(len(upper) / n_layers, 0)})")
    if df.empty or not upper:
        return Verdict(NA, crit, "empty table" if df.empty else "the model has no layer in the upper part")
    share = float(df["layer"].isin(upper).mean())
    agreeing = int((df["n_agree"] > 0).sum())
    meas = (f"{(df['layer'].isin(upper)).sum()} of {len(df)} in the upper part ({_pct(share, 0)}; paper 97/100); "
            f"{agreeing} of {len(df)} have ≥1 agreeing trigger (paper 46/100)")
    return Verdict(SAME if share > 0.5 else DIFFERS, crit, meas)


# ---- Fig 7 ---------------------------------------------------------------------------------------------
def fig7(compose_layers, activation: str | None, gated: bool, n_layers: int | None = None,
         lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, active_mean (share of d_m with m > 0), active_eps_mean."""
    df = as_frame(compose_layers)
    if df is None:
        return missing("compose_layers", "compose")
    df, _ = _lens(df, lens)
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
    t = _thirds_or_none(df, n_layers)
    if t is None:
        return _no_thirds("compose_layers")
    _, bottom, middle, _ = t
    a_b = _weighted(df, bottom, "active_mean")
    a_m = _weighted(df, middle, "active_mean") if middle else float("nan")
    ok = 0.10 <= typical <= 0.50 and a_m < a_b
    meas = (f"typical share {_pct(typical)}; bottom third {_pct(a_b)}, middle third {_pct(a_m)}{eps} "
            f"(paper: 10–50%)")
    return Verdict(SAME if ok else DIFFERS, crit, meas)


# ---- Fig 8 ---------------------------------------------------------------------------------------------
PAPER_FIG8 = 0.68


def fig8(compose_layers, gated: bool = False, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, n_examples, fig8_no_single_memory (paper's form, m > 0),
    fig8_no_single_memory_eps (signed form, used for gated FFNs)."""
    df = as_frame(compose_layers)
    if df is None:
        return missing("compose_layers", "compose")
    df, _ = _lens(df, lens)
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


# ---- Fig 9 ---------------------------------------------------------------------------------------------
def fig9(compose_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, r_matches_final, o_matches_final."""
    df = as_frame(compose_layers)
    if df is None:
        return missing("compose_layers", "compose")
    df, _ = _lens(df, lens)
    crit = ("same trend when the share of examples whose residual already has the final prediction "
            "(top(r_ℓ) = top(o_L)) is higher in the top third of the layers than in the bottom third, "
            f"and the curve ends at 1 (top(o) of the last layer; {THIRDS})")
    t = _thirds_or_none(df, n_layers)
    if t is None:
        return _no_thirds("compose_layers")
    _, bottom, _, top = t
    m_b, m_t = _weighted(df, bottom, "r_matches_final"), _weighted(df, top, "r_matches_final")
    end = float(df.sort_values("layer")["o_matches_final"].iloc[-1])
    ok = m_t > m_b and end >= 0.999
    meas = (f"{_pct(m_b)} in layers {_span(bottom)} vs {_pct(m_t)} in layers {_span(top)}; end point "
            f"{_pct(end)} (paper: about a third early, steep rise from layer 10 of 16)")
    return Verdict(SAME if ok else DIFFERS, crit, meas)


# ---- Fig 10 --------------------------------------------------------------------------------------------
def fig10(compose_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, p_final_mean."""
    df = as_frame(compose_layers)
    if df is None:
        return missing("compose_layers", "compose")
    df, _ = _lens(df, lens)
    crit = ("same trend when the mean probability of the final prediction under the residual's distribution "
            f"is higher in the top third of the layers than in the bottom third ({THIRDS})")
    t = _thirds_or_none(df, n_layers)
    if t is None:
        return _no_thirds("compose_layers")
    _, bottom, _, top = t
    p_b, p_t = _weighted(df, bottom, "p_final_mean"), _weighted(df, top, "p_final_mean")
    rho = spearman(df["layer"], df["p_final_mean"])
    meas = (f"mean probability {p_b:.3f} in layers {_span(bottom)} vs {p_t:.3f} in layers {_span(top)}; "
            f"ρ(layer, p) = {'n/a' if math.isnan(rho) else f'{rho:+.2f}'}")
    return Verdict(SAME if p_t > p_b else DIFFERS, crit, meas)


# ---- Fig 11 --------------------------------------------------------------------------------------------
def fig11(compose_layers, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, residual, ffn, agreement, composition (shares per layer)."""
    df = as_frame(compose_layers)
    if df is None:
        return missing("compose_layers", "compose")
    df, _ = _lens(df, lens)
    crit = ("same trend when, averaged over layers, residual + agreement make up the majority (> 50%) of "
            "the examples, and among the examples whose prediction changes, composition is more common "
            "than ffn")
    if df.empty:
        return Verdict(NA, crit, "no layers")
    m = {c: float(df[c].mean()) for c in ("residual", "agreement", "composition", "ffn")}
    keep = m["residual"] + m["agreement"]
    ok = keep > 0.5 and m["composition"] > m["ffn"]
    meas = (f"residual {_pct(m['residual'])} + agreement {_pct(m['agreement'])} = {_pct(keep)}; "
            f"composition {_pct(m['composition'])} vs ffn {_pct(m['ffn'])}")
    return Verdict(SAME if ok else DIFFERS, crit, meas)


# ---- §5.2 cases and Table 1 (qualitative) --------------------------------------------------------------
def cases(compose_cases, lens: str | None = None) -> Verdict:
    """`compose_cases`: the last-layer cases (category ffn | composition)."""
    df = as_frame(compose_cases)
    if df is None:
        return missing("compose_cases", "compose")
    df, _ = _lens(df, lens)
    crit = ("not judged automatically: the paper's split (66 semantically distant vs 34 related changes) "
            "is a human reading of each case; read the sample below")
    n = len(df)
    comp = float((df["category"] == "composition").mean()) if n else float("nan")
    return Verdict(NA, crit, f"{n} last-layer cases; {_pct(comp)} of them composition, {_pct(1 - comp) if n else 'n/a'} ffn")


def table1(pattern_keys) -> Verdict:
    df = as_frame(pattern_keys)
    if df is None:
        return missing("pattern_keys", "patterns")
    crit = "not judged: Table 1 is a set of examples; compare by reading"
    if df.empty:
        return Verdict(NA, crit, "no keys analysed")
    with_p = float((df["n_patterns"] > 0).mean())
    return Verdict(NA, crit, f"{len(df):,} keys analysed, {_pct(with_p)} with at least one automatic pattern "
                             f"(paper: every annotated key had one)")
