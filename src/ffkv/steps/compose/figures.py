"""The `compose` step's figures: Figs 7-11, each lens of the run drawn, the run's own first."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ffkv.report.figures import finish, lines_by_lens, new_figure, reference, styled
from ffkv.steps.compose.paper import FIG7, FIG8, FIG9

COLORS = {"residual": "#4C72B0", "agreement": "#55A868", "composition": "#DD8452", "ffn": "#C44E52"}


# ---- Fig 7 ---------------------------------------------------------------------------------------------
@styled
def fig7(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    lens, d, _ = next(lines_by_lens(df, primary))  # the fraction does not depend on the lens
    x = d["layer"]
    reference(ax, FIG7.reference)
    ax.fill_between(x, d["active_p25"] * 100, d["active_p75"] * 100, alpha=0.25, color="C0")
    ax.plot(x, d["active_median"] * 100, "o-", ms=3.5, color="C0", label="m > 0 (median, IQR)")
    if "active_eps_median" in d.columns:
        ax.plot(x, d["active_eps_median"] * 100, "s--", ms=3, color="C1", label="|m| > ε (median)")
    if "n90_median" in d.columns and "d_m" in d.columns and d["n90_median"].notna().any():
        ax.plot(x, d["n90_median"] / d["d_m"] * 100, "^-", ms=3.5, color="C2",
                label="n90: fewest memories with 90% of Σ|m|·‖v‖ (median)")
    return finish(fig, ax, x, "% of the layer's memories", "Active memories per example", ylim=(0, 100))


# ---- Fig 8 ---------------------------------------------------------------------------------------------
@styled
def fig8(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in lines_by_lens(df, primary):
        ls = "-" if first else ":"
        tag = f" ({lens} lens)" if lens else ""
        ax.plot(d["layer"], d["fig8_no_single_memory"] * 100, "o" + ls, ms=3.5, color="C0",
                alpha=1 if first else 0.5, label=f"paper's form, m > 0{tag}")
        if "fig8_no_single_memory_eps" in d.columns and "fig8_no_match_rel" not in d.columns:
            ax.plot(d["layer"], d["fig8_no_single_memory_eps"] * 100, "s" + ls, ms=3, color="C1",
                    alpha=1 if first else 0.5, label=f"signed form, |m| > ε{tag}")
        if first and "fig8_no_match_rel" in d.columns:  # issue 14's variants, run's lens only
            for col, c, lab in (("signed", "C1", "all m ≠ 0, signed"), ("code", "C3", "paper's code: vs top(o)"),
                                ("rel", "C2", "signed, |m| > 0.1·max|m|")):
                ax.plot(d["layer"], d[f"fig8_no_match_{col}"] * 100, "s-", ms=3, color=c, label=lab)
                ax.plot(d["layer"], d[f"fig8_shuffled_{col}"] * 100, ":", color=c, lw=1,
                        label=f"{lab}, shuffled pairing")
            ax.plot(d["layer"], d["fig8_shuffled_paper"] * 100, ":", color="C0", lw=1, label="m > 0, shuffled pairing")
    reference(ax, FIG8.reference)
    return finish(fig, ax, df["layer"], "% examples: no memory has top(y)",
                   "The layer's prediction is not any single memory's", ylim=(0, 100))


# ---- Fig 9 ---------------------------------------------------------------------------------------------
@styled
def fig9(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in lines_by_lens(df, primary):
        tag = f" ({lens} lens)" if lens else ""
        x = list(d["layer"]) + [int(d["layer"].max()) + 1]
        y = list(d["r_matches_final"] * 100) + [float(d["o_matches_final"].iloc[-1]) * 100]
        ax.plot(x, y, "o-" if first else "o:", ms=3.5, color="C0", alpha=1 if first else 0.5,
                label=f"top(r_ℓ) = final{tag}")
    reference(ax, FIG9.reference)
    return finish(fig, ax, df["layer"], "% of examples",
                   "Residual already holds the final prediction (last point: output)", ylim=(0, 105))


# ---- Fig 10 --------------------------------------------------------------------------------------------
@styled
def fig10(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in lines_by_lens(df, primary):
        tag = f" ({lens} lens)" if lens else ""
        if first:
            ax.fill_between(d["layer"], d["p_final_q25"], d["p_final_q75"], alpha=0.2, color="C0",
                            label=f"25–75%{tag}")
        ax.plot(d["layer"], d["p_final_mean"], "o-" if first else "o:", ms=3.5, color="C0",
                alpha=1 if first else 0.5, label=f"mean{tag}")
    return finish(fig, ax, df["layer"], "p(final prediction | r_ℓ)",
                   "Confidence in the final prediction through the layers", ylim=(0, 1))


# ---- Fig 11 --------------------------------------------------------------------------------------------
@styled
def fig11(df: pd.DataFrame, primary: str | None = None) -> Figure:
    lens, d, _ = next(lines_by_lens(df, primary))
    fig, ax = new_figure()
    bottom = np.zeros(len(d))
    for k in ("residual", "agreement", "composition", "ffn"):
        v = d[k].fillna(0).to_numpy() * 100
        ax.bar(d["layer"], v, bottom=bottom, color=COLORS[k], label=k, width=0.8)
        bottom += v
    return finish(fig, ax, d["layer"], "% of examples",
                   "Where top(o) comes from" + (f" ({lens} lens)" if lens else ""),
                   ylim=(0, 100))
