"""The census's verdicts: each later paper's trend by depth, read on this run's `census_layers`.
Pure (a table in, a `Verdict` out); the intervals and thirds are `ffkv.report.stats`'s.

Shares are pooled over the layers of a third (counts = share × the layer's memories, or its mined
memories for dead), so the interval is that of a difference of two proportions (`diff_ci`); a
share is "above chance" when its Wilson interval's low end is above the chance share of the same
layers (`*_chance`, `ffkv.steps.census.compute`'s chance baselines).
"""
from __future__ import annotations

from ffkv.report.stats import (
    DIFFERS, INCONCLUSIVE, NA, SAME, THIRDS, Verdict, by_interval, diff_ci, frame, judged, layer_thirds, n_layers_of,
    pct_na, span, weighted, wilson_ci)

# (id, title, paper): the records' ids in verdicts.json and `ffkv verdicts`
TITLES = {
    "census_dead": "Dead memories concentrate in the early layers (Voita et al. 2024)",
    "census_prediction": "Prediction memories rise with depth (Gurnee et al. 2024)",
    "census_suppression": "Suppression memories sit in the last layers (Gurnee et al. 2024)",
    "census_io": "Enrichment early and middle, depletion late (Gerstner & Schütze 2025)",
}


def _pooled(df, layers, col: str, base: str = "memories") -> tuple[float, float]:
    """(k, n) of `col`'s share pooled over `layers`, n the layers' `base` counts."""
    sub = df[df["layer"].isin(layers) & df[col].notna()]
    n = float(sub[base].sum())
    return float((sub[col] * sub[base]).sum()), n


def _chance(df, layers, col: str) -> float:
    c = f"{col}_chance"
    return weighted(df, layers, c, "memories") if c in df.columns else float("nan")


def _above(k: float, n: float, chance: float) -> bool | None:
    """k/n's Wilson interval above `chance` (True), below it (False), or holding it / no baseline (None)."""
    if chance != chance or n <= 0:
        return None
    lo, hi = wilson_ci(round(k), round(n))
    return True if lo > chance else False if hi < chance else None


def _rise(df, low, high, col: str, base: str = "memories") -> tuple[str, str, float]:
    """The verdict that `col` pooled over `high` exceeds it over `low`, and its numbers."""
    k1, n1 = _pooled(df, high, col, base)
    k2, n2 = _pooled(df, low, col, base)
    d, lo, hi = diff_ci(k1, n1, k2, n2)
    meas = (f"{col.replace('_', ' ')} {pct_na(k2 / n2 if n2 else float('nan'), 2)} in layers {span(low)} vs "
            f"{pct_na(k1 / n1 if n1 else float('nan'), 2)} in layers {span(high)}, difference "
            f"{100 * d:+.2f} points [{100 * lo:+.2f}, {100 * hi:+.2f}]")
    return by_interval(lo, hi), meas, k1 / n1 if n1 else float("nan")


def _rise_above_chance(df, low, high, col: str) -> tuple[str, str]:
    """`_rise`, made inconclusive unless `high`'s pooled share is above its random-direction chance."""
    verdict, meas, _ = _rise(df, low, high, col)
    k, n = _pooled(df, high, col)
    ch = _chance(df, high, col)
    above = _above(k, n, ch)
    if verdict == SAME and above is not True:
        verdict = INCONCLUSIVE
    return verdict, meas + f"; chance (random directions) {pct_na(ch, 2)}" + ("" if above else " (not above it)")


@judged
def dead(census_layers, n_layers: int | None = None, activation: str | None = None) -> Verdict:
    """Voita et al.: in OPT (ReLU) models, most dead neurons sit in the early layers."""
    df = frame(census_layers, "census_layers", "census")
    crit = (f"same trend when the share of dead memories (never |m| > eps over the mined tokens) pooled over the "
            f"bottom third is higher than over the top third ({THIRDS}; the difference's 95% interval above 0); "
            f"differs when below 0; not comparable when no layer has a dead memory (e.g. a smooth activation, "
            f"whose coefficients are never exactly 0)")
    n_layers = n_layers or n_layers_of(df, None)
    df = df[df["mined"] > 0]
    _, bottom, _, top = layer_thirds(df, n_layers, "census_layers")
    if not (df["dead"].fillna(0) > 0).any():
        act = f" ({activation})" if activation else ""
        return Verdict(NA, crit, f"no dead memory in any mined layer{act}")
    verdict, meas, _ = _rise(df, top, bottom, "dead", "mined")
    return Verdict(verdict, crit, meas + " (Voita et al.: over 70% in some early layers of OPT-66B)")


@judged
def prediction(census_layers, n_layers: int | None = None) -> Verdict:
    """Gurnee et al.: prediction neurons become common in the later half of GPT-2."""
    df = frame(census_layers, "census_layers", "census")
    crit = (f"same trend when the share of prediction memories (high kurtosis, positive skew of cos(W_U, v)) "
            f"pooled over the top third is higher than over the bottom third ({THIRDS}; the difference's 95% "
            f"interval above 0) and the top third's share is above its random-direction chance share (Wilson "
            f"interval above it); differs when the interval lies below 0; inconclusive otherwise")
    n_layers = n_layers or n_layers_of(df, None)
    _, bottom, _, top = layer_thirds(df, n_layers, "census_layers")
    verdict, meas = _rise_above_chance(df, bottom, top, "prediction")
    return Verdict(verdict, crit, meas)


@judged
def suppression(census_layers, n_layers: int | None = None) -> Verdict:
    """Gurnee et al.: suppression neurons appear in the last layers, where they outnumber prediction ones."""
    df = frame(census_layers, "census_layers", "census")
    crit = (f"same trend when the share of suppression memories (high kurtosis, negative skew of cos(W_U, v)) "
            f"pooled over the top third is higher than over the rest of the layers ({THIRDS}; the difference's "
            f"95% interval above 0) and above its random-direction chance share; differs when the interval lies "
            f"below 0; inconclusive otherwise. The last layer's suppression and prediction shares are shown "
            f"beside it (Gurnee et al.: suppression outnumbers prediction there)")
    n_layers = n_layers or n_layers_of(df, None)
    _, bottom, middle, top = layer_thirds(df, n_layers, "census_layers")
    verdict, meas = _rise_above_chance(df, bottom + middle, top, "suppression")
    last = df.loc[df["layer"].idxmax()]
    return Verdict(verdict, crit, meas + f"; last layer "
                   f"{int(last['layer'])}: suppression {pct_na(float(last['suppression']), 1)} vs prediction "
                   f"{pct_na(float(last['prediction']), 1)}")


@judged
def io(census_layers, n_layers: int | None = None) -> Verdict:
    """Gerstner & Schütze: enrichment dominates the early and middle layers, depletion the later ones."""
    df = frame(census_layers, "census_layers", "census")
    crit = (f"same trend when both hold: the enrichment share pooled over the bottom two thirds is higher than over "
            f"the top third, and the depletion share over the top third is higher than over the bottom two thirds "
            f"({THIRDS}; each difference's 95% interval above 0); differs when either interval lies below 0; "
            f"inconclusive otherwise. Shuffled-pairing chance shares beside them")
    n_layers = n_layers or n_layers_of(df, None)
    _, bottom, middle, top = layer_thirds(df, n_layers, "census_layers")
    early = bottom + middle
    v1, m1, _ = _rise(df, top, early, "enrichment")
    v2, m2, _ = _rise(df, early, top, "depletion")
    verdict = SAME if v1 == v2 == SAME else DIFFERS if DIFFERS in (v1, v2) else INCONCLUSIVE
    ch = f"chance (shuffled pairs) enrichment {pct_na(_chance(df, early, 'enrichment'), 2)}, depletion " \
         f"{pct_na(_chance(df, top, 'depletion'), 2)}"
    return Verdict(verdict, crit, f"{m1}; {m2}; {ch}")


def records(census_layers, n_layers: int | None = None, activation: str | None = None) -> list[tuple[str, Verdict]]:
    """[(id, Verdict)] of every census verdict."""
    return [("census_dead", dead(census_layers, n_layers, activation)),
            ("census_prediction", prediction(census_layers, n_layers)),
            ("census_suppression", suppression(census_layers, n_layers)),
            ("census_io", io(census_layers, n_layers))]
