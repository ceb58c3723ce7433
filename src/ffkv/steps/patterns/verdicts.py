"""The `patterns` step's verdicts: Fig 2 (shallow patterns below, semantic ones above, from the
automatic labels or the run's annotations) and Table 1 (examples: shown, not judged). Pure; the
shared statistics are `ffkv.report.stats`."""
from __future__ import annotations

from ffkv.report.stats import (
    DIFFERS, INCONCLUSIVE, NA, SAME, THIRDS, Verdict, as_frame, by_interval, diff_ci, frame, judged,
    layer_thirds, missing, n_layers_of, pct_na, span, weighted)


# ---- Fig 2 ---------------------------------------------------------------------------------------------
@judged
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
    n_layers = n_layers or n_layers_of(df, None)
    df = df[df["prefixes"] > 0]
    t = layer_thirds(df, n_layers, f"the {source} Fig 2 table")
    _, bottom, _, top = t
    sh_b, sh_t = weighted(df, bottom, "shallow", "prefixes"), weighted(df, top, "shallow", "prefixes")
    se_b, se_t = weighted(df, bottom, "semantic", "prefixes"), weighted(df, top, "semantic", "prefixes")
    cov = 1 - weighted(df, sorted(df["layer"]), "not_covered", "prefixes")
    n_b = float(df[df["layer"].isin(bottom)]["prefixes"].sum())
    n_t = float(df[df["layer"].isin(top)]["prefixes"].sum())
    d1 = diff_ci(sh_b * n_b, n_b, sh_t * n_t, n_t)  # shallow: bottom − top
    d2 = diff_ci(se_t * n_t, n_t, se_b * n_b, n_b)  # semantic: top − bottom
    v1, v2 = by_interval(d1[1], d1[2]), by_interval(d2[1], d2[2])
    verdict = DIFFERS if DIFFERS in (v1, v2) else SAME if v1 == v2 == SAME else INCONCLUSIVE
    meas = (f"shallow only {pct_na(sh_b)} (layers {span(bottom)}) vs {pct_na(sh_t)} (layers {span(top)}), "
            f"difference {d1[0]:+.3f} [{d1[1]:+.3f}, {d1[2]:+.3f}]; semantic only {pct_na(se_b)} vs {pct_na(se_t)}, "
            f"difference {d2[0]:+.3f} [{d2[1]:+.3f}, {d2[2]:+.3f}]; prefixes covered by any pattern: {pct_na(cov)} "
            + ("(the experts' coverage on their sample; paper 65–80%)" if source != "automatic" else
               "(automatic; the paper's 65–80% is human coverage: level not comparable)"))
    if all_keys is not None and len(all_keys):
        ls = sorted(all_keys["layer"])
        shallow_all = weighted(all_keys, ls, "shallow", "prefixes")
        if "both" in all_keys.columns:
            shallow_all += weighted(all_keys, ls, "both", "prefixes")
        meas += f"; shallow coverage over all keys: {pct_na(shallow_all)}"
    return Verdict(verdict, crit, meas)


# ---- Table 1 (qualitative) ---------------------------------------------------------------------------
@judged
def table1(pattern_keys) -> Verdict:
    df = frame(pattern_keys, "pattern_keys", "patterns")
    crit = "not judged: Table 1 is a set of examples; compare by reading"
    if df.empty:
        return Verdict(NA, crit, "no keys analysed")
    with_p = float((df["n_patterns"] > 0).mean())
    return Verdict(NA, crit, f"{len(df):,} keys analysed, {pct_na(with_p)} with at least one automatic pattern "
                             f"(paper: every annotated key had one)")
