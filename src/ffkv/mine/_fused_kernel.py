"""The Triton kernels of `ffkv.mine.fused_cuda` (imported only when that path runs)."""
import triton
import triton.language as tl

from ffkv.mine import rules


def _same_code(fn, **bind):
    """`fn` jitted by Triton from its own code (`ffkv.mine.rules.rebound`), its integer constants
    bound as constexpr."""
    consts = {k: tl.constexpr(getattr(rules, k)) for k in ("_A1", "_A2", "M31", "NPOS")}
    return triton.jit(rules.rebound(fn, tl=tl, **consts, **bind))


sample_hash = _same_code(rules.sample_hash, _perm=_same_code(rules._perm))
pos_bucket = _same_code(rules.pos_bucket)
pack_key = triton.jit(rules.rebound(rules.pack_key, tl=tl))


@triton.jit
def capture_kernel(m_ptr, len_ptr, lut_ptr, hist_ptr, s1_ptr, s2_ptr, hi_ptr, hip_ptr, lo_ptr, lop_ptr,
                   B, W, stride_b, stride_t,
                   ROWS: tl.constexpr, TT: tl.constexpr, BW: tl.constexpr, NBC: tl.constexpr, NB: tl.constexpr,
                   STATS: tl.constexpr, POS: tl.constexpr, NEG: tl.constexpr, FLUSH: tl.constexpr):
    """One read of a block of keys over ROWS rows: each row's max and min with their first
    positions, and (STATS) the bins and the sums of m and m² (float32 within a tile of TT rows,
    float64 across them: the portable path's products are float32 throughout).

    Bins are counted in 10-bit fields, three bins to a 32-bit counter: every value is compared
    with each counter of its key, so 16 counters for the 45 bins take half the compares and
    selects of two bins to a counter (32, a power of two). The fields are flushed into wide
    counters before one could overflow, tile by tile (a row may be longer than a field holds)."""
    pr = tl.program_id(1)
    cols = tl.program_id(0) * BW + tl.arange(0, BW)
    cm = cols < W
    q = tl.arange(0, NBC)  # packed counter r: bins 3r, 3r + 1, 3r + 2 in bits 0-9, 10-19, 20-29
    acc = tl.zeros((NBC, BW), dtype=tl.uint32)
    wide0 = tl.zeros((NBC, BW), dtype=tl.int32)
    wide1 = tl.zeros((NBC, BW), dtype=tl.int32)
    wide2 = tl.zeros((NBC, BW), dtype=tl.int32)
    s1 = tl.zeros((BW,), dtype=tl.float64)
    s2 = tl.zeros((BW,), dtype=tl.float64)
    held = pr * 0  # positions counted since the last flush (an int32 tensor, as the loops carry it)
    for i in range(ROWS):
        b = pr * ROWS + i
        L = tl.load(len_ptr + b, mask=b < B, other=0)
        hi = tl.full((BW,), float("-inf"), tl.float32)
        lo = tl.full((BW,), float("inf"), tl.float32)
        hip = tl.zeros((BW,), tl.int32)
        lop = tl.zeros((BW,), tl.int32)
        base = m_ptr + b.to(tl.int64) * stride_b
        for t0 in range(0, L, TT):
            tt = t0 + tl.arange(0, TT)
            ok = (tt < L)[:, None] & cm[None, :]
            x = tl.load(base + tt[:, None].to(tl.int64) * stride_t + cols[None, :], mask=ok, other=0.0)
            x = x.to(tl.float32)
            if POS:
                xm = tl.where(ok, x, float("-inf"))
                tm = tl.max(xm, axis=0)
                tp = tl.min(tl.where(xm == tm[None, :], tt[:, None], 1 << 30), axis=0)
                up = tm > hi
                hi = tl.where(up, tm, hi)
                hip = tl.where(up, tp, hip)
            if NEG:
                xn = tl.where(ok, x, float("inf"))
                tn = tl.min(xn, axis=0)
                tq = tl.min(tl.where(xn == tn[None, :], tt[:, None], 1 << 30), axis=0)
                dn = tn < lo
                lo = tl.where(dn, tn, lo)
                lop = tl.where(dn, tq, lop)
            if STATS:  # a tile's TT rows summed in float32, carried in float64: most GPUs but the
                # data-centre ones run float64 at 1/32 to 1/64 of float32, and its shuffles cost two
                xz = tl.where(ok, x, 0.0)
                s1 += tl.sum(xz, axis=0).to(tl.float64)
                s2 += tl.sum(xz * xz, axis=0).to(tl.float64)
                if held + TT > FLUSH:  # a 10-bit field could overflow in this tile: flush first
                    wide0 += (acc & 0x3FF).to(tl.int32)
                    wide1 += ((acc >> 10) & 0x3FF).to(tl.int32)
                    wide2 += (acc >> 20).to(tl.int32)
                    acc = tl.zeros((NBC, BW), dtype=tl.uint32)
                    held = 0
                held += TT
                r = (x.to(tl.int32, bitcast=True) >> 23) + 256  # sign and exponent: 0..511
                e = tl.where(ok, tl.load(lut_ptr + r, mask=ok, other=0), NBC)  # padding: no counter
                one = tl.full((TT, BW), 1, tl.uint32) << (e >> 8).to(tl.uint32)  # `fused_cuda.field_lut`
                hit = (e & 0xFF)[:, None, :] == q[None, :, None]  # (TT, NBC, BW)
                acc += tl.sum(tl.where(hit, one[:, None, :], 0), axis=0).to(tl.uint32)
        rm = cm & (b < B)
        if POS:
            tl.store(hi_ptr + b.to(tl.int64) * W + cols, hi, mask=rm)
            tl.store(hip_ptr + b.to(tl.int64) * W + cols, hip, mask=rm)
        if NEG:
            tl.store(lo_ptr + b.to(tl.int64) * W + cols, -lo, mask=rm)
            tl.store(lop_ptr + b.to(tl.int64) * W + cols, lop, mask=rm)
    if STATS:
        wide0 += (acc & 0x3FF).to(tl.int32)
        wide1 += ((acc >> 10) & 0x3FF).to(tl.int32)
        wide2 += (acc >> 20).to(tl.int32)
        cell = q[:, None] * 3 * W + cols[None, :]
        # only bins that counted something: most of a key's bins are empty over ROWS rows, and
        # every atomic is a round trip to L2
        tl.atomic_add(hist_ptr + cell, wide0, mask=((3 * q)[:, None] < NB) & cm[None, :] & (wide0 != 0))
        tl.atomic_add(hist_ptr + cell + W, wide1, mask=((3 * q + 1)[:, None] < NB) & cm[None, :] & (wide1 != 0))
        tl.atomic_add(hist_ptr + cell + 2 * W, wide2, mask=((3 * q + 2)[:, None] < NB) & cm[None, :] & (wide2 != 0))
        tl.store(s1_ptr + pr * W + cols, s1, mask=cm)
        tl.store(s2_ptr + pr * W + cols, s2, mask=cm)


@triton.jit
def _sample_slot(v, sid, salt, cols, mask, side_ptr, SIDE: tl.constexpr, K: tl.constexpr):
    """For best coefficients v (any shape, with sid, salt and cols broadcast to it): whether each
    has a positive side bin, its sample hash, and the first of its bin's K sorted slots."""
    j = tl.load(side_ptr + (v.to(tl.int32, bitcast=True) >> 23) + 256, mask=mask, other=-1)
    slot = (cols.to(tl.int64) * SIDE + tl.maximum(j, 0)) * K
    return mask & (j >= 0), sample_hash(sid, salt), slot


@triton.jit
def offer_kernel(score_ptr, pos_ptr, sid_ptr, salt_ptr, side_ptr, mx_ptr, ph_ptr, h_ptr, p_ptr, c_ptr,
                 B, W, SIGN: tl.constexpr, K: tl.constexpr, SIDE: tl.constexpr, NPOS: tl.constexpr,
                 BW: tl.constexpr, R: tl.constexpr):
    """Each key's row bests: the running max, the position buckets and the k smallest-hash
    samples of each side bin (sorted slots; an entering sample shifts the larger ones up). One
    program owns its keys, so no two writers meet.

    Rows go R at a time: their loads are issued together, and the samples are checked against
    the chunk's starting state. Where no row of the chunk enters (the common case once the
    samples fill), none would have one by one either, since nothing changed: the chunk costs one
    round trip instead of R. Otherwise its rows are taken one by one, as they must be."""
    cols = tl.program_id(0) * BW + tl.arange(0, BW)
    cm = cols < W
    best = tl.load(mx_ptr + cols, mask=cm, other=float("-inf"))
    salt = tl.load(salt_ptr + cols, mask=cm, other=0)
    qs = tl.arange(0, NPOS)
    rr = tl.arange(0, R)
    ph = tl.zeros((NPOS, BW), dtype=tl.int32)
    for b0 in range(0, B, R):
        rows = b0 + rr
        rm = rows < B
        ok2 = rm[:, None] & cm[None, :]
        v2 = tl.load(score_ptr + rows.to(tl.int64)[:, None] * W + cols[None, :], mask=ok2, other=float("-inf"))
        top = tl.max(v2, axis=0)
        best = tl.where(top > best, top, best)
        for r in tl.static_range(R):  # the buckets row by row (a (NPOS, R, BW) tile would not fit)
            live = b0 + r < B
            p = tl.load(pos_ptr + tl.cast(b0 + r, tl.int64) * W + cols, mask=cm & live, other=0)
            ph += ((qs[:, None] == pos_bucket(p)[None, :]) & live).to(tl.int32)
        if K > 0:
            ok2, h2, slot2 = _sample_slot(v2, tl.load(sid_ptr + rows, mask=rm, other=0)[:, None], salt[None, :],
                                          cols[None, :], ok2, side_ptr, SIDE, K)
            last2 = tl.load(h_ptr + slot2 + (K - 1), mask=ok2, other=0)
            if tl.sum((ok2 & (h2 < last2)).to(tl.int32)) > 0:
                for b in range(b0, tl.minimum(b0 + R, B)):
                    row = tl.cast(b, tl.int64) * W
                    v = tl.load(score_ptr + row + cols, mask=cm, other=float("-inf"))
                    p = tl.load(pos_ptr + row + cols, mask=cm, other=0)
                    ok, h, slot = _sample_slot(v, tl.load(sid_ptr + b), salt, cols, cm, side_ptr, SIDE, K)
                    last = tl.load(h_ptr + slot + (K - 1), mask=ok, other=0)
                    placed = ~(ok & (h < last))
                    for jj in range(0, K - 1):  # a loop, not unrolled: --samples-per-bin goes to 1,000
                        i = K - 1 - jj
                        prev = tl.load(h_ptr + slot + (i - 1), mask=~placed, other=0)
                        shift = ~placed & (prev > h)
                        tl.store(h_ptr + slot + i, prev, mask=shift)
                        tl.store(p_ptr + slot + i, tl.load(p_ptr + slot + (i - 1), mask=shift), mask=shift)
                        tl.store(c_ptr + slot + i, tl.load(c_ptr + slot + (i - 1), mask=shift), mask=shift)
                        put = ~placed & ~shift
                        tl.store(h_ptr + slot + i, h.to(tl.int32), mask=put)
                        tl.store(p_ptr + slot + i, p.to(p_ptr.dtype.element_ty), mask=put)
                        tl.store(c_ptr + slot + i, v * SIGN, mask=put)
                        placed = placed | put
                    tl.store(h_ptr + slot, h.to(tl.int32), mask=~placed)
                    tl.store(p_ptr + slot, p.to(p_ptr.dtype.element_ty), mask=~placed)
                    tl.store(c_ptr + slot, v * SIGN, mask=~placed)
    tl.store(mx_ptr + cols, best, mask=cm)
    cell = cols[None, :].to(tl.int64) * NPOS + qs[:, None]
    tl.store(ph_ptr + cell, tl.load(ph_ptr + cell, mask=cm[None, :], other=0) + ph, mask=cm[None, :])


@triton.jit
def topk_kernel(score_ptr, pos_ptr, sid_ptr, key_ptr, kpos_ptr, B, W, T: tl.constexpr, BW: tl.constexpr,
                STAGES: tl.constexpr):
    """Each key's top-T list (sorted keys, `ffkv.mine.rules.pack_key`) takes the rows' bests in
    row order: a candidate below the list's last key is inserted, the larger ones shift up. The
    same lists as the portable merge (keys are unique: one sentence once). Rows where no key of
    the block enters cost one compare each, the common case once the lists have filled. The rows'
    loads are prefetched STAGES rows ahead (asynchronous copies): they are read-only, and the
    lists, which the loop writes, are read only inside its branch, which Triton does not prefetch
    (`ffkv.mine.fused_aot` counts the copies; a test holds them to the rows' three loads)."""
    cols = tl.program_id(0) * BW + tl.arange(0, BW)
    cm = cols < W
    base = cols.to(tl.int64) * T
    worst = tl.load(key_ptr + base + (T - 1), mask=cm, other=0)  # masked lanes: nothing is below 0
    for b in tl.range(0, B, num_stages=STAGES):
        row = tl.cast(b, tl.int64) * W
        v = tl.load(score_ptr + row + cols, mask=cm, other=0.0)
        p = tl.load(pos_ptr + row + cols, mask=cm, other=0)
        bits = (-v + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
        cand = pack_key(bits, tl.load(sid_ptr + b))
        enter = cm & (cand < worst)
        if tl.sum(enter.to(tl.int32), axis=0) > 0:
            placed = ~enter
            for j in range(0, T - 1):
                i = T - 1 - j
                prev = tl.load(key_ptr + base + (i - 1), mask=~placed, other=0)
                shift = ~placed & (prev > cand)
                tl.store(key_ptr + base + i, prev, mask=shift)
                tl.store(kpos_ptr + base + i, tl.load(kpos_ptr + base + (i - 1), mask=shift), mask=shift)
                put = ~placed & ~shift
                tl.store(key_ptr + base + i, cand, mask=put)
                tl.store(kpos_ptr + base + i, p, mask=put)
                placed = placed | put
            tl.store(key_ptr + base, cand, mask=~placed)
            tl.store(kpos_ptr + base, p, mask=~placed)
            worst = tl.load(key_ptr + base + (T - 1), mask=cm, other=0)
