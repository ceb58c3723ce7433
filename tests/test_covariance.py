"""The keys' second moment from the mining pass (`ffkv mine --covariance`): against a brute-force
product over the same tokens, exact merges in any order, and one-line refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import WT2, merges_bit_for_bit, mine_tiny, run_cli
from ffkv.mine.covariance import KeyCovariance
from ffkv.mine.trackers import Batch, LayerCapture


@pytest.fixture(scope="module")
def mined(tmp_path_factory, tiny_dirs):
    return mine_tiny(tmp_path_factory.mktemp("cov") / "run", tiny_dirs["llama"], 60, 3, "--covariance", "0,2",
                     "--batch-tokens", "256")


def test_second_moment_equals_brute_force_over_the_same_tokens(mined, tiny_models):
    from ffkv.store import query
    from ffkv.store.run import Run

    run = Run(mined)
    mm = tiny_models["llama"]
    ids = query.table(run, "sentences", columns=["token_ids"]).column("token_ids").to_pylist()
    assert query.covariance_layers(run) == [0, 2]
    for layer in (0, 2):
        ms = []
        for seq in ids:  # one sentence at a time: no batching shared with the pass
            x = torch.tensor([seq])
            ms.append(mm.capture(x, layers=[layer])[layer]["m"][0].double())
        M = torch.cat(ms)
        mean, C, n = query.key_covariance(run, layer)
        assert n == M.shape[0] == sum(map(len, ids))
        np.testing.assert_allclose(C, (M.T @ M / n).numpy(), rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(mean, M.mean(0).numpy(), rtol=2e-5, atol=1e-7)
        # torch.cov's (population) covariance is C − mean meanᵀ
        np.testing.assert_allclose(C - np.outer(mean, mean), torch.cov(M.T, correction=0).numpy(), rtol=1e-4, atol=1e-6)
        assert np.allclose(C, C.T)
    with pytest.raises(Exception, match="no key covariance of layer 1.*keeps layers 0, 2"):
        query.key_covariance(run, 1)


def _fed(batches, n=6, layers=(0, 1)):
    t = KeyCovariance(list(layers), [1], n)
    for m, lengths in batches:
        mask = torch.arange(m.shape[1])[None, :] < torch.tensor(lengths)[:, None]
        b = Batch.from_lengths(lengths, list(range(len(lengths))), mask)
        for i, l in enumerate(layers):
            t.update(b, LayerCapture(l, m[..., i * n:(i + 1) * n].clone(), b))
    return t


batches = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(0, 2 ** 31)), min_size=3, max_size=3)


@settings(max_examples=25, deadline=None)
@given(batches)
def test_merge_is_associative_and_order_free_bit_for_bit(spec):
    def batch(B, T, seed):
        g = torch.Generator().manual_seed(seed)
        m = torch.randn(B, T, 12, generator=g) * torch.exp(torch.randn(1, 1, 12, generator=g) * 3)
        return m, [int(x) for x in torch.randint(1, T + 1, (B,), generator=g)]

    a, b, c = ([batch(*s)] for s in spec)
    first = merges_bit_for_bit(_fed, a, b, c)
    # one state fed all three batches sums them in float64 before its limbs: the same to rounding
    whole = _fed(a + b + c)
    merged = KeyCovariance([0, 1], [1], 6).load_arrays(first)
    np.testing.assert_allclose(whole.moments(1)[1], merged.moments(1)[1], rtol=1e-12, atol=1e-300)
    back = KeyCovariance([0, 1], [1], 6).load_arrays(_fed(a).arrays())
    assert all(np.array_equal(back.arrays()[k], v) for k, v in _fed(a).arrays().items())


@pytest.mark.parametrize("extra, says", [
    (["--covariance", "9"], "--covariance 9 out of range 0..2"),
    (["--covariance", "1", "--layers", "0"], "--covariance 1 is not among --layers"),
    (["--covariance", "1", "--dims", "0-3"], "--covariance needs every dim"),
    (["--covariance", "x"], "covariance"),
])
def test_bad_covariance_is_one_line(tmp_path, tiny_dirs, extra, says):
    res = run_cli("mine", "--out", tmp_path / "r", "--model", tiny_dirs["llama"], "--corpus",
                  WT2 / "wiki.valid.tokens", "--max-sentences", "3", *extra)
    assert res.returncode == 2 and says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
