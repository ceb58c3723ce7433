"""The trackers' work on a batch in two compiled passes on a CPU (numba; issue 24).

The portable path (`ffkv.mine.stats.KeyStats.update`) scatters each value into a (bin, key)
table with torch's single-threaded `index_add_`, squares the whole capture for the sum of squares
and reads it three times more per sign for the rows' bests: on a 2-core CPU that costs more than a
third of a plain forward. Here `capture` has each thread take a block of keys and walk the valid
tokens once, counting bins (read from the sign and exponent bits through the same table,
`ffkv.mine.rules._raw_luts`), summing m and m² in float64 and keeping each row's max and min with
their first positions (the CPU twin of `ffkv.mine.fused_cuda.capture`). `offer` then hands each
row's best to the running max, the position buckets and the quantile samples, key by key,
instead of some twenty torch ops over the (rows, keys) table.

Each key is summed by one thread in token order, so the sums have the same bits for any thread
count (a Ray shard runs one); the counts are integers, equal to the portable path's, and the row
bests are `ffkv.mine.topk.row_best`'s. The sums differ from the portable path's float32 products
in their last bits only.

Used for CPU tensors when numba imports (FFKV_NUMBA=0 turns it off).
"""
from __future__ import annotations


import numpy as np
import torch

from ffkv.mine import rules, switches

KEYS = 1024  # keys per thread's block: one 4 KB row read per token, its counts in L2

_kernels = None


available = switches.numba_here  # the one gate (kept under its old name for the trackers)


def _same_code(fn, **bind):
    """`fn` compiled by numba from its own code (`ffkv.mine.rules.rebound`)."""
    from numba import njit

    return njit(rules.rebound(fn, **bind))


def _compile():
    """The kernels, compiled on first use (cached on disk by numba)."""
    global _kernels
    if _kernels is None:
        from numba import njit, prange

        sample_hash = _same_code(rules.sample_hash, _perm=_same_code(rules._perm))
        pos_bucket = _same_code(rules.pos_bucket)

        @njit(parallel=True, cache=True, nogil=True)
        def capture(mf, mi, valid, lut, hist, s1, s2, hi, hip, lo, lop, stats, pos, neg):  # pragma: no cover
            B, T, W = mf.shape
            nb = hist.shape[0]
            for blk in prange((W + KEYS - 1) // KEYS):
                k0 = blk * KEYS
                w = min(W, k0 + KEYS) - k0
                loc = np.zeros((KEYS, nb), np.int32)
                a1 = np.zeros(KEYS, np.float64)
                a2 = np.zeros(KEYS, np.float64)
                bh = np.empty(KEYS, np.float32)
                bl = np.empty(KEYS, np.float32)
                ph = np.zeros(KEYS, np.int32)
                pl = np.zeros(KEYS, np.int32)
                for b in range(B):
                    for j in range(w):
                        bh[j], bl[j], ph[j], pl[j] = -np.inf, np.inf, 0, 0
                    for t in range(T):
                        if not valid[b, t]:
                            continue
                        if stats:
                            for j in range(w):
                                v = np.float64(mf[b, t, k0 + j])
                                a1[j] += v
                                a2[j] += v * v
                            for j in range(w):
                                loc[j, lut[(mi[b, t, k0 + j] >> 23) + 256]] += 1
                        if pos:  # strictly greater: the first position of the best
                            for j in range(w):
                                v = mf[b, t, k0 + j]
                                if v > bh[j]:
                                    bh[j], ph[j] = v, t
                        if neg:
                            for j in range(w):
                                v = mf[b, t, k0 + j]
                                if v < bl[j]:
                                    bl[j], pl[j] = v, t
                    for j in range(w):
                        if pos:
                            hi[b, k0 + j], hip[b, k0 + j] = bh[j], ph[j]
                        if neg:
                            lo[b, k0 + j], lop[b, k0 + j] = -bl[j], pl[j]
                if stats:
                    for j in range(w):
                        s1[k0 + j] = a1[j]
                        s2[k0 + j] = a2[j]
                        for q in range(nb):
                            hist[q, k0 + j] += loc[j, q]

        @njit(parallel=True, cache=True, nogil=True)
        def offer(score, sbits, pos, sids, salt, side, mx, ph, H, P, C, sign, k):  # pragma: no cover
            B, W = score.shape
            for key in prange(W):
                best = mx[key]
                for b in range(B):
                    v = score[b, key]
                    if v > best:
                        best = v
                    p = pos[b, key]
                    ph[key, pos_bucket(p)] += 1
                    if k == 0:
                        continue
                    j = side[(sbits[b, key] >> 23) + 256]
                    if j < 0:
                        continue
                    h = sample_hash(sids[b], salt[key])
                    if h >= H[key, j, k - 1]:
                        continue
                    i = k - 1  # insert, keeping the slots sorted by hash
                    while i > 0 and H[key, j, i - 1] > h:
                        H[key, j, i] = H[key, j, i - 1]
                        P[key, j, i] = P[key, j, i - 1]
                        C[key, j, i] = C[key, j, i - 1]
                        i -= 1
                    H[key, j, i] = h
                    P[key, j, i] = p
                    C[key, j, i] = v * sign
                mx[key] = best

        _kernels = capture, offer
    return _kernels


def _threads() -> None:
    """As many threads as torch uses (one in a Ray shard)."""
    import numba

    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def capture(m: torch.Tensor, valid: torch.Tensor, lut: torch.Tensor, signs, stats: bool):
    """One read of m (B, T, W) float32 over its valid tokens (valid (B, T) bool), as
    `ffkv.mine.fused_cuda.capture` on CUDA: ({sign: (score (B, W) = best sign·m, its first
    position int32)}, hist (NB, W) int64 or None, the sums of m and m² (2, W) float64 or None).
    Each row's best is `ffkv.mine.topk.row_best`'s, bit for bit; lut (512,) int32: raw
    sign/exponent index -> bin."""
    kernel = _compile()[0]
    _threads()
    mf = m.detach().contiguous().numpy()
    B, _, W = mf.shape
    pos, neg = 1 in signs, -1 in signs
    hist = np.zeros((rules.NB if stats else 1, W if stats else 1), np.int64)
    sums = np.empty((2, W if stats else 1))
    hi, lo = (np.empty((B, W) if x else (1, 1), np.float32) for x in (pos, neg))
    hip, lop = (np.empty((B, W) if x else (1, 1), np.int32) for x in (pos, neg))
    kernel(mf, mf.view(np.int32), valid.detach().contiguous().numpy(), lut.numpy(), hist, sums[0], sums[1],
           hi, hip, lo, lop, bool(stats), pos, neg)
    best = {}
    if pos:
        best[1] = (torch.from_numpy(hi), torch.from_numpy(hip))
    if neg:
        best[-1] = (torch.from_numpy(lo), torch.from_numpy(lop))
    if not stats:
        return best, None, None
    return best, torch.from_numpy(hist), torch.from_numpy(sums)


def hist_sums(m: torch.Tensor, valid: torch.Tensor, lut: torch.Tensor, hist: torch.Tensor):
    """Add the bins of m (B, T, W) float32's valid tokens (valid (B, T) bool) to hist (NB, W)
    int64 in place; return the per-key sums of m and m² over them, float64 (W,) each."""
    _, h, sums = capture(m, valid, lut, (), True)
    hist += h
    return sums[0], sums[1]


def offer(score, pos, sids, salt, side, mx, ph, sh, sp, sc, sign: int, k: int) -> None:
    """One sign's row bests (score (B, W) = sign·m float32, pos (B, W) int32) into its state, in
    place: the running max (W,), the position buckets (W, NPOS) and the sample slots (W, SIDE, k),
    each (key, bin) keeping the k (0: none) smallest `sample_hash(sid, salt)` sorted; side (512,) int32:
    raw sign/exponent index -> side bin (-1: none). The same state as the portable path's."""
    kernel = _compile()[1]
    _threads()
    s = score.detach().contiguous().numpy()
    kernel(s, s.view(np.int32), pos.detach().contiguous().numpy(), sids.numpy(), salt.numpy(), side.numpy(),
           mx.numpy(), ph.numpy(), sh.numpy(), sp.numpy(), sc.numpy(), np.float32(sign), int(k))
