"""Every key's histogram of one batch in one pass on CUDA (a Triton kernel; issue 24).

torch has no per-column histogram: the portable path (`ffkv.mine.stats.KeyStats.update`) scatters
every value of a batch into a (bin, key) table with `index_add_`, which on a GPU means an index
tensor the size of the captures and one atomic per value. Here each program counts a tile of keys
over its rows in registers (the bin of a value is read from its sign and exponent bits through
the same table, `ffkv.mine.stats._raw_luts`) and adds its counts once. The counts are integers, so
both paths give the same table.

Off unless `FFKV_TRITON=1`: measured on an H200 (`benchmarks/bench_stats_gpu.py`), it counts
bit-equal to the portable path but is no faster (9 ms for 0.49G values: its 64-way compare per
value bounds it, not memory), and the mining batch's time is spread over top-k, products and
copies as much as over the histogram. It is the first part of a fused statistics kernel.
"""
from __future__ import annotations

import os

import torch

try:  # torch's CUDA builds ship Triton; the CPU build does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BW = 128  # keys per program
ROWS = 8  # batch rows per program
NBP = 64  # bins padded to a power of two (>= stats.NB)


def available(device) -> bool:
    """The kernel runs here: asked for (FFKV_TRITON=1), Triton present, a CUDA device (or Triton's interpreter)."""
    if triton is None or os.environ.get("FFKV_TRITON", "0") != "1":
        return False
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _key_hist(m_ptr, len_ptr, lut_ptr, out_ptr, B, T, n, stride_b, stride_t,
                  ROWS: tl.constexpr, BW: tl.constexpr, NBP: tl.constexpr, NB: tl.constexpr):
        cols = tl.program_id(0) * BW + tl.arange(0, BW)
        cm = cols < n
        bins = tl.arange(0, NBP)
        acc = tl.zeros((NBP, BW), dtype=tl.int32)
        for i in range(ROWS):
            b = tl.program_id(1) * ROWS + i
            L = tl.load(len_ptr + b, mask=b < B, other=0)  # rows past B count nothing
            base = m_ptr + b.to(tl.int64) * stride_b
            for t in range(0, T):
                ok = cm & (t < L)
                x = tl.load(base + t * stride_t + cols, mask=ok, other=0.0)
                r = (x.to(tl.int32, bitcast=True) >> 23) + 256  # sign and exponent: 0..511
                k = tl.load(lut_ptr + r)
                acc += ((k[None, :] == bins[:, None]) & ok[None, :]).to(tl.int32)
        tl.atomic_add(out_ptr + bins[:, None] * n + cols[None, :], acc,
                      mask=(bins[:, None] < NB) & cm[None, :])


def key_hist(m: torch.Tensor, lengths: torch.Tensor, lut: torch.Tensor, nb: int) -> torch.Tensor:
    """(nb, n) int32 counts of each key's bins over the valid tokens of right-padded m (B, T, n)
    float32; lengths (B,) int32 on m's device, lut (512,) int32: raw sign/exponent index -> bin."""
    if nb > NBP:
        raise ValueError(f"{nb} bins: the kernel holds at most {NBP}")
    if m.stride(-1) != 1:
        m = m.contiguous()
    B, T, n = m.shape
    out = torch.zeros((nb, n), dtype=torch.int32, device=m.device)
    if B and n:
        grid = (triton.cdiv(n, BW), triton.cdiv(B, ROWS))
        _key_hist[grid](m, lengths, lut, out, B, T, n, m.stride(0), m.stride(1),
                        ROWS=ROWS, BW=BW, NBP=NBP, NB=nb, num_warps=4)
    return out
