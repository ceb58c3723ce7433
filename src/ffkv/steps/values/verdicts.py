"""The `values` step's verdicts: Figs 4-6 and Table 2 (a value predicts the token after its key's
triggers, more so in the upper layers and the more confident it is). Pure; the shared statistics
are `ffkv.report.stats`."""
from __future__ import annotations

import math

from ffkv.report.stats import (
    DIFFERS, INCONCLUSIVE, NA, SAME, THIRDS, Verdict, by_interval, by_test, diff_ci, frame, judged,
    layer_thirds, layers_test, n_layers_of, pct_na, span, spearman, weighted, wilson_ci)


# ---- Fig 4 ---------------------------------------------------------------------------------------------
@judged
def fig4(values_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`values_layers`: layer, n, n_agree, shuffled (and lens, when the run has both)."""
    df = frame(values_layers, "values_layers", "values", lens)
    crit = ("same trend when the agreement rate pooled over the top third of the layers is higher than over "
            f"the bottom third ({THIRDS}; the difference's 95% interval above 0) and the top third's agreement "
            "is above its shuffled-pairing baseline (Wilson interval above the baseline's mean); differs when "
            "the interval lies below 0 or the top third is clearly below chance; inconclusive when it holds 0 "
            "or the top third cannot be told apart from chance")
    n_layers = n_layers or n_layers_of(df, None)
    df = df[df["n"] > 0]
    t = layer_thirds(df, n_layers, "values_layers")
    _, bottom, _, top = t
    b, tp = (df[df["layer"].isin(ls)] for ls in (bottom, top))
    a_b = b["n_agree"].sum() / b["n"].sum()
    a_t = tp["n_agree"].sum() / tp["n"].sum()
    sh_t = weighted(df, top, "shuffled", "n")
    d, lo, hi = diff_ci(tp["n_agree"].sum(), tp["n"].sum(), b["n_agree"].sum(), b["n"].sum())
    w_lo, w_hi = wilson_ci(tp["n_agree"].sum(), tp["n"].sum())
    verdict = by_interval(lo, hi)
    chance = not (w_lo > sh_t) if sh_t == sh_t else False
    if sh_t == sh_t and w_hi < sh_t:
        verdict = DIFFERS  # clearly below chance
    elif chance and verdict == SAME:
        verdict = INCONCLUSIVE
    best = df.loc[df["agreement"].idxmax()]
    meas = (f"agreement {pct_na(a_b, 2)} in layers {span(bottom)} vs {pct_na(a_t, 2)} in layers {span(top)}, "
            f"difference {100 * d:+.2f} points [{100 * lo:+.2f}, {100 * hi:+.2f}]; shuffled baseline in the top "
            f"third {pct_na(sh_t, 3)}{' (not above it)' if chance else ''}; best layer {int(best['layer'])}: "
            f"{pct_na(float(best['agreement']), 2)} (paper: ≈0 up to layer 10 of 16, up to 3.5% above)")
    return Verdict(verdict, crit, meas)


# ---- Fig 5 ---------------------------------------------------------------------------------------------
@judged
def fig5(values_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`values_layers`: layer, rank_median (rank 0 = the value's top token), n, shuffled_rank_median,
    frac_rank_lt10, frac_rank_lt100 (when present), and lens (when the run has both)."""
    df = frame(values_layers, "values_layers", "values", lens)
    crit = ("same trend when the median rank of the trigger's next token in the value's distribution, "
            f"averaged over the layers of the top third, is lower (better) than over the bottom third ({THIRDS}), "
            "layers as units (Mann–Whitney p < 0.05), and the top third beats its shuffled-pairing baseline "
            "(lower median rank than shuffled in most of its layers); inconclusive otherwise unless it is "
            "significantly higher (differs)")
    n_layers = n_layers or n_layers_of(df, None)
    df = df[(df["n"] > 0) & df["rank_median"].notna()]
    t = layer_thirds(df, n_layers, "values_layers")
    _, bottom, _, top = t
    r_b, r_t = weighted(df, bottom, "rank_median"), weighted(df, top, "rank_median")
    d, p = layers_test(df[df["layer"].isin(bottom)]["rank_median"], df[df["layer"].isin(top)]["rank_median"])
    verdict = by_test(d, p)  # d > 0: the top third ranks better
    meas = f"median rank {r_b:,.0f} in layers {span(bottom)} vs {r_t:,.0f} in layers {span(top)} (p = {p:.2g})"
    if "shuffled_rank_median" in df.columns:
        t = df[df["layer"].isin(top)]
        beats = float((t["rank_median"] < t["shuffled_rank_median"]).mean()) if len(t) else float("nan")
        meas += (f"; shuffled pairing {weighted(df, top, 'shuffled_rank_median'):,.0f} in the top third, "
                 f"beaten in {pct_na(beats, 0)} of its layers")
        if verdict == SAME and not beats > 0.5:
            verdict = INCONCLUSIVE
    for col, lab in (("frac_rank_lt10", "rank < 10"), ("frac_rank_lt100", "rank < 100")):
        if col in df.columns:
            meas += f"; {lab}: {pct_na(weighted(df, bottom, col, 'n'))} vs {pct_na(weighted(df, top, col, 'n'))}"
    return Verdict(verdict, crit, meas)


# ---- Fig 6 ---------------------------------------------------------------------------------------------
@judged
def fig6(values_fig6, lens: str | None = None) -> Verdict:
    """`values_fig6`: bin (ascending max probability), n, n_agree, agreement (and lens)."""
    df = frame(values_fig6, "values_fig6", "values", lens)
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
    meas = (f"agreement {pct_na(lo, 2)} in the lowest of {len(df)} bins vs {pct_na(hi, 2)} in the highest, "
            f"difference {100 * d:+.2f} points [{100 * dlo:+.2f}, {100 * dhi:+.2f}]; "
            f"ρ = {'n/a (constant)' if math.isnan(rho) else f'{rho:+.2f}'}")
    return Verdict(verdict, crit, meas)


# ---- Table 2 -------------------------------------------------------------------------------------------
PAPER_UPPER = 10 / 16  # the paper's layers 11–16 of 16 (0-based 10..15) start at depth 10/16


@judged
def table2(values_table2, n_layers: int, lens: str | None = None) -> Verdict:
    """`values_table2`: layer, n_agree (per row; and lens). Upper part = relative depth ≥ 10/16, the
    paper's layers 11–16."""
    df = frame(values_table2, "values_table2", "values", lens)
    upper = [l for l in range(n_layers) if l >= PAPER_UPPER * n_layers]
    crit = (f"same trend when most (> 50%) of the highest-max-probability values lie in the upper part of "
            f"the network, layers ≥ {PAPER_UPPER:.3f}·L (layers {span(upper) if upper else '—'}; the paper's "
            f"layers 11–16 of 16; {len(upper)}/{n_layers} of the layers, so an even spread would give "
            f"{pct_na(len(upper) / n_layers, 0)}, the chance baseline); the share's Wilson 95% interval must lie "
            f"above both 50% and the even spread; differs when it lies below 50%; inconclusive otherwise")
    if df.empty or not upper:
        return Verdict(NA, crit, "empty table" if df.empty else "the model has no layer in the upper part")
    share = float(df["layer"].isin(upper).mean())
    k = int(df["layer"].isin(upper).sum())
    lo, hi = wilson_ci(k, len(df))
    even = len(upper) / n_layers
    verdict = SAME if lo > max(0.5, even) else DIFFERS if hi < 0.5 else INCONCLUSIVE
    agreeing = int((df["n_agree"] > 0).sum())
    meas = (f"{k} of {len(df)} in the upper part ({pct_na(share, 0)} [{pct_na(lo, 0)}, {pct_na(hi, 0)}]; paper 97/100; "
            f"even spread {pct_na(even, 0)}); {agreeing} of {len(df)} have ≥1 agreeing trigger (paper 46/100)")
    return Verdict(verdict, crit, meas)
