"""Fig 3 (mutations): re-scored coefficients against direct forward passes, a planted key, speed
bookkeeping. Also home of `make_run`, a brute-force trigger miner the key tests share."""
from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st
import torch

from conftest import WT2, build_tiny, run_cli
from ffkv.corpus.batching import pack
from ffkv.corpus.sources import leading_specials
from ffkv.memories import rescore as R
from ffkv.steps.mutate import STEP, MutateSettings
from ffkv.steps.mutate import compute as M
from ffkv.store.query import read_triggers, sample_keys, sentence_lookup
from ffkv.store.run import Run
from ffkv.model import identity


def cli_inproc(*args) -> tuple[int, str, str]:
    """The `ffkv` entry point in this process: (exit code, stdout, stderr)."""
    from conftest import run_cli

    r = run_cli(*args)
    return r.returncode, r.stdout, r.stderr


# ---- a run with brute-force triggers (independent of the miner) --------------------------------
@torch.no_grad()
def brute_force_triggers(mm, sentences: list[list[int]], sentence_ids, k: int) -> pa.Table:
    """One prefix per sentence (its best position); top-k sentences per (layer, dim, sign).
    Each sentence is run alone, so nothing here shares code with the batched engine."""
    rows = {c: [] for c in ("layer", "dim", "sign", "rank", "coef", "sentence_id", "position",
                            "next_token")}
    per_layer = {l: [] for l in range(mm.n_layers)}
    for ids in sentences:
        inp, mask = mm.batch([ids])
        cap = mm.capture(inp, mask, what=("m",))
        for l in range(mm.n_layers):
            per_layer[l].append(cap[l]["m"][0].float())  # (T, d_m)
    for l in range(mm.n_layers):
        for sign in (1, -1):
            best = torch.stack([(sign * m).max(0).values for m in per_layer[l]])  # (S, d_m)
            bpos = torch.stack([(sign * m).max(0).indices for m in per_layer[l]])
            for d in range(mm.d_m):
                order = sorted(range(len(sentences)), key=lambda s: (-float(best[s, d]), s))[:k]
                for r, s in enumerate(order):
                    p = int(bpos[s, d])
                    rows["layer"].append(l)
                    rows["dim"].append(d)
                    rows["sign"].append(sign)
                    rows["rank"].append(r + 1)
                    rows["coef"].append(float(per_layer[l][s][p, d]))
                    rows["sentence_id"].append(int(sentence_ids[s]))
                    rows["position"].append(p)
                    ids = sentences[s]
                    rows["next_token"].append(ids[p + 1] if p + 1 < len(ids) else None)
    return pa.table({
        "layer": pa.array(rows["layer"], pa.int16()), "dim": pa.array(rows["dim"], pa.int32()),
        "sign": pa.array(rows["sign"], pa.int8()), "rank": pa.array(rows["rank"], pa.int16()),
        "coef": pa.array(rows["coef"], pa.float32()),
        "sentence_id": pa.array(rows["sentence_id"], pa.int64()),
        "position": pa.array(rows["position"], pa.int32()),
        "next_token": pa.array(rows["next_token"], pa.int32())})


def make_run(path, model_dir, n_sentences: int = 40, k: int = 12, max_tokens: int = 40,
             mm=None) -> Run:
    """A run directory with `sentences`, brute-force `triggers` and a finished `mine` step."""
    from ffkv.corpus.prepare import prepare_sentences
    from ffkv.model.memories import open_model

    mm = mm or open_model(str(model_dir), device="cpu")
    run = Run(path, create=True)
    identity.record_model(run, mm)
    run.start_step("mine", {"test": "brute force"})
    tbl = prepare_sentences(run, mm, str(WT2 / "wiki.valid.tokens"), n_sentences, seed=0)
    ids = [t[:max_tokens] for t in tbl.column("token_ids").to_pylist()]
    if any(len(t) != len(u) for t, u in zip(ids, tbl.column("token_ids").to_pylist())):
        tbl = tbl.set_column(tbl.column_names.index("token_ids"), "token_ids",
                             pa.array(ids, pa.list_(pa.int32())))
        tbl = tbl.set_column(tbl.column_names.index("n_tokens"), "n_tokens",
                             pa.array([len(t) for t in ids], pa.int32()))
        run.write_table("sentences", tbl)
    sids = tbl.column("sentence_id").to_pylist()
    run.write_table("triggers", brute_force_triggers(mm, ids, sids, k))
    from ffkv.steps.mine.compute import vocab_table

    run.write_table("vocab", vocab_table(mm.tok, mm.vocab_size))  # every mined run has one
    run.finish_step("mine")
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dirs, tiny_models):
    root = tmp_path_factory.mktemp("mutruns")
    return {a: make_run(root / a, tiny_dirs[a], mm=tiny_models[a]) for a in ("gpt2", "llama")}


def _direct(mm, ids, layer, dim, pos=None):
    inp, mask = mm.batch([list(ids)])
    m = mm.capture(inp, mask, layers=[layer], what=("m",))[layer]["m"][0]
    return float(m[len(ids) - 1 if pos is None else pos, dim])


# ---- the engine ----------------------------------------------------------------------------------
def test_absorb_prefixes_brute_force():
    rng = random.Random(0)
    seqs = [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 6))) for _ in range(300)]
    rep = R.absorb_prefixes(seqs)
    for i, s in enumerate(seqs):
        r = seqs[rep[i]]
        assert r[: len(s)] == s
        # a representative is a prefix of no other sequence
        assert not any(len(o) > len(r) and o[: len(r)] == r for o in seqs)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_rescore_equals_direct_forward(tiny_models, arch):
    """Random sequences and positions, all layers, tiny batches: each value equals a lone pass."""
    mm = tiny_models[arch]
    rng = random.Random(1)
    base = [[rng.randrange(5, mm.vocab_size) for _ in range(rng.randrange(2, 30))] for _ in range(12)]
    seqs, lays, poss, dims = [], [], [], []
    for _ in range(80):
        b = rng.choice(base)
        s = tuple(b[: rng.randrange(1, len(b) + 1)])
        seqs.append(s)
        lays.append(rng.randrange(mm.n_layers))
        poss.append(rng.randrange(len(s)))
        dims.append(rng.randrange(mm.d_m))
    st = R.RescoreStats()
    got = R.rescore(mm, seqs, lays, poss, dims, batch_tokens=64, stats=st)
    want = np.array([_direct(mm, s, l, d, p) for s, l, p, d in zip(seqs, lays, poss, dims)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # prefixes were absorbed: at most one pass per base sentence
    assert st.sequences_run <= len(base) and st.batches > 1


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_mutations_match_direct_forward(runs, tiny_models, arch):
    run, mm = runs[arch], tiny_models[arch]
    res = M.mutate(run, mm, keys_per_layer=4, examples=8, seed=3, batch_tokens=256,
                   show_progress=False)
    t = res.mutations.to_pylist()
    assert len(t) == res.stats["variants"] > 0
    assert {r["mutation"] for r in t} == set(M.MUTATIONS)
    sents = sentence_lookup(run, [r["sentence_id"] for r in t])
    rng = random.Random(0)
    old_cache = {}
    for r in rng.sample(t, 45) + [r for r in t if r["mutation"] == "last"][:10]:
        ids = sents[r["sentence_id"]][: r["position"] + 1]
        variant = ids[: r["removed_position"]] + ids[r["removed_position"] + 1:]
        assert len(variant) == r["n_tokens"] and r["removed_token"] == ids[r["removed_position"]]
        if r["mutation"] == "first":
            assert r["removed_position"] == 0
        if r["mutation"] == "last":
            assert r["removed_position"] == r["position"]
        new = _direct(mm, variant, r["layer"], r["dim"])
        key = (r["sentence_id"], r["position"], r["layer"], r["dim"])
        old = old_cache.setdefault(key, _direct(mm, ids, r["layer"], r["dim"]))
        assert r["new_coef"] == pytest.approx(new, rel=1e-4, abs=1e-5)
        assert r["old_coef"] == pytest.approx(old, rel=1e-4, abs=1e-5)
        assert r["trigger_coef"] == pytest.approx(old, rel=1e-4, abs=1e-5)
        assert r["rel_change"] == pytest.approx((new - old) / old, rel=1e-3, abs=1e-4)
    # the summary is the quartiles of the table, recomputed here
    rel = np.array([r["rel_change"] for r in t if r["layer"] == 1 and r["mutation"] == "random"])
    row = [s for s in res.layers.to_pylist() if s["layer"] == 1 and s["mutation"] == "random"][0]
    assert row["n"] == len(rel)
    assert row["median"] == pytest.approx(float(np.median(rel)), rel=1e-5)
    assert row["q25"] == pytest.approx(float(np.percentile(rel, 25)), rel=1e-5)
    assert row["mean"] == pytest.approx(float(rel.mean()), rel=1e-5)
    # every sampled key contributes its top-8 (minus 1-token prefixes, which are skipped)
    keys = {(r["layer"], r["dim"]) for r in t}
    assert len(keys) == 4 * mm.n_layers


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "opt", "llama"])
def test_prefix_sharing_equals_direct_forward(tiny_models, arch, monkeypatch):
    """Variants computed from their original's cached keys/values equal lone passes; so do they
    with CUDA's pass cost, whose batches mix leaves of many layers."""
    mm = tiny_models[arch]
    assert R.sharing_ok(mm)
    rng = random.Random(2)
    seqs, lays, poss, dims, anchors = [], [], [], [], []
    for _ in range(12):
        base = tuple(rng.randrange(5, mm.vocab_size) for _ in range(rng.randrange(4, 30)))
        layer = rng.randrange(mm.n_layers)
        seqs.append(base)
        lays.append(layer)
        poss.append(len(base) - 1)
        dims.append(rng.randrange(mm.d_m))
        anchors.append(-1)
        a = len(seqs) - 1
        for _ in range(4):
            j = rng.randrange(1, len(base))
            r = rng.randrange(0, j + 1)
            v = base[:r] + base[r + 1:j + 1]
            seqs.append(v)
            lays.append(rng.randrange(mm.n_layers))
            poss.append(rng.randrange(len(v)))  # not only the last position
            dims.append(rng.randrange(mm.d_m))
            anchors.append(a)
    shared, plain = R.RescoreStats(), R.RescoreStats()
    got = R.rescore(mm, seqs, lays, poss, dims, batch_tokens=96, anchors=anchors, stats=shared)
    ref = R.rescore(mm, seqs, lays, poss, dims, batch_tokens=96, stats=plain)
    want = np.array([_direct(mm, s, l, d, p) for s, l, p, d in zip(seqs, lays, poss, dims)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ref, want, rtol=1e-4, atol=1e-5)
    assert shared.tokens_run < plain.tokens_run and shared.layer_tokens < plain.layer_tokens
    monkeypatch.setattr(R, "PAST_FACTOR", 0.25)  # leaf batches split by their copied prefixes
    split = R.RescoreStats()
    got = R.rescore(mm, seqs, lays, poss, dims, batch_tokens=96, anchors=anchors, stats=split)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert split.batches > shared.batches and split.tokens_run == shared.tokens_run
    monkeypatch.setattr(R, "PAST_FACTOR", 4)
    monkeypatch.setattr(R, "POOL_FACTOR", 0)  # each root batch's leaves alone, as before the pool
    alone = R.RescoreStats()
    got = R.rescore(mm, seqs, lays, poss, dims, batch_tokens=96, anchors=anchors, stats=alone)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert alone.tokens_run == shared.tokens_run

    def cost(s):  # padded work and a pass's fixed cost (`R.SLACK` tokens): leaves of several root batches share passes
        return s.padded_layer_tokens + R.SLACK * s.batches

    assert cost(alone) > cost(shared)
    monkeypatch.setattr(R, "POOL_FACTOR", 4)
    wide, merged = R.RescoreStats(), R.RescoreStats()
    R.rescore(mm, seqs, lays, poss, dims, batch_tokens=4096, anchors=anchors, stats=wide)
    monkeypatch.setattr(R, "pass_tokens", lambda device: R.CUDA_PASS_TOKENS)
    got = R.rescore(mm, seqs, lays, poss, dims, batch_tokens=4096, anchors=anchors, stats=merged)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert merged.batches < wide.batches and merged.layer_tokens >= wide.layer_tokens


def test_mutate_shares_prefixes(runs, tiny_models):
    run, mm = runs["llama"], tiny_models["llama"]
    a = M.mutate(run, mm, keys_per_layer=3, examples=8, write=False, show_progress=False)
    b = M.mutate(run, mm, keys_per_layer=3, examples=8, write=False, show_progress=False,
                 share_prefixes=False)
    np.testing.assert_allclose(a.mutations.column("new_coef").to_numpy(),
                               b.mutations.column("new_coef").to_numpy(), rtol=1e-4, atol=1e-5)
    assert a.stats["rescore"]["layer_tokens"] < 0.9 * b.stats["rescore"]["layer_tokens"]


def test_rescore_stops_at_the_layer(tiny_models):
    """A pass for layer-0 requests never runs the blocks above layer 0."""
    mm = tiny_models["llama"]
    calls = {l: 0 for l in range(mm.n_layers)}
    hooks = [mm.blocks[l].register_forward_hook(lambda *a, l=l: calls.__setitem__(l, calls[l] + 1))
             for l in range(mm.n_layers)]
    try:
        seqs = [tuple(range(10, 10 + n)) for n in (3, 5, 8)] + [tuple(range(40, 46))]
        st = R.RescoreStats()
        R.rescore(mm, seqs, [0, 0, 0, 0], [2, 4, 7, 5], [1, 2, 3, 4], stats=st)
        assert calls[0] >= 1 and all(calls[l] == 0 for l in range(1, mm.n_layers))
        assert st.sequences_run == 2 and st.layer_tokens == 8 + 6
        R.rescore(mm, seqs[:1], [1], [2], [0])
        assert calls[1] == 1 and calls[2] == 0
    finally:
        for h in hooks:
            h.remove()


def test_last_token_costs_no_pass(runs, tiny_models):
    """Originals and their last-token variants are served by one pass per sentence."""
    run, mm = runs["llama"], tiny_models["llama"]
    trig = read_triggers(run, 1, 5).to_pylist()
    sents = sentence_lookup(run, [r["sentence_id"] for r in trig])
    seqs, lays, dims = [], [], []
    for r in trig:
        if r["position"] < 1:
            continue
        full = tuple(sents[r["sentence_id"]][: r["position"] + 1])
        for s in (full, full[:-1]):
            seqs.append(s)
            lays.append(r["layer"])
            dims.append(r["dim"])
    st = R.RescoreStats()
    got = R.rescore(mm, seqs, lays, [len(s) - 1 for s in seqs], dims, stats=st)
    n_sent = len({r["sentence_id"] for r in trig if r["position"] >= 1})
    assert st.sequences_run <= n_sent  # no sequence of its own for any last-token variant
    for i in range(0, len(seqs), 37):
        assert got[i] == pytest.approx(_direct(mm, seqs[i], lays[i], dims[i]), rel=1e-4, abs=1e-5)


def test_mutate_step(runs, tiny_models, tmp_path, monkeypatch):
    """The declared step: its manifest settings, skip when done, refuse bad settings before any
    model is opened or the step is started."""
    import shutil

    from ffkv.errors import FfkvError
    from ffkv.steps.lifecycle import execute

    shutil.copytree(runs["gpt2"].path, tmp_path / "r")
    run, mm = Run(tmp_path / "r"), tiny_models["gpt2"]
    s = MutateSettings(keys_per_layer=2, examples=5, seed=1, layers=[1, 0], batch_tokens=256)
    rec = {"keys_per_layer": 2, "examples": 5, "sign": 1, "seed": 1, "layers": [0, 1], "dtype": "auto"}
    assert STEP.recorded(run, s) == M.settings_for(2, 5, 1, 1, [1, 0]) == rec
    assert STEP.requires == ("mine",) and STEP.tables == ("mutations", "mutations_layers")
    out = execute(run, "mutate", s, mm=mm, show_progress=False)
    res = out.result
    assert out.status == "done" and run.settings("mutate") == rec
    assert res.mutations.num_rows == res.stats["variants"] == out.info["variants"] > 0
    assert {k: v for k, v in out.info.items() if k in res.stats and k != "seconds"} == \
        {k: v for k, v in res.stats.items() if k != "seconds"}
    assert run.read_table("mutations").equals(res.mutations)
    assert (out.info["rescore"]["batch_tokens"], out.info["rescore"]["max_rows"]) == (256, 256)  # as given; CPU rows

    def no_model(*a, **k):
        raise AssertionError("the model was opened")

    monkeypatch.setattr(identity, "open_model", no_model)
    again = execute(run, "mutate", MutateSettings(keys_per_layer=2, examples=5, seed=1, layers=(0, 1),
                                                    batch_tokens=4096))
    assert again.skipped and again.result is None
    for bad, msg in ((dict(examples=0), "--examples"), (dict(keys_per_layer=-1), "--keys-per-layer"),
                     (dict(sign=2), "--sign"), (dict(layers=[7]), "no mined keys")):
        with pytest.raises(FfkvError, match=msg):
            execute(run, "mutate", MutateSettings(**bad), force=True)
        assert run.step("mutate")["status"] == "done" and run.settings("mutate") == rec


def test_batch_size_and_determinism(runs, tiny_models):
    run, mm = runs["gpt2"], tiny_models["gpt2"]
    a = M.mutate(run, mm, keys_per_layer=2, examples=5, seed=5, batch_tokens=48, write=False,
                 show_progress=False).mutations
    b = M.mutate(run, mm, keys_per_layer=2, examples=5, seed=5, batch_tokens=8192, write=False,
                 show_progress=False).mutations
    for c in ("layer", "dim", "rank", "mutation", "removed_position"):
        assert a.column(c).to_pylist() == b.column(c).to_pylist()
    np.testing.assert_allclose(a.column("new_coef").to_numpy(), b.column("new_coef").to_numpy(),
                               rtol=1e-4, atol=1e-5)
    c = M.mutate(run, mm, keys_per_layer=2, examples=5, seed=6, write=False, show_progress=False).mutations
    assert c.column("dim").to_pylist() != a.column("dim").to_pylist() or \
        c.column("removed_position").to_pylist() != a.column("removed_position").to_pylist()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 7)), min_size=1, max_size=60),
       st.sampled_from([64, 256, 2048]), st.integers(1, 300), st.sampled_from([1.5, None]),
       st.sampled_from([0, 48, 8192]))
def test_batches_merge_only_what_pays(rows, bt, max_rows, ratio, fixed):
    """Every member once; each batch in its budget (a row over it alone); the modelled cost (each
    batch run to its deepest member) never above the batches of one layer each."""
    lengths = np.array([r[0] for r in rows])
    deepest = np.array([r[1] for r in rows])
    members = np.arange(len(rows))[::-1].copy()
    got = R._batches(lengths, deepest, members, bt, max_rows, ratio, fixed)
    assert sorted(np.concatenate(got).tolist()) == sorted(members.tolist())

    def cost(bs):
        return sum(R._pass_cost(len(b), int(lengths[b].max()), int(deepest[b].max()), fixed) for b in bs)

    apart = []
    for L in np.unique(deepest):
        m = members[deepest[members] == L]
        apart += [m[b] for b in pack(lengths[m], bt, max_batch=max_rows, ratio=ratio, slack=R.SLACK)]
    for b in got:
        assert len(b) == 1 or (len(b) <= max_rows and len(b) * lengths[b].max() <= bt)
    assert cost(got) <= cost(apart)
    if fixed == 0:  # nothing to save: no batch spans two layers
        assert all(len(set(deepest[b].tolist())) == 1 for b in got)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=80), st.integers(1, 2048))
def test_leaf_batches_bound_their_copied_prefixes(shares, bt):
    """Pieces of a leaf batch: every row once, and rows × longest shared prefix within
    PAST_FACTOR × the budget, or a row alone."""
    share = np.array(shares)
    lb = np.arange(len(share))[::-1].copy()
    parts = R._past_bounded(lb, share, bt)
    assert sorted(np.concatenate(parts).tolist()) == sorted(lb.tolist())
    for p in parts:
        assert len(p) == 1 or len(p) * share[p].max() <= R.PAST_FACTOR * bt
    if len(lb) * share.max() <= R.PAST_FACTOR * bt:
        assert len(parts) == 1 and (parts[0] == lb).all()


def test_pack_tight():
    """`pack` as `mutate` calls it (ratio 1.5, up to 256 a batch); equal to the old `pack_tight`
    (tests/test_batching.py)."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 90, 500)
    bs = pack(lens, 512, max_batch=256, ratio=1.5)
    assert sorted(int(i) for b in bs for i in b) == list(range(500))
    for b in bs:
        L = lens[b]
        assert L.max() * len(b) <= 512 or len(b) == 1
        assert L.max() <= 1.5 * L.min()


def test_plan_prefers_the_whole_original():
    """An original absorbed into a random variant would cost that variant its sharing: originals
    are absorbed among themselves first, and variants become leaves of the whole sentence."""
    s = tuple(range(10, 22))
    seqs = [s[:5], s[:9], s[:4] + s[5:9], s[:7] + s[8:12], s[:11]]
    anchors = [-1, -1, 0, 1, -1]
    run_seqs, rid, deepest, parent, share, _ = R.plan(seqs, [0, 3, 1, 2, 0], [4, 8, 7, 10, 10], anchors)
    assert run_seqs[rid[0]] == s[:11] and rid[0] == rid[1] == rid[4]
    assert parent[rid[2]] == rid[0] and share[rid[2]] == 4
    assert parent[rid[3]] == rid[0] and share[rid[3]] == 7
    assert deepest[rid[0]] == 3


def test_sample_keys_nested_and_seeded():
    keys = {0: np.arange(50), 1: np.arange(7)}
    s10, s20 = sample_keys(keys, 10, 0), sample_keys(keys, 20, 0)
    assert len(s10[0]) == 10 and set(s10[0]) <= set(s20[0]) and list(s10[1]) == list(range(7))
    assert list(sample_keys(keys, 10, 0)[0]) == list(s10[0])
    assert list(sample_keys(keys, 10, 1)[0]) != list(s10[0])
    assert len(sample_keys(keys, 0, 0)[0]) == 50


def test_bos_first_token_and_short_prefixes():
    """With a prepended BOS, 'first' removes the first real token; 1-token prefixes are skipped."""
    sents = {7: [1, 10, 11, 12, 13], 8: [1, 20]}
    trig = {"layer": np.array([0, 0, 0]), "dim": np.array([3, 3, 3]), "rank": np.array([1, 2, 3]),
            "coef": np.ones(3), "sentence_id": np.array([7, 8, 7]), "position": np.array([3, 1, 2])}
    (seqs, lays, poss, dims, anchors), rows, skipped = M.build_variants(trig, sents, [1], seed=0)
    assert skipped == {0: 1}  # [BOS, 20] has one real token
    first = [seqs[r] for m, r in zip(rows["mutation"], rows["new_req"]) if m == "first"]
    assert first == [(1, 11, 12), (1, 11)]
    assert all(p >= 1 for m, p in zip(rows["mutation"], rows["removed_position"]) if m == "random")
    assert [seqs[r] for m, r in zip(rows["mutation"], rows["new_req"]) if m == "last"] == [(1, 10, 11), (1, 10)]

    class Tok:
        bos_token_id = 1

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([1] if add_special_tokens else []) + [5, 6]}

    assert leading_specials(Tok()) == [1]


# ---- the planted key -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def planted(tmp_path_factory, tok_dir):
    """Tiny llama whose layer-0 attention writes nothing, and key 5 of layer 0 reads token t."""
    from ffkv.model.memories import open_model

    root = tmp_path_factory.mktemp("planted")
    d = build_tiny("llama", root / "model", tok_dir, seed=2)
    mm = open_model(str(d), device="cpu")
    t = mm.tok(" the")["input_ids"]
    assert len(t) == 1
    t = t[0]
    blk = mm.blocks[0]
    with torch.no_grad():
        blk.self_attn.o_proj.weight.zero_()
        x_t = blk.post_attention_layernorm(mm.hf.get_input_embeddings().weight[t])
        direction = x_t / x_t.norm() ** 2
        mm.hf.model.layers[0].mlp.gate_proj.weight[5] = 6 * direction
        mm.hf.model.layers[0].mlp.up_proj.weight[5] = 6 * direction
    mm.hf.save_pretrained(d)
    mm = open_model(str(d), device="cpu")
    run = make_run(root / "run", d, n_sentences=30, k=10, mm=mm)
    return mm, run, t


def test_planted_key_last_token(planted):
    mm, run, t = planted
    res = M.mutate(run, mm, keys_per_layer=0, examples=10, layers=[0], show_progress=False)
    rows = [r for r in res.mutations.to_pylist() if r["dim"] == 5]
    assert len(rows) == 30
    sents = sentence_lookup(run, [r["sentence_id"] for r in rows])
    blk = mm.blocks[0]
    emb = mm.hf.get_input_embeddings().weight

    def coef_of_token(tok_id):  # layer 0 reads only the current token here
        return float(mm.coefficients(0, blk.post_attention_layernorm(emb[tok_id]))[5])

    peak = coef_of_token(t)
    assert peak == pytest.approx(6 * 6 / (1 + np.exp(-6)), rel=1e-4)
    for r in rows:
        ids = sents[r["sentence_id"]][: r["position"] + 1]
        assert ids[-1] == t and r["old_coef"] == pytest.approx(peak, rel=1e-4)
        variant = ids[: r["removed_position"]] + ids[r["removed_position"] + 1:]
        expect = coef_of_token(variant[-1])
        assert r["new_coef"] == pytest.approx(expect, rel=1e-3, abs=1e-4)
        if r["mutation"] == "last" or r["removed_position"] == r["position"]:
            assert variant[-1] != t and r["rel_change"] < -0.5  # the trigger token is gone
        else:
            assert r["rel_change"] == pytest.approx(0, abs=1e-4)  # it is still last
    summary = {s["mutation"]: s for s in res.layers.to_pylist() if s["layer"] == 0}
    assert summary["last"]["median"] < summary["random"]["median"] <= summary["first"]["median"] + 1e-6


# ---- the CLI -------------------------------------------------------------------------------------------
def test_cli_mutate(runs, tmp_path):
    import shutil

    src = runs["gpt2"].path
    dst = tmp_path / "r"
    shutil.copytree(src, dst)
    for f in ("mutations.parquet", "mutations_layers.parquet"):
        (dst / f).unlink(missing_ok=True)
    res = run_cli("mutate", dst, "--keys-per-layer", "2", "--examples", "5", "--json")  # the real entry point
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["keys"] == 4 and out["variants"] > 0
    run = Run(dst)
    assert run.step_done("mutate")
    assert run.read_table("mutations").num_rows == out["variants"]
    code, stdout, err = cli_inproc("mutate", dst, "--keys-per-layer", "2", "--examples", "5")
    assert code == 0 and "already done" in stdout and "first" in stdout
    code, stdout, err = cli_inproc("mutate", dst, "--sign", "x")
    assert code == 2 and "--sign" in err and len(err.strip().splitlines()) == 1
    code, stdout, err = cli_inproc("mutate", dst, "--layer", "7")
    assert code == 2 and "no mined keys" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    Run(empty, create=True).save()
    code, stdout, err = cli_inproc("mutate", empty)
    assert code == 2 and "ffkv mine" in err and "Traceback" not in err
    code, stdout, err = cli_inproc("mutate", tmp_path / "nope")
    assert code == 2 and "does not exist" in err


def test_prefix_sharing_past_a_sliding_window_runs_in_full(tmp_path_factory, tok_dir):
    """Gemma 3 with a sliding window of 12 tokens passes the sharing check (9-token sequences) but
    a cached prefix's masked places would count in the window of a longer sequence: sequences
    past the window are run in full, and equal lone passes."""
    from test_families import _BUILT, FAMILIES, open_tiny

    def config(n):
        c = FAMILIES["gemma3_text"].config(n)
        c.sliding_window = 12
        return c

    mm = open_tiny("gemma3_text-w12", config, lambda: tmp_path_factory.mktemp("g3w"), tok_dir, _BUILT)[1]
    assert R.sharing_ok(mm)
    rng = random.Random(3)
    seqs, lays, poss, dims, anchors = [], [], [], [], []
    for _ in range(4):
        base = tuple(rng.randrange(5, mm.vocab_size) for _ in range(24))
        seqs.append(base)
        lays.append(mm.n_layers - 1)
        poss.append(len(base) - 1)
        dims.append(rng.randrange(mm.d_m))
        anchors.append(-1)
        a = len(seqs) - 1
        for j in (3, 5):  # a token removed early: the variant shares only its first j tokens
            v = base[:j] + base[j + 1:]
            seqs += [v]
            lays.append(mm.n_layers - 1)
            poss.append(len(v) - 1)
            dims.append(rng.randrange(mm.d_m))
            anchors.append(a)
    got = R.rescore(mm, seqs, lays, poss, dims, batch_tokens=96, anchors=anchors)
    want = np.array([_direct(mm, s, l, d, p) for s, l, p, d in zip(seqs, lays, poss, dims)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
