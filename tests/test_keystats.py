"""Key statistics (issue 13): histograms and samples against brute force, exact merges, no device transfers."""
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import WT2, run_cli, wikitext_sentences
from ffkv.corpus.batching import pack
from ffkv.mine import stats as S
from ffkv.mine.engine import mine_batches, new_state
from ffkv.mine.topk import TopKState
from ffkv.mine.trackers import Batch, LayerCapture, MineState
from ffkv.steps.mine import MineSettings


# ---- brute force over every token of a tiny model --------------------------------------------------------
def _captured(mm, token_lists, plan):
    """Every valid token's coefficients, per layer (N_tokens, d_m) float32, and per sentence."""
    per_layer = {l: [] for l in range(mm.n_layers)}
    per_sent = []  # (sid, {layer: (len, d_m)})
    for _, idx in plan:
        seqs = [token_lists[i] for i in idx]
        ids, mask = mm.batch(seqs)
        caps = mm.capture(ids, mask, layers=list(range(mm.n_layers)), what=("m",))
        for r, i in enumerate(idx):
            L = len(token_lists[i])
            d = {l: caps.layers[l]["m"][r, :L].float().numpy() for l in range(mm.n_layers)}
            per_sent.append((int(i), d))
            for l in d:
                per_layer[l].append(d[l])
    return {l: np.concatenate(v) for l, v in per_layer.items()}, per_sent


def _np_hist(v: np.ndarray) -> np.ndarray:
    """One key's signed histogram by numpy: np.histogram of |m| on each side, zeros apart."""
    lo, hi = S.side_edges()
    edges = np.append(lo, np.inf)
    a = np.abs(v.astype(np.float64))
    pos = np.histogram(a[(v > 0) & (a >= S.TINY)], bins=edges)[0]
    neg = np.histogram(a[(v < 0) & (a >= S.TINY)], bins=edges)[0]
    return np.concatenate([neg[::-1], [int((a < S.TINY).sum())], pos])


@pytest.fixture(scope="module")
def mined(tiny_models):
    mm = tiny_models["llama"]
    token_lists = [mm.tok(x)["input_ids"][:36] for x in wikitext_sentences(90)]
    token_lists[3] = token_lists[3][:1]  # a one-token sentence: its best is at position 0
    plan = list(enumerate(pack([len(t) for t in token_lists], 200)))
    s = MineSettings(top_k=3, negative=True, batch_tokens=200, samples_per_bin=2)
    st_ = mine_batches(mm, new_state(mm, s), token_lists, list(range(len(token_lists))), plan)
    flat, per_sent = _captured(mm, token_lists, plan)
    return mm, token_lists, st_, flat, per_sent


def test_histograms_equal_numpy_over_every_token(mined):
    mm, token_lists, st_, flat, _ = mined
    t = st_.stats.hist_table().to_pandas()
    n_tok = sum(map(len, token_lists))
    for l in range(mm.n_layers):
        got = np.zeros((mm.d_m, S.NB), np.int64)
        d = t[t.layer == l]
        got[d.dim.to_numpy(), d.bin.to_numpy()] = d["count"].to_numpy()
        for i in range(mm.d_m):
            np.testing.assert_array_equal(got[i], _np_hist(flat[l][:, i]), err_msg=f"key {l}/{i}")
        assert (got.sum(1) == n_tok).all()  # per key: every valid token once


def test_summary_against_brute_force(mined):
    mm, token_lists, st_, flat, per_sent = mined
    t = st_.stats.stats_table().to_pandas()
    n_tok = sum(map(len, token_lists))
    for l in range(mm.n_layers):
        v = flat[l].astype(np.float64)
        for sgn in (1, -1):
            d = t[(t.layer == l) & (t.sign == sgn)].sort_values("dim")
            assert (d["count"] == n_tok).all() and (d["sentences"] == len(token_lists)).all()
            np.testing.assert_allclose(d["mean"], v.mean(0), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(d["std"], v.std(0), rtol=1e-4, atol=1e-6)
            np.testing.assert_array_equal(d["max"], (sgn * (sgn * flat[l]).max(0)).astype(np.float32))
            side = (sgn * v > 0) & (np.abs(v) >= S.TINY)
            np.testing.assert_allclose(d["frac_active"], side.mean(0), rtol=1e-6)
            # histogram quantiles: within the octave of the exact quantile
            for i in range(mm.d_m):
                a = np.abs(v[side[:, i], i])
                if len(a) < 20:
                    continue
                exact = np.quantile(a, 0.5)
                assert abs(math.log2(abs(d["p50"].iloc[i]) / exact)) <= 1.0
                strong = (sgn * v[:, i] > 0.1 * abs(d["max"].iloc[i])).mean()
                assert abs(d["frac_strong"].iloc[i] - strong) <= 0.1 * max(strong, 0.02) + 0.02
            # positions of each sentence's best, bucketed
            ph = np.stack(d["pos_hist"].to_numpy())
            ref = np.zeros_like(ph)
            for _, cap in per_sent:
                x = sgn * cap[l]
                p = x.argmax(0)  # first best position
                b = np.where(p == 0, 0, np.minimum(np.floor(np.log2(np.maximum(p, 1))).astype(int) + 1, S.NPOS - 1))
                np.add.at(ref, (np.arange(mm.d_m), b), 1)
            np.testing.assert_array_equal(ph, ref)


def test_quantile_samples_equal_brute_force_selection(mined):
    mm, token_lists, st_, flat, per_sent = mined
    got = st_.stats.samples_table().to_pandas()
    k = st_.stats.k
    sign_t, lo_t, hi_t = S.bin_table()
    for l in range(mm.n_layers):
        salt = S.key_salt(l, np.arange(mm.d_m))
        for sgn in (1, -1):
            for i in range(mm.d_m):
                cands = {}
                for sid, cap in per_sent:
                    x = sgn * cap[l][:, i]
                    p = int(x.argmax())
                    c = float(cap[l][p, i])
                    if not (sgn * c > 0 and abs(c) >= S.TINY):
                        continue
                    b = int(S.bin_of(np.float32(c)))
                    h = int(S.sample_hash(np.int64(sid), np.int64(salt[i])))
                    cands.setdefault(b, []).append((h, sid, p, c))
                exp = sorted((b, h, sid, p, np.float32(c)) for b, lst in cands.items() for h, sid, p, c in sorted(lst)[:k])
                d = got[(got.layer == l) & (got.dim == i) & (got.sign == sgn)]
                rows = sorted((int(r.bin), int(S.sample_hash(np.int64(r.sentence_id), np.int64(salt[i]))),
                               int(r.sentence_id), int(r.position), np.float32(r.coef)) for r in d.itertuples())
                assert rows == exp, (l, i, sgn)
                for b, _, _, _, c in rows:  # each lies in its bin
                    assert sign_t[b] == sgn and lo_t[b] <= abs(c) < hi_t[b]


def test_sample_hash_is_a_bijection():
    from ffkv.mine import rules as R

    salt = np.int64(R.key_salt(3, [17])[0])
    sids = np.concatenate([np.arange(0, 5000), np.array([R.M31 - 1, R.M31 - 2, 2 ** 30])]).astype(np.int64)
    h = R.sample_hash(sids, salt)
    assert (h >= 0).all() and (h < R.EMPTY).all() and len(np.unique(h)) == len(h)
    np.testing.assert_array_equal(R.sample_sid(h, salt), sids)
    # the one id that π maps onto EMPTY takes the hole, and comes back
    star = np.int64(R._perm_inv(np.int64(R.M31)) ^ salt)
    assert R.sample_hash(star, salt) != R.EMPTY and R.sample_sid(R.sample_hash(star, salt), salt) == star
    th = R.sample_hash(torch.as_tensor(sids), torch.as_tensor(salt))
    np.testing.assert_array_equal(th.numpy(), h)


# ---- merges: associative, commutative, equal to one global pass ---------------------------------------
def _state(n, signs, k):
    trackers = {"topk": TopKState([0, 1], None, n, 3, negative=len(signs) == 2),
                "stats": S.KeyStats([0, 1], None, n, signs=signs, samples=k)}
    return MineState(trackers, [0, 1], None)


def _feed(state, batches):
    for m, lengths, sids in batches:
        B, T, n = m[0].shape
        mask = torch.arange(T) < torch.as_tensor(lengths).unsqueeze(1)
        b = Batch.from_lengths(lengths, sids, mask)
        for l in (0, 1):
            state.update(l, m[l], b)
    return state


def _equal(a: MineState, b: MineState) -> bool:
    x, y = a.arrays(), b.arrays()
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k], equal_nan=True) for k in x)


@st.composite
def batch_lists(draw):
    n = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2 ** 16))
    nb = draw(st.integers(3, 6))
    g = torch.Generator().manual_seed(seed)
    out, sid = [], draw(st.integers(0, 50))
    for _ in range(nb):
        B, T = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        lengths = sorted(torch.randint(1, T + 1, (B,), generator=g).tolist())
        # magnitudes over many octaves, exact zeros and ties
        m = [torch.randn(B, T, n, generator=g) * torch.exp2(torch.randint(-14, 12, (B, T, n), generator=g).float())
             for _ in range(2)]
        for x in m:
            x[torch.rand(B, T, n, generator=g) < 0.15] = 0.0
            x[torch.rand(B, T, n, generator=g) < 0.1] = 1.0
        out.append((m, lengths, list(range(sid, sid + B))))
        sid += B + int(torch.randint(0, 3, (1,), generator=g))
    return n, out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_lists(), st.sampled_from([(1,), (1, -1)]), st.integers(1, 3))
def test_merge_associative_commutative_global(data, signs, k):
    n, batches = data
    third = max(1, len(batches) // 3)
    A, B, C = batches[:third], batches[third:2 * third], batches[2 * third:]
    fresh = lambda part: _feed(_state(n, signs, k), part)  # noqa: E731
    whole = fresh(batches)
    left = fresh(A).merge(fresh(B)).merge(fresh(C))
    right = fresh(A).merge(fresh(B).merge(fresh(C)))
    swapped = fresh(C).merge(fresh(A)).merge(fresh(B))
    assert _equal(whole, left) and _equal(left, right) and _equal(left, swapped)
    # and through the arrays (checkpoints, Ray): load(arrays(x)) == x
    assert _equal(whole, _state(n, signs, k).load_arrays(whole.arrays()))


def test_limbs_are_exact_and_order_free():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(50, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 9, (50,), generator=g)
          for _ in range(20)]
    a = sum(S.to_limbs(x) for x in xs)
    b = sum(S.to_limbs(x) for x in reversed(xs))
    assert torch.equal(a, b)
    exact = [math.fsum(float(x[i]) for x in xs) for i in range(50)]
    np.testing.assert_allclose(S.from_limbs(a.numpy()), exact, rtol=1e-12, atol=1e-15)


# ---- one protocol on the captures' device: no transfers in update -----------------------------------
def _update_all(device, n=12, B=4, T=6, negative=True):
    trackers = {"topk": TopKState([0], None, n, 3, negative=negative, device=device),
                "stats": S.KeyStats([0], None, n, signs=(1, -1) if negative else (1,), samples=2, device=device)}
    state = MineState(trackers, [0], None, device=device)
    lengths = [2, 3, 3, 6]
    mask = (torch.arange(T) < torch.as_tensor(lengths).unsqueeze(1)).to(device)
    batch = Batch.from_lengths(lengths, [5, 6, 7, 8], mask)
    m = torch.randn(B, T, n).to(device)
    return state, batch, m


def test_update_runs_on_meta_device(monkeypatch):
    """The meta device has no data: any host read (item, tolist, bool of a tensor) would raise."""
    import torch.fx.experimental._config as fxc

    monkeypatch.setattr(fxc, "meta_nonzero_assume_all_nonzero", True)
    for negative in (False, True):
        state, batch, m = _update_all("meta", negative=negative)
        state.update(0, m, batch)
        assert state.stats.hist[(0,)].device.type == "meta"
        # a batch with a hole in the mask (the masked path) too
        b2 = Batch(mask=batch.mask.clone(), sids=batch.sids, lengths=batch.lengths, runs=None,
                   tokens=batch.tokens, padded=True)
        state.update(0, m, b2)


def test_update_makes_no_transfers(monkeypatch):
    """On the CPU, with every host read and device move patched to fail: the portable path, the
    one a GPU runs (a CPU's numba kernels read their tensors as numpy views, no copy)."""
    monkeypatch.setenv("FFKV_NUMBA", "0")
    state, batch, m = _update_all("cpu")
    state.update(0, m, batch)  # warm: some lists fill

    def boom(name):
        def f(self, *a, **kw):
            raise AssertionError(f"update called Tensor.{name}")
        return f

    orig_to = torch.Tensor.to

    def to(self, *a, **kw):
        dev = kw.get("device")
        for x in a:
            if isinstance(x, (str, torch.device)):
                dev = x
            elif isinstance(x, torch.Tensor):
                dev = x.device
        if dev is not None and torch.device(dev) != self.device:
            raise AssertionError(f"update moved a tensor to {dev}")
        return orig_to(self, *a, **kw)

    for name in ("cpu", "cuda", "numpy", "tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom(name))
    monkeypatch.setattr(torch.Tensor, "to", to)
    for _ in range(3):
        state.update(0, m * 2, batch)
    monkeypatch.undo()
    assert state.stats.tokens == 4 * batch.tokens


# ---- the step: tables, old runs, --no-stats ---------------------------------------------------------
def test_settings_record_keeps_old_runs():
    import hashlib

    s = MineSettings(corpus="x", top_k=7)
    # batch_tokens (speed only) left the record in issue 24; a run that recorded it keeps it
    # through the step's record (`ffkv.steps.mine.record`, tests/test_gpu_scale.py). The record
    # as written before key statistics, spelled out: checkpoint_every, ray and shards (how the
    # pass runs) are not in it either
    old = {"corpus": "x", "max_sentences": None, "seed": 0, "field": "text", "layers": None, "dims": None,
           "top_k": 7, "negative": False, "per_prefix": False}
    assert s.record() == old  # a run recorded before the fields existed has this very record
    assert s.key() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert MineSettings(stats=False).record()["stats"] is False
    assert MineSettings(samples_per_bin=3).record()["samples_per_bin"] == 3


def test_cli_stats_tables_show_and_old_runs(tmp_path, tiny_dirs):
    import pyarrow.parquet as pq

    out = tmp_path / "run"
    args = ["--model", tiny_dirs["opt"], "--corpus", WT2 / "wiki.valid.tokens", "--max-sentences", 40, "--top-k", 3]
    res = run_cli("mine", "--out", out, *args)
    assert res.returncode == 0, res.stderr
    man = json.loads((out / "manifest.json").read_text())
    lay = man["steps"]["mine"]["stats"]
    assert lay["bins"] == S.NB and len(lay["lo"]) == S.NB and "stats" not in man["settings"]["mine"]
    ks = pq.read_table(out / "key_stats.parquet")
    assert ks.num_rows == 2 * 96 and set(ks.column("sign").to_pylist()) == {1}
    # OPT's ReLU: exact zeros fill the zero bin, and the density is the share of m > 0
    kh = pq.read_table(out / "key_hist.parquet").to_pandas()
    assert (kh[kh.bin == S.ZERO]["count"] > 0).mean() > 0.9
    assert (kh[kh.bin < S.ZERO]["count"].sum()) == 0
    res = run_cli("show", out, "--layer", 1, "--dim", 4, "--top", 2, "--samples", 1)
    assert res.returncode == 0, res.stderr
    assert "stats +: density" in res.stdout and "bin " in res.stdout and "tokens" in res.stdout
    # an old run: no stats info, no tables (and so no record of them) -> still done, show still works
    man["steps"]["mine"].pop("stats")
    for t in ("key_stats", "key_hist", "key_samples"):
        man.get("tables", {}).pop(t, None)
    (out / "manifest.json").write_text(json.dumps(man))
    for t in ("key_stats", "key_hist", "key_samples"):
        (out / f"{t}.parquet").unlink()
    res = run_cli("mine", "--out", out, *args)
    assert res.returncode == 0 and "nothing to do" in res.stdout, res.stderr
    res = run_cli("show", out, "--layer", 1, "--dim", 4, "--top", 2)
    assert res.returncode == 0 and "no activation statistics" in res.stdout
    # --no-stats: no tables, recorded, and skipped when repeated
    out2 = tmp_path / "nostats"
    assert run_cli("mine", "--out", out2, *args, "--no-stats").returncode == 0
    assert not (out2 / "key_stats.parquet").exists()
    res = run_cli("mine", "--out", out2, *args, "--no-stats")
    assert res.returncode == 0 and "nothing to do" in res.stdout
    assert pq.read_table(out2 / "triggers.parquet").equals(pq.read_table(out / "triggers.parquet"))


def test_position_buckets_one_rule():
    """`rules.pos_bucket` (the compiled kernels' code) and the portable path's exponent-bit read
    give the same bucket for every position up to and past the last bucket's start."""
    from ffkv.mine import rules as S

    p = torch.arange(0, 70000, dtype=torch.int32)
    bits = (torch.bitwise_right_shift(p.float().view(torch.int32), 23) - 126).clamp(0, S.NPOS - 1)
    assert torch.equal(S.pos_bucket(p.long()), bits.long())
    want = [0 if x == 0 else min(S.NPOS - 1, x.bit_length()) for x in range(0, 70000, 997)]
    assert [int(S.pos_bucket(x)) for x in range(0, 70000, 997)] == want
