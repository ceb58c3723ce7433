"""The key statistics of one batch in two compiled passes on a CPU (numba; issue 24).

The portable path (`ffkv.mine.stats.KeyStats.update`) scatters each value into a (bin, key)
table with torch's single-threaded `index_add_` and squares the whole capture for the sum of
squares: on a 2-core CPU that costs more than a third of a plain forward. Here each thread takes
a block of keys and walks the valid tokens once, counting bins (read from the sign and exponent
bits through the same table, `ffkv.mine.stats._raw_luts`) and summing m and m² in float64.
A second pass offers each row's best coefficient to the running max, the position buckets and
the quantile samples, key by key, instead of some twenty torch ops over the (rows, keys) table.

Each key is summed by one thread in token order, so the sums have the same bits for any thread
count (a Ray shard runs one); the counts are integers, equal to the portable path's. The sums
differ from the portable path's float32 products in their last bits only.

Used for CPU tensors when numba imports (FFKV_NUMBA=0 turns it off).
"""
from __future__ import annotations

import os

import numpy as np
import torch

KEYS = 1024  # keys per thread's block: one 4 KB row read per token, its counts in L2

_kernels = None


_numba_ok: bool | None = None


def available(device) -> bool:
    """This path runs here: a CPU device, numba importable (a missing or broken one falls back to
    the portable path), not turned off."""
    global _numba_ok
    if os.environ.get("FFKV_NUMBA", "1") == "0" or torch.device(device).type != "cpu":
        return False
    if _numba_ok is None:
        try:
            import numba  # noqa: F401
            _numba_ok = True
        except Exception:  # noqa: BLE001  (an install that does not match numpy, say)
            _numba_ok = False
    return _numba_ok


def _same_code(fn, **bind):
    """`fn` compiled from its own code, with some of its globals bound to compiled functions: the
    one definition (`ffkv.mine.stats.sample_hash`) serves torch, numpy and these kernels."""
    import types

    from numba import njit

    g = dict(fn.__globals__)
    g.update(bind)
    return njit(types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__))


def _compile():
    """The kernels, compiled on first use (cached on disk by numba)."""
    global _kernels
    if _kernels is None:
        from numba import njit, prange

        from ffkv.mine import stats

        sample_hash = _same_code(stats.sample_hash, _perm=_same_code(stats._perm))

        @njit(parallel=True, cache=True, nogil=True)
        def hist_sums(mf, mi, valid, lut, hist, s1, s2):  # pragma: no cover  (compiled)
            B, T, W = mf.shape
            nb = hist.shape[0]
            for blk in prange((W + KEYS - 1) // KEYS):
                k0 = blk * KEYS
                w = min(W, k0 + KEYS) - k0
                loc = np.zeros((KEYS, nb), np.int32)
                a1 = np.zeros(KEYS, np.float64)
                a2 = np.zeros(KEYS, np.float64)
                for b in range(B):
                    for t in range(T):
                        if not valid[b, t]:
                            continue
                        for j in range(w):
                            v = np.float64(mf[b, t, k0 + j])
                            a1[j] += v
                            a2[j] += v * v
                        for j in range(w):
                            loc[j, lut[(mi[b, t, k0 + j] >> 23) + 256]] += 1
                for j in range(w):
                    s1[k0 + j] = a1[j]
                    s2[k0 + j] = a2[j]
                    for q in range(nb):
                        hist[q, k0 + j] += loc[j, q]

        @njit(parallel=True, cache=True, nogil=True)
        def offer(score, sbits, pos, sids, salt, side, mx, ph, H, P, C, sign, k):  # pragma: no cover
            B, W = score.shape
            npos = ph.shape[1]
            for key in prange(W):
                best = mx[key]
                for b in range(B):
                    v = score[b, key]
                    if v > best:
                        best = v
                    p, q = pos[b, key], 0  # bucket 1 + floor(log2 p), 0 for p = 0, capped
                    while q < npos - 1 and (1 << q) <= p:
                        q += 1
                    ph[key, q] += 1
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

        _kernels = hist_sums, offer
    return _kernels


def _threads() -> None:
    """As many threads as torch uses (one in a Ray shard)."""
    import numba

    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))


def hist_sums(m: torch.Tensor, valid: torch.Tensor, lut: torch.Tensor, hist: torch.Tensor):
    """Add the bins of m (B, T, W) float32's valid tokens (valid (B, T) bool) to hist (NB, W)
    int64 in place; return the per-key sums of m and m² over them, float64 (W,) each.
    lut (512,) int32: raw sign/exponent index -> bin."""
    kernel = _compile()[0]
    _threads()
    mf = m.detach().contiguous().numpy()
    W = mf.shape[-1]
    s1, s2 = np.empty(W), np.empty(W)
    kernel(mf, mf.view(np.int32), valid.detach().contiguous().numpy(), lut.numpy(), hist.numpy(), s1, s2)
    return torch.from_numpy(s1), torch.from_numpy(s2)


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
