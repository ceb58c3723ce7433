"""The `normalize` step's report section: one verdict per claim (C1–C5 of seed 004) and one figure
per measure, from the step's tables (`normalize_layers`, `normalize_capacity`, `normalize_variance`;
columns in `ffkv.steps.normalize.compute`).

Verdict functions are pure: tables in (pyarrow Table, DataFrame, list of dicts, or None when the
step was not run), a `Verdict` out whose verdict is HOLDS, NOT_HOLDS or NA, with the criterion in
one sentence and the numbers it was tested on. As for the paper's figures, each criterion compares
against a baseline or a stated band and an interval (2 standard errors, clustered by sentence, of
paired differences; 3 SE for the synthetic variance); a difference inside the interval is "not
comparable". `AS_REPORT` maps the three outcomes onto the report's chips.

`sections(run, fig_dir)` (the step's `Step.sections`, for a run whose step is done): `its =
items(get, fig_dir, gated, run_path)` (`get(name)` returns a table as a DataFrame or None; figures
are saved into fig_dir as norm_c1..norm_c5 .png/.svg), then `section_html(its, fig_rel)` is the
section in the report's markup and `verdict_records(its)` the records for verdicts.json.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ffkv.report.stats import DIFFERS, NA, SAME, Verdict, as_frame, spearman

HOLDS, NOT_HOLDS = "holds", "does not hold"
AS_REPORT = {HOLDS: SAME, NOT_HOLDS: DIFFERS, NA: NA}
PPL_TOLERANCE = 0.05  # C5: "equivalent" = perplexity up by less than 5% with the layer substituted
TAU_EDGES = (2.0 ** -4, 2.0 ** 8)  # the ends of `ffkv.steps.normalize.variants.TAU_GRID` (a test)
SLOPE_BAND = 0.2  # C3/C4: "grows like n" = log-log slope within 1 ± 0.2; "constant" = within 0 ± 0.2
GATED_NOTE = ("Gated FFN: the coefficients are signed (m = f(x·g)·(x·u)), so the softmax memory is "
              "sign(m)·softmax(|m|/τ), and the scaled ReLU replaces the activation f by a ReLU, "
              "ReLU(x·g)·(x·u)/(γ·√(d_m/2)); the concentration is that of |m|.")


def _missing(step_table: str) -> Verdict:
    return Verdict(NA, f"needs the `{step_table}` table, which `ffkv normalize RUN` creates", "the step was not run")


def _majority(n_yes: int, n_no: int, total: int) -> str:
    return HOLDS if n_yes * 2 > total else NOT_HOLDS if n_no * 2 > total else NA


def _span(ls) -> str:
    ls = sorted(int(l) for l in ls)
    return "none" if not ls else f"{ls[0]}–{ls[-1]}" if len(ls) > 1 else f"{ls[0]}"


# ---- C1 ------------------------------------------------------------------------------------------------
def c1(normalize_layers) -> Verdict:
    """Softmax at the fitted τ vs the model's own coefficient mass: entropy and top-10 share."""
    df = as_frame(normalize_layers)
    if df is None:
        return _missing("normalize_layers")
    crit = ("holds when the softmax memory's weights, at the τ fit to reproduce the FFN output, are more "
            "concentrated than the model's own coefficient mass |m|/Σ|m| (lower entropy by more than 2 SE, "
            "paired over held-out tokens, clustered by sentence) in more than half of the layers; does not "
            "hold when they are less concentrated (higher entropy by more than 2 SE) in more than half")
    d = df[df["variant"] == "softmax"].sort_values("layer")
    if d.empty:
        return Verdict(NA, crit, "no softmax rows")
    diff = d["entropy_w"] - d["entropy_m"]
    more, less = int((diff < -2 * d["entropy_diff_se"]).sum()), int((diff > 2 * d["entropy_diff_se"]).sum())
    meas = (f"softmax more concentrated in {more} of {len(d)} layers, less in {less}; mean entropy "
            f"{d['entropy_m'].mean():.2f} nats for |m| vs {d['entropy_w'].mean():.2f} for softmax (uniform: "
            f"{float(d['entropy_uniform'].iloc[0]):.2f}); top-10 share {100 * d['top10_m'].mean():.1f}% vs "
            f"{100 * d['top10_w'].mean():.1f}%; fitted τ = {d['tau_rel'].median():.2g} × RMS|m| (median)")
    return Verdict(_majority(more, less, len(d)), crit, meas)


# ---- C2 ------------------------------------------------------------------------------------------------
def c2(normalize_capacity) -> Verdict:
    """The capacity sweep: does softmax's loss gap to the original activation widen with n?"""
    df = as_frame(normalize_capacity)
    if df is None:
        return _missing("normalize_capacity")
    crit = ("holds when the loss gap between the softmax memory and the model's own activation, both "
            "restricted to n slots, widens from the smallest to the largest n (by more than 2 SE, paired by "
            "sentence, with a positive Spearman ρ between n and the gap) in more than half of the swept "
            "(layer, selection) pairs; does not hold when it narrows by more than 2 SE in more than half")
    if df.empty:
        return Verdict(NA, crit, "no capacity sweep (`--capacity-layers` was empty or `--sweep-tokens 0`)")
    widen = narrow = 0
    parts = []
    groups = list(df.sort_values("n").groupby(["layer", "selection"], sort=True))
    for (layer, sel), g in groups:
        last = g.iloc[-1]
        rho = spearman(g["n"], g["gap"])
        up = last["gap_change"] > 2 * last["gap_change_se"] and rho > 0
        widen += bool(up)
        narrow += bool(last["gap_change"] < -2 * last["gap_change_se"])
        parts.append(f"layer {int(layer)} {sel}: {g['gap'].iloc[0]:+.2f} → {last['gap']:+.2f}")
    meas = (f"gap widens in {widen} of {len(groups)} pairs, narrows in {narrow}; gap (nats) from n = "
            f"{int(df['n'].min())} to {int(df['n'].max())}: " + "; ".join(parts))
    return Verdict(_majority(widen, narrow, len(groups)), crit, meas)


# ---- C3, C4 --------------------------------------------------------------------------------------------
def _synthetic_ok(df: pd.DataFrame, kind: str) -> tuple[bool, str]:
    s = df[(df["source"] == "synthetic") & (df["kind"] == kind)].sort_values("n")
    z = (s["variance"] - s["expected"]).abs() / s["se"]
    worst = s.loc[z.idxmax()]
    return bool((z <= 3).all()), (f"synthetic: within 3 SE of {'n/2' if kind == 'raw' else '1/γ²'} at "
                                  f"{int((z <= 3).sum())} of {len(s)} n from {int(s['n'].min())} to "
                                  f"{int(s['n'].max())} (worst n = {int(worst['n'])}: {float(z.max()):.1f} SE)")


def layer_slopes(df: pd.DataFrame, kind: str) -> pd.Series:
    """Per layer, the least-squares slope of log variance against log n (model rows of `kind`)."""
    m = df[(df["source"] == "model") & (df["kind"] == kind) & (df["variance"] > 0)]
    return m.groupby("layer").apply(lambda g: float(np.polyfit(np.log(g["n"]), np.log(g["variance"]), 1)[0])
                                    if len(g) > 1 else float("nan"), include_groups=False).dropna()


def _slope_verdict(df: pd.DataFrame, kind: str, target: float) -> tuple[str, str]:
    """(outcome, text) of the mean slope over layers against target ± SLOPE_BAND (95% t-interval)."""
    from scipy import stats

    sl = layer_slopes(df, kind)
    if len(sl) < 2:
        return NA, f"on the model: {len(sl)} layer(s) with a slope; need 2"
    mean, se = float(sl.mean()), float(sl.std(ddof=1) / math.sqrt(len(sl)))
    h = float(stats.t.ppf(0.975, len(sl) - 1)) * se
    lo, hi = mean - h, mean + h
    inside = target - SLOPE_BAND <= lo and hi <= target + SLOPE_BAND
    outside = hi < target - SLOPE_BAND or lo > target + SLOPE_BAND
    return (HOLDS if inside else NOT_HOLDS if outside else NA,
            f"on the model: log-log slope {mean:.2f} (95% CI {lo:.2f}–{hi:.2f}, {len(sl)} layers, "
            f"range {sl.min():.2f}–{sl.max():.2f})")


def _variance_claim(normalize_variance, kind: str, target: float, crit: str) -> Verdict:
    df = as_frame(normalize_variance)
    if df is None:
        return _missing("normalize_variance")
    if not (df["source"] == "synthetic").any():
        return Verdict(NA, crit, "no synthetic rows")
    syn_ok, syn_text = _synthetic_ok(df, kind)
    model, model_text = _slope_verdict(df, kind, target)
    outcome = NOT_HOLDS if not syn_ok or model == NOT_HOLDS else model
    return Verdict(outcome, crit, f"{syn_text}; {model_text}")


def c3(normalize_variance) -> Verdict:
    crit = ("holds when the synthetic ReLU memory's output variance is within 3 SE of n/2 at every n, and "
            "on the model the variance of Σ_{i∈S} m_i·v_i over random subsets grows like |S|: the 95% "
            f"interval of the mean log-log slope over layers lies within 1 ± {SLOPE_BAND}; does not hold "
            "when the synthetic check fails or the interval lies outside that band")
    return _variance_claim(normalize_variance, "raw", 1.0, crit)


def c4(normalize_variance) -> Verdict:
    crit = ("holds when the synthetic scaled ReLU memory's variance is within 3 SE of 1/γ² at every n, and "
            "on the model the variance scaled by 1/(γ²·|S|/2) stays flat: the 95% interval of the mean "
            f"log-log slope over layers lies within 0 ± {SLOPE_BAND}; does not hold when the synthetic check "
            "fails or the interval lies outside that band")
    return _variance_claim(normalize_variance, "scaled", 0.0, crit)


# ---- C5 ------------------------------------------------------------------------------------------------
def c5(normalize_layers) -> Verdict:
    """Is a softmax memory followed by a (fitted) layer-norm scale a stand-in for the FFN?"""
    df = as_frame(normalize_layers)
    if df is None:
        return _missing("normalize_layers")
    tol = math.log1p(PPL_TOLERANCE)
    crit = (f"holds when substituting any one layer's FFN by the softmax memory, rescaled to the FFN's RMS "
            f"output norm (τ and scale fit on a separate split), raises the held-out loss by less than "
            f"ln {1 + PPL_TOLERANCE:g} = {tol:.3f} nats (perplexity +{100 * PPL_TOLERANCE:g}%) even at 2 SE above "
            f"the measured increase, in every layer; does not hold when the increase exceeds that by more than "
            f"2 SE in more than half of the layers")
    d = df[df["variant"] == "softmax"].sort_values("layer")
    if d.empty:
        return Verdict(NA, crit, "no softmax rows")
    ok = d["delta_loss"] + 2 * d["delta_loss_se"] < tol
    bad = d["delta_loss"] - 2 * d["delta_loss_se"] > tol
    outcome = HOLDS if ok.all() else NOT_HOLDS if bad.sum() * 2 > len(d) else NA
    worst = d.loc[d["delta_loss"].idxmax()]
    r = df[df["variant"] == "scaled_relu"]
    meas = (f"loss up by more than the tolerance in {int(bad.sum())} of {len(d)} layers, within it in "
            f"{int(ok.sum())}; median increase {d['delta_loss'].median():+.3f} nats, worst layer "
            f"{int(worst['layer'])}: {worst['delta_loss']:+.3f} (perplexity {worst['ppl_intact']:.1f} → "
            f"{worst['ppl']:.1f}); scaled ReLU for reference: median {r['delta_loss'].median():+.3f} nats")
    return Verdict(outcome, crit, meas)


# ---- figures ---------------------------------------------------------------------------------------------
VARIANT_COLORS = {"m": "#4C72B0", "softmax": "#C44E52", "scaled_relu": "#55A868", "original": "#4C72B0"}
LABELS = {"m": "model's own |m|", "softmax": "softmax memory", "scaled_relu": "scaled ReLU"}


def _panels(n: int, size=(9.0, 3.4)):
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ffkv.report.figures import DPI, RC

    with matplotlib.rc_context(RC):
        fig = Figure(figsize=size, dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, n)
    return fig, list(np.atleast_1d(axes))


def log2_ticks(ns: list[int], gap: float = 1.0) -> list[int]:
    """Of sorted tick values on a log2 axis, those at least `gap` octaves apart (the largest always
    kept, replacing its too-close neighbour): labels that never run into each other ("10241536")."""
    keep: list[int] = []
    for n in ns:
        if not keep or math.log2(n) - math.log2(keep[-1]) >= gap:
            keep.append(n)
    if ns and keep[-1] != ns[-1]:
        if len(keep) > 1:
            keep[-1] = ns[-1]
        else:
            keep.append(ns[-1])
    return keep


def _legend_below(fig, ax) -> None:
    from ffkv.report.figures import legend_below

    legend_below(fig, ax)


def _layer_ticks(ax, label: str = "layer (0-based)") -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(label)


def _styled(fn):
    """figures' style, imported when a plot is drawn (verdicts alone need no matplotlib)."""
    def wrapper(*a, **kw):
        from ffkv.report.figures import styled

        return styled(fn)(*a, **kw)
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


@_styled
def fig_concentration(normalize_layers):
    """C1: entropy and top-10 share per layer, the model's |m| against each variant's weights."""
    df = as_frame(normalize_layers).sort_values("layer")
    fig, (a1, a2) = _panels(2)
    base = df[df["variant"] == "softmax"]
    for ax, st, ylabel in ((a1, "entropy", "entropy (nats)"), (a2, "top10", "share of the top 10 memories")):
        ax.plot(base["layer"], base[f"{st}_m"], "o-", ms=3, color=VARIANT_COLORS["m"], label=LABELS["m"])
        for v in ("softmax", "scaled_relu"):
            d = df[df["variant"] == v]
            ax.errorbar(d["layer"], d[f"{st}_w"], yerr=2 * d[f"{st}_diff_se"], fmt="o-", ms=3, capsize=2,
                        color=VARIANT_COLORS[v], label=LABELS[v])
        _layer_ticks(ax)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    a1.axhline(float(df["entropy_uniform"].iloc[0]), color="#8C8C8C", ls=":", lw=1, label="uniform")
    fig.suptitle("How concentrated the memory weights are (held-out tokens; bars: 2 SE of the paired difference)")
    _legend_below(fig, a1)
    return fig


@_styled
def fig_substitution(normalize_layers):
    """C5 (and C2): loss increase with one layer's FFN substituted, per layer and variant."""
    from ffkv.report.figures import new_figure

    df = as_frame(normalize_layers).sort_values("layer")
    fig, ax = new_figure()
    for v in ("softmax", "scaled_relu"):
        d = df[df["variant"] == v]
        ax.errorbar(d["layer"], d["delta_loss"], yerr=2 * d["delta_loss_se"], fmt="o-", ms=3, capsize=2,
                    color=VARIANT_COLORS[v], label=LABELS[v])
    ax.axhline(0, color="#333333", lw=0.8)
    ax.axhline(math.log1p(PPL_TOLERANCE), color="#8C8C8C", ls=":", lw=1,
               label=f"+{100 * PPL_TOLERANCE:g}% perplexity")
    if (df["delta_loss"] > 0).any() and df["delta_loss"].max() / max(df["delta_loss"].abs().min(), 1e-9) > 100:
        ax.set_yscale("symlog", linthresh=0.01)
    _layer_ticks(ax, "layer substituted (0-based)")
    ax.set_ylabel("held-out loss − intact (nats)")
    ax.set_title(f"One FFN replaced at a time (intact loss {df['loss_intact'].iloc[0]:.3f} nats; bars: 2 SE)")
    ax.grid(axis="y", alpha=0.3)
    _legend_below(fig, ax)
    return fig


@_styled
def fig_capacity(normalize_capacity):
    """C2: the softmax − original loss gap against the number of slots n, per layer and selection."""
    from matplotlib.ticker import NullFormatter

    df = as_frame(normalize_capacity)
    fig, axes = _panels(2)
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2", "#8C8C8C"]
    for ax, sel in zip(axes, ("random", "top")):
        d = df[df["selection"] == sel]
        for i, (layer, g) in enumerate(d.sort_values("n").groupby("layer")):
            ax.errorbar(g["n"], g["gap"], yerr=2 * g["gap_se"], fmt="o-", ms=3, capsize=2,
                        color=colors[i % len(colors)], label=f"layer {int(layer)}")
        ax.axhline(0, color="#333333", lw=0.8)
        ax.set_xscale("log", base=2)
        ns = log2_ticks(sorted(int(n) for n in df["n"].unique()))
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("memories kept, n")
        ax.set_ylabel("loss(softmax) − loss(original) (nats)")
        ax.set_title(f"{'a fixed random draw' if sel == 'random' else 'each token’s top n by |m|'}")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Capacity: the softmax memory's loss gap as the slots grow (bars: 2 SE)")
    _legend_below(fig, max(axes, key=lambda a: len(a.get_legend_handles_labels()[0])))
    return fig


@_styled
def fig_variance(normalize_variance, kind: str = "raw"):
    """C3 (kind raw) / C4 (kind scaled): variance against n, synthetic (left) and the model (right)."""
    df = as_frame(normalize_variance)
    fig, (a1, a2) = _panels(2)
    s = df[(df["source"] == "synthetic") & (df["kind"] == kind)].sort_values("n")
    a1.errorbar(s["n"], s["variance"], yerr=3 * s["se"], fmt="o", ms=3, capsize=2, color="#4C72B0",
                label="measured (bars: 3 SE)")
    a1.plot(s["n"], s["expected"], "-", color="#C44E52", lw=1, label="n/2" if kind == "raw" else "1/γ²")
    a1.set_title("synthetic: Σ ReLU(x_i)·v_i" + ("" if kind == "raw" else "\n/ (γ·√(n/2))"))
    m = df[(df["source"] == "model") & (df["kind"] == kind)]
    layers = sorted(int(l) for l in m["layer"].dropna().unique())
    cmap = __import__("matplotlib").colormaps["viridis"]
    many = len(layers) > 6  # then a colour bar names the layers; else the legend names each
    for i, layer in enumerate(layers):
        g = m[m["layer"] == layer].sort_values("n")
        a2.plot(g["n"], g["variance"], "o-", ms=2, lw=0.8, color=cmap(i / max(len(layers) - 1, 1)),
                label=None if many else f"layer {layer}")
    if len(m):
        n0 = m["n"].min()
        ref = m[m["n"] == n0]["variance"].median()
        ns = np.array(sorted(m["n"].unique()), dtype=float)
        a2.plot(ns, ref * (ns / n0) ** (1.0 if kind == "raw" else 0.0), ":", color="#C44E52", lw=1,
                label="∝ n" if kind == "raw" else "flat")
    if many:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        sm = ScalarMappable(norm=Normalize(layers[0], layers[-1]), cmap=cmap)
        fig.colorbar(sm, ax=a2, label="layer (0-based)", pad=0.02)
    a2.set_title("model: Σ_{i∈S} m_i·v_i over random subsets S" + ("" if kind == "raw" else "\n/ (γ·√(|S|/2))"))
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("memories summed, n = |S|")
        ax.set_ylabel("variance" if kind == "raw" else "scaled variance")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.suptitle(("C3: the output variance of a ReLU memory against n" if kind == "raw" else
                  "C4: the variance after scaling by 1/(γ·√(n/2)) against n") + " (log–log)")
    return fig


# ---- the section -----------------------------------------------------------------------------------------
CLAIMS = {
    "norm_c1": ("C1 — a softmax memory puts its weight on a few slots", "normalize_layers", c1, fig_concentration),
    "norm_c2": ("C2 — so softmax degrades as the slots grow", "normalize_capacity", c2, fig_capacity),
    "norm_c3": ("C3 — a ReLU memory's output variance grows like n/2", "normalize_variance", c3,
                lambda t: fig_variance(t, "raw")),
    "norm_c4": ("C4 — scaling the ReLU by 1/(γ·√(n/2)) keeps the variance constant", "normalize_variance", c4,
                lambda t: fig_variance(t, "scaled")),
    "norm_c5": ("C5 — a memory followed by a layer norm stands in for the FFN", "normalize_layers", c5,
                fig_substitution),
}


@dataclass
class Item:
    """One claim of the section: what a report builder renders."""
    id: str
    title: str
    verdict: Verdict
    report_verdict: str  # the verdict mapped onto the report's chips (AS_REPORT)
    figure: dict | None = None  # {"png": Path, "svg": Path}
    notes: list[str] = field(default_factory=list)
    missing: str | None = None


def items(get, fig_dir: Path, gated: bool = False, run_path: str = "RUN") -> list[Item]:
    """The section: per claim, its verdict and its figure saved into `fig_dir` (PNG and SVG)."""
    from ffkv.report.figures import save

    out = []
    for cid, (title, table, verdict_fn, fig_fn) in CLAIMS.items():
        df = get(table)
        v = verdict_fn(df)
        it = Item(cid, title, v, AS_REPORT.get(v.verdict, NA))
        if df is None:
            it.missing = f"This claim needs the `{table}` table; create it with `ffkv normalize {run_path}`."
        elif len(df):
            it.figure = save(fig_fn(df), Path(fig_dir), cid)
        if gated and cid in ("norm_c1", "norm_c5", "norm_c2"):
            it.notes.append(GATED_NOTE)
        if cid == "norm_c1" and df is not None and len(df):
            d = df[df["variant"] == "softmax"]
            edge = d[np.isclose(d["tau_rel"], TAU_EDGES[0]) | np.isclose(d["tau_rel"], TAU_EDGES[1])]
            if len(edge):
                it.notes.append(f"The fitted τ sits at the edge of the grid in layers {_span(edge['layer'])}; "
                                f"the best τ there may lie beyond it.")
        out.append(it)
    return out


# ---- HTML (for the report builder) -------------------------------------------------------------------
INTRO = ("The paper (§2) reads a FFN as a key-value memory that lacks the softmax of a memory network. "
         "Seed 004 argues about what a normalization would change; each claim is measured here on the model's "
         "own FFNs, on held-out text, by replacing one layer's FFN at a time by a normalized memory built from "
         "the same keys and values (τ and scales fit on a separate split).")
CLAIM_TEXT = {
    "norm_c1": ("The softmax is exponential in the scores, so nearly all of its weight lands on the few best "
                "matching slots.",
                "entropy and top-10 share of the weights per held-out token: the model's own |m|/Σ|m| against "
                "softmax(m/τ) at the fitted τ (and the scaled ReLU's)"),
    "norm_c2": ("Because of that concentration, a softmax memory falls behind an unnormalized one more and more as "
                "it gets more slots.",
                "held-out loss with one FFN restricted to n slots (a fixed random draw, or each token's top n by "
                "|m|), softmax memory vs the model's own activation, n = 16 … d_m, for a low, a middle and a "
                "high layer"),
    "norm_c3": ("Left unnormalized, the output adds up n terms; with independent standard normal scores and "
                "values each ReLU(x)·v term has variance 1/2, so the output's variance is n/2.",
                "the variance of Σ ReLU(x_i)·v_i for n = 16 … 16,384 (synthetic), and of Σ_{i∈S} m_i·v_i over "
                "random subsets S of each layer's memories (the model)"),
    "norm_c4": ("Dividing the ReLU weights by γ·√(n/2) makes that variance 1/γ² for every n.",
                "the same variances divided by γ²·n/2"),
    "norm_c5": ("A key-value memory followed by a layer normalization computes the same kind of function as a "
                "FFN.",
                "held-out loss and perplexity with one layer's FFN replaced by the softmax memory rescaled to the "
                "FFN's RMS output norm, per layer, beside the scaled ReLU"),
}


def verdict_records(its: list[Item]) -> list[dict]:
    """The section's verdicts as data, in the shape of the report's verdicts.json records."""
    return [{"id": it.id, "title": it.title, "verdict": it.verdict.verdict, "report_verdict": it.report_verdict,
             "criterion": it.verdict.criterion, "measured": it.verdict.measured,
             "figure": it.figure["png"].name if it.figure else None, "missing": it.missing} for it in its]


def section_html(its: list[Item], fig_rel: str = "figures") -> str:
    """The whole section as HTML in the report's markup (figure, the claim, verdict line, notes)."""
    from ffkv.report.html import VERDICT_CLASS, code, esc, img

    parts = ['<section id="normalize" class="figure-section" data-section="normalize">',
             "<h2>Normalized vs unnormalized memories (seed 004, claims C1–C5)</h2>", f"<p>{esc(INTRO)}</p>"]
    for it in its:
        claim, measure = CLAIM_TEXT[it.id]
        if it.figure:
            alt = f"{it.title}. {it.figure.get('alt', '')}".rstrip(". ")
            fig = (f'<figure>{img(it.figure["png"], alt)}<figcaption class="files">Files: '
                   f'<a href="{fig_rel}/{it.figure["png"].name}">{esc(it.figure["png"].name)}</a>, '
                   f'<a href="{fig_rel}/{it.figure["svg"].name}">{esc(it.figure["svg"].name)}</a></figcaption></figure>')
        else:
            fig = f'<div class="missing"><p>{code(it.missing or "no rows")}</p></div>'
        aside = (f'<aside class="paper"><h3>The claim</h3><p>{esc(claim)}</p>'
                 f'<p class="setup"><b>Measured:</b> {esc(measure)}.</p></aside>')
        cls = VERDICT_CLASS.get(it.report_verdict, "v-na")
        v = it.verdict
        parts += [f'<section id="{it.id}" class="figure-section" data-section="{it.id}">', f"<h3>{esc(it.title)}</h3>",
                  f'<div class="cols">{fig}{aside}</div>',
                  f'<p class="verdict {cls}" data-verdict="{esc(v.verdict)}"><span class="label">Verdict: '
                  f'{esc(v.verdict)}.</span> <span class="measured">Measured: {code(v.measured)}</span>'
                  f'<span class="criterion">Criterion: {code(v.criterion)}</span></p>']
        if it.notes:
            parts.append('<div class="notes"><b>Reading this with this model:</b><ul>'
                         + "".join(f"<li>{esc(n)}</li>" for n in it.notes) + "</ul></div>")
        parts.append("</section>")
    parts.append("</section>")
    return "\n".join(parts)


def sections(run, fig_dir) -> list:
    from ffkv.report.build import Builder
    from ffkv.steps import ReportSection

    if not run.step_done("normalize"):
        return []
    b = Builder.of(run, fig_dir)
    its = items(b.t.get, fig_dir, gated=bool(b.m.get("gated")), run_path=str(run.path))
    return [ReportSection("normalize", "Normalized memories", section_html(its, "figures"),
                          tuple(verdict_records(its)), whole=True)]
