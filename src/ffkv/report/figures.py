"""The paper's figures drawn from a run's tables, with matplotlib.

Figures are drawn on the Agg canvas directly (no pyplot, so no global state and no GUI backend).

Each `figN(...)` takes the table(s) as pandas DataFrames and returns a matplotlib Figure; `save`
writes it as PNG at twice the layout's resolution (`SCALE`: sharp on high-density screens; the page
shows it at its 1× size) and SVG (text as paths, so the file needs no font), and describes it in
words for the page's alt text (`describe`). Text is at least 9 pt (`MIN_PT`), legends sit outside
the axes (below them) so they never cover data, and the paper's stated levels
(`ffkv.report.paper.REFERENCE`) are drawn where a figure has one. Layers are 0-based on every axis,
as in the tables.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ffkv.defs import lens_name

DPI = 90  # the layout's resolution: a 6.4-inch figure is 576 CSS px on the page
SCALE = 2  # the PNG holds SCALE × the layout's pixels
MIN_PT = 9  # the smallest text in a figure (tick labels, legends), in points
SIZE = (6.4, 3.5)
COLORS = {"shallow": "#4C72B0", "both": "#8172B2", "semantic": "#DD8452", "not_covered": "#CCCCCC",
          "first": "#55A868", "last": "#C44E52", "random": "#8C8C8C",
          "residual": "#4C72B0", "agreement": "#55A868", "composition": "#DD8452", "ffn": "#C44E52"}
RC = {"svg.fonttype": "path", "svg.hashsalt": "ffkv", "font.size": MIN_PT, "axes.titlesize": 10,
      "axes.labelsize": MIN_PT, "xtick.labelsize": MIN_PT, "ytick.labelsize": MIN_PT, "legend.fontsize": MIN_PT,
      "figure.titlesize": 10, "axes.spines.top": False, "axes.spines.right": False}


def new_figure(size=SIZE) -> tuple[Figure, object]:
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def new_panels(n: int, size=(9.0, 3.4)) -> tuple[Figure, list]:
    """A figure of `n` panels side by side (constrained layout)."""
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(np.atleast_1d(fig.subplots(1, n)))


def save(fig: Figure, folder: Path, name: str) -> dict:
    """Write `name`.png (at `SCALE` × `DPI`) and `name`.svg into `folder`, each atomically (rendered
    in memory, then temp file + rename: a killed report never leaves a truncated figure); returns
    both paths and "alt", what the figure shows in words (`describe`)."""
    import io

    from ffkv.store.run import atomic_write_bytes

    folder.mkdir(parents=True, exist_ok=True)
    out = {"png": folder / f"{name}.png", "svg": folder / f"{name}.svg"}
    with matplotlib.rc_context(RC):
        out["alt"] = describe(fig)
        for kind, kw in (("png", {"dpi": DPI * SCALE, "metadata": {"Software": None}}),
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


def legend_below(fig, ax, ncol: int | None = None) -> None:
    """The axes' legend outside them, below the x label (never over the data); the figure grows by
    the legend's rows, so the axes keep their height."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    n = len(handles)
    ncol = ncol or (n if n <= 4 and sum(len(l) for l in labels) < 70 else 2 if max(map(len, labels)) > 30 else 3)
    rows = -(-n // ncol)
    fig.set_figheight(fig.get_figheight() + 0.12 + 0.21 * rows)
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, frameon=False, fontsize=MIN_PT)


REFERENCE_GID = "paper-reference"  # the gid of a drawn reference level (describe names it as one)


def reference(ax, sid: str, horizontal: bool = True) -> None:
    """The paper's stated level for figure `sid` (`paper.REFERENCE`), as a dashed line or a band."""
    from ffkv.report.paper import REFERENCE

    ref = REFERENCE.get(sid)
    if ref is None:
        return
    if "band" in ref:
        lo, hi = ref["band"]
        ax.axhspan(lo, hi, color="#E4E4E4", zorder=0, label=ref["label"], gid=REFERENCE_GID)
    else:
        ax.axhline(ref["line"], color="black", lw=0.9, ls="--", zorder=1.5, label=ref["label"], gid=REFERENCE_GID)


def _finish(fig, ax, layers, ylabel: str, title: str, ylim=None, legend_below_axes: bool = True) -> Figure:
    """The frame every layer-wise figure shares (its legend below the axes)."""
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _layer_axis(ax, layers)
    if legend_below_axes:
        legend_below(fig, ax)
    else:
        ax.legend(loc="best")
    return fig


def _range(values) -> str:
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if not len(v):
        return ""
    lo, hi = float(v.min()), float(v.max())
    return f"{lo:.3g}" if np.isclose(lo, hi) else f"{lo:.3g} to {hi:.3g}"


def _label(artist) -> str:
    """An artist's label, "_" (matplotlib's "unlabelled") when it has none."""
    return str(artist.get_label() or "_")


def describe(fig: Figure) -> str:
    """What a figure shows, in words (its alt text): per panel the kind of chart, the axes (label,
    scale, ticks' range), each legend entry, the range of the plotted values and the reference lines."""
    from matplotlib.collections import PolyCollection
    from matplotlib.container import BarContainer, ErrorbarContainer
    from matplotlib.lines import Line2D

    title = (fig.get_suptitle() if hasattr(fig, "get_suptitle") else "").replace("\n", " ")
    axes = [a for a in fig.axes if _label(a) != "<colorbar>"]
    bars_of = [a for a in fig.axes if _label(a) == "<colorbar>"]
    cbar = (f"coloured by {bars_of[0].get_ylabel() or 'value'} ({_range(bars_of[0].get_ylim())})" if bars_of else "")
    parts = [title.rstrip(".") + "." if title else ""]
    for i, ax in enumerate(axes):
        kinds = []
        bars = [c for c in ax.containers if isinstance(c, BarContainer)]
        errs = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        is_ref = lambda a: a.get_gid() == REFERENCE_GID  # noqa: E731
        lines = [l for l in ax.get_lines() if not _label(l).startswith("_") and len(l.get_xdata()) > 1
                 and not is_ref(l)]
        bar_labels = {_label(b) for b in bars}
        shapes = [p for p in ax.patches if not _label(p).startswith("_") and not is_ref(p)
                  and _label(p) not in bar_labels]
        if bars:
            stacked = len(bars) > 1 and any(getattr(b.patches[0], "get_y", lambda: 0)() != 0 for b in bars[1:] if b.patches)
            kinds.append(("stacked bar chart" if stacked else "bar chart"))
        if errs:
            kinds.append("points with error bars")
        if lines:
            kinds.append("line chart")
        if shapes:
            kinds.append("histograms")
        if any(isinstance(c, PolyCollection) for c in ax.collections):
            kinds.append("shaded bands")
        head = f"Panel {i + 1}" if len(axes) > 1 else "Chart"
        what = " and ".join(dict.fromkeys(kinds)) or "chart"
        t = ax.get_title().replace("\n", " ")
        text = f"{head}: {what}" + (f", '{t}'" if t else "")
        for name, axis, lim in (("x", ax.xaxis, ax.get_xlim()), ("y", ax.yaxis, ax.get_ylim())):
            label = axis.get_label_text()
            scale = axis.get_scale()
            text += (f"; {name} axis: {label or 'unlabelled'}" + (f" ({scale} scale)" if scale != "linear" else "")
                     + f", {lim[0]:.3g} to {lim[1]:.3g}")
        series = []
        for l in lines:
            series.append(f"{_label(l)} ({_range(l.get_ydata())})")
        for c in errs:
            lab = _label(c)
            if lab and not lab.startswith("_"):
                series.append(f"{lab} ({_range(c.lines[0].get_ydata())})")
        for b in bars:
            lab = _label(b)
            if lab and not lab.startswith("_"):
                series.append(f"{lab} ({_range([p.get_height() for p in b.patches])})")
        series += [_label(p) for p in shapes]
        unnamed = [l for l in ax.get_lines() if _label(l).startswith("_") and len(l.get_xdata()) > 1
                   and l.get_linestyle() not in ("None", "", " ")]
        if unnamed and cbar and len(unnamed) > 1:
            series.append(f"{len(unnamed)} lines {cbar}")
        if series:
            text += "; series: " + "; ".join(series)
        refs = [_label(a) for a in list(ax.get_lines()) + list(ax.patches) if is_ref(a)]
        if refs:
            text += "; reference: " + "; ".join(dict.fromkeys(refs))
        parts.append(text + ".")
    return " ".join(p for p in parts if p)


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
    reference(ax, "fig2")
    return _finish(fig, ax, df["layer"], "% of prefixes", title, ylim=(0, 100))


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
    reference(ax, "fig4")
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
        legend_below(fig, ax)
    return fig


# ---- Fig 7 ---------------------------------------------------------------------------------------------
@styled
def fig7(df: pd.DataFrame, primary: str | None = None) -> Figure:
    fig, ax = new_figure()
    lens, d, _ = next(_lines_by_lens(df, primary))  # the fraction does not depend on the lens
    x = d["layer"]
    reference(ax, "fig7")
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
    reference(ax, "fig8")
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
    reference(ax, "fig9")
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
                   ylim=(0, 100))
