"""What the report's figures share: the style, saving, alt texts and the paper's levels (matplotlib).

Figures are drawn on the Agg canvas directly (no pyplot, so no global state and no GUI backend).

Each step's `figN(...)` takes the table(s) as pandas DataFrames and returns a matplotlib Figure; `save`
writes it as PNG at twice the layout's resolution (`SCALE`: sharp on high-density screens; the page
shows it at its 1× size) and SVG (text as paths, so the file needs no font), and describes it in
words for the page's alt text (`describe`). Text is at least 9 pt (`MIN_PT`), legends sit outside
the axes (below them) so they never cover data, and the paper's stated levels
(`ffkv.report.paper.Paper.reference`) are drawn where a figure has one. Layers are 0-based on every
axis, as in the tables. The figures themselves are the steps' (`src/ffkv/steps/<name>/figures.py`).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 90  # the layout's resolution: a 6.4-inch figure is 576 CSS px on the page
SCALE = 2  # the PNG holds SCALE × the layout's pixels
MIN_PT = 9  # the smallest text in a figure (tick labels, legends), in points
SIZE = (6.4, 3.5)
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
            # laid out once: the SVG keeps the PNG's layout (in inches, whatever the DPI) instead of
            # running the constrained layout's text measuring again, a third of a figure's time
            fig.set_layout_engine("none")
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


def reference(ax, ref: dict | None) -> None:
    """The paper's stated level (`ffkv.report.paper.Paper.reference`), as a dashed line or a band."""
    if ref is None:
        return
    if "band" in ref:
        lo, hi = ref["band"]
        ax.axhspan(lo, hi, color="#E4E4E4", zorder=0, label=ref["label"], gid=REFERENCE_GID)
    else:
        ax.axhline(ref["line"], color="black", lw=0.9, ls="--", zorder=1.5, label=ref["label"], gid=REFERENCE_GID)


def finish(fig, ax, layers, ylabel: str, title: str, ylim=None, legend_below_axes: bool = True) -> Figure:
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


def lines_by_lens(df: pd.DataFrame, primary: str | None, by: str = "layer"):
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
