"""What every verdict shares: the four verdicts, intervals, tests and trend calls.

A step's verdict functions (`ffkv/steps/<name>/verdicts.py`, one per figure) are pure: they take the
run's table(s) (a pyarrow Table, a pandas DataFrame or a list of row dicts; None when the step was
not run) and return a `Verdict` (verdict, criterion, measured). The verdict is one of SAME ("same
trend"), DIFFERS ("differs"), INCONCLUSIVE ("inconclusive": the measured difference lies within its
95% interval, or cannot be told apart from the figure's chance baseline) or NA ("not comparable":
the paper's measure does not apply or the table is missing); the criterion says what was tested,
against which baseline and interval; `measured` gives the numbers it was tested on.

Intervals: shares pooled over layers use the normal interval of a difference of two proportions
(n = the pooled counts, `diff_ci`); curves stored only as one number per layer use the layers as
units (Mann–Whitney U between the bottom and the top third, two-sided, α = 0.05, `layers_test`), so
a trend carried by one or two layers stays inconclusive.

Layer-wise criteria compare parts of the network by *relative depth*, so that a 30-layer model is
read against the paper's 16 layers: layer ℓ (0-based) of an L-layer model sits at depth
(ℓ + ½) / L; the bottom third is depth ≤ 1/3, the top third depth ≥ 2/3 (`thirds`). A table that
covers only some layers (e.g. `mine --layers`) is judged on the layers it has.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import pandas as pd

from ffkv.defs import pct, wilson

SAME, DIFFERS, NA = "same trend", "differs", "not comparable"
INCONCLUSIVE = "inconclusive"
VERDICTS = (SAME, DIFFERS, INCONCLUSIVE, NA)
ALPHA = 0.05
Z = 1.959963984540054  # two-sided 95%

# Activations whose "m > 0" count means what it means for the paper's ReLU: m_i > 0 exactly when the
# pre-activation is positive. For gated FFNs m_i = f(x·g_i)·(x·u_i) is signed through x·u_i.
RELU_LIKE = ("relu", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_accurate", "quick_gelu")


class Verdict(NamedTuple):
    verdict: str
    criterion: str
    measured: str


THIRDS = "thirds by relative depth (ℓ+½)/L: bottom ≤ 1/3, top ≥ 2/3"


# ---- tables, depth and intervals -----------------------------------------------------------------------------------------
def as_frame(table) -> pd.DataFrame | None:
    """pyarrow Table, DataFrame, list of dicts or None -> DataFrame or None."""
    if table is None:
        return None
    if isinstance(table, pd.DataFrame):
        return table
    if hasattr(table, "to_pandas"):
        return table.to_pandas()
    return pd.DataFrame(list(table))


def missing(table: str, step: str) -> Verdict:
    return Verdict(NA, f"needs the `{table}` table, which `ffkv {step} RUN` creates", "the step was not run")


def depth(layer, n_layers: int) -> np.ndarray:
    return (np.asarray(layer, dtype=float) + 0.5) / n_layers


def thirds(layers, n_layers: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """Bottom, middle and top thirds of `layers` by relative depth (ℓ+½)/L."""
    layers = sorted({int(l) for l in layers})
    if not layers:
        return [], [], []
    n = n_layers or (max(layers) + 1)
    bottom = [l for l in layers if (l + 0.5) / n <= 1 / 3]
    top = [l for l in layers if (l + 0.5) / n >= 2 / 3]
    middle = [l for l in layers if l not in bottom and l not in top]
    return bottom, middle, top


def n_layers_of(df: pd.DataFrame, n_layers: int | None) -> int:
    """The model's layer count: given, else inferred from the table *before* any row is filtered
    out (call it first), so that dropping empty layers does not change the relative depths."""
    return int(n_layers or (int(df["layer"].max()) + 1 if len(df) else 1))


def span(ls: list[int]) -> str:
    return f"{ls[0]}–{ls[-1]}" if len(ls) > 1 else f"{ls[0]}"


def pct_na(x: float, digits: int = 1) -> str:
    """`defs.pct`, with "n/a" for a missing value."""
    return "n/a" if x is None or x != x else pct(x, digits)


def weighted(df: pd.DataFrame, layers: list[int], col: str, weight: str | None = None) -> float:
    sub = df[df["layer"].isin(layers)]
    sub = sub[sub[col].notna()]
    if sub.empty:
        return float("nan")
    if weight is None:
        return float(sub[col].mean())
    w = sub[weight].astype(float)
    return float((sub[col] * w).sum() / w.sum()) if w.sum() > 0 else float("nan")


def diff_ci(k1, n1, k2, n2) -> tuple[float, float, float]:
    """(p1 − p2, low, high): the normal 95% interval of a difference of two proportions."""
    n1, n2 = float(n1), float(n2)
    if n1 <= 0 or n2 <= 0:
        return float("nan"), float("nan"), float("nan")
    p1, p2 = k1 / n1, k2 / n2
    se = math.sqrt(max(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2, 0.0))
    d = p1 - p2
    return d, d - Z * se, d + Z * se


def wilson_ci(k, n) -> tuple[float, float]:
    """Wilson score 95% interval of k/n: `ffkv.defs.wilson`."""
    return wilson(k, n)


def by_interval(lo: float, hi: float) -> str:
    """SAME when the interval of (measured − expected-direction) lies above 0, DIFFERS below, else
    INCONCLUSIVE (also when it is NaN)."""
    if lo > 0:
        return SAME
    if hi < 0:
        return DIFFERS
    return INCONCLUSIVE


def layers_test(a, b) -> tuple[float, float]:
    """(mean(a) − mean(b), two-sided Mann–Whitney p) over per-layer values; p = 1 when either
    side has fewer than two layers or both are constant and equal."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if len(a) == 0 or len(b) == 0:
        return float("nan"), 1.0
    d = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2 or (np.ptp(np.r_[a, b]) == 0):
        return d, 1.0
    from scipy.stats import mannwhitneyu

    return d, float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


def by_test(d: float, p: float) -> str:
    """SAME when d > 0 at p < α, DIFFERS when d < 0 at p < α, else INCONCLUSIVE."""
    if p < ALPHA and d > 0:
        return SAME
    if p < ALPHA and d < 0:
        return DIFFERS
    return INCONCLUSIVE


def spearman(x, y) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either side is constant."""
    x = pd.Series(np.asarray(x, dtype=float)).rank().to_numpy()
    y = pd.Series(np.asarray(y, dtype=float)).rank().to_numpy()
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def on_lens(df: pd.DataFrame, lens: str | None) -> tuple[pd.DataFrame, str | None]:
    if "lens" not in df.columns:
        return df, None
    have = list(dict.fromkeys(df["lens"]))
    use = lens if lens in have else ("norm" if "norm" in have else have[0])
    return df[df["lens"] == use], use


def thirds_or_none(df: pd.DataFrame, n_layers: int | None):
    """(n_layers, bottom, middle, top), or None when the table has no layer in the bottom or the
    top third (or no rows at all)."""
    if df.empty:
        return None
    n = n_layers_of(df, n_layers)
    bottom, middle, top = thirds(df["layer"], n)
    if not bottom or not top:
        return None
    return n, bottom, middle, top


def no_thirds(what: str) -> Verdict:
    return Verdict(NA, f"compares the bottom and top thirds of the layers ({THIRDS})",
                   f"{what} has no layer in the bottom or in the top third")


class Early(Exception):
    """A verdict reached before the figure's own test: its table is missing, or it lacks a third."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.measured)
        self.verdict = verdict


def judged(f):
    """Let a verdict function stop at `frame` or `layer_thirds` with their verdict."""
    @functools.wraps(f)
    def judged(*args, **kwargs) -> Verdict:
        try:
            return f(*args, **kwargs)
        except Early as e:
            return e.verdict
    return judged


def frame(table, name: str, step: str, lens: str | None = None) -> pd.DataFrame:
    """The table as a frame, on one lens when it has several; NA when its step was not run."""
    df = as_frame(table)
    if df is None:
        raise Early(missing(name, step))
    return on_lens(df, lens)[0]


def layer_thirds(df: pd.DataFrame, n_layers: int | None, what: str):
    """(n_layers, bottom, middle, top); NA when `what` has no layer in the bottom or the top third."""
    t = thirds_or_none(df, n_layers)
    if t is None:
        raise Early(no_thirds(what))
    return t
