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

import importlib.util
import os

import torch

BW = 128  # keys per program
ROWS = 8  # batch rows per program
NBP = 64  # bins padded to a power of two (>= stats.NB)


def available(device) -> bool:
    """The kernel runs here: asked for (FFKV_TRITON=1), Triton present, a CUDA device (or Triton's
    interpreter). Triton is imported only then: on a CPU its import alone slowed mining."""
    if os.environ.get("FFKV_TRITON", "0") != "1":
        return False
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return importlib.util.find_spec("triton") is not None


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
        from ffkv.mine._hist_kernel import key_hist_kernel

        grid = (-(-n // BW), -(-B // ROWS))
        key_hist_kernel[grid](m, lengths, lut, out, B, T, n, m.stride(0), m.stride(1),
                              ROWS=ROWS, BW=BW, NBP=NBP, NB=nb, num_warps=4)
    return out
