"""The Triton kernel of `ffkv.mine.hist_cuda` (imported only when that path runs)."""
import triton
import triton.language as tl


@triton.jit
def key_hist_kernel(m_ptr, len_ptr, lut_ptr, out_ptr, B, T, n, stride_b, stride_t,
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
