"""The check a faster forward passes before mining uses it (`ffkv.mine.packing`, `ffkv.mine.compiled`):
three short sentences through both forwards, the coefficients compared to the dtype's rounding.
Whether a family's transformers code allows the faster forward depends on the family and the
transformers version, so it is found by running the model, not listed."""
from __future__ import annotations

import numpy as np
import torch

LENGTHS = (5, 7, 3)


def sentences(mm) -> tuple[np.ndarray, np.ndarray]:
    """The check's token ids one after another (seeded, inside the model's vocabulary) and their lengths."""
    vocab = min(int(mm.vocab_size), len(mm.tok)) if mm.tok is not None else int(mm.vocab_size)
    lens = np.array(LENGTHS, np.int64)
    return np.random.default_rng(0).integers(0, vocab, int(lens.sum())), lens


def tolerance(dtype) -> float:
    """The largest relative difference put down to rounding: 1e-4 in float32; in a half type, 12 of
    its epsilons and at least 3e-2 (bfloat16 0.094). On an H100, torch.compile's bf16 SmolLM2 forward
    sat 3.8e-2 from eager at layer 18, packed rows 1.9e-2 (fused kernels round differently); a wrong
    capture (another layer, a stale batch, a lost residual) is off by the values themselves (~1)."""
    if dtype == torch.float32 or dtype == torch.float64:
        return 1e-4
    return max(3e-2, 12 * torch.finfo(dtype).eps)


def first_difference(mm, got: dict, want: dict, keep: torch.Tensor) -> tuple[int, float] | None:
    """(layer, relative error) of the first layer where got[l] and want[l] ((B, T, n) padded
    layouts) differ beyond the dtype's rounding at the real tokens `keep`; None where none does."""
    tol = tolerance(mm.dtype)
    for l in sorted(want):
        a, b = got[l].float()[keep], want[l].float()[keep]
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        if not err <= tol:  # NaN too
            return l, err
    return None
