"""The `compose` step's verdicts: Figs 7-11 (how a layer's memories compose and the layers refine
the prediction) and the last layer's cases (shown, not judged). Pure; the shared statistics are
`ffkv.report.stats`."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ffkv.report.stats import (
    DIFFERS, INCONCLUSIVE, NA, RELU_LIKE, SAME, THIRDS, Verdict, by_interval, by_test, diff_ci, frame,
    judged, layer_thirds, layers_test, pct_na, span, spearman, weighted, wilson_ci)


# ---- Fig 7 ---------------------------------------------------------------------------------------------
@judged
def fig7(compose_layers, activation: str | None, gated: bool, n_layers: int | None = None,
         lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, active_mean (share of d_m with m > 0), active_eps_mean."""
    df = frame(compose_layers, "compose_layers", "compose", lens)
    if "n90_median" in df.columns and df["n90_median"].notna().any():
        return _fig7_scale_free(df, activation, gated, n_layers)
    act = (activation or "?").lower()
    crit = ("same trend when the typical share of active memories (m > 0; median over layers of the "
            "per-layer mean) is between 10% and 50% and the middle third of the layers has a lower share "
            f"than the bottom third (the paper's dip towards layer 10 of 16; {THIRDS}); only for ReLU-like, "
            "non-gated FFNs, where m > 0 means the key fired")
    typical = float(df["active_mean"].median()) if not df.empty else float("nan")
    eps = f"; |m| > ε: {pct_na(float(df['active_eps_mean'].median()))}" if "active_eps_mean" in df.columns and not df.empty else ""
    if gated or act not in RELU_LIKE:
        why = ("gated FFN: m = f(x·g)·(x·u) takes the sign of x·u, which is symmetric, so about half of the "
               "memories have m > 0 whatever the input" if gated else
               f"activation {act}: the coefficient is rarely exactly 0, so m > 0 does not mean 'fired'")
        return Verdict(NA, crit + f". Not comparable here — {why}",
                       f"typical share with m > 0: {pct_na(typical)}{eps}")
    t = layer_thirds(df, n_layers, "compose_layers")
    _, bottom, middle, _ = t
    a_b = weighted(df, bottom, "active_mean")
    a_m = weighted(df, middle, "active_mean") if middle else float("nan")
    ok = 0.10 <= typical <= 0.50 and a_m < a_b
    meas = (f"typical share {pct_na(typical)}; bottom third {pct_na(a_b)}, middle third {pct_na(a_m)}{eps} "
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
    t = layer_thirds(df, n_layers, "compose_layers")
    _, bottom, middle, _ = t
    typical = float(df["n90_median"].median())
    d, p = layers_test(df[df["layer"].isin(bottom)]["n90_mean"], df[df["layer"].isin(middle)]["n90_mean"])
    dip = by_test(d, p) if middle else INCONCLUSIVE
    verdict = DIFFERS if (typical < HUNDREDS or dip == DIFFERS) else dip
    d_m = float(df["d_m"].iloc[0]) if "d_m" in df.columns else float("nan")
    eps = (f"; share with m > 0: {pct_na(float(df['active_mean'].median()))}, |m| > ε: "
           f"{pct_na(float(df['active_eps_mean'].median()))}" if "active_eps_mean" in df.columns else "")
    meas = (f"typical n90 {typical:,.0f} memories ({pct_na(typical / d_m)} of d_m); bottom third mean "
            f"{weighted(df, bottom, 'n90_mean'):,.0f}, middle third {weighted(df, middle, 'n90_mean') if middle else float('nan'):,.0f} "
            f"(p = {p:.2g}){eps} (paper: hundreds of 4,096, fewer towards layer 10 of 16)")
    return Verdict(verdict, crit, meas)


# ---- Fig 8 ---------------------------------------------------------------------------------------------
PAPER_FIG8 = 0.68


@judged
def fig8(compose_layers, gated: bool = False, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, n_examples, fig8_no_single_memory (paper's form, m > 0),
    fig8_no_single_memory_eps (signed form, used for gated FFNs)."""
    df = frame(compose_layers, "compose_layers", "compose", lens)
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
    meas = (f"lowest layer {int(worst['layer'])}: {pct_na(float(worst[col]))}, mean {pct_na(float(df[col].mean()))} "
            f"(threshold {pct_na(thr)} with n = {n})")
    if gated:
        meas += f"; paper's form m > 0: mean {pct_na(float(df['fig8_no_single_memory'].mean()))}"
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
            parts.append(f"{name} {pct_na(float(df[c].mean()))} (shuffled {pct_na(float(np.nanmean(df[s])))})")
    meas = (f"no single memory [{use}]: {pct_na(obs)} vs shuffled {pct_na(base)}, matches above chance by "
            f"{100 * d:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]; lowest layer "
            f"{pct_na(float(df[col].min()))} (threshold {pct_na(thr)}); variants, mean over layers: " + "; ".join(parts))
    if "fig8_hub_share" in df.columns:
        meas += (f"; hub tokens (top 0.1% by e·ē/‖ē‖) make {pct_na(float(np.nanmean(df['fig8_hub_share'])))} of the "
                 f"[rel] matches; without hub targets [rel] no-match is {pct_na(float(np.nanmean(df['fig8_no_match_rel_nohub'])))}")
    return Verdict(verdict, crit, meas)


# ---- Fig 9 ---------------------------------------------------------------------------------------------
FIG9_LEVEL = (0.25, 0.42)  # "about a third"


@judged
def fig9(compose_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, r_matches_final, o_matches_final."""
    df = frame(compose_layers, "compose_layers", "compose", lens)
    crit = ("same trend when the share of examples whose residual already has the final prediction "
            "(top(r_ℓ) = top(o_L)) is higher in the top third of the layers than in the bottom third "
            f"(difference's 95% interval above 0; the bottom third is the baseline; {THIRDS}), the curve ends "
            f"at 1 (top(o) of the last layer), and the bottom third's level is about a third (its Wilson "
            f"interval meets {pct_na(FIG9_LEVEL[0], 0)}–{pct_na(FIG9_LEVEL[1], 0)}); differs when the trend is "
            "reversed, the end point is not 1 or the level is clearly outside; inconclusive otherwise")
    t = layer_thirds(df, n_layers, "compose_layers")
    _, bottom, _, top = t
    m_b, m_t = weighted(df, bottom, "r_matches_final"), weighted(df, top, "r_matches_final")
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
    meas = (f"{pct_na(m_b)} in layers {span(bottom)} vs {pct_na(m_t)} in layers {span(top)}, difference "
            f"{100 * d:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]; level of the bottom third {pct_na(m_b)} "
            f"[{pct_na(l_lo)}, {pct_na(l_hi)}] vs the paper's about a third ({'consistent' if level_ok else 'differs'}); "
            f"end point {pct_na(end)} (paper: about a third early, steep rise from layer 10 of 16)")
    return Verdict(verdict, crit, meas)


# ---- Fig 10 --------------------------------------------------------------------------------------------
@judged
def fig10(compose_layers, n_layers: int | None = None, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, p_final_mean."""
    df = frame(compose_layers, "compose_layers", "compose", lens)
    crit = ("same trend when the mean probability of the final prediction under the residual's distribution "
            f"is higher in the top third of the layers than in the bottom third ({THIRDS}), layers as units "
            "(Mann–Whitney p < 0.05; the bottom third is the baseline); differs when significantly lower; "
            "inconclusive otherwise")
    t = layer_thirds(df, n_layers, "compose_layers")
    _, bottom, _, top = t
    p_b, p_t = weighted(df, bottom, "p_final_mean"), weighted(df, top, "p_final_mean")
    rho = spearman(df["layer"], df["p_final_mean"])
    d, p = layers_test(df[df["layer"].isin(top)]["p_final_mean"], df[df["layer"].isin(bottom)]["p_final_mean"])
    meas = (f"mean probability {p_b:.3f} in layers {span(bottom)} vs {p_t:.3f} in layers {span(top)} "
            f"(p = {p:.2g}); ρ(layer, p) = {'n/a' if math.isnan(rho) else f'{rho:+.2f}'}")
    return Verdict(by_test(d, p), crit, meas)


# ---- Fig 11 --------------------------------------------------------------------------------------------
@judged
def fig11(compose_layers, lens: str | None = None) -> Verdict:
    """`compose_layers`: layer, residual, ffn, agreement, composition (shares per layer)."""
    df = frame(compose_layers, "compose_layers", "compose", lens)
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
    meas = (f"residual {pct_na(m['residual'])} + agreement {pct_na(m['agreement'])} = {pct_na(keep)} "
            f"[{pct_na(k_lo)}, {pct_na(k_hi)}]; composition {pct_na(m['composition'])} vs ffn {pct_na(m['ffn'])}")
    return Verdict(verdict, crit, meas)


@judged
def cases(compose_cases, lens: str | None = None) -> Verdict:
    """`compose_cases`: the last-layer cases (category ffn | composition)."""
    df = frame(compose_cases, "compose_cases", "compose", lens)
    crit = ("not judged automatically: the paper's split (66 semantically distant vs 34 related changes) "
            "is a human reading of each case; read the sample below")
    n = len(df)
    comp = float((df["category"] == "composition").mean()) if n else float("nan")
    return Verdict(NA, crit, f"{n} last-layer cases; {pct_na(comp)} of them composition, {pct_na(1 - comp) if n else 'n/a'} ffn")
