"""The `mutate` step's verdict: Fig 3 (removing the last token of a trigger lowers its key's
coefficient more than removing the first). Pure; the shared statistics are `ffkv.report.stats`."""
from __future__ import annotations

from ffkv.report.stats import (
    ALPHA, DIFFERS, INCONCLUSIVE, NA, SAME, Verdict, frame, judged, n_layers_of, span, thirds_or_none,
    weighted)


# ---- Fig 3 ---------------------------------------------------------------------------------------------
@judged
def fig3(mutations_layers, n_layers: int | None = None) -> Verdict:
    """`mutations_layers`: layer, mutation (first | last | random), median of the relative change."""
    df = frame(mutations_layers, "mutations_layers", "mutate")
    crit = ("same trend when removing the last token lowers the coefficient more than removing the first "
            "one: the median relative change, averaged over layers, is lower for `last` than for `first`, "
            "with a sign test over layers (last < first in significantly more than half of them, binomial "
            "p < 0.05; inconclusive otherwise). Baseline: removing a random token")
    n_layers = n_layers or n_layers_of(df, None)
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
    t = thirds_or_none(df, n_layers)
    if t is not None:
        _, bottom, _, top = t
        last = df[df["mutation"] == "last"]
        meas += (f"; removing the last token: {weighted(last, bottom, 'median'):+.2f} in layers {span(bottom)} vs "
                 f"{weighted(last, top, 'median'):+.2f} in layers {span(top)} (paper: weaker in upper layers)")
    return Verdict(verdict, crit, meas)
