"""Names shared across ffkv, defined once and importable without torch."""
from __future__ import annotations

from ffkv.errors import FfkvError

# The lens: "naive" projects with the unembedding alone (the paper); "norm" applies the
# model's final norm first (and reproduces the logits at the last layer).
LENSES = ("naive", "norm")
LENS_HELP = "naive: h·E as in the paper; norm: through the final norm."  # --lens of every command that opens a model
PAPER_LENS = "naive"

# The window, in tokens, that a flat token stream corpus is cut into (--context; ffkv.corpus.tokens).
CORPUS_CONTEXT = 128


def other_lens(lens: str) -> str:
    return LENSES[1 - LENSES.index(check_lens(lens))]


def lens_name(lens: str) -> str:
    """'norm lens', or "naive lens (the paper's)": every label of a lens says which one the paper used."""
    return f"{lens} lens" + (" (the paper's)" if lens == PAPER_LENS else "")

# dtype spellings a user may type -> the canonical torch name.
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def canonical_dtype(dtype: str, device: str | None = None, bf16: bool = True) -> str:
    """'auto' and every alias -> float32/float16/bfloat16; an unknown name is a user error.

    'auto' is bfloat16 on a CUDA device (`device` 'cuda' or 'cuda:N') that supports it (`bf16`),
    float32 anywhere else (a CPU, or no device named)."""
    if dtype == "auto":
        return "bfloat16" if device is not None and str(device).startswith("cuda") and bf16 else "float32"
    if dtype not in DTYPES:
        raise FfkvError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_lens(lens: str) -> str:
    if lens not in LENSES:
        raise FfkvError(f"unknown lens {lens!r}; choose naive or norm")
    return lens


def pct(x: float, digits: int = 1) -> str:
    """0.1234 -> '12.3%'; None or NaN -> '-'."""
    if x is None or x != x:
        return "-"
    return f"{100 * x:.{digits}f}%"


def wilson(k, n, confidence: float = 0.95):
    """Wilson score interval of k successes in n trials (scipy's `binomtest(...).proportion_ci`),
    for scalars (a (lo, hi) pair of floats) or arrays (two arrays); NaN where n == 0. A
    fractional k (a share times n) is rounded. The one interval for proportions in ffkv."""
    import numpy as np
    from scipy.stats import binomtest

    k, n = np.broadcast_arrays(np.asarray(k, dtype=float), np.asarray(n, dtype=float))
    lo, hi = np.full(k.shape, np.nan), np.full(k.shape, np.nan)
    for i in np.ndindex(k.shape):  # a few dozen intervals per step: the loop costs milliseconds
        if n[i] > 0:
            ci = binomtest(int(round(k[i])), int(n[i])).proportion_ci(confidence_level=confidence, method="wilson")
            lo[i], hi[i] = ci.low, ci.high
    if lo.ndim == 0:
        return float(lo), float(hi)
    return lo, hi
