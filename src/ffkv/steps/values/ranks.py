"""Ranks of several targets per row of a (C, V) logit block, each in its own sign, in one visit.

`signed_ranks(z, targets, signs)[r, j]` = `ffkv.model.memories.rank_of` of targets[r, j] in
signs[r, j]·z[r]: the number of logits strictly above the target's, which for a sign of −1 is the
number strictly below it in z, so no row is negated. Why: the values step ranks two targets per
value (its top-1 trigger's next token and the shuffled pairing's) in rows of 262,144 logits for
Gemma 3; torch flipped each row in place, compared, summed and flipped back, two full passes per
target. On a CPU with numba each thread takes a row (1 MB for Gemma 3, within its L2) and counts
every target there; elsewhere (CUDA, FFKV_NUMBA=0, no numba) the same counts come from torch.
"""
from __future__ import annotations

import numpy as np
import torch

_kernel = None


def _compiled():
    global _kernel
    if _kernel is None:
        from numba import njit, prange

        @njit(parallel=True, cache=True, nogil=True)
        def count(z, thr, sgn, out):  # pragma: no cover  (compiled)
            C, V = z.shape
            J = thr.shape[1]
            for r in prange(C):
                for j in range(J):
                    t = thr[r, j]
                    n = 0
                    if sgn[r, j] > 0:
                        for v in range(V):
                            if z[r, v] > t:
                                n += 1
                    else:
                        for v in range(V):
                            if z[r, v] < t:
                                n += 1
                    out[r, j] = n

        _kernel = count
    return _kernel


def signed_ranks(z: torch.Tensor, targets: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(C, J) int64 ranks of targets (C, J) in signs (C, J; > 0: +1, else −1) · z (C, V)."""
    from ffkv.mine import stats_cpu

    targets = targets.to(torch.long)
    thr = z.gather(1, targets.to(z.device))
    pos = (signs > 0).to(z.device)
    if stats_cpu.available(z.device) and z.dtype == torch.float32 and z.is_contiguous():
        out = np.empty(tuple(targets.shape), np.int64)
        _compiled()(z.numpy(), thr.numpy(), pos.numpy().astype(np.int8), out)
        return torch.from_numpy(out)
    out = torch.empty(tuple(targets.shape), dtype=torch.long, device=z.device)
    for a in range(0, len(z), 128):  # `rank_of`'s uint8 sums, over row blocks
        zb = z[a:a + 128]
        for j in range(targets.shape[1]):
            t = thr[a:a + 128, j:j + 1]
            above = (zb > t).view(torch.uint8).sum(-1, dtype=torch.int32)
            below = (zb < t).view(torch.uint8).sum(-1, dtype=torch.int32)
            out[a:a + 128, j] = torch.where(pos[a:a + 128, j], above, below).to(torch.long)
    return out
