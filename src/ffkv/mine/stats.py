"""Every key's activation profile from the mining pass: histogram, summary, quantile samples, positions.

`KeyStats` is a tracker (`ffkv.mine.trackers`) beside the top-k, fed by the same captures on
their device. Off with `ffkv mine --no-stats`. It writes three tables (a public contract):

``key_hist``: layer int16, dim int32, bin int16, count int64. The signed histogram of m over
every valid token of the corpus, one row per non-empty bin (absent rows are 0). The bins are the
same for every key and are recorded in the manifest (`manifest.steps.mine.stats`, `layout()`):
bin b holds the m with sign(m) = sign[b] and lo[b] <= |m| < hi[b]. They are ordered by value:
the negative side (|m| from large to small), one zero bin (|m| < 2^-126: zeros and subnormal
floats), the positive side. Each side has a tiny bin (|m| < 2^-10), 20 octaves
[2^k, 2^(k+1)) for k = -10..9, and an overflow bin (|m| >= 2^10): 45 bins, log2-spaced, so a
token's bin is read from its float's sign and exponent bits. Per key, the counts add up to the
number of valid tokens.

``key_stats``: layer int16, dim int32, sign int8 (+1, and -1 when mined with --negative), then
  - count int64: valid tokens seen (the same on both sign rows);
  - mean, std float32: of m over every valid token (population std; the same on both sign rows);
  - max float32: the extreme coefficient on this side (max m for +1, min m for -1), exact;
  - frac_active float32: share of tokens with sign·m > 0 (for +1: the density, m > 0);
  - frac_strong float32: share of tokens with sign·m > 10% of the key's own extreme on that side;
  - p50, p90, p99 float32: quantiles of m among the tokens on this side (sign·m > 0), signed;
    null when the side has no token;
  - sentences int64: sentences seen; pos_hist list<int64>: where each sentence's best
    coefficient on this side sits (the candidate the top-k uses): bucket 0 is position 0,
    bucket b >= 1 positions [2^(b-1), 2^b), the last bucket also everything beyond;
    first_share float32 = pos_hist[0] / sentences (keys that fire on the first token).
  frac_strong and the quantiles are read from the histogram: interpolated geometrically within
  an octave, linearly within the tiny bin, with the top occupied bin capped at the exact max.
  count, mean, std, max and frac_active are exact.

``key_samples``: layer int16, dim int32, sign int8, bin int16, sentence_id int64, position int32,
coef float32. For each key, sign and histogram bin on that side: up to k sentences (default 5,
`--samples-per-bin`) drawn from the sentences whose best coefficient on that side (sign·m > 0,
the top-k's candidate, at its first best position) falls in the bin: those with the k smallest
`sample_hash(sentence_id, layer, dim)`, a seeded bijection. Deterministic and mergeable: the
same rows under resume, merge and Ray sharding, given the same floats from the forward (a machine
that rounds a value differently can move it across a bin edge; DEVELOPING.md). Rows are ordered
by layer, dim, sign desc, bin, then hash.

Exactness: histogram and position counts are integers; the sums behind mean and std are summed
per batch (in float64 key by key on a CPU, `ffkv.mine.stats_cpu`, and in the fused CUDA kernel,
`ffkv.mine.fused_cuda`; as float32 products on the portable path)
and carried across batches as exact integer limbs (`to_limbs`), so any merge order gives the
same bits. The bins, position buckets, sample hash and limbs, which the compiled kernels share,
are defined once, in `ffkv.mine.rules`.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ffkv.mine import fused_cuda, stats_cpu
from ffkv.mine.groups import layer_groups, unit_of
from ffkv.mine.rules import (E_HI, E_LO, EMPTY, NB, NPOS, SIDE, TINY, ZERO, _raw_luts, from_limbs, key_salt,
                             sample_hash, sample_sid, to_limbs)

STRONG = 0.1  # frac_strong: share above this fraction of the key's own extreme
QUANTILES = (0.5, 0.9, 0.99)


# ---- bins -----------------------------------------------------------------------------------------
def side_edges() -> tuple[np.ndarray, np.ndarray]:
    """|m| bounds (lo, hi) of one side's bins, |m| ascending: tiny, octaves, overflow (hi = inf)."""
    lo = np.array([TINY] + [2.0 ** k for k in range(E_LO, E_HI)] + [2.0 ** E_HI])
    hi = np.array([2.0 ** E_LO] + [2.0 ** (k + 1) for k in range(E_LO, E_HI)] + [math.inf])
    return lo, hi


def bin_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per bin (value order): sign (-1, 0, +1) and the |m| bounds lo <= |m| < hi."""
    lo, hi = side_edges()
    sign = np.array([-1] * SIDE + [0] + [1] * SIDE, np.int8)
    return sign, np.concatenate([lo[::-1], [0.0], lo]), np.concatenate([hi[::-1], [TINY], hi])


def side_bin(sign: int, j):
    """Bin index of side bin j (0 = tiny) on side `sign`."""
    return ZERO + 1 + j if sign == 1 else ZERO - 1 - j


def layout() -> dict:
    """What the manifest records about the bins (JSON: an unbounded hi is null)."""
    sign, lo, hi = bin_table()
    return {"version": 1, "bins": NB, "zero_bin": ZERO,
            "sign": sign.tolist(), "lo": lo.tolist(), "hi": [None if math.isinf(h) else h for h in hi],
            "rule": "bin b holds m with sign(m) = sign[b] and lo[b] <= |m| < hi[b]; the zero bin "
                    "(sign 0) holds |m| < 2^-126 (zeros and subnormals)",
            "position_buckets": NPOS,
            "position_rule": "bucket 0: position 0; bucket b >= 1: positions [2^(b-1), 2^b); the last "
                             "also holds every later position",
            "strong": STRONG, "quantiles": list(QUANTILES),
            "interpolation": "quantiles and frac_strong: geometric within an octave, linear within the "
                             "tiny bin, the top occupied bin capped at the exact max"}


def bin_of(m) -> np.ndarray:
    """The bin of each value (numpy, float32), by the rule of `layout` (for readers)."""
    a = np.abs(np.asarray(m, np.float32)).astype(np.float64)
    s = np.sign(np.asarray(m, np.float32))
    lo, _ = side_edges()
    j = np.searchsorted(lo, a, side="right") - 1  # -1: below TINY
    return np.where(j < 0, ZERO, np.where(s > 0, ZERO + 1 + j, ZERO - 1 - j)).astype(np.int16)


# ---- reading the histogram ------------------------------------------------------------------------
def side_counts(hist: np.ndarray, sign: int) -> np.ndarray:
    """(n, NB) histogram -> (n, SIDE) counts of one side, |m| ascending."""
    return hist[:, ZERO + 1:] if sign == 1 else hist[:, :ZERO][:, ::-1]


def _bounds(maxabs: np.ndarray):
    lo, hi = side_edges()
    lo = np.broadcast_to(lo, (len(maxabs), SIDE)).copy()
    hi = np.minimum(hi[None, :], maxabs[:, None])  # the top occupied bin ends at the max
    hi = np.maximum(hi, lo)
    lo[:, 0] = 0.0  # the tiny bin: linear from 0
    return lo, hi


def bin_moments(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """E|m| and E m² of the tokens in bins [lo, hi), under the model the quantiles read them by:
    log-uniform within an octave, uniform from 0 in a tiny bin (lo < 2^-100), a point where a bin
    was cut to its lower edge. Callers cap unbounded bins first (the histogram keeps no sums)."""
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    e1, e2 = lo.copy(), lo ** 2
    tiny = lo < 2.0 ** -100
    e1[tiny], e2[tiny] = hi[tiny] / 2, hi[tiny] ** 2 / 3
    octv = ~tiny & (hi > lo)
    r = np.log(hi[octv] / lo[octv])
    e1[octv], e2[octv] = (hi[octv] - lo[octv]) / r, (hi[octv] ** 2 - lo[octv] ** 2) / (2 * r)
    return e1, e2


def hist_quantiles(counts: np.ndarray, maxabs: np.ndarray, qs=QUANTILES) -> np.ndarray:
    """(n, SIDE) side counts -> (n, len(qs)) quantiles of |m| on that side (nan: empty side)."""
    counts = counts.astype(np.float64)
    lo, hi = _bounds(maxabs)
    cum = np.cumsum(counts, 1)
    total = cum[:, -1]
    rows = np.arange(len(counts))
    out = np.full((len(counts), len(qs)), np.nan)
    for qi, q in enumerate(qs):
        target = q * total
        b = np.argmax(cum >= target[:, None] - 1e-9 * total[:, None], axis=1)
        c = counts[rows, b]
        f = np.clip(np.divide(target - (cum[rows, b] - c), c, out=np.zeros_like(c), where=c > 0), 0, 1)
        l, h = lo[rows, b], hi[rows, b]
        with np.errstate(divide="ignore", invalid="ignore"):
            geo = l * np.power(np.divide(h, l, out=np.ones_like(h), where=l > 0), f)
        out[:, qi] = np.where(total > 0, np.where(b == 0, f * h, geo), np.nan)
    return out


def hist_share_above(counts: np.ndarray, maxabs: np.ndarray, frac: float = STRONG) -> np.ndarray:
    """(n, SIDE) side counts -> tokens with |m| > frac · maxabs (interpolated within its bin)."""
    lo, hi = _bounds(maxabs)
    t = (frac * maxabs)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        geo = np.log(hi / t) / np.log(hi / lo)
        lin = (hi - t) / hi
    part = np.where(np.arange(SIDE)[None, :] == 0, lin, geo)
    share = np.where(lo >= t, 1.0, np.where(hi <= t, 0.0, np.nan_to_num(part)))
    return (counts * np.clip(share, 0, 1)).sum(1)


# ---- the tracker ----------------------------------------------------------------------------------
class KeyStats:
    """Histogram, summary sums, extremes, positions and quantile samples of every mined key.

    State per group of layers (`ffkv.mine.groups.layer_groups`; its G·n keys side by side, on
    `device`): hist (NB, G·n) int64 and sum limbs (2, 3, G·n) int64; per sign: max (G·n,) float32,
    positions (G·n, NPOS) int64 and the sample slots (G·n, SIDE, k) (hash int32, sorted ascending
    with EMPTY last; position int16/int32; coef float32): 408 bytes per key plus 1,232 per key
    and sign at k = 5 (SmolLM2, 46,080 keys: 76 MB; 132 MB with --negative), and, on the
    portable path only, one scratch histogram of 4 KB per key of a group. Dicts are keyed by
    the group (a tuple of layers)."""

    name = "stats"

    def __init__(self, layers: list[int], dims: list[int] | None, d_m: int, signs=(1,), samples: int = 5,
                 device=None, max_position: int = 32767, group: int = 1):
        self.layers, self.signs, self.k = list(layers), tuple(signs), int(samples)
        self.dims = None if dims is None else list(dims)
        self.d_m, self.max_position, self.group = d_m, max_position, int(group)
        self.dim_ids = np.arange(d_m) if dims is None else np.asarray(self.dims, np.int64)
        n = self.n = len(self.dim_ids)
        dev = self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pos_dtype = torch.int16 if max_position < (1 << 15) else torch.int32
        self.tokens = 0
        self.sentences = 0
        self.groups = layer_groups(self.layers, group)
        self._unit = unit_of(self.groups)
        W = {g: n * len(g) for g in self.groups}
        self.hist = {g: torch.zeros((NB, W[g]), dtype=torch.long, device=dev) for g in self.groups}
        self.limbs = {g: torch.zeros((2, 3, W[g]), dtype=torch.long, device=dev) for g in self.groups}
        keys = [(s, g) for s in self.signs for g in self.groups]
        self.max = {sg: torch.full((W[sg[1]],), -math.inf, device=dev) for sg in keys}
        self.pos = {sg: torch.zeros((W[sg[1]], NPOS), dtype=torch.long, device=dev) for sg in keys}
        k = max(self.k, 1)
        self.sh = {sg: torch.full((W[sg[1]], SIDE, k), EMPTY, dtype=torch.int32, device=dev) for sg in keys}
        self.sp = {sg: torch.zeros((W[sg[1]], SIDE, k), dtype=self.pos_dtype, device=dev) for sg in keys}
        self.sc = {sg: torch.full((W[sg[1]], SIDE, k), math.nan, device=dev) for sg in keys}
        lut, side = _raw_luts()
        self._lut, self._side = lut.to(dev), side.to(dev)
        self._lut32, self._side32 = fused_cuda.bin_lut(dev), self._side.to(torch.int32)
        self._salt = {g: torch.as_tensor(np.concatenate([key_salt(l, self.dim_ids) for l in g]), device=dev)
                      for g in self.groups}
        self._one = torch.ones(1, dtype=torch.long, device=dev)
        self._scratch: dict = {}

    def _offsets(self, w: int):
        """Per group width w: raw histogram offsets (r, key; bin-major), position-bucket and
        sample-group offsets, made once per width."""
        if w not in self._scratch:
            dev = self.device
            self._scratch[w] = (torch.arange(w, dtype=torch.int32, device=dev) + 256 * w,
                                torch.arange(w, dtype=torch.int32, device=dev) * NPOS,
                                torch.arange(w, dtype=torch.long, device=dev) * SIDE)
        return self._scratch[w]

    def _raw(self, w: int) -> torch.Tensor:
        """The portable histogram's scratch (4 KB per key of a group), made only where it runs."""
        if ("raw", w) not in self._scratch:
            self._scratch[("raw", w)] = torch.zeros(w * 512, dtype=torch.long, device=self.device)
        return self._scratch[("raw", w)]

    def _at(self, l: int) -> tuple[tuple[int, ...], slice]:
        """Layer l's group and its keys' slice of the group's key axis."""
        g, i = self._unit[l]
        return g, slice(i * self.n, (i + 1) * self.n)

    # ---- update -----------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, batch, cap) -> None:
        g = self._unit[cap.layers[0]][0]
        if g != cap.layers:
            raise ValueError(f"layers {list(cap.layers)} arrived where the statistics hold {list(g)}")
        if g == self.groups[0]:
            self.tokens += batch.tokens
            self.sentences += len(batch.lengths)
        n = cap.n
        cpu = stats_cpu.available(self.device)
        fused = cap.hist_sums()
        if fused is not None:  # counted in the capture's compiled read (numba or Triton)
            self.hist[g] += fused[0]
            sums = fused[1]
        elif cpu:  # a capture that was not asked for statistics: the same kernel
            sums = torch.stack(stats_cpu.hist_sums(cap.m, batch.mask, self._lut32, self.hist[g]))
        else:
            self._hist(g, cap, batch)
            sums = torch.stack(self._sums(cap, batch))
        poffs = self._offsets(n)[1]
        self.limbs[g] += to_limbs(sums).transpose(0, 1)  # (2, 3, n): both sums in one pass
        for s in self.signs:
            score, pos = cap.best(s)
            args = self.offer_args(g, s, score, pos, batch.sids)
            if cpu:
                stats_cpu.offer(*args)
                continue
            if fused_cuda.available(self.device) and fused_cuda.offer(*args):
                continue
            mx = self.max[(s, g)]
            torch.maximum(mx, score.amax(0), out=mx)
            pb = torch.bitwise_right_shift(pos.float().view(torch.int32), 23) - 126  # 1 + floor(log2 pos)
            pb = pb.clamp_(0, NPOS - 1) + poffs
            pb = pb.reshape(-1)
            self.pos[(s, g)].view(-1).index_add_(0, pb, self._one.expand(pb.numel()))
            if self.k:
                self._sample(s, g, score, pos, batch.sids)

    def offer_args(self, g, s: int, score, pos, sids) -> tuple:
        """The compiled offers' arguments (`stats_cpu.offer`, `fused_cuda.offer`): rows' bests and
        this group's and sign's state."""
        return (score, pos, sids, self._salt[g], self._side32, self.max[(s, g)], self.pos[(s, g)],
                self.sh[(s, g)], self.sp[(s, g)], self.sc[(s, g)], s, self.k)

    def _hist(self, g, cap, batch) -> None:
        """The portable histogram."""
        n = cap.n
        offs, raw = self._offsets(n)[0], self._raw(n)
        raw.zero_()
        blocks, pad_zeros = cap.blocks()
        for v in blocks:
            # raw index r·n + key, r = (sign and exponent bits) + 256: bin-major, so neighbouring
            # keys (mostly of like exponents) count into neighbouring cells; one scatter-add.
            # torch has no per-column histogram; index_add_ (not bincount) keeps shapes static.
            idx = torch.bitwise_right_shift(v.view(torch.int32), 23)
            idx = torch.add(offs, idx, alpha=n, out=idx).reshape(-1)
            raw.index_add_(0, idx, self._one.expand(idx.numel()))
        if pad_zeros:
            raw.view(512, n)[256] -= pad_zeros
        self.hist[g].index_add_(0, self._lut, raw.view(512, n))

    @staticmethod
    def _sums(cap, batch):
        """Sums of m and m² over valid tokens as a masked matrix product: BLAS under
        MKL_CBWR=STRICT gives the same bits for any thread count (Ray shards run 1 thread),
        which torch's own reductions do not (their vector/scalar split moves with the
        per-thread chunk)."""
        m2 = cap.m.reshape(-1, cap.m.shape[-1])
        w = batch.weights(m2.dtype)
        return (w @ m2).squeeze(0).double(), (w @ (m2 * m2)).squeeze(0).double()

    def _sample(self, s: int, g, score, pos, sids) -> None:
        """Offer each row's best (score (B, w) = s·m, pos) to its (key, bin)'s k smallest hashes."""
        k = self.k
        j = self._side[torch.bitwise_right_shift(score.view(torch.int32), 23).long() + 256]  # (B, w), -1: none
        h = sample_hash(sids.unsqueeze(1), self._salt[g].unsqueeze(0))  # (B, w) int64
        H = self.sh[(s, g)].view(-1, k)
        gi = self._offsets(score.shape[-1])[2].unsqueeze(0) + j.clamp(min=0)
        enter = (j >= 0) & (h < H[:, k - 1][gi])
        bi, ki = enter.nonzero(as_tuple=True)
        if bi.numel() == 0:
            return
        self._insert(s, g, gi[bi, ki], h[bi, ki], pos[bi, ki], score[bi, ki] * s)

    def _insert(self, s: int, grp, g, hh, pp, cc) -> None:
        """Merge N candidates (sample group g = key·SIDE + bin, hash, position, coef) into the slots.

        Static shapes (no unique): each candidate merges its whole group's k first candidates
        with the group's slots; candidates of one group compute the same row and write it alike.
        """
        k = self.k
        order = torch.argsort(g * (1 << 31) + hh)
        g, hh, pp, cc = g[order], hh[order], pp[order], cc[order]
        N = g.numel()
        start = torch.searchsorted(g, g)  # first candidate of each one's group
        win = start.unsqueeze(1) + torch.arange(k, device=g.device).unsqueeze(0)  # (N, k)
        ok = win < N
        win = win.clamp(max=N - 1)
        ok &= g[win] == g.unsqueeze(1)
        H, P, C = (t.view(-1, k) for t in (self.sh[(s, grp)], self.sp[(s, grp)], self.sc[(s, grp)]))
        allh = torch.cat([H[g].long(), torch.where(ok, hh[win], EMPTY)], 1)
        idx = torch.topk(allh, k, 1, largest=False, sorted=True).indices
        H[g] = allh.gather(1, idx).to(H.dtype)
        P[g] = torch.cat([P[g], torch.where(ok, pp[win], 0).to(P.dtype)], 1).gather(1, idx)
        C[g] = torch.cat([C[g], torch.where(ok, cc[win], math.nan)], 1).gather(1, idx)

    # ---- merge and persistence --------------------------------------------------------------------
    def _check(self, other: "KeyStats") -> None:
        if (other.layers, other.dims, other.signs, other.k, other.n) != (
                self.layers, self.dims, self.signs, self.k, self.n):
            raise ValueError("cannot merge key statistics mined with different settings")

    def merge(self, other: "KeyStats") -> "KeyStats":
        self._check(other)
        if other.groups != self.groups:  # another layout: through its per-layer arrays
            other = KeyStats(self.layers, self.dims, self.d_m, self.signs, self.k, self.device,
                             self.max_position, self.group).load_arrays(other.arrays())
        self.tokens += other.tokens
        self.sentences += other.sentences
        dev = self.device
        for g in self.groups:
            self.hist[g] += other.hist[g].to(dev)
            self.limbs[g] += other.limbs[g].to(dev)
        for sg in self.max:
            torch.maximum(self.max[sg], other.max[sg].to(dev), out=self.max[sg])
            self.pos[sg] += other.pos[sg].to(dev)
            if self.k:
                allh = torch.cat([self.sh[sg].long(), other.sh[sg].to(dev).long()], 2)
                idx = torch.topk(allh, self.k, 2, largest=False, sorted=True).indices
                self.sh[sg] = allh.gather(2, idx).to(torch.int32)
                self.sp[sg] = torch.cat([self.sp[sg], other.sp[sg].to(dev)], 2).gather(2, idx)
                self.sc[sg] = torch.cat([self.sc[sg], other.sc[sg].to(dev)], 2).gather(2, idx)
        return self

    @staticmethod
    def _tag(s: int, l: int) -> str:
        return f"{'p' if s == 1 else 'n'}{l}"

    def _per_layer(self):
        """(name, dict, key axis, tag-maker) of every state array: one set per layer in files."""
        yield "hist", self.hist, 1, None
        yield "limbs", self.limbs, 2, None
        yield "max", self.max, 0, True
        yield "pos", self.pos, 0, True
        if self.k:
            for a in ("sh", "sp", "sc"):
                yield a, getattr(self, a), 0, True

    def arrays(self) -> dict[str, np.ndarray]:
        """One set of arrays per layer (and sign), whatever the grouping: checkpoints and Ray
        results load into a state of any layout."""
        out = {"tokens": np.array([self.tokens], np.int64), "sentences": np.array([self.sentences], np.int64)}
        for name, d, axis, signed in self._per_layer():
            for s in (self.signs if signed else (None,)):
                for l in self.layers:
                    g, sl = self._at(l)
                    t = d[(s, g) if signed else g]
                    part = t[(slice(None),) * axis + (sl,)]
                    out[f"{name}_{self._tag(s, l) if signed else l}"] = part.cpu().numpy()
        return out

    def load_arrays(self, arrs) -> "KeyStats":
        dev = self.device
        new = {}
        for name, d, axis, signed in self._per_layer():
            for key, like in d.items():
                s, g = key if signed else (None, key)
                parts = []
                for l in g:
                    nm = f"{name}_{self._tag(s, l) if signed else l}"
                    a = torch.from_numpy(np.array(arrs[nm]))
                    want = list(like.shape)
                    want[axis] = self.n
                    if list(a.shape) != want or a.dtype != like.dtype:
                        raise KeyError(f"stats array {nm} has shape {tuple(a.shape)}, not {tuple(want)}")
                    parts.append(a)
                new[(name, key)] = torch.cat(parts, axis).to(dev)
        self.tokens = int(np.asarray(arrs["tokens"])[0])
        self.sentences = int(np.asarray(arrs["sentences"])[0])
        for (name, key), t in new.items():
            getattr(self, name)[key] = t
        return self

    def layer_arrays(self, l: int, s: int | None = None) -> dict[str, np.ndarray]:
        """Layer l's state on the host: hist (NB, n) and limbs (2, 3, n); with a sign also max,
        pos and the sample slots (sh, sp, sc)."""
        g, sl = self._at(l)
        out = {"hist": self.hist[g][:, sl].cpu().numpy(), "limbs": self.limbs[g][:, :, sl].cpu().numpy()}
        if s is not None:
            for a in ("max", "pos", "sh", "sp", "sc"):
                out[a] = getattr(self, a)[(s, g)][sl].cpu().numpy()
        return out

    # ---- tables -----------------------------------------------------------------------------------
    def finish(self, ctx=None) -> dict:
        return {"key_stats": self.stats_table(), "key_hist": self.hist_table(),
                "key_samples": self.samples_table()}

    def hist_table(self):
        import pyarrow as pa

        cols = {"layer": [], "dim": [], "bin": [], "count": []}
        for l in sorted(self.layers):
            h = self.layer_arrays(l)["hist"].T
            d, b = np.nonzero(h)
            cols["layer"].append(np.full(len(d), l, np.int16))
            cols["dim"].append(self.dim_ids[d].astype(np.int32))
            cols["bin"].append(b.astype(np.int16))
            cols["count"].append(h[d, b].astype(np.int64))
        return pa.table({k: np.concatenate(v) for k, v in cols.items()})

    def stats_table(self):
        import pyarrow as pa

        parts = []
        N = self.tokens
        for l in sorted(self.layers):
            own = self.layer_arrays(l)
            hist, limbs = own["hist"].T, own["limbs"]
            s1, s2 = from_limbs(limbs[0]), from_limbs(limbs[1])
            mean = s1 / N if N else np.full(self.n, np.nan)
            std = np.sqrt(np.maximum(s2 / N - mean ** 2, 0.0)) if N else np.full(self.n, np.nan)
            for s in sorted(self.signs, reverse=True):
                side = self.layer_arrays(l, s)
                mx = side["max"].astype(np.float64)
                maxabs = np.where(np.isfinite(mx) & (mx > 0), mx, 0.0)
                cnt = side_counts(hist, s)
                on_side = cnt.sum(1)
                q = hist_quantiles(cnt, maxabs)
                strong = hist_share_above(cnt, maxabs)
                ph = side["pos"]
                parts.append({
                    "layer": np.full(self.n, l, np.int16), "dim": self.dim_ids.astype(np.int32),
                    "sign": np.full(self.n, s, np.int8), "count": np.full(self.n, N, np.int64),
                    "mean": mean.astype(np.float32), "std": std.astype(np.float32),
                    "max": (s * mx).astype(np.float32),
                    "frac_active": (on_side / N if N else np.zeros(self.n)).astype(np.float32),
                    "frac_strong": (strong / N if N else np.zeros(self.n)).astype(np.float32),
                    **{f"p{round(qq * 100)}": (s * q[:, i]).astype(np.float32) for i, qq in enumerate(QUANTILES)},
                    "sentences": np.full(self.n, self.sentences, np.int64),
                    "pos_hist": ph,
                    "first_share": (ph[:, 0] / self.sentences if self.sentences else np.zeros(self.n)).astype(np.float32),
                })
        cols = {}
        for k in parts[0]:
            if k == "pos_hist":
                flat = np.concatenate([p[k] for p in parts]).astype(np.int64)
                cols[k] = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), NPOS).cast(
                    pa.list_(pa.int64()))
            elif k.startswith("p") and k[1:].isdigit():
                v = np.concatenate([p[k] for p in parts])
                cols[k] = pa.array(v, mask=np.isnan(v))
            else:
                cols[k] = np.concatenate([p[k] for p in parts])
        return pa.table(cols)

    def samples_table(self):
        import pyarrow as pa

        cols = {"layer": [], "dim": [], "sign": [], "bin": [], "sentence_id": [], "position": [], "coef": []}
        if self.k:
            for l in sorted(self.layers):
                salt = key_salt(l, self.dim_ids)
                for s in sorted(self.signs, reverse=True):
                    side = self.layer_arrays(l, s)
                    h = side["sh"].astype(np.int64)  # (n, SIDE, k)
                    d, j, r = np.nonzero(h != EMPTY)  # row-major: dim, bin, hash order
                    if s == -1:  # bins ascend by value: the negative side's j runs downwards
                        o = np.lexsort((r, -j, d))
                        d, j, r = d[o], j[o], r[o]
                    cols["layer"].append(np.full(len(d), l, np.int16))
                    cols["dim"].append(self.dim_ids[d].astype(np.int32))
                    cols["sign"].append(np.full(len(d), s, np.int8))
                    cols["bin"].append(side_bin(s, j).astype(np.int16))
                    cols["sentence_id"].append(sample_sid(h[d, j, r], salt[d]).astype(np.int64))
                    cols["position"].append(side["sp"][d, j, r].astype(np.int32))
                    cols["coef"].append(side["sc"][d, j, r].astype(np.float32))
        types = {"layer": np.int16, "dim": np.int32, "sign": np.int8, "bin": np.int16, "sentence_id": np.int64,
                 "position": np.int32, "coef": np.float32}
        return pa.table({k: (np.concatenate(v) if v else np.zeros(0, types[k])) for k, v in cols.items()})
