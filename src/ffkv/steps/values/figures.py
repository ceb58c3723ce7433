"""The `values` step's figures: Figs 4-6, each lens of the run drawn, the run's own first."""
from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from ffkv.defs import lens_name
from ffkv.report.figures import finish, legend_below, lines_by_lens, new_figure, reference, styled
from ffkv.steps.values.paper import FIG4


# ---- Fig 4 ---------------------------------------------------------------------------------------------
def _lens_tag(lens: str | None) -> str:
    if not lens:
        return ""
    return f", {lens_name(lens)}"


@styled
def fig4(df: pd.DataFrame, primary: str | None = None) -> Figure:
    """Agreement per layer; a table with a lens column (`values_lenses`) draws each lens, the
    run's solid with its interval and baselines, the other dotted."""
    fig, ax = new_figure()
    for lens, d, first in lines_by_lens(df, primary):
        ax.plot(d["layer"], d["agreement"] * 100, "o-" if first else "o:", ms=3.5, color="C0" if first else "C3",
                alpha=1 if first else 0.7, label=f"agreement{_lens_tag(lens)}")
        if first:
            ax.fill_between(d["layer"], d["ci_low"] * 100, d["ci_high"] * 100, alpha=0.2, label="95% CI (Wilson)")
            ax.plot(d["layer"], d["shuffled"] * 100, "--", color="gray", label="shuffled pairing")
            ax.plot(d["layer"], d["random_baseline"] * 100, ":", color="black", label="random (1/|V|)")
    reference(ax, FIG4.reference)
    return finish(fig, ax, df["layer"], "agreement rate (%)",
                   "Value's top token = next token of the key's top trigger")


# ---- Fig 5 ---------------------------------------------------------------------------------------------
@styled
def fig5(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in lines_by_lens(df, primary):
        x, tag = d["layer"], _lens_tag(lens)
        if first:
            ax.fill_between(x, d["rank_q10"] + 1, d["rank_q90"] + 1, alpha=0.12, color="C0", label=f"10–90%{tag}")
            ax.fill_between(x, d["rank_q25"] + 1, d["rank_q75"] + 1, alpha=0.25, color="C0", label=f"25–75%{tag}")
        ax.plot(x, d["rank_median"] + 1, "o-" if first else "o:", ms=3.5, color="C0" if first else "C3",
                alpha=1 if first else 0.7, label=f"median{tag}")
        if "shuffled_rank_median" in d.columns:
            ax.plot(x, d["shuffled_rank_median"] + 1, "--" if first else ":", color="gray",
                    alpha=1 if first else 0.6, label=f"median, shuffled pairing{tag}")
    ax.set_yscale("log")
    return finish(fig, ax, df["layer"], "rank of the next token + 1 (log)",
                   "Rank of the trigger's next token in the value's distribution")


# ---- Fig 6 ---------------------------------------------------------------------------------------------
@styled
def fig6(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in lines_by_lens(df[df["n"] > 0], primary, by="bin"):
        ax.errorbar(d["mean_max_prob"], d["agreement"] * 100,
                    yerr=[(d["agreement"] - d["ci_low"]).clip(lower=0) * 100,
                          (d["ci_high"] - d["agreement"]).clip(lower=0) * 100],
                    fmt="o-" if first else "o:", ms=3.5, capsize=2, color="C0" if first else "C3",
                    alpha=1 if first else 0.6, label=f"agreement{_lens_tag(lens)}")
    ax.set_xscale("log")
    ax.set_xlabel("value's max probability (bin mean, quantile bins, log)")
    ax.set_ylabel("agreement rate (%)")
    ax.set_title("Agreement by the value's max probability")
    ax.grid(alpha=0.3)
    if "lens" in df.columns:
        legend_below(fig, ax)
    return fig
