"""The key statistics' CPU kernels (`ffkv.mine.stats_cpu`, numba) keep the portable path's state.

Counts, extremes, position buckets and samples are equal to the portable torch path
(FFKV_NUMBA=0, the path a GPU runs) bit for bit; the sums, which the kernels add in float64, agree
to float32 rounding and are exact to math.fsum; and a thread count changes no bit.
"""
import contextlib
import math
import os

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import wikitext_sentences
from ffkv.corpus.batching import pack
from ffkv.mine import stats as S
from ffkv.mine import stats_cpu
from ffkv.mine.engine import mine_batches, new_state
from ffkv.mine.trackers import Batch, LayerCapture
from ffkv.steps.mine import MineSettings


@contextlib.contextmanager
def numba(on: bool):
    old = os.environ.get("FFKV_NUMBA")
    os.environ["FFKV_NUMBA"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FFKV_NUMBA")
        else:
            os.environ["FFKV_NUMBA"] = old


def _assert_same_state(a: dict, b: dict, rtol=2e-6):
    """Every array equal, but the sums' limbs: those within rtol of the largest |sum| of the key."""
    assert a.keys() == b.keys()
    for k in a:
        if k.startswith("limbs"):
            x, y = S.from_limbs(a[k][0]), S.from_limbs(b[k][0])
            x2, y2 = S.from_limbs(a[k][1]), S.from_limbs(b[k][1])
            np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * max(1.0, float(np.abs(y2).max()) ** 0.5), err_msg=k)
            np.testing.assert_allclose(x2, y2, rtol=rtol, atol=rtol * max(1.0, float(np.abs(y2).max())), err_msg=k)
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_available_only_on_a_cpu_and_when_not_turned_off(monkeypatch):
    assert stats_cpu.available("cpu")
    assert not stats_cpu.available("meta") and not stats_cpu.available("cuda")
    with numba(False):
        assert not stats_cpu.available("cpu")
    import sys

    from ffkv.mine import switches

    with switches.over({"FFKV_NUMBA": "0"}):  # a pass's own switch, not only the environment's
        assert not stats_cpu.available("cpu")
    monkeypatch.setattr(switches, "_numba_ok", None)
    monkeypatch.setitem(sys.modules, "numba", None)  # not importable: the portable path
    assert not stats_cpu.available("cpu")
    monkeypatch.setattr(switches, "_numba_ok", None)


@st.composite
def batches(draw):
    """Batches of one layer: values over many octaves, exact zeros, ties and subnormals; rows
    right-padded, or (holes=True) with padding anywhere."""
    n = draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    holes = draw(st.booleans())
    out, sid = [], draw(st.integers(0, 1000))
    for _ in range(draw(st.integers(1, 4))):
        B, T = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        m = torch.randn(B, T, n, generator=g) * torch.exp2(torch.randint(-14, 12, (B, T, n), generator=g).float())
        m[torch.rand(B, T, n, generator=g) < 0.15] = 0.0
        m[torch.rand(B, T, n, generator=g) < 0.1] = 1.0
        m[torch.rand(B, T, n, generator=g) < 0.05] = -1e-40  # subnormal: the zero bin
        if holes:
            mask = torch.rand(B, T, generator=g) < 0.7
            mask[:, 0] = True
        else:
            lengths = torch.randint(1, T + 1, (B,), generator=g)
            mask = torch.arange(T) < lengths.unsqueeze(1)
        out.append((m, mask, list(range(sid, sid + B))))
        sid += B + int(torch.randint(0, 3, (1,), generator=g))
    return n, out


def _fed(n, data, signs, k, on):
    st_ = S.KeyStats([0], None, n, signs=signs, samples=k)
    with numba(on):
        for i, (m, mask, sids) in enumerate(data):
            b = Batch.from_mask(mask, sids)
            # as mining hands it over (every sign and the statistics asked for), or bare
            st_.update(b, LayerCapture(0, m, b, signs, True) if i % 2 == 0 else LayerCapture(0, m, b))
    return st_


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_capture_reads_row_bests_histogram_and_sums_at_once(data):
    """`stats_cpu.capture`'s row bests are `row_best`'s (values and first positions, any mask),
    its histogram and sums `hist_sums`' own."""
    from ffkv.mine.topk import row_best

    n, bs = data
    lut = S._raw_luts()[0].to(torch.int32)
    for m, mask, _ in bs:
        m = m.clone()
        m[0, 0, :1] = -float("inf")  # a row whose best may be -inf keeps position 0
        best, hist, sums = stats_cpu.capture(m, mask, lut, (1, -1), True)
        for s in (1, -1):
            want = row_best(m, mask, s)
            assert torch.equal(best[s][0], want[0]) and torch.equal(best[s][1], want[1]), s
        h = torch.zeros((S.NB, n), dtype=torch.long)
        s1, s2 = stats_cpu.hist_sums(m, mask, lut, h)
        assert torch.equal(hist, h) and torch.equal(sums[0], s1) and torch.equal(sums[1], s2)
        only = stats_cpu.capture(m, mask, lut, (1,), False)
        assert only[1] is None and set(only[0]) == {1} and torch.equal(only[0][1][1], best[1][1])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.sampled_from([(1,), (1, -1)]), st.integers(0, 3))
def test_kernels_keep_the_portable_state(data, signs, k):
    n, bs = data
    _assert_same_state(_fed(n, bs, signs, k, True).arrays(), _fed(n, bs, signs, k, False).arrays())


def test_sums_are_exact_and_thread_free():
    g = torch.Generator().manual_seed(3)
    B, T, n = 9, 17, 2500  # more keys than one thread's block
    m = torch.randn(B, T, n, generator=g) * torch.exp2(torch.randint(-20, 20, (B, T, n), generator=g).float())
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths.unsqueeze(1)
    lut = S._raw_luts()[0].to(torch.int32)
    got = []
    threads = torch.get_num_threads()
    try:
        for th in (1, 2):
            torch.set_num_threads(th)
            hist = torch.zeros((S.NB, n), dtype=torch.long)
            got.append((hist, *stats_cpu.hist_sums(m, mask, lut, hist)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*got):
        assert torch.equal(a, b)
    v = m[mask].double().numpy()  # (tokens, n)
    for key in (0, 1023, 1024, n - 1):
        assert math.isclose(float(got[0][1][key]), math.fsum(v[:, key]), rel_tol=1e-12, abs_tol=1e-300)
        assert math.isclose(float(got[0][2][key]), math.fsum(v[:, key] ** 2), rel_tol=1e-12)
    assert int(got[0][0].sum()) == int(mask.sum()) * n


def test_a_tiny_model_mines_alike_on_both_paths(tiny_models):
    """Gated (llama) and ungated (gpt2) FFNs, both signs: the same state through the engine."""
    for arch in ("llama", "gpt2"):
        mm = tiny_models[arch]
        token_lists = [mm.tok(x)["input_ids"][:30] for x in wikitext_sentences(60)]
        plan = list(enumerate(pack([len(t) for t in token_lists], 160)))
        s = MineSettings(top_k=3, negative=True, batch_tokens=160, samples_per_bin=2)
        runs = []
        for on in (True, False):
            with numba(on):
                runs.append(mine_batches(mm, new_state(mm, s), token_lists, list(range(len(token_lists))), plan))
        _assert_same_state(runs[0].stats.arrays(), runs[1].stats.arrays())
        a, b = runs[0].topk.arrays(), runs[1].topk.arrays()
        assert all(np.array_equal(a[k], b[k]) for k in a)
