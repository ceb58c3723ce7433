"""The CUDA histogram kernel (`ffkv.mine.hist_cuda`) counts exactly what the portable path counts.

Run through Triton's interpreter on the CPU (in a subprocess: TRITON_INTERPRET is read when the
kernel is defined), against a brute force of `stats.bin_of` and against KeyStats' own torch path.
Skipped where Triton is not installed.
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import triton.runtime.interpreter as ti
    _orig = ti._LangPatchScope.set_attr
    def _set_attr(self, obj, name, value):  # NumPy >= 2.4 refuses int() of a 1-element array
        if name == "__index__":
            value = lambda t: int(t.handle.data.reshape(-1)[0])
        return _orig(self, obj, name, value)
    ti._LangPatchScope.set_attr = _set_attr

    import os, numpy as np, torch
    from ffkv.mine import hist_cuda, stats
    from ffkv.mine.trackers import Batch, LayerCapture
    assert hist_cuda.available("cpu")
    for seed, (B, T, n) in enumerate([(11, 9, 300), (3, 1, 129), (17, 4, 64)]):
        g = torch.Generator().manual_seed(seed)
        m = torch.randn(B, T, n, generator=g) * torch.exp(torch.randn(B, T, n, generator=g) * 4)
        m[0, 0, :5] = 0.0
        m[-1, 0, :5] = -0.0
        m[0, 0, 5:7] = torch.tensor([1e-40, -1e-40])            # subnormals: the zero bin
        m[-1, 0, 5:9] = torch.tensor([float("inf"), 2.0 ** 12, -2.0 ** 10, 2.0 ** -10])
        lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
        mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
        m = m.masked_fill(~mask[..., None], 3.0)                   # padding must not count
        ref = np.zeros((stats.NB, n), np.int64)
        for b in range(B):
            for t in range(lengths[b]):
                np.add.at(ref, (stats.bin_of(m[b, t].numpy()).astype(np.int64), np.arange(n)), 1)
        lut = stats._raw_luts()[0].to(torch.int32)
        got = hist_cuda.key_hist(m, torch.tensor(lengths, dtype=torch.int32), lut, stats.NB)
        assert np.array_equal(got.numpy(), ref), (seed, np.argwhere(got.numpy() != ref)[:5])
        hists = {}
        for flag in ("0", "1"):
            os.environ["FFKV_TRITON"] = flag
            layers = (0, 1) if n % 2 == 0 else (0,)  # two layers side by side, or one
            ks = stats.KeyStats(list(layers), None, n // len(layers), samples=2, group=len(layers))
            batch = Batch.from_lengths(lengths, list(range(B)), mask)
            ks.update(batch, LayerCapture(layers, m, batch))
            hists[flag] = {k: np.array(v) for k, v in ks.arrays().items()}
        assert hists["0"].keys() == hists["1"].keys()
        for k in hists["0"]:
            assert np.array_equal(hists["0"][k], hists["1"][k], equal_nan=True), (seed, k)
    print("ok")
''')


def test_kernel_counts_exactly(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "FFKV_TRITON": "1"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]


def test_off_switch_and_cpu(monkeypatch):
    from ffkv.mine import hist_cuda

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("FFKV_TRITON", "1")
    assert not hist_cuda.available("cpu")  # the CPU keeps the portable path
    assert hist_cuda.available("cuda")
    monkeypatch.delenv("FFKV_TRITON")
    assert not hist_cuda.available("cuda")  # off unless asked for


def test_triton_is_not_imported_by_mining():
    """On a CPU install that happens to have Triton, mining must not import it (its import alone
    slowed mining measurably here); it loads only with FFKV_TRITON=1 on CUDA."""
    code = "import sys, ffkv.mine.runner, ffkv.mine.stats, ffkv.mine.engine; print('triton' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.stdout.strip() == "False", p.stdout + p.stderr[-2000:]
