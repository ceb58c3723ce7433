"""Statistics of (C, V) logit rows that read each row once: ranks of several targets, both tails.

Why: the values step reads rows of 262,144 logits for Gemma 3 (1 MB each). torch made a pass over
the whole block per statistic: a top-k per tail, and per ranked target a flip of the row in place,
a comparison, a sum and a flip back. On a CPU with numba each thread here takes a row, within its
L2, and gathers what it needs in one visit; elsewhere (CUDA, FFKV_NUMBA=0, no numba) torch gives
the same numbers.

- `signed_ranks(z, targets, signs)[r, j]` = `ffkv.model.memories.rank_of` of targets[r, j] in
  signs[r, j]·z[r]: the logits strictly above the target's, for a sign of −1 those strictly below
  it in z, so no row is negated.
- `tails(z, k)`: the k largest logits of each row and the k smallest, with their tokens, in
  order; ties go to the lower token id (torch's `topk` leaves their order unspecified; the CPU
  kernel and the fallback both give this one).
"""
from __future__ import annotations

import numpy as np
import torch

_kernel = None
_tails = None


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
    from ffkv.mine.switches import numba_here
    from ffkv.model.memories import rank_of

    targets = targets.to(torch.long)
    thr = z.gather(1, targets.to(z.device))
    pos = (signs > 0).to(z.device)
    if numba_here(z.device) and z.dtype == torch.float32 and z.is_contiguous():
        out = np.empty(tuple(targets.shape), np.int64)
        _compiled()(z.numpy(), thr.numpy(), pos.numpy().astype(np.int8), out)
        return torch.from_numpy(out)
    out = torch.empty(tuple(targets.shape), dtype=torch.long, device=z.device)
    tg = targets.to(z.device)
    for a in range(0, len(z), 128):  # row blocks: a (128, V) comparison at a time
        for j in range(targets.shape[1]):
            out[a:a + 128, j] = rank_of(z[a:a + 128], tg[a:a + 128, j], below=~pos[a:a + 128, j])
    return out


def _tails_kernel():
    global _tails
    if _tails is None:
        from numba import njit, prange

        def inserter(top: bool):
            """x (token v) into row r's list of its n largest (top) or smallest values, kept in
            order: behind every equal value, so the lower id comes first. Returns the new length.
            `top` is a constant of the compiled function (the comparison is chosen once)."""
            @njit(inline="always")
            def before(a, b):  # pragma: no cover  (compiled)
                return a > b if top else a < b

            @njit(inline="always")
            def insert(vals, idx, r, n, k, x, v):  # pragma: no cover  (compiled)
                if n < k or before(x, vals[r, k - 1]):
                    i = min(n, k - 1)
                    while i > 0 and before(x, vals[r, i - 1]):
                        vals[r, i] = vals[r, i - 1]
                        idx[r, i] = idx[r, i - 1]
                        i -= 1
                    vals[r, i] = x
                    idx[r, i] = v
                    return min(n + 1, k)
                return n
            return insert

        high, low = inserter(True), inserter(False)

        @njit(parallel=True, cache=True, nogil=True)
        def tails(z, k, both, hv, hi, lv, li, nan):  # pragma: no cover  (compiled)
            C, V = z.shape
            for r in prange(C):
                nh = 0
                nl = 0
                for v in range(V):
                    x = z[r, v]
                    if x != x:
                        nan[r] = True
                    nh = high(hv, hi, r, nh, k, x, v)
                    if both:
                        nl = low(lv, li, r, nl, k, x, v)

        _tails = tails
    return _tails


def tails(z: torch.Tensor, k: int, both: bool = True):
    """((top logits, tokens), (bottom logits, tokens) or None): each (C, k), k ≤ V; the top
    descending, the bottom ascending; ties to the lower token id."""
    from ffkv.mine.switches import numba_here

    C, V = z.shape
    if numba_here(z.device) and z.dtype == torch.float32 and z.is_contiguous():
        hv, hi = np.empty((C, k), np.float32), np.empty((C, k), np.int64)
        lv, li = (np.empty((C, k), np.float32), np.empty((C, k), np.int64)) if both else (hv[:0], hi[:0])
        nan = np.zeros(C, np.bool_)
        if C:
            _tails_kernel()(z.numpy(), k, both, hv, hi, lv, li, nan)
        if not nan.any():  # a NaN row: torch's order below (it ranks NaN highest)
            top = (torch.from_numpy(hv), torch.from_numpy(hi))
            return top, ((torch.from_numpy(lv), torch.from_numpy(li)) if both else None)
    return _stable_top(z, k, True), (_stable_top(z, k, False) if both else None)


def _stable_top(z: torch.Tensor, k: int, largest: bool):
    """torch's top-k, its ties put in token order: the values are exact, only tied runs reorder."""
    v, i = z.topk(k, dim=-1, largest=largest)
    if not len(z):
        return v, i
    # rows with a tie inside the list, or with tokens beyond the k-th tied with it: within a run
    # of equal values, token order; of the tokens tied with the k-th, the lowest ids are kept
    edge = v[:, -1:]
    tied = z == edge
    rows = (v[:, 1:] == v[:, :-1]).any(1) | (tied.sum(1) > (v == edge).sum(1))
    for r in torch.nonzero(rows).flatten().tolist():
        keep = torch.nonzero((z[r] > edge[r]) if largest else (z[r] < edge[r])).flatten()
        cand = torch.cat([keep, torch.nonzero(tied[r]).flatten()[:k - len(keep)]])
        order = torch.argsort(-z[r, cand] if largest else z[r, cand], stable=True)
        i[r] = cand[order]
        v[r] = z[r, i[r]]
    return v, i
