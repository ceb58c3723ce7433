"""The `mine` step's report section: key activation profiles (density per layer, a few keys'
activation histograms), from the pass's key statistics.

Reads the `key_stats` and `key_hist` tables (`ffkv.mine.stats`) through the read API, and
`values_agreement` (the `values` step) to pick the keys shown: the top-agreement key of a low,
a middle and a high layer (an agreeing memory with the highest probability of its trigger's next
token; without the values step, the key with the strongest coefficient). Runs mined before key
statistics existed, or with --no-stats, have no section (`section` returns None).

`sections(run, fig_dir)` is the step's `Step.sections`; the figure functions are pure.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ffkv.report import figures as F
from ffkv.report.html import esc, mem, table
from ffkv.store import query

TITLE = "Key activation profiles (beyond the paper)"
SIGN_COLOR = {1: "#4C72B0", -1: "#C44E52"}


def _side_name(sign: int) -> str:
    return "m > 0" if sign == 1 else "m < 0"


STRONG_FLOOR = 1e-4  # the right panel's log axis starts here; a key never that strong counts in the first bin
DEPTH_COLORS = ("#4C72B0", "#DD8452", "#55A868")


def depth_groups(layers) -> list[tuple[str, list[int]]]:
    """The run's layers in three groups by depth (low, middle, high thirds), each named by its range."""
    ls = sorted({int(l) for l in layers})
    if not ls:
        return []
    parts = [p for p in np.array_split(np.asarray(ls), min(3, len(ls))) if len(p)]
    names = ("low", "middle", "high") if len(parts) == 3 else ("low", "high") if len(parts) == 2 else ("all",)
    return [(f"{name} layers {int(p[0])}–{int(p[-1])}" if len(p) > 1 else f"{name} layer {int(p[0])}", p.tolist())
            for name, p in zip(names, parts)]


@F.styled
def density_figure(per_key: pd.DataFrame):
    """How many keys are active how often: histograms over keys (share of keys, %) of the density
    (share of tokens with m > 0, left) and of the share of tokens above 10% of the key's own extreme
    (right, log scale), for a low, a middle and a high third of the layers (the m > 0 side).

    per_key: key_stats rows with layer, sign, frac_active, frac_strong."""
    from matplotlib.ticker import PercentFormatter

    d = per_key[per_key["sign"] == 1] if "sign" in per_key.columns else per_key
    fig, (a1, a2) = F.new_panels(2, size=(7.6, 3.3))
    lin = np.linspace(0, 1, 41)
    logb = np.logspace(np.log10(STRONG_FLOOR), 0, 33)
    for (name, ls), c in zip(depth_groups(d["layer"]), DEPTH_COLORS):
        g = d[d["layer"].isin(ls)]
        if not len(g):
            continue
        w = np.full(len(g), 100.0 / len(g))
        fa = g["frac_active"].to_numpy(dtype=float)
        fs = np.clip(g["frac_strong"].to_numpy(dtype=float), STRONG_FLOOR, 1)
        a1.hist(fa, bins=lin, weights=w, histtype="step", lw=1.4, color=c,
                label=f"{name} ({len(g):,} keys, median {np.median(fa):.1%} / {np.median(g['frac_strong']):.2%})")
        a2.hist(fs, bins=logb, weights=w, histtype="step", lw=1.4, color=c, label=name)
    a1.set_xlabel("density: share of tokens with m > 0")
    a1.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    a2.set_xscale("log")
    a2.set_xlabel("share of tokens with m > 10% of the key's max\n(below 10⁻⁴: in the first bin)")
    for ax in (a1, a2):
        ax.set_ylabel("% of the keys")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("How often each key is active, over the keys of a low, a middle and a high third of the layers")
    F.legend_below(fig, a1, ncol=1)
    return fig


def bin_labels(layout: dict) -> list[str]:
    """Short label of each bin: its |m| bound nearer zero, signed; '0' and '±tiny' near zero."""
    out = []
    lo_nonzero = min(l for l, s in zip(layout["lo"], layout["sign"]) if s != 0)
    for sg, lo in zip(layout["sign"], layout["lo"]):
        if sg == 0:
            out.append("0")
        elif lo == lo_nonzero:
            out.append("+tiny" if sg > 0 else "-tiny")
        else:
            out.append(f"${'-' if sg < 0 else ''}2^{{{int(round(np.log2(lo)))}}}$")
    return out


@F.styled
def histograms_figure(keys: list[dict], layout: dict):
    """One panel per key: its signed log2-binned histogram (counts on a log scale), bins in value order.

    keys: dicts with layer, dim, label and count (a list over every bin)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = max(len(keys), 1)
    fig = Figure(figsize=(6.4, 2.0 * n + 0.4), dpi=F.DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    sign = np.asarray(layout["sign"])
    colors = [SIGN_COLOR.get(int(s), "#8C8C8C") for s in sign]
    x = np.arange(len(sign))
    labels = bin_labels(layout)
    for ax, k in zip(axes, keys):
        count = np.asarray(k["count"], float)
        nz = count > 0  # a log axis: empty bins are drawn as nothing (no bar, no "0" tick)
        ax.bar(x[nz], count[nz], color=[c for c, z in zip(colors, nz) if z], width=0.9)
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.7)
        ax.set_title(f"key {k['layer']}/{k['dim']}: {k.get('label', '')}", fontsize=F.MIN_PT)
        ax.set_ylabel("tokens (log)")
        zero = int(np.flatnonzero(sign == 0)[0])
        ticks = [i for i in x if (i - zero) % 4 == 0]
        ax.set_xticks(ticks, [labels[i] for i in ticks], fontsize=F.MIN_PT)
        ax.set_xlim(-0.6, len(x) - 0.4)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xlabel("coefficient m (log2 bins; a tick marks the bin's bound nearer zero)")
    return fig


def pick_keys(run, layers: list[int]) -> list[dict]:
    """The top-agreement key of a low, a middle and a high layer (see the module docstring)."""
    if not layers:
        return []
    ls = sorted(set(layers))
    chosen = sorted({ls[0], ls[len(ls) // 2], ls[-1]})
    out = []
    ag = None
    if run.has_table("values_agreement"):
        ag = query.table(run, "values_agreement", columns=["layer", "dim", "agree", "target_prob", "max_prob"],
                         filters=[("layer", "in", chosen)]).to_pandas()
    for where, l in zip(("low", "middle", "high") if len(chosen) == 3 else ("",) * len(chosen), chosen):
        label = None
        if ag is not None:
            d = ag[(ag.layer == l) & ag["agree"].fillna(False).astype(bool)]
            if len(d):
                r = d.sort_values(["target_prob", "dim"], ascending=[False, True]).iloc[0]
                label = f"{where} layer, top agreement (p(next token) = {float(r.target_prob):.2f})"
                out.append({"layer": int(l), "dim": int(r.dim), "label": label})
                continue
        st = query.table(run, "key_stats", columns=["layer", "dim", "sign", "max"],
                         filters=[("layer", "=", int(l)), ("sign", "=", 1)]).to_pandas()
        if len(st):
            r = st.sort_values(["max", "dim"], ascending=[False, True]).iloc[0]
            out.append({"layer": int(l), "dim": int(r.dim), "label": f"{where} layer, strongest key (no values step)"})
    return out


def content(run) -> dict | None:
    """The section's data: {"by_layer": DataFrame, "per_key": DataFrame (key_stats' layer, sign,
    frac_active, frac_strong), "keys": [...with count and stats], "layout": dict}."""
    lay = query.stats_layout(run)
    if lay is None:
        return None
    by_layer = query.key_stats_by_layer(run).to_pandas()
    per_key = query.table(run, "key_stats", columns=["layer", "sign", "frac_active", "frac_strong"]).to_pandas()
    keys = []
    for k in pick_keys(run, by_layer["layer"].tolist()):
        h = query.key_hist(run, k["layer"], k["dim"])
        st = {r["sign"]: r for r in query.key_stats(run, k["layer"], k["dim"])}
        keys.append({**k, "count": h["count"], "stats": st})
    return {"by_layer": by_layer, "per_key": per_key, "keys": keys, "layout": lay}


def section(run, fig_dir: Path) -> dict | None:
    """Figures and HTML of the section, or None when the run has no key statistics.

    Returns {"id": "keystats", "title", "figures": [{"png", "svg"}, ...], "html": str}."""
    c = content(run)
    if c is None:
        return None
    figs = [F.save(density_figure(c["per_key"]), fig_dir, "keystats_density")]
    if c["keys"]:
        figs.append(F.save(histograms_figure(c["keys"], c["layout"]), fig_dir, "keystats_hist"))
    rows = []
    for k in c["keys"]:
        for sign, r in sorted(k["stats"].items(), key=lambda kv: -kv[0]):
            rows.append([mem(k["layer"], k["dim"]), f"{sign:+d}", f"{r['frac_active']:.1%}", f"{r['frac_strong']:.2%}",
                         f"{r['max']:+.3g}", "" if r["p50"] is None else f"{r['p50']:+.3g}",
                         "" if r["p99"] is None else f"{r['p99']:+.3g}", f"{r['first_share']:.0%}"])
    b = c["by_layer"]
    pos = b[b.sign == 1]
    first = float(pos["first_token_keys"].mean()) if len(pos) else float("nan")
    html = (f"<p>Every key's coefficient m over every token of the mined corpus, from the same pass as the "
            f"triggers (tables <code>key_stats</code>, <code>key_hist</code>, <code>key_samples</code>). "
            f"Density is the share of tokens with m &gt; 0 (m &lt; 0 for the negative side); for gated FFNs "
            f"\"non-zero\" means nothing, so the share above 10% of the key's own extreme is shown too. "
            f"Quantiles are read from the log2-binned histogram. Keys whose best position is the first token "
            f"in over half of the sentences: {first:.1%} on average per layer.</p>"
            + (table(["key", "sign", "density", "> 10% of max", "max", "p50", "p99", "best at token 0"], rows, raw={0})
               if rows else "")
            + f"<p>{esc(c['layout'].get('rule', ''))}</p>")
    return {"id": "keystats", "title": TITLE, "figures": figs, "html": html}


def sections(run, fig_dir) -> list:
    from ffkv.report.build import figure_html
    from ffkv.steps import ReportSection

    sec = section(run, fig_dir)
    if sec is None:
        return []
    figs = "".join(figure_html(f, sec["title"]) for f in sec["figures"])
    return [ReportSection("keystats", sec["title"], figs + sec["html"], short="Key activations")]
