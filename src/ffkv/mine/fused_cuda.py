"""The trackers' work on a batch in three Triton kernels on CUDA (issue 24).

The portable path reads a group's captures (0.5G float32 values for SmolLM2 at a 32k-token budget)
some eight times: the row maxima and their first positions (an amax, a compare, a weighted amax,
per sign), the square for the sum of squares, two masked products and the histogram's scatter.
On a GPU each read is a full pass over 2 GB, and the statistics cost as much as the forward.

- `capture`: one read of the captures gives each row's max and min with their first positions
  (what the top-k and the statistics take, `LayerCapture.best`), the histogram (integer counts,
  equal to the portable path's) and per-block float64 sums of m and m².
- `offer`: each row's best offered to the running max, the position buckets and the quantile
  samples, key by key: the same state as the portable path, with no host sync (that path's
  `nonzero` waits for the device once per sign and update).
- `topk`: each row's best inserted into its key's sorted top-t list (`ffkv.mine.rules.pack_key`,
  shared with the portable merge), again with no host sync.

Per update: 3 launches with one sign (5 with two) and about a dozen small torch ops, 15 and 17
ops in all (`tests/test_fused_cuda.py`), against 132 and 235 for the portable path.

`FFKV_TRITON=1` turns it on; `auto` (the default on CUDA) lets `ffkv mine` time it against the
portable path on the run's first batches and keep the faster (`ffkv.mine.tune`). Before its first
use on a device, `ffkv.mine.selfcheck.verify` feeds made-up captures through both paths and
compares the states: a kernel that fails to compile, or that disagrees on this GPU (the test suite runs them in Triton's
CPU interpreter; an H100 agreed, `benchmarks/GPU.md`), turns the path off for the process with one
line on stderr (`ffkv.errors.notice`), and the portable path runs instead.
"""
from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager

import torch

from ffkv.errors import notice
from ffkv.mine import rules, switches

ENV = "FFKV_TRITON"

# The capture kernel's tiling, the fastest of the 18 an H100 timed (bf16, one sign, 2026-11-26;
# bench_stats_gpu's sweep): 3.6 ms a 10-layer update against 8.2 for 64 keys, 8 rows and 4 warps.
# Smaller programs won in each step of the sweep (more of them resident on an SM).
BW = 16  # keys per program of the capture kernel
ROWS = 32  # rows per program
TT = 4  # positions per tile
WARPS = 1  # warps per program (BW, TT and WARPS set its registers: `python -m ffkv.mine.fused_aot`)
NBC = 16  # packed counters per key: three bins each (>= rules.NB / 3, a power of two)
OFFER_BW = 128  # keys per program of the offer kernel
OFFER_ROWS = 8  # rows the offer kernel checks at once (`_fused_kernel.offer_kernel`)
TOPK_STAGES = 4  # rows the top-k kernel's loads run ahead (software pipelining; 1: none); H100: 0.86 ms, 3: 1.14
FIELD = 1023  # counts a 10-bit field holds
FLUSH = FIELD  # positions counted before the packed counters are flushed (tests lower it)

_broken: str | None = None
_forced: bool | None = None  # the tuner's arm for the batch at hand (`ffkv.mine.tune`), over the setting
_has_triton: bool | None = None
_luts: dict = {}
launches = 0  # kernel launches so far
_aot = None  # `ffkv.mine.fused_aot.compiled_for`'s compiler while it is active
KERNEL = "ffkv::triton_kernel"  # a launch, as the profiler sees it: one op, whatever runs inside


def setting(device=None) -> str:
    """FFKV_TRITON as "0", "1" or "auto"; unset: "auto" on CUDA (timed against the portable path),
    "0" elsewhere. A bad value is the user's to fix (FfkvError)."""
    return switches.by_device(ENV, device, parse, "0")[0]


def parse(raw: str, name: str = ENV) -> str:
    """A fused-kernels setting (FFKV_TRITON's, or `ffkv mine --fused-kernels`'s, named `name`)."""
    return switches.on_off_auto(raw, name, "1 uses the fused Triton kernels, 0 the portable path, auto times "
                                "both on the run's first batches (the default on CUDA)")


def runs_here(device) -> bool:
    """The kernels can run here: Triton present, a CUDA device (or Triton's interpreter), none failed."""
    if _broken is not None:
        return False
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    global _has_triton
    if _has_triton is None:  # asked a few times per update: look once
        _has_triton = importlib.util.find_spec("triton") is not None
    return _has_triton


def available(device) -> bool:
    """This path runs here: asked for (FFKV_TRITON=1, or the tuner's arm), and `runs_here`. Triton
    is imported only then: on a CPU its import alone slowed mining."""
    if _aot is not None:  # compiling for a GPU that is not here: every launch counts
        return True
    want = _forced if _forced is not None else switches.read(ENV, "0").strip() == "1"
    return want and runs_here(device)


@contextmanager
def forced(on: bool | None):
    """Within: the fused path on or off whatever FFKV_TRITON says (None: as it says)."""
    global _forced
    prev, _forced = _forced, on
    try:
        yield
    finally:
        _forced = prev


def why_of(e: BaseException) -> str:
    """An exception in one short line, for `turn_off`."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def turn_off(why: str, message: str) -> None:
    """This path off for the process (`why` kept as the reason), said in one line on stderr."""
    global _broken
    _broken = why
    notice(message)


def bin_lut(device) -> torch.Tensor:
    """`ffkv.mine.rules._raw_luts`'s bin table as int32 on `device`, made once per device."""
    key = str(device)
    if key not in _luts:
        _luts[key] = rules._raw_luts()[0].to(torch.int32).to(device)
    return _luts[key]


_fields: dict = {}  # id of a bin table -> (the table, its `field_lut`)


def field_lut(lut: torch.Tensor) -> torch.Tensor:
    """A bin table as the capture kernel reads it: the packed counter (bin // 3) in the low byte,
    the shift of the bin's field in it ((bin % 3) · 10) above; made once per table."""
    got = _fields.get(id(lut))
    if got is None or got[0] is not lut:
        got = _fields[id(lut)] = (lut, (lut // 3) | (((lut % 3) * 10) << 8))
    return got[1]


def _launch(kernel, grid, *args, **kw) -> bool:
    """Launch `kernel` (its name in `_fused_kernel`); on a compile or launch error turn this path
    off (one line on stderr) and say so. Under `ffkv.mine.fused_aot.compiled_for` it compiles for that
    GPU instead and runs nothing."""
    global launches
    if _aot is not None:  # a compile error there is the tool's to show, not to fall back from
        from ffkv.mine import _fused_kernel

        _aot(getattr(_fused_kernel, kernel), args, kw)
        return True
    try:
        from ffkv.mine import _fused_kernel  # a Triton that fails to import falls back too

        with torch.profiler.record_function(KERNEL):  # one op in `trackers.count_ops`
            getattr(_fused_kernel, kernel)[grid](*args, **kw)
        launches += 1
        return True
    except Exception as e:  # noqa: BLE001  (Triton raises many kinds; the portable path is exact)
        why = why_of(e)
        turn_off(why, f"the fused CUDA kernels failed ({why}); using the portable path")
        return False


def capture(m: torch.Tensor, lengths: torch.Tensor, lut: torch.Tensor, signs, stats: bool, nb: int | None = None):
    """Read right-padded m (B, T, W) (any float dtype) once.

    Returns ({sign: (score (B, W) float32 = best sign·m, pos (B, W) int32 its first position)},
    hist (nb, W) int32 or None, the sums of m and m² (2, W) float64 or None); None when the kernel cannot run
    (then nothing was written). lengths (B,) int32 on m's device; lut (512,) int32: raw
    sign/exponent index -> bin, of nb bins (default `rules.NB`)."""
    if nb is None:
        nb = rules.NB
    B, T, W = m.shape
    if nb > 3 * NBC:
        return None
    if m.stride(-1) != 1:
        m = m.contiguous()
    dev = m.device
    hi = torch.empty((B, W), dtype=torch.float32, device=dev) if 1 in signs else None
    hip = torch.empty((B, W), dtype=torch.int32, device=dev) if 1 in signs else None
    lo = torch.empty((B, W), dtype=torch.float32, device=dev) if -1 in signs else None
    lop = torch.empty((B, W), dtype=torch.int32, device=dev) if -1 in signs else None
    nrb = -(-B // ROWS)
    hist = torch.zeros((nb, W), dtype=torch.int32, device=dev) if stats else None
    sums = torch.empty((2, nrb, W), dtype=torch.float64, device=dev) if stats else None
    if B and W:
        grid = (-(-W // BW), nrb)
        dummy = lengths
        if not _launch("capture_kernel", grid,
                m, lengths, field_lut(lut), hist if stats else dummy, sums if stats else dummy, sums[1] if stats else dummy,
                hi if hi is not None else dummy, hip if hip is not None else dummy,
                lo if lo is not None else dummy, lop if lop is not None else dummy,
                B, W, m.stride(0), m.stride(1), ROWS=ROWS, TT=TT, BW=BW, NBC=NBC, NB=nb,
                STATS=bool(stats), POS=hi is not None, NEG=lo is not None, FLUSH=FLUSH, num_warps=WARPS):
            return None
    best = {}
    if hi is not None:
        best[1] = (hi, hip)
    if lo is not None:
        best[-1] = (lo, lop)
    if not stats:
        return best, None, None
    return best, hist, sums.sum(1)


def offer(score, pos, sids, salt, side, mx, ph, sh, sp, sc, sign: int, k: int) -> bool:
    """`ffkv.mine.stats_cpu.offer`'s contract on CUDA; False when the kernel cannot run."""
    B, W = score.shape
    if not (B and W):
        return True
    score, pos = score.contiguous(), pos.contiguous()
    return _launch("offer_kernel", (-(-W // OFFER_BW),), score, pos, sids, salt, side, mx, ph, sh, sp, sc, B, W,
                   SIGN=float(sign), K=int(k), SIDE=rules.SIDE, NPOS=rules.NPOS, BW=OFFER_BW, R=OFFER_ROWS,
                   num_warps=4)


def topk(score, pos, sids, key, kpos) -> bool:
    """Rows' bests (score (B, W) = sign·m float32, pos (B, W) int32, sids (B,) int64) into sorted
    top-t lists in place (key (W, t) int64 ascending, kpos (W, t) int32); False when the kernel
    cannot run (then nothing was written)."""
    B, W = score.shape
    if not (B and W):
        return True
    score, pos = score.contiguous(), pos.contiguous()
    return _launch("topk_kernel", (-(-W // OFFER_BW),), score, pos, sids, key, kpos, B, W,
                   T=key.shape[1], BW=OFFER_BW, STAGES=TOPK_STAGES, num_warps=4)
