"""The checks a faster path passes before mining uses it, on the machine at hand.

- A faster forward (`ffkv.mine.packing`, `ffkv.mine.compiled`): three short sentences through
  both forwards, the coefficients compared to the dtype's rounding. Whether a family's
  transformers code allows it depends on the family and the transformers version, so it is found
  by running the model, not listed.
- The fused CUDA kernels (`verify`): made-up captures through whole mining states by each path,
  compared bit for bit. It builds trackers, so it sits above them and their backends
  (`ffkv.mine.fused_cuda` only runs kernels; it does not know the trackers).
"""
from __future__ import annotations

import numpy as np
import torch

from ffkv.mine import fused_cuda
from ffkv.mine.rules import from_limbs
from ffkv.mine.stats import KeyStats
from ffkv.mine.topk import TopKState
from ffkv.mine.trackers import Batch, MineState

LENGTHS = (5, 7, 3)
CHECK_KEYS = 160  # keys per layer of the kernels' check: ten capture programs, two offer blocks


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


# ---- the fused kernels --------------------------------------------------------------------------
_verified: set[str] = set()  # devices where `verify` has run (its verdict: `fused_cuda._broken`)


def checked(device) -> bool:
    """Whether `verify` has run for `device` in this process."""
    return str(torch.device(device)) in _verified


def verify(device) -> bool:
    """Whether the fused path gives the portable path's states on `device`, checked once per
    device on made-up captures (`_check_states`); a disagreement turns the path off for the process
    (one line on stderr). False too where the path cannot run."""
    key = str(torch.device(device))
    if key in _verified:
        return fused_cuda._broken is None
    if not fused_cuda.runs_here(device):
        return False
    try:
        why = _check_states(device)
    except Exception as e:  # noqa: BLE001  (whatever breaks: the portable path is exact)
        why = fused_cuda.why_of(e)
    if why and fused_cuda._broken is None:
        fused_cuda.turn_off(why, f"the fused CUDA kernels disagree with the portable path here ({why}); "
                                 "using the portable path")
    _verified.add(key)
    return fused_cuda._broken is None


@torch.no_grad()
def _check_states(device) -> str | None:
    """Three made-up batches (both signs, samples, two layers side by side, padding, ties, zeros)
    through a whole mining state by each path, as float32 and as bf16 captures (what a GPU mines):
    the counts, maxima, positions, samples and top-k lists must be equal bit for bit, the sums to
    float32 rounding. None: they are."""
    g = torch.Generator().manual_seed(0)
    B, T, w, layers = 12, 9, CHECK_KEYS, (0, 1)
    m = torch.randn(B, T, 2 * w, generator=g) * torch.exp(torch.randn(B, T, 2 * w, generator=g) * 2)
    m[1, :, 9] = 1.5  # ties: the first position wins
    m[0, 0, :5] = 0.0
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    lengths[0] = T
    m = m.to(device)
    mask = torch.arange(T, device=m.device)[None, :] < torch.tensor(lengths, device=m.device)[:, None]
    m = m.masked_fill(~mask[..., None], 3.0)  # padding must not count
    for dtype in (torch.float32, torch.bfloat16):
        got = []
        for on in (False, True):
            with fused_cuda.forced(on):
                st = MineState({"topk": TopKState(list(layers), None, w, 4, negative=True, device=m.device, group=2),
                                "stats": KeyStats(list(layers), None, w, signs=(1, -1), samples=3,
                                                  device=m.device, group=2)}, list(layers), None,
                               device=m.device)
                for rep in (0, 1, 3):  # samples move; a power of two apart: exact in any dtype
                    batch = Batch.from_lengths(lengths, [rep * 100 + i for i in range(B)], mask)
                    x = (m * (1 + rep)).to(dtype)
                    for i, l in enumerate(layers):
                        st.update(l, x[..., i * w:(i + 1) * w], batch)
                got.append({a: np.array(v) for a, v in st.arrays().items()})
            if fused_cuda._broken is not None:  # a launch failed (said already)
                return None
        why = _first_mismatch(*got)
        if why:
            return f"{why}, {str(dtype).replace('torch.', '')} captures"
    return None


def _first_mismatch(want: dict, have: dict) -> str | None:
    """The first array of the fused path's state that is not the portable path's (the sums:
    float32 rounding apart, the fused kernel sums in float64)."""
    for a in want:
        x, y = want[a], have.get(a)
        if y is None or x.shape != y.shape:
            return f"{a} missing or of another shape"
        if "limbs" in a:
            x = np.stack([from_limbs(x[0]), from_limbs(x[1])])
            y = np.stack([from_limbs(y[0]), from_limbs(y[1])])
            if not np.allclose(x, y, rtol=1e-5, atol=1e-5 * float(np.abs(x).max() or 1.0)):
                return f"the sums differ ({a})"
        elif not np.array_equal(x, y, equal_nan=True):
            return f"{a} differs at {len(np.argwhere(x != y))} entries"
    return None
