"""The fused CUDA kernels compiled for a GPU that is not here (issue 24).

Triton's interpreter proves the kernels' results on a CPU, but not that they compile for a real
GPU, nor what they cost there: a kernel that spills registers or fits few warps on an SM runs
far slower than its traffic allows. Triton compiles for any NVIDIA architecture without a GPU
(its wheel carries ptxas), so this module runs `ffkv.mine.fused_cuda`'s own launches, with the
arguments mining passes, through the compiler for a chosen architecture, and reads each
kernel's registers, spills, shared memory, innermost loop and asynchronous copies from the cubin.

    PYTHONPATH=src python -m ffkv.mine.fused_aot --arch 90

Run it without TRITON_INTERPRET (the kernels must be real `triton.jit` functions).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch

REGS_PER_SM = 65536  # every NVIDIA architecture Triton targets (sm_80 ... sm_120)
MAX_WARPS_PER_SM = {75: 32, 80: 64, 86: 48, 89: 48, 90: 64, 100: 64, 120: 48}  # what Triton compiles for


@dataclass
class Compiled:
    kernel: str
    variant: str
    seconds: float
    regs: int
    local: int  # bytes of local memory per thread: register spills (or a stack array)
    shared: int
    warps: int
    arch: int
    loop: int = 0  # SASS instructions of the innermost loop (0: none)
    prefetch: int = 0  # asynchronous global-to-shared copies (LDGSTS): loads software-pipelined ahead
    common: int = 0  # of `loop`, those outside the blocks its forward branches skip (a flush, a list
    # insertion: taken rarely), what an iteration issues on its usual path

    @property
    def occupancy(self) -> float:
        """Resident warps per SM over the most an SM holds, as registers allow (shared memory
        is never the limit here: a kernel uses at most a few KB)."""
        most = MAX_WARPS_PER_SM.get(self.arch, 64)
        blocks = REGS_PER_SM // max(1, self.regs * 32 * self.warps)
        return min(most, blocks * self.warps) / most


def _resources(cubin: bytes) -> dict:
    """Registers, spills and shared memory (cuobjdump's resource usage), and the instructions of
    the innermost loop: the shortest backward branch of the SASS, which each thread runs once per
    tile (capture) or row (offer, top-k): the static measure of what the kernel issues."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    r = {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|SHARED|STACK):(\d+)", text)}
    loops = [(int(at, 16) - int(to, 16)) // 16 + 1
             for at, to in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:!?U?P\w+\s*,\s*)?`?\(?0x([0-9a-f]+)", sass)
             if int(to, 16) < int(at, 16)]
    r["LOOP"] = min(loops) if loops else 0
    r["COMMON"] = r["LOOP"] - _skipped(sass, r["LOOP"], loops)
    r["LDGSTS"] = len(re.findall(r"\bLDGSTS\b", sass))  # asynchronous copies: loads prefetched ahead
    return r


def _skipped(sass: str, loop: int, loops: list) -> int:
    """Instructions of the innermost loop that its forward branches jump over."""
    if not loop:
        return 0
    addr = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    for i, (a, t) in enumerate(addr):  # the innermost loop's backward branch and its target
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and (a - int(m.group(1), 16)) // 16 + 1 == loop:
            lo, hi = int(m.group(1), 16), a
            break
    else:
        return 0
    skipped = set()
    for a, t in addr:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and lo <= a < hi and a < int(m.group(1), 16) <= hi:
            skipped.update(x for x, _ in addr if a < x < int(m.group(1), 16))
    return len(skipped)


@contextlib.contextmanager
def compiled_for(arch: int, out: list):
    """While active, `fused_cuda`'s launches compile for sm_`arch` (what its JIT would compile on
    such a GPU for these arguments) and append a `Compiled` to `out`; nothing runs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from ffkv.mine import fused_cuda

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    variant = {"name": ""}

    def compile_one(fn, args, kw):
        bind = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = bind(*args, **kw)
        options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
        t0 = time.perf_counter()
        k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        r = _resources(k.asm["cubin"])
        out.append(Compiled(fn.__name__, variant["name"], time.perf_counter() - t0, r.get("REG", 0),
                            r.get("LOCAL", 0), r.get("SHARED", 0), options.num_warps, arch, r["LOOP"], r["LDGSTS"],
                            r["COMMON"]))

    prev, fused_cuda._aot = fused_cuda._aot, compile_one
    try:
        yield variant
    finally:
        fused_cuda._aot = prev


def mining_launches(variant: dict, W: int = 1536, B: int = 64, T: int = 128, top_k: int = 50,
                    samples: tuple = (0, 5), dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> None:
    """Every launch `ffkv mine` makes through the fused path, once per specialization: the
    capture for each capture dtype, sign set and statistics on or off; the offer for each sign and
    sample count, on a real `KeyStats`'s state; the insertion into a real top-k list of `top_k`.
    CPU tensors of the real dtypes stand in (their shapes do not change the code; W, B and T only
    its integer specialization)."""
    from ffkv.mine import fused_cuda
    from ffkv.mine.stats import KeyStats
    from ffkv.mine.topk import LayerTopK

    lengths = torch.full((B,), T, dtype=torch.int32)
    lut = fused_cuda.bin_lut("cpu")
    for dt in dtypes:
        m = torch.zeros((B, T, W), dtype=dt)
        for signs in ((1,), (-1,), (1, -1)):
            for st in (True, False):
                variant["name"] = f"{str(dt).removeprefix('torch.')} signs={signs} stats={st}"
                fused_cuda.capture(m, lengths, lut, signs, st)
    score, pos = torch.zeros((B, W)), torch.zeros((B, W), dtype=torch.int32)
    sids = torch.arange(B, dtype=torch.int64)
    for k in samples:
        ks = KeyStats([0], None, W, signs=(1, -1), samples=k)
        for sign in (1, -1):
            variant["name"] = f"samples={k} sign={sign}"
            fused_cuda.offer(*ks.offer_args(ks.groups[0], sign, score, pos, sids))
    variant["name"] = f"top_k={top_k}"
    LayerTopK(top_k, W).update_rows(score, sids, pos)


def report(archs=(80, 90), **kw) -> list[Compiled]:
    rows: list[Compiled] = []
    for arch in archs:
        with compiled_for(arch, rows) as variant:
            mining_launches(variant, **kw)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    def within(lo, hi):
        def check(text):
            try:
                v = int(text)
            except ValueError:
                v = None
            if v is None or not lo <= v <= hi:
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {lo} to {hi}")
            return v
        return check

    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(MAX_WARPS_PER_SM),
                    metavar="SM", help="Compute capabilities to compile for: 80 (A100), 90 (H100, H200), 100 "
                                       "(B200), 120, 75, 86, 89 (default 80 90).")
    ap.add_argument("--top-k", type=within(1, 10000), default=50,
                    help="The top-k list length compiled, as `ffkv mine --top-k` (default 50).")
    ap.add_argument("--samples", type=within(0, 1000), nargs="+", default=[0, 5],
                    help="Samples per bin compiled, as `ffkv mine --samples-per-bin` (default 0 5).")
    ap.add_argument("--json", action="store_true", help="One JSON object per compiled kernel.")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("TRITON_INTERPRET=1 replaces the kernels by the interpreter; unset it")
    rows = report(tuple(a.arch), top_k=a.top_k, samples=tuple(a.samples))
    if a.json:
        import dataclasses
        import json

        for r in rows:
            print(json.dumps({**dataclasses.asdict(r), "occupancy": round(r.occupancy, 4)}))
        return 0
    print(f"{'arch':>4}  {'kernel':<14} {'variant':<36} {'regs':>4} {'spill B':>7} {'smem B':>6} "
          f"{'warps':>5} {'occupancy':>9} {'loop':>5} {'usual':>5} {'async':>5} {'compile s':>9}")
    for r in rows:
        print(f"sm{r.arch:<2}  {r.kernel:<14} {r.variant:<36} {r.regs:>4} {r.local:>7} {r.shared:>6} "
              f"{r.warps:>5} {r.occupancy:>9.0%} {r.loop:>5} {r.common:>5} {r.prefetch:>5} {r.seconds:>9.2f}")
    spills = [r for r in rows if r.local]
    print(f"{len(rows)} kernels compiled; {len(spills)} spill registers to local memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
