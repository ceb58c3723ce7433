"""The paper's figures drawn from a run's tables, with matplotlib.

Figures are drawn on the Agg canvas directly (no pyplot, so no global state and no GUI backend).

Each `figN(...)` takes the table(s) as pandas DataFrames and returns a matplotlib Figure; `save`
writes it as PNG (modest DPI, so the self-contained HTML stays small) and SVG (text as paths, so the
file needs no font). Layers are 0-based on every axis, as in the tables.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ffkv.defs import lens_name

DPI = 90
SIZE = (6.4, 3.5)
COLORS = {"shallow": "#4C72B0", "both": "#8172B2", "semantic": "#DD8452", "not_covered": "#CCCCCC",
          "first": "#55A868", "last": "#C44E52", "random": "#8C8C8C",
          "residual": "#4C72B0", "agreement": "#55A868", "composition": "#DD8452", "ffn": "#C44E52"}
RC = {"svg.fonttype": "path", "svg.hashsalt": "ffkv", "font.size": 9, "axes.titlesize": 10,
      "axes.spines.top": False, "axes.spines.right": False}


def new_figure(size=SIZE) -> tuple[Figure, object]:
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def save(fig: Figure, folder: Path, name: str) -> dict[str, Path]:
    """Write `name`.png and `name`.svg into `folder`, each atomically (rendered in memory, then
    temp file + rename: a killed report never leaves a truncated figure); returns both paths."""
    import io

    from ffkv.store.run import atomic_write_bytes

    folder.mkdir(parents=True, exist_ok=True)
    out = {"png": folder / f"{name}.png", "svg": folder / f"{name}.svg"}
    with matplotlib.rc_context(RC):
        for kind, kw in (("png", {"dpi": DPI, "metadata": {"Software": None}}),
                         ("svg", {"metadata": {"Date": None, "Creator": None}})):
            buf = io.BytesIO()
            fig.savefig(buf, format=kind, **kw)
            atomic_write_bytes(out[kind], buf.getvalue())
    return out


def _layer_axis(ax, layers) -> None:
    layers = sorted({int(l) for l in layers})
    ax.set_xlabel("layer (0-based)")
    if len(layers) <= 16:
        ax.set_xticks(layers)
    ax.grid(axis="y", alpha=0.3)


def _finish(fig, ax, layers, ylabel: str, title: str, ylim=None, legend_below: bool = False) -> Figure:
    """The frame every layer-wise figure shares."""
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _layer_axis(ax, layers)
    if legend_below:
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    else:
        ax.legend(fontsize=7)
    return fig


def styled(fn):
    def wrapper(*a, **kw):
        with matplotlib.rc_context(RC):
            return fn(*a, **kw)
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


def _lines_by_lens(df: pd.DataFrame, primary: str | None, by: str = "layer"):
    """(lens, frame sorted by `by`, is_primary), the primary lens first."""
    if "lens" not in df.columns:
        yield None, df.sort_values(by), True
        return
    lenses = list(dict.fromkeys(df["lens"]))
    if primary in lenses:
        lenses.remove(primary)
        lenses.insert(0, primary)
    for i, lens in enumerate(lenses):
        yield lens, df[df["lens"] == lens].sort_values(by), i == 0


# ---- Fig 2 ---------------------------------------------------------------------------------------------
@styled
def fig2(df: pd.DataFrame, title: str = "Pattern kinds of the top-25 trigger prefixes") -> Figure:
    if "scope" in df.columns:
        scope = "semantic_sample" if (df["scope"] == "semantic_sample").any() else "all"
        df = df[df["scope"] == scope]
    df = df.sort_values("layer")
    fig, ax = new_figure()
    bottom = np.zeros(len(df))
    for k, label in (("shallow", "shallow"), ("both", "shallow + semantic"), ("semantic", "semantic"),
                     ("not_covered", "not covered")):
        v = df[k].fillna(0).to_numpy() * 100
        ax.bar(df["layer"], v, bottom=bottom, color=COLORS[k], label=label, width=0.8)
        bottom += v
    return _finish(fig, ax, df["layer"], "% of prefixes", title, ylim=(0, 100), legend_below=True)


# ---- Fig 3 ---------------------------------------------------------------------------------------------
@styled
def fig3(df: pd.DataFrame) -> Figure:
    fig, ax = new_figure()
    offsets = {"first": -0.22, "random": 0.0, "last": 0.22}
    for m, off in offsets.items():
        d = df[df["mutation"] == m].sort_values("layer")
        if d.empty:
            continue
        x = d["layer"].to_numpy() + off
        ax.errorbar(x, d["median"], yerr=[d["median"] - d["q25"], d["q75"] - d["median"]], fmt="o",
                    ms=3.5, capsize=2, color=COLORS[m], label=f"remove {m} token (median, IQR)")
        ax.plot(x, d["mean"], "x", ms=4, color=COLORS[m], alpha=0.6)
    ax.axhline(0, color="black", lw=0.6)
    return _finish(fig, ax, df["layer"], "relative change of the coefficient",
                   "Removing a token from a trigger example (× = mean)")


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
    for lens, d, first in _lines_by_lens(df, primary):
        ax.plot(d["layer"], d["agreement"] * 100, "o-" if first else "o:", ms=3.5, color="C0" if first else "C3",
                alpha=1 if first else 0.7, label=f"agreement{_lens_tag(lens)}")
        if first:
            ax.fill_between(d["layer"], d["ci_low"] * 100, d["ci_high"] * 100, alpha=0.2, label="95% CI (Wilson)")
            ax.plot(d["layer"], d["shuffled"] * 100, "--", color="gray", label="shuffled pairing")
            ax.plot(d["layer"], d["random_baseline"] * 100, ":", color="black", label="random (1/|V|)")
    return _finish(fig, ax, df["layer"], "agreement rate (%)",
                   "Value's top token = next token of the key's top trigger")


# ---- Fig 5 ---------------------------------------------------------------------------------------------
@styled
def fig5(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in _lines_by_lens(df, primary):
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
    return _finish(fig, ax, df["layer"], "rank of the next token + 1 (log)",
                   "Rank of the trigger's next token in the value's distribution")


# ---- Fig 6 ---------------------------------------------------------------------------------------------
@styled
def fig6(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in _lines_by_lens(df[df["n"] > 0], primary, by="bin"):
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
        ax.legend(fontsize=8)
    return fig


# ---- Fig 7 ---------------------------------------------------------------------------------------------
@styled
def fig7(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    lens, d, _ = next(_lines_by_lens(df, primary))  # the fraction does not depend on the lens
    x = d["layer"]
    ax.axhspan(10, 50, color="#EEEEEE", label="paper's range (10–50%)")
    ax.fill_between(x, d["active_p25"] * 100, d["active_p75"] * 100, alpha=0.25, color="C0")
    ax.plot(x, d["active_median"] * 100, "o-", ms=3.5, color="C0", label="m > 0 (median, IQR)")
    if "active_eps_median" in d.columns:
        ax.plot(x, d["active_eps_median"] * 100, "s--", ms=3, color="C1", label="|m| > ε (median)")
    if "n90_median" in d.columns and "d_m" in d.columns and d["n90_median"].notna().any():
        ax.plot(x, d["n90_median"] / d["d_m"] * 100, "^-", ms=3.5, color="C2",
                label="n90: fewest memories with 90% of Σ|m|·‖v‖ (median)")
    return _finish(fig, ax, x, "% of the layer's memories", "Active memories per example", ylim=(0, 100))


# ---- Fig 8 ---------------------------------------------------------------------------------------------
@styled
def fig8(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in _lines_by_lens(df, primary):
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
    ax.axhline(68, color="black", lw=0.8, ls="--", label="paper: ≥ 68%")
    return _finish(fig, ax, df["layer"], "% examples: no memory has top(y)",
                   "The layer's prediction is not any single memory's", ylim=(0, 100))


# ---- Fig 9 ---------------------------------------------------------------------------------------------
@styled
def fig9(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in _lines_by_lens(df, primary):
        tag = f" ({lens} lens)" if lens else ""
        x = list(d["layer"]) + [int(d["layer"].max()) + 1]
        y = list(d["r_matches_final"] * 100) + [float(d["o_matches_final"].iloc[-1]) * 100]
        ax.plot(x, y, "o-" if first else "o:", ms=3.5, color="C0", alpha=1 if first else 0.5,
                label=f"top(r_ℓ) = final{tag}")
    return _finish(fig, ax, df["layer"], "% of examples",
                   "Residual already holds the final prediction (last point: output)", ylim=(0, 105))


# ---- Fig 10 --------------------------------------------------------------------------------------------
@styled
def fig10(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    for lens, d, first in _lines_by_lens(df, primary):
        tag = f" ({lens} lens)" if lens else ""
        if first:
            ax.fill_between(d["layer"], d["p_final_q25"], d["p_final_q75"], alpha=0.2, color="C0",
                            label=f"25–75%{tag}")
        ax.plot(d["layer"], d["p_final_mean"], "o-" if first else "o:", ms=3.5, color="C0",
                alpha=1 if first else 0.5, label=f"mean{tag}")
    return _finish(fig, ax, df["layer"], "p(final prediction | r_ℓ)",
                   "Confidence in the final prediction through the layers", ylim=(0, 1))


# ---- Fig 11 --------------------------------------------------------------------------------------------
@styled
def fig11(df: pd.DataFrame, primary: str | None = None) -> Figure:
    lens, d, _ = next(_lines_by_lens(df, primary))
    fig, ax = new_figure()
    bottom = np.zeros(len(d))
    for k in ("residual", "agreement", "composition", "ffn"):
        v = d[k].fillna(0).to_numpy() * 100
        ax.bar(d["layer"], v, bottom=bottom, color=COLORS[k], label=k, width=0.8)
        bottom += v
    return _finish(fig, ax, d["layer"], "% of examples",
                   "Where top(o) comes from" + (f" ({lens} lens)" if lens else ""),
                   ylim=(0, 100), legend_below=True)
