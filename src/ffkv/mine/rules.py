"""The rules that the trackers' three paths share bit for bit: the torch code (`ffkv.mine.stats`,
`ffkv.mine.topk`), numba on a CPU (`ffkv.mine.stats_cpu`) and Triton on CUDA
(`ffkv.mine._fused_kernel`). The compiled kernels are compiled from these very functions
(`rebound`), so each rule has one definition. A leaf: it imports nothing of ffkv, and every
backend imports it.
"""
from __future__ import annotations

import numpy as np
import torch

E_LO, E_HI = -10, 10  # octaves [2^k, 2^(k+1)) for E_LO <= k < E_HI
OCTAVES = E_HI - E_LO
SIDE = OCTAVES + 2  # per side: tiny, octaves, overflow
NB = 2 * SIDE + 1  # bins in all
ZERO = SIDE  # index of the zero bin
TINY = 2.0 ** -126  # smallest normal float32: below it, "zero"
NPOS = 16  # position buckets: 0, 1, 2-3, 4-7, ..., >= 2^14
M31 = (1 << 31) - 1
EMPTY = M31  # hash of an empty sample slot (real hashes are < 2^31 - 1)
LIMB_SCALES = (2.0 ** 24, 2.0 ** -16, 2.0 ** -56)  # units of the three integer limbs of a sum


# ---- bins (`ffkv.mine.stats.layout` says them to readers) -----------------------------------------
def _raw_luts() -> tuple[torch.Tensor, torch.Tensor]:
    """Tables from r = (float32 bits >> 23) + 256 (sign and exponent) to the bin, and to the
    positive side's bin j (-1 for zero and negative values)."""
    full, pos = [], []
    for r in range(512):
        neg, e = (r < 256), (r if r < 256 else r - 256)
        if e == 0:
            full.append(ZERO)
            pos.append(-1)
            continue
        k = e - 127
        j = 0 if k < E_LO else SIDE - 1 if k >= E_HI else 1 + k - E_LO
        full.append(ZERO - 1 - j if neg else ZERO + 1 + j)
        pos.append(-1 if neg else j)
    return torch.tensor(full, dtype=torch.long), torch.tensor(pos, dtype=torch.long)


def rebound(fn, **bind):
    """A copy of `fn` whose globals include `bind`: the compiled kernels (numba, Triton) build
    their versions of the rules here (`pos_bucket`, `sample_hash`, `pack_key`) from this very
    code, with their own compiled helpers and constants bound in."""
    import types

    g = dict(fn.__globals__)
    g.update(bind)
    return types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)


def pos_bucket(p):
    """The position bucket of p >= 0 (`ffkv.mine.stats.layout`'s rule): 0 for p = 0, else 1 + floor(log2 p), the
    last bucket also everything beyond. Operators only: the compiled kernels (numba on a CPU,
    Triton on CUDA) use this code itself; the portable torch path reads the same buckets from the
    float's exponent bits in fewer ops (`ffkv.mine.stats.KeyStats.update`; tests hold the two equal)."""
    q = p * 0
    for i in range(NPOS - 1):
        q += p >= (1 << i)
    return q


# ---- sample hash: a seeded bijection of sentence ids per key ---------------------------------------
_A1, _A2 = 0x2C1B3C6D, 0x297A2D39  # odd multipliers
_A1I, _A2I = pow(_A1, -1, 1 << 31), pow(_A2, -1, 1 << 31)


def _perm(x):
    """A bijection of [0, 2^31) (multiply-xorshift; works on torch and numpy int64)."""
    x = (x * _A1) & M31
    x = x ^ (x >> 16)
    x = (x * _A2) & M31
    return x ^ (x >> 16)


def _perm_inv(x):
    x = x ^ (x >> 16)  # x ^= x >> 16 undoes itself on 31 bits
    x = (x * _A2I) & M31
    x = x ^ (x >> 16)
    return (x * _A1I) & M31


def key_salt(layer: int, dims):
    """Per-key salt in [0, 2^31): varies the sample order from key to key."""
    return _perm((np.asarray(dims, np.int64) + 1 + layer * 65537) & M31)


def sample_hash(sid, salt):
    """h(sentence_id) for a key: a bijection of [0, 2^31 - 1), so EMPTY (2^31 - 1) is never a hash.

    π(sid ^ salt) is a bijection of [0, 2^31); the one valid id mapped to 2^31 - 1 takes the
    value that no valid id gets, π((2^31 - 1) ^ salt)."""
    x = _perm(sid ^ salt)
    hole = _perm(salt ^ M31)
    return x + (x == M31) * (hole - x)


def sample_sid(h, salt):
    """Inverse of `sample_hash`."""
    hole = _perm(salt ^ M31)
    x = h + (h == hole) * (M31 - h)
    return _perm_inv(x) ^ salt


# ---- exact sums -----------------------------------------------------------------------------------
def to_limbs(x: torch.Tensor) -> torch.Tensor:
    """float64 (...) -> exact int64 limbs (3, ...): x = Σ limb_i · LIMB_SCALES[i] (to 2^-56).

    Limbs add as integers, so sums carried in them do not depend on the order of additions. Each
    addition grows a limb by < 2^41: 2^22 batches fit."""
    q0 = torch.div(x, LIMB_SCALES[0], rounding_mode="trunc")
    r = torch.add(x, q0, alpha=-LIMB_SCALES[0])  # exact: the bits of x below 2^24
    q1 = torch.div(r, LIMB_SCALES[1], rounding_mode="trunc")
    r = torch.add(r, q1, alpha=-LIMB_SCALES[1])  # exact, |r| < 2^-16
    q2 = torch.round(r / LIMB_SCALES[2])
    return torch.stack([q0, q1, q2]).to(torch.int64)


def from_limbs(limbs: np.ndarray) -> np.ndarray:
    limbs = np.asarray(limbs)
    return (limbs[0].astype(np.float64) * LIMB_SCALES[0] + limbs[1].astype(np.float64) * LIMB_SCALES[1]
            + limbs[2].astype(np.float64) * LIMB_SCALES[2])


# ---- top-k keys -----------------------------------------------------------------------------------
def pack_key(bits, tie):
    """The int64 key of a score from the float32 bits of −score + 0.0 (widened to int64), ties by
    `tie` (0 <= tie < 2^31): smallest first = highest score. Operators only, so torch and the
    fused CUDA kernel (`ffkv.mine._fused_kernel`) share this one definition."""
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) + (1 << 31)  # float order as integers, >= 0
    return (ordered << 31) | tie
