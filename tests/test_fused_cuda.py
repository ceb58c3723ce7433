"""The fused CUDA kernels (`ffkv.mine.fused_cuda`) give what the portable path gives.

Run through Triton's interpreter on the CPU (in a subprocess: TRITON_INTERPRET is read when the
kernels are defined): the histogram against a brute force of `stats.bin_of`, the row bests against
`topk.row_best`, and whole mining states (top-k and statistics, both signs, k = 0, 1, 3) against
the portable path's, fed the same captures. Counts, maxima, positions and samples are equal bit
for bit; the sums agree to float32 rounding (the kernel sums a tile's rows in float32 and carries
the tiles in float64; the portable path's products are float32).
"""
import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

pytest.importorskip("triton")

PATCH = textwrap.dedent('''
    import triton.runtime.interpreter as ti
    _orig = ti._LangPatchScope.set_attr
    def _set_attr(self, obj, name, value):  # NumPy >= 2.4 refuses int() of a 1-element array
        if name == "__index__":
            value = lambda t: int(t.handle.data.reshape(-1)[0])
        return _orig(self, obj, name, value)
    ti._LangPatchScope.set_attr = _set_attr
''')

SCRIPT = PATCH + textwrap.dedent('''
    import os, sys, numpy as np, torch
    from ffkv.mine import fused_cuda, stats
    from ffkv.mine.topk import TopKState, row_best
    from ffkv.mine.trackers import Batch, LayerCapture, MineState
    assert fused_cuda.available("cpu")
    lut = fused_cuda.bin_lut("cpu")
    for seed, (B, T, n) in enumerate([(6, 9, 40), (3, 1, 129), (7, 6, 32), (5, 13, 34)]):
        g = torch.Generator().manual_seed(seed)
        m = torch.randn(B, T, n, generator=g) * torch.exp(torch.randn(B, T, n, generator=g) * 4)
        m[0, 0, :5] = 0.0
        m[-1, 0, :5] = -0.0
        m[0, 0, 5:7] = torch.tensor([1e-40, -1e-40])            # subnormals: the zero bin
        m[-1, 0, 5:9] = torch.tensor([float("inf"), 2.0 ** 12, -2.0 ** 10, 2.0 ** -10])
        m[1, :, 9] = 1.5                                          # ties: the first position wins
        m[1, 2:, 10] = -7.0
        lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
        mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
        m = m.masked_fill(~mask[..., None], 3.0)                   # padding must not count
        ref = np.zeros((stats.NB, n), np.int64)
        for b in range(B):
            for t in range(lengths[b]):
                np.add.at(ref, (stats.bin_of(m[b, t].numpy()).astype(np.int64), np.arange(n)), 1)
        best, hist, (s1, s2) = fused_cuda.capture(m, torch.tensor(lengths, dtype=torch.int32), lut, (1, -1), True)
        assert np.array_equal(hist.numpy(), ref), (seed, np.argwhere(hist.numpy() != ref)[:5])
        fused_cuda.FLUSH = 7                                       # flush the packed counters row by row
        assert np.array_equal(fused_cuda.capture(m, torch.tensor(lengths, dtype=torch.int32), lut, (1,), True)[1], ref)
        fused_cuda.FLUSH = fused_cuda.FIELD
        valid = m.double() * mask[..., None]
        u = 2.0 ** -24  # float32 within a tile of TT rows, float64 across: 3 roundings a tile's sum, 1 a square
        fin = torch.isfinite(valid.abs().sum((0, 1)))
        for got, want, scale in ((s1, valid.sum((0, 1)), 4 * u * valid.abs().sum((0, 1))),
                                 (s2, (valid ** 2).sum((0, 1)), 5 * u * (valid ** 2).sum((0, 1)))):
            err = (got - want).abs()[fin]
            assert (err <= scale[fin]).all(), (seed, (err / scale[fin]).max())
            assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        for s in (1, -1):
            sc, ps = row_best(m, mask, s)
            assert torch.equal(best[s][0], sc) and torch.equal(best[s][1], ps), (seed, s)
        # the kernel reads any float dtype (bf16 subnormals aside: the interpreter flushes them)
        half = torch.where(m.abs() < 2.0 ** -126, 0.0, m).to(torch.bfloat16)
        bh = fused_cuda.capture(half, torch.tensor(lengths, dtype=torch.int32), lut, (1,), False)[0]
        assert torch.equal(bh[1][0], row_best(half.float(), mask, 1)[0])
        # every (k, dtype) on the two-offer-block shape (129 keys) and the first; k = 3 float32, the
        # general case, on every shape; the other shapes one more each (3 s apiece in the interpreter)
        combos = ((0, torch.float32), (1, torch.float32), (3, torch.float32), (3, torch.bfloat16))
        for k, dtype in (combos if seed in (0, 1) else (combos[2], combos[3 if seed == 2 else 0])):
            layers = (0, 1) if n % 2 == 0 else (0,)                # two layers side by side, or one
            got = {}
            src = m if dtype == torch.float32 else half            # bf16 captures: read as they come
            for flag in ("0", "1"):
                os.environ["FFKV_TRITON"] = flag
                w = n // len(layers)
                st = MineState({"topk": TopKState(list(layers), None, w, 4, negative=True, group=len(layers)),
                                "stats": stats.KeyStats(list(layers), None, w, signs=(1, -1), samples=k,
                                                        group=len(layers))}, list(layers), None)
                for rep in (0, 1, 3):                              # three batches: samples move
                    sids = [rep * 100 + i for i in range(B)]
                    batch = Batch.from_lengths(lengths, sids, mask)
                    mm = src * (1 + rep)                           # exact: a power of two apart
                    for i, l in enumerate(layers):
                        st.update(l, mm[..., i * w:(i + 1) * w], batch)
                got[flag] = {a: np.array(v) for a, v in st.arrays().items()}
            assert got["0"].keys() == got["1"].keys()
            for a in got["0"]:
                x, y = got["0"][a], got["1"][a]
                if "limbs" in a:                                   # the sums: float32 rounding apart
                    x = np.stack([stats.from_limbs(x[0]), stats.from_limbs(x[1])])
                    y = np.stack([stats.from_limbs(y[0]), stats.from_limbs(y[1])])
                    l = int(a.rsplit("_", 1)[1])
                    v = (src.double() * mask[..., None])[..., l * w:(l + 1) * w].abs()
                    scale = np.stack([7 * v.sum((0, 1)).numpy(), 21 * (v ** 2).sum((0, 1)).numpy()])  # x1, x2, x4
                    fin = np.isfinite(scale)                       # a column with inf: no sum to compare
                    bad = np.abs(x - y)[fin] > 1e-6 * scale[fin]
                    assert not bad.any(), (seed, k, a, x[fin][bad][:3], y[fin][bad][:3], scale[fin][bad][:3])
                else:
                    assert np.array_equal(x, y, equal_nan=True), (seed, k, a, np.argwhere(x != y)[:5])
    assert fused_cuda._broken is None
    print("ok")
''')


LANES = 2  # processes at once: the cores here (each process is one Python thread, the interpreter's)
_lanes: ThreadPoolExecutor | None = None
_live: set = set()  # processes running now


def _queue(argv, env=None) -> Future:
    """`argv` run in a process of its own once a lane is free: a Future of its CompletedProcess."""
    global _lanes
    if _lanes is None:
        _lanes = ThreadPoolExecutor(LANES)
    return _lanes.submit(_complete, argv, env)


def _complete(argv, env) -> subprocess.CompletedProcess:
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _live.add(p)
    try:
        out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    finally:
        _live.discard(p)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def _start(script, **env) -> Future:
    env = {**os.environ, "TRITON_INTERPRET": "1", "FFKV_TRITON": "1", "FFKV_NUMBA": "0", **env}
    return _queue([sys.executable, "-c", script], env)


def _finish(f: Future) -> subprocess.CompletedProcess:
    return f.result()


STARTS: dict = {}  # test function's name -> start(folder, tiny_dirs, **its parameters): its processes, queued
_AHEAD: dict = {}  # test name, as pytest names it -> what `_head_start` queued for it


def starts(name):
    """Registers `start` as the processes of the test function `name`."""
    def add(start):
        STARTS[name] = start
        return start
    return add


def _start_for(item, folder, dirs):
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return STARTS[item.originalname](folder, dirs, **params)


@pytest.fixture(scope="module", autouse=True)
def _head_start(request, tmp_path_factory):
    """Every process this module's tests run is queued with the module, in the tests' order, and
    runs in one of LANES lanes: each is one Python thread (Triton's interpreter, or its compiler),
    so the two cores run two side by side, in about half the time of one after another, while the
    tests wait for their own. Not more: more processes than cores only share them."""
    global _lanes
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and item.originalname in STARTS:
            _AHEAD[item.name] = _start_for(item, tmp_path_factory.mktemp("fused"),
                                           lambda: request.getfixturevalue("tiny_dirs"))
    yield
    if _lanes is not None:
        _lanes.shutdown(wait=False, cancel_futures=True)
        for p in list(_live):
            p.kill()
        _lanes.shutdown(wait=True)
        _lanes = None
    _AHEAD.clear()


def _started(request):
    """What `_head_start` queued for this test, else its processes queued now."""
    got = _AHEAD.pop(request.node.name, None)
    if got is None:
        got = _start_for(request.node, request.getfixturevalue("tmp_path"), lambda: request.getfixturevalue("tiny_dirs"))
    return got


starts("test_kernels_equal_the_portable_path")(lambda out, dirs: _start(SCRIPT))


def test_kernels_equal_the_portable_path(request):
    p = _finish(_started(request))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]


BREAK = {
    # a kernel that does not compile (a Triton too old for it): its launch raises
    "launch": '''
        from ffkv.mine import _fused_kernel
        class Broken:
            def __getitem__(self, grid):
                raise RuntimeError("no such instruction")
        _fused_kernel.capture_kernel = _fused_kernel.offer_kernel = Broken()
    ''',
    # a Triton that is present but does not import (a build that does not match torch)
    "import": '''
        import sys
        sys.modules["ffkv.mine._fused_kernel"] = None              # its import now raises ImportError
    ''',
}


FALLBACK = textwrap.dedent('''
        import warnings, numpy as np, torch
        from ffkv.mine import fused_cuda, stats
        from ffkv.mine.trackers import feed
        warnings.filterwarnings("ignore")  # as the CLI has it (`ffkv.cli.main`): the line must still show
        m = torch.randn(4, 5, 32)
        mask = torch.ones(4, 5, dtype=torch.bool)
        a = stats.KeyStats([0], None, 32, samples=2)
        feed(a, 0, m, mask, [0, 1, 2, 3])
        feed(a, 0, m, mask, [4, 5, 6, 7])
        assert not fused_cuda.available("cpu")
        b = stats.KeyStats([0], None, 32, samples=2)
        feed(b, 0, m, mask, [0, 1, 2, 3])
        feed(b, 0, m, mask, [4, 5, 6, 7])
        for k, v in a.arrays().items():
            assert np.array_equal(v, b.arrays()[k], equal_nan=True), k
        print("ok")
    ''')
starts("test_a_failing_kernel_falls_back_with_one_line")(
    lambda out, dirs, how: _start(PATCH + textwrap.dedent(BREAK[how]) + FALLBACK))


@pytest.mark.parametrize("how", sorted(BREAK))
def test_a_failing_kernel_falls_back_with_one_line(request, how):
    """A kernel that cannot run turns the path off with one line on stderr (shown though warnings
    are silenced, as in the CLI), no traceback; the state equals the portable path's."""
    p = _finish(_started(request))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stderr.count("ffkv: the fused CUDA kernels failed") == 1, p.stderr[-4000:]


OFFER = PATCH + textwrap.dedent('''
        import os, numpy as np, torch
        from ffkv.mine import fused_cuda, stats
        from ffkv.mine.trackers import feed
        n, T = 200, 5
        g = torch.Generator().manual_seed(7)
        batches = []
        for rep, B in enumerate((40, 37, 40, 9)):
            sign = torch.where(torch.rand(B, T, n, generator=g) < 0.5, -1.0, 1.0)
            m = sign * (1.5 + 0.1 * torch.rand(B, T, n, generator=g))   # one bin per side
            batches.append((m, torch.ones(B, T, dtype=torch.bool), [rep * 100 + i for i in range(B)]))
        for k in (1, 3):
            got = {}
            for flag in ("0", "1"):
                os.environ["FFKV_TRITON"] = flag
                ks = stats.KeyStats([0], None, n, signs=(1, -1), samples=k)
                for m, mask, sids in batches:
                    feed(ks, 0, m, mask, sids)
                got[flag] = ks.arrays()
            for a in got["0"]:
                if "limbs" not in a:
                    assert np.array_equal(got["0"][a], got["1"][a], equal_nan=True), (k, a)
        assert fused_cuda._broken is None and fused_cuda.OFFER_ROWS == 8
        print("ok")
    ''')
starts("test_offer_chunks_equal_row_by_row")(lambda out, dirs: _start(OFFER))


def test_offer_chunks_equal_row_by_row(request):
    """The offer kernel checks R rows at once against the chunk's starting samples and takes
    them one by one only where one enters. Here every value of a key falls in one bin per side, so
    after the first rows a row enters only with a new smallest hash: most chunks skip, some do
    not. Equal to the portable path over four batches (both signs, k = 1 and 3, a block of keys
    cut short, a batch that is not a whole number of chunks)."""
    p = _finish(_started(request))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]


def test_off_switch_and_cpu(monkeypatch):
    from ffkv.mine import fused_cuda

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FFKV_TRITON", "1")
    assert not fused_cuda.available("cpu")  # the CPU keeps its own path
    assert fused_cuda.available("cuda")
    monkeypatch.delenv("FFKV_TRITON")
    assert not fused_cuda.available("cuda")  # off unless asked for


@starts("test_triton_is_not_imported_by_mining")
def _start_import_check(out, dirs):
    code = "import sys, ffkv.steps.mine.compute, ffkv.mine.stats, ffkv.mine.engine; print('triton' in sys.modules)"
    return _queue([sys.executable, "-c", code])


def test_triton_is_not_imported_by_mining(request):
    """On a CPU install that happens to have Triton, mining must not import it (its import alone
    slowed mining measurably here); it loads only with FFKV_TRITON=1 on CUDA."""
    p = _finish(_started(request))
    assert p.stdout.strip() == "False", p.stdout + p.stderr[-2000:]


# A gated FFN only: the kernels read m whatever made it (the kernels' own test covers shapes and
# groups), and the interpreter's cost is per batch and launch, so two batches of six sentences
E2E_ARCHS = ("llama",)
# The kernels' check on 40 keys a layer, not 160 (49 s in the interpreter, twice in the verify
# test): the kernels' own test covers the shapes (129 keys: two offer blocks)
SMALL_CHECK = "from ffkv.mine import selfcheck\nselfcheck.CHECK_KEYS = 40\n"


def _e2e_args(out, tiny_dirs, arch, flag):
    from conftest import WT2

    return ["mine", "--out", str(out / f"{arch}{flag}"), "--model", str(tiny_dirs[arch]), "--corpus",
            str(WT2 / "wiki.valid.tokens"), "--max-sentences", "6", "--top-k", "4", "--negative",
            "--batch-tokens", "160"]  # two batches (286 tokens): the second merges into the first


def _start_fused_mines(out, tiny_dirs) -> Future:
    """The fused run of the end-to-end test, in a process of its own."""
    fused = [_e2e_args(out, tiny_dirs, a, "1") for a in E2E_ARCHS]
    return _start(PATCH + SMALL_CHECK + "import sys\nfrom ffkv.cli import main\n" + "".join(
        f"try:\n    main({x!r})\nexcept SystemExit as e:\n    assert not e.code, e.code\n" for x in fused)
        + "print('ok')", FFKV_TRITON="1", HF_HUB_OFFLINE="1")


starts("test_mine_end_to_end_equals_the_portable_path")(lambda out, dirs: (out, _start_fused_mines(out, dirs())))


def test_mine_end_to_end_equals_the_portable_path(request, tiny_dirs):
    """`ffkv mine` with the fused kernels (in Triton's interpreter) writes the tables the portable
    path writes, within the resume check's tolerances (the sums round differently), on a gated
    FFN. The fused run has a process of its own, started with the module (`_head_start`);
    the portable one runs here."""
    from conftest import run_cli
    from test_mine import _assert_same_mine

    out, p = _started(request)
    for a in E2E_ARCHS:
        res = run_cli(*_e2e_args(out, tiny_dirs, a, "0"))
        assert res.returncode == 0, res.stderr
    p = _finish(p)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]
    assert "fused CUDA kernels" not in p.stderr, p.stderr[-3000:]
    for a in E2E_ARCHS:
        _assert_same_mine(out / f"{a}1", out / f"{a}0")


OPS = PATCH + textwrap.dedent('''
        import os, torch
        from ffkv.mine import fused_cuda
        from ffkv.mine.stats import KeyStats
        from ffkv.mine.topk import TopKState
        from ffkv.mine.trackers import Batch, MineState, count_ops
        for flag in ("0", "1"):
            os.environ["FFKV_TRITON"] = flag
            for G, signs in ((1, (1,)), (2, (1, -1))):
                n, B, T = 96, 16, 12
                layers = list(range(G))
                st = MineState({"topk": TopKState(layers, None, n, 8, negative=len(signs) > 1, group=G),
                                "stats": KeyStats(layers, None, n, signs=signs, group=G)}, layers, None)
                lengths = [12] * 5 + [9] * 4 + [7] * 4 + [3] * 3   # four runs of equal length
                mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
                for rep in range(2):
                    ms = [torch.randn(B, T, n) for _ in layers]
                    batch = Batch.from_lengths(lengths, list(range(rep * B, (rep + 1) * B)), mask)
                    before = fused_cuda.launches
                    ops = count_ops(lambda: [st.update(l, m, batch) for l, m in zip(layers, ms)])
                launched = fused_cuda.launches - before
                print(flag, G, len(signs), ops, launched)
                if flag == "1":
                    assert launched == 1 + 2 * len(signs), launched
                    assert ops <= 20, (G, signs, ops)
                else:
                    assert launched == 0
        print("ok")
    ''')
starts("test_fused_ops_per_update")(lambda out, dirs: _start(OPS))


def test_fused_ops_per_update(request):
    """The CPU proxy of launches (`trackers.count_ops`, a Triton launch counted once) on the fused
    path: issue 24's ceiling of 20 per layer and batch holds even at one layer per update (an 8B
    model's 14,336 keys are one update), with both signs, whatever the batch's shape; the portable
    path's row bests take ops per run of equal length (132 and 235 here). Launches: one capture a
    group, then per sign one top-k and one statistics pass. Measured: 15 and 17."""
    p = _finish(_started(request))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]


def _aot(*args, **env):
    """`python -m ffkv.mine.fused_aot ARGS`, started (compiling for a GPU, not in the interpreter)."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return _queue([sys.executable, "-m", "ffkv.mine.fused_aot", *args], {**base, **env})


starts("test_kernels_compile_for_real_gpus")(lambda out, dirs: _aot(
    "--arch", "80", "90", "100", "--samples", "0", "5", "1000", "--top-k", "10000", "--json"))


def test_kernels_compile_for_real_gpus(request):
    """The interpreter proves the kernels' results, not that they compile for a GPU. Triton
    compiles for an architecture without one (`ffkv.mine.fused_aot`): every launch mining makes,
    for an A100 (sm_80), an H100 (sm_90) and a B200 (sm_100), compiles to a cubin with no register spills. The
    extremes of the settings are included: `--samples-per-bin 1000` (an unrolled insertion loop
    took minutes to compile there) and `--top-k 10000`."""
    import json

    p = _finish(_started(request))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in p.stdout.splitlines()]
    # 18 captures (3 dtypes x 3 sign sets x stats on/off), 6 offers (3 sample counts x 2 signs), 1 top-k
    for arch in (80, 90, 100):
        got = [r for r in rows if r["arch"] == arch]
        assert sorted({r["kernel"] for r in got}) == ["capture_kernel", "offer_kernel", "topk_kernel"]
        assert len(got) == 25, [r["variant"] for r in got]
    spills = [(r["arch"], r["kernel"], r["variant"], r["local"]) for r in rows if r["local"]]
    assert not spills, spills
    from ffkv.mine.fused_cuda import WARPS

    assert all(0 < r["regs"] <= 255 and r["warps"] == (WARPS if r["kernel"] == "capture_kernel" else 4) for r in rows)
    assert all(r["loop"] > 0 for r in rows), [(r["arch"], r["kernel"]) for r in rows if not r["loop"]]  # SASS read
    # Prefetching is safe only for loads the loop never writes: the top-k kernel's three row loads
    # (score, position, sentence id), TOPK_STAGES rows ahead; nothing in the capture or the offer,
    # whose samples the row loop reads and writes (a prefetched sample slot would be stale).
    from ffkv.mine.fused_cuda import TOPK_STAGES

    wrong = [(r["arch"], r["kernel"], r["variant"], r["prefetch"]) for r in rows
             if r["prefetch"] != (3 * TOPK_STAGES if r["kernel"] == "topk_kernel" else 0)]
    assert not wrong, wrong


AOT_BAD = [([], {"TRITON_INTERPRET": "1"}, "TRITON_INTERPRET"),
           (["--arch", "70"], {}, "invalid choice: 70"),
           (["--top-k", "0"], {}, "from 1 to 10000"),
           (["--samples", "5", "x"], {}, "from 0 to 1000")]
starts("test_aot_refuses_bad_input")(lambda out, dirs, args, env, says: _aot(*args, **env))


@pytest.mark.parametrize("args,env,says", AOT_BAD)
def test_aot_refuses_bad_input(request, args, env, says):
    p = _finish(_started(request))
    assert p.returncode == 2 and says in p.stderr.splitlines()[-1], p.stderr[-2000:]


VERIFY = PATCH + textwrap.dedent('''
        import os, warnings
        warnings.filterwarnings("ignore")
        from ffkv.mine import fused_cuda, selfcheck
        from ffkv.mine.tune import arms_for
        class Tiny:
            device = "cpu"
        os.environ["FFKV_TRITON"] = "auto"
        assert [a.name for a in arms_for(Tiny())] == ["padded", "padded+fused"]
        assert selfcheck.verify("cpu") and fused_cuda._broken is None
        selfcheck._verified.clear()
        from ffkv.mine import _fused_kernel
        class Idle:
            def __getitem__(self, grid):
                return lambda *a, **k: None
        _fused_kernel.topk_kernel = Idle()
        assert not selfcheck.verify("cpu")
        assert not selfcheck.verify("cpu")                           # said once
        with fused_cuda.forced(True):
            assert not fused_cuda.available("cpu")
        assert [a.name for a in arms_for(Tiny())] == ["padded"]
        print("ok")
    ''')
starts("test_verify_passes_and_catches_a_wrong_kernel")(
    lambda out, dirs: _start(VERIFY.replace(PATCH, PATCH + SMALL_CHECK, 1), FFKV_NUMBA="1"))


def test_verify_passes_and_catches_a_wrong_kernel(request):
    """`verify` (run before the kernels mine) passes on the interpreter's kernels, and turns the
    path off with one line when a kernel runs but computes something else (here: a top-k kernel
    that writes nothing, as a miscompiled one might); the tuner then offers the portable path only."""
    p = _finish(_started(request))
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]
    said = [l for l in p.stderr.splitlines() if l.startswith("ffkv:")]
    assert len(said) == 1 and "disagree with the portable path" in said[0] and "key_p0 differs" in said[0], p.stderr[-2000:]


@starts("test_auto_times_the_fused_path_and_mines_the_same_tables")
def _start_auto(out, dirs):
    """`ffkv mine` with FFKV_TRITON=0 and =auto, each in a process of its own: {flag: (folder, process)}."""
    from conftest import WT2

    got = {}
    for flag in ("0", "auto"):
        args = ["mine", "--out", str(out / f"run{flag}"), "--model", str(dirs()["llama"]), "--corpus",
                str(WT2 / "wiki.valid.tokens"), "--max-sentences", "16", "--top-k", "4", "--batch-tokens", "96"]
        got[flag] = (out / f"run{flag}", _start(PATCH + SMALL_CHECK + f"import sys; from ffkv.cli import main; sys.exit(main({args!r}))",
                                                FFKV_TRITON=flag, HF_HUB_OFFLINE="1"))
    return got


def test_auto_times_the_fused_path_and_mines_the_same_tables(request):
    """FFKV_TRITON=auto where the kernels run (the interpreter here): the first batches are mined
    by the portable path and the fused one in turn, the faster mines the rest, the tables equal the
    portable path's, and the manifest says which ran."""
    import json

    from test_mine import _assert_same_mine

    outs = {}
    for flag, (out, proc) in _started(request).items():
        outs[flag] = out
        p = _finish(proc)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "ffkv:" not in p.stderr, p.stderr[-2000:]
        said = (p.stdout + p.stderr).count("mine: checking the fused kernels against the portable path")
        assert said == (flag == "auto"), p.stdout[-2000:]  # a pause the user is told of (Triton compiles)
    _assert_same_mine(outs["auto"], outs["0"])
    rec = json.loads((outs["auto"] / "manifest.json").read_text())["steps"]["mine"]
    t = rec["tuning"]
    assert [a["arm"] for a in t["arms"]] == ["padded", "padded+fused"] and t["chosen"] is not None
    assert rec["fused_trackers"] == (t["chosen"] == "padded+fused")


def test_usual_path_leaves_out_what_forward_branches_skip():
    """`fused_aot`'s `usual` count on a hand-made SASS listing: a 10-instruction loop (0x100 to
    0x190) whose forward branch at 0x120 jumps over 0x130..0x150 (3 instructions) to 0x160; a
    forward branch outside the loop does not count."""
    from ffkv.mine.fused_aot import _skipped

    ops = {0x100: "IMAD R1, R2, R3, RZ", 0x110: "ISETP.GT.AND P1, PT, R1, 0x3, PT",
           0x120: "@!P1 BRA 0x160", 0x130: "IADD3 R4, R4, R5, RZ", 0x140: "LOP3.LUT R4, R4, 0x3ff, RZ, 0xc0, !PT",
           0x150: "SHF.R.U32.HI R5, RZ, 0xa, R5", 0x160: "FADD R6, R6, R7", 0x170: "SEL R8, R9, RZ, P1",
           0x180: "ISETP.NE.AND P0, PT, R1, R10, PT", 0x190: "@P0 BRA 0x100", 0x1a0: "BRA 0x1c0",
           0x1b0: "NOP", 0x1c0: "EXIT"}
    sass = "\n".join(f"        /*{a:04x}*/                   {t} ;" for a, t in ops.items())
    assert _skipped(sass, 10, [10]) == 3
    assert _skipped(sass, 0, []) == 0
