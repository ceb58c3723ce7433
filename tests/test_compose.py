"""`ffkv compose` (paper §5, Figs 7-11): every quantity checked against a brute-force
recomputation that runs each prefix alone through the Hugging Face model with plain forward
hooks and takes torch argmaxes, without ffkv's capture, lens or batching code."""
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ARCHS, WT2, run_cli

from ffkv.corpus.stopwords import stopwords
from ffkv.steps.compose.compute import CATEGORIES, compose, token_is_stop
from ffkv.store.run import Run
from ffkv.model import identity

VALID = str(WT2 / "wiki.valid.tokens")
EPS = 0.05
N = 40


# ---- brute force -----------------------------------------------------------------------------
def _sites(hf, arch):
    """Per block: (module whose input is r or None, module whose input is m and output is y),
    the final norm, and value vectors V (d_m, d) read from the raw weights."""
    if arch == "llama":
        blocks = hf.model.layers
        return blocks, [(b.post_attention_layernorm, b.mlp.down_proj) for b in blocks], hf.model.norm, \
            [b.mlp.down_proj.weight.T for b in blocks]
    if arch == "gpt2":
        blocks = hf.transformer.h
        return blocks, [(b.ln_2, b.mlp.c_proj) for b in blocks], hf.transformer.ln_f, \
            [b.mlp.c_proj.weight for b in blocks]  # Conv1D stores (in, out) = (d_m, d)
    if arch == "gpt_neox":  # parallel residual: r = o - y has no single module input
        blocks = hf.gpt_neox.layers
        return blocks, [(None, b.mlp.dense_4h_to_h) for b in blocks], hf.gpt_neox.final_layer_norm, \
            [b.mlp.dense_4h_to_h.weight.T for b in blocks]
    if arch == "opt":
        blocks = hf.model.decoder.layers
        return blocks, [(b.final_layer_norm, b.fc2) for b in blocks], hf.model.decoder.final_layer_norm, \
            [b.fc2.weight.T for b in blocks]
    raise ValueError(arch)


@torch.no_grad()
def brute_force(hf, arch, prefixes, eps, dtype=torch.float64):
    blocks, sites, fnorm, values = _sites(hf, arch)
    W = hf.get_output_embeddings().weight.to(dtype)  # (V, d)
    b = hf.get_output_embeddings().bias
    L = len(blocks)
    lenses = {
        "naive": lambda h: h.to(dtype) @ W.T + (b.to(dtype) if b is not None else 0),
        "norm": lambda h: hf.get_output_embeddings()(fnorm(h)).to(dtype),
    }
    dirs = {"naive": lambda v: v.to(dtype) @ W.T,
            "norm": lambda v: (v * fnorm.weight).to(dtype) @ W.T}
    vt = {ln: [(z.argmax(-1), z.argmin(-1)) for z in map(dirs[ln], values)] for ln in lenses}
    vnorm = [v.double().norm(dim=-1) for v in values]
    out = {"m": [], "gap": {ln: [] for ln in lenses}, "model_top": []}
    per = {ln: {k: [] for k in ("top_r", "top_y", "top_o", "p", "rank_lo", "rank_hi", "match",
                                "match_eps", "match_signed", "match_code", "match_rel", "w")} for ln in lenses}
    common = {k: [] for k in ("n_active", "n_active_eps", "mass1", "mass10", "mass50", "n90")}
    for ids in prefixes:
        got = {}
        hooks = []
        for l, (rmod, vmod) in enumerate(sites):
            if rmod is not None:
                hooks.append(rmod.register_forward_pre_hook(
                    lambda mod, a, l=l: got.__setitem__(("r", l), a[0].reshape(-1, a[0].shape[-1])[-1])))
            hooks.append(vmod.register_forward_pre_hook(
                lambda mod, a, l=l: got.__setitem__(("m", l), a[0].reshape(-1, a[0].shape[-1])[-1])))
            hooks.append(vmod.register_forward_hook(
                lambda mod, a, res, l=l: got.__setitem__(("y", l), res.reshape(-1, res.shape[-1])[-1])))
            hooks.append(blocks[l].register_forward_hook(
                lambda mod, a, res, l=l: got.__setitem__(
                    ("o", l), (res[0] if isinstance(res, tuple) else res).reshape(-1, hf.config.hidden_size)[-1])))
        try:
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        finally:
            for h in hooks:
                h.remove()
        out["model_top"].append(int(logits.argmax()))
        row = {k: [] for k in common}
        lrow = {ln: {k: [] for k in per[ln]} for ln in lenses}
        for l in range(L):
            m, y, o = got[("m", l)], got[("y", l)], got[("o", l)]
            r = got[("r", l)] if ("r", l) in got else o - y
            assert torch.allclose(r + y, o, atol=1e-5)
            row["n_active"].append(int((m > 0).sum()))
            row["n_active_eps"].append(int((m.abs() > eps).sum()))
            c = np.sort((m.double().abs() * vnorm[l]).numpy())[::-1]
            for p, k in ((1, "mass1"), (10, "mass10"), (50, "mass50")):
                row[k].append(c[: math.ceil(p / 100 * len(c))].sum() / c.sum())
            # fewest memories carrying 90% of the mass, counted one at a time
            acc, n90 = 0.0, 0
            while acc < 0.9 * c.sum() and n90 < len(c):
                acc += c[n90]
                n90 += 1
            row["n90"].append(max(n90, 1))
            for ln, f in lenses.items():
                lr, ly, lo = f(r), f(y), f(o)
                for t in (lr, ly, lo):
                    top2 = t.topk(2).values
                    out["gap"][ln].append(float(top2[0] - top2[1]))
                lrow[ln]["top_r"].append(int(lr.argmax()))
                lrow[ln]["top_y"].append(int(ly.argmax()))
                lrow[ln]["top_o"].append(int(lo.argmax()))
                lrow[ln]["_lr"] = lrow[ln].get("_lr", []) + [lr]
                pos, neg = vt[ln][l]
                ty = int(ly.argmax())
                lrow[ln]["match"].append(bool(((m > 0) & (pos == ty)).any()))
                signed = torch.where(m > 0, pos, neg)
                lrow[ln]["match_eps"].append(bool(((m.abs() > eps) & (signed == ty)).any()))
                # Fig 8's variants, memory by memory: top(m_i·v_i) read from m_i·v_i itself
                # (tiny models only: on SmolLM2 this is 92k vocabulary projections per prefix)
                if len(m) * W.shape[0] > 200_000:
                    continue
                to = int(lo.argmax())
                big = float(m.abs().max())
                sig = cod = rel = False
                for i in torch.nonzero(m != 0)[:, 0].tolist():
                    t = int(dirs[ln](m[i] * values[l][i]).argmax())
                    sig |= t == ty
                    cod |= t == to
                    rel |= t == ty and abs(float(m[i])) > 0.1 * big
                lrow[ln]["match_signed"].append(sig)
                lrow[ln]["match_code"].append(cod)
                lrow[ln]["match_rel"].append(rel)
        for ln in lenses:
            w = lrow[ln]["top_o"][-1]
            lrow[ln]["w"] = w
            lrs = lrow[ln].pop("_lr")
            lrow[ln]["p"] = [float(torch.softmax(lr, -1)[w]) for lr in lrs]
            # rank of w: logits strictly above it, bracketed by a 1e-4 float margin
            lrow[ln]["rank_lo"] = [int((lr > lr[w] + 1e-4).sum()) for lr in lrs]
            lrow[ln]["rank_hi"] = [int((lr > lr[w] - 1e-4).sum()) for lr in lrs]
            for k in per[ln]:
                per[ln][k].append(lrow[ln][k])
        for k in common:
            common[k].append(row[k])
    res = {"common": {k: np.array(v) for k, v in common.items()}, "model_top": np.array(out["model_top"]),
           "min_gap": {ln: min(g) for ln, g in out["gap"].items()}}
    for ln in lenses:
        res[ln] = {k: np.array(v) for k, v in per[ln].items()}
    return res


def _examples(run, lens):
    """compose_examples for one lens as {column: (N, L) array}."""
    t = run.read_table("compose_examples").to_pydict()
    sel = np.array(t["lens"]) == lens
    ex, layer = np.array(t["example_id"])[sel], np.array(t["layer"])[sel]
    n, L = ex.max() + 1, layer.max() + 1
    out = {}
    for k, v in t.items():
        if k in ("lens",):
            continue
        a = np.empty((n, L), dtype=object if k == "category" else np.asarray(v).dtype)
        a[ex, layer] = np.asarray(v, dtype=object if k == "category" else None)[sel]
        out[k] = a
    return out


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    """compose on each tiny model, plus its brute-force recomputation."""
    out = {}
    for arch in ARCHS:
        mm = tiny_models[arch]
        run = Run(tmp_path_factory.mktemp(f"compose_{arch}"), create=True)
        identity.record_model(run, mm)
        compose(run, mm, corpus=VALID, n_prefixes=N, max_sentences=300, eps=EPS, batch_tokens=512,
                show_progress=False)
        prefixes = run.read_table("compose_prefixes").column("token_ids").to_pylist()
        out[arch] = (run, mm, brute_force(mm.hf, arch, prefixes, EPS))
    return out


# ---- the figures against brute force -------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_every_quantity_matches_brute_force(runs, arch):
    run, mm, bf = runs[arch]
    L = mm.n_layers
    pre = run.read_table("compose_prefixes").to_pydict()
    assert len(pre["example_id"]) == N
    # targets and positions: the prefix is the sentence's token_ids[:position + 1]
    sents = {s: t for s, t in zip(*run.read_table("compose_sentences", columns=["sentence_id", "token_ids"]).to_pydict().values())}
    for sid, pos, ids, tgt in zip(pre["sentence_id"], pre["position"], pre["token_ids"], pre["target"]):
        assert sents[sid][: pos + 1] == ids and sents[sid][pos + 1] == tgt
    # Fig 7 (lens-free): exact counts, mass shares to float precision
    ex = _examples(run, "norm")
    np.testing.assert_array_equal(ex["n_active"], bf["common"]["n_active"])
    np.testing.assert_array_equal(ex["n_active_eps"], bf["common"]["n_active_eps"])
    for k, b in (("mass_top1", "mass1"), ("mass_top10", "mass10"), ("mass_top50", "mass50")):
        np.testing.assert_allclose(ex[k], bf["common"][b], rtol=1e-4)
    lay = {(r["lens"], r["layer"]): r for r in run.read_table("compose_layers").to_pylist()}
    stop = np.array(pre["target_is_stop"])
    short = np.array(pre["prefix_tokens"]) < 5
    for ln in ("naive", "norm"):
        # no near-ties in the brute force, so argmaxes must agree exactly
        assert bf["min_gap"][ln] > 1e-4, bf["min_gap"][ln]
        ex, b = _examples(run, ln), bf[ln]
        for k in ("top_r", "top_y", "top_o"):
            np.testing.assert_array_equal(ex[k], b[k], err_msg=f"{ln} {k}")
        np.testing.assert_array_equal(ex["top_final"][:, 0], b["w"])
        np.testing.assert_allclose(ex["p_final_in_r"], b["p"], rtol=1e-4, atol=1e-7)
        assert ((b["rank_lo"] <= ex["rank_final_in_r"]) & (ex["rank_final_in_r"] <= b["rank_hi"])).all()
        assert (ex["rank_final_in_r"] == 0).sum() == (b["top_r"] == b["w"][:, None]).sum()
        np.testing.assert_array_equal(ex["y_matches_memory"], b["match"])
        np.testing.assert_array_equal(ex["y_matches_memory_eps"], b["match_eps"])
        # Fig 11 categories from the brute-force tops
        o_r, o_y = b["top_o"] == b["top_r"], b["top_o"] == b["top_y"]
        cat = np.where(o_r & ~o_y, "residual", np.where(o_y & ~o_r, "ffn",
                       np.where(o_r & o_y, "agreement", "composition")))
        assert (ex["category"] == cat).all()
        for l in range(L):
            row = lay[(ln, l)]
            assert row["active_mean"] == pytest.approx(bf["common"]["n_active"][:, l].mean() / mm.d_m)
            assert row["active_eps_mean"] == pytest.approx(bf["common"]["n_active_eps"][:, l].mean() / mm.d_m)
            assert row["fig8_no_single_memory"] == pytest.approx(1 - b["match"][:, l].mean())
            assert row["fig8_no_single_memory_eps"] == pytest.approx(1 - b["match_eps"][:, l].mean())
            mt = b["match"][:, l]
            assert row["fig8_matched"] == mt.sum()
            if mt.any():
                assert row["fig8_matched_stop_share"] == pytest.approx((mt & stop).sum() / mt.sum())
                assert row["fig8_matched_short_share"] == pytest.approx((mt & short).sum() / mt.sum())
            assert row["r_matches_final"] == pytest.approx((b["top_r"][:, l] == b["w"]).mean())
            assert row["p_final_mean"] == pytest.approx(b["p"][:, l].mean(), rel=1e-4)
            assert row["p_final_median"] == pytest.approx(np.median(b["p"][:, l]), rel=1e-4)
            for c in CATEGORIES:
                assert row[c] == pytest.approx((cat[:, l] == c).mean())
            assert row["r_eq_y_ne_o"] == pytest.approx(
                ((b["top_r"][:, l] == b["top_y"][:, l]) & (b["top_o"][:, l] != b["top_r"][:, l])).mean())
        # last-layer cases: exactly the examples where the last FFN changes top(r)
        cases = [c for c in run.read_table("compose_cases").to_pylist() if c["lens"] == ln]
        want = np.flatnonzero(b["top_r"][:, -1] != b["top_o"][:, -1])
        assert sorted(c["example_id"] for c in cases) == want.tolist()
        assert sorted(c["sample_order"] for c in cases) == list(range(len(want)))
        for c in cases:
            i = c["example_id"]
            assert (c["top_r"], c["top_o"]) == (b["top_r"][i, -1], b["top_o"][i, -1])
            assert c["top_r_token"] == mm.tok.decode([c["top_r"]]) and c["prefix"] == pre["prefix"][i]


@pytest.mark.parametrize("arch", ARCHS)
def test_fig11_partitions_and_fig9_ends_at_one(runs, arch):
    run, mm, bf = runs[arch]
    L = mm.n_layers
    t = run.read_table("compose_examples").to_pydict()
    assert set(t["category"]) <= set(CATEGORIES)
    assert len(t["category"]) == N * L * 2  # one category per example, layer and lens
    for r in run.read_table("compose_layers").to_pylist():
        assert sum(r[c] for c in CATEGORIES) == pytest.approx(1.0, abs=1e-12)
        if r["layer"] == L - 1:
            # the curve's end point: top(o_L) = w by construction, for both lenses
            assert r["o_matches_final"] == 1.0
            n_cases = sum(1 for c in run.read_table("compose_cases").column("lens").to_pylist() if c == r["lens"])
            assert r["r_matches_final"] == pytest.approx(1 - n_cases / N)
    # the norm lens reproduces the model's own logits: w is exactly the model's argmax
    np.testing.assert_array_equal(_examples(run, "norm")["top_final"][:, 0], bf["model_top"])


def test_results_do_not_depend_on_batching(runs):
    from ffkv.memories.value_tops import value_tops
    from ffkv.steps.compose.compute import analyze

    run, mm, _ = runs["llama"]
    ids = run.read_table("compose_prefixes").column("token_ids").to_pylist()
    vt = value_tops(run, mm)  # read back from the run's cache
    a = analyze(mm, ids, eps=EPS, vtops=vt, batch_tokens=40, max_batch=3, rows=6)
    b = analyze(mm, ids, eps=EPS, vtops=vt, batch_tokens=100_000, max_batch=256)
    for k in a["common"]:
        np.testing.assert_allclose(a["common"][k], b["common"][k], rtol=1e-5)
    for ln in ("naive", "norm"):
        for k in ("top_r", "top_y", "top_o", "w", "y_matches_memory", "n_agreeing"):
            np.testing.assert_array_equal(a[ln][k], b[ln][k])
        np.testing.assert_allclose(a[ln]["p_final_in_r"], b[ln]["p_final_in_r"], rtol=1e-4, atol=1e-7)


def test_fig8_variants_and_n90_match_brute_force(runs):
    """Fig 8's three variants (signed, the paper's code vs top(o), relative ε) and Fig 7's n90
    against hooks and a memory-by-memory loop (top(m_i·v_i) projected one memory at a time)."""
    from ffkv.memories.value_tops import value_tops
    from ffkv.steps.compose.compute import analyze

    for arch in ("llama", "gpt2"):
        run, mm, bf = runs[arch]
        ids = run.read_table("compose_prefixes").column("token_ids").to_pylist()
        a = analyze(mm, ids, eps=EPS, vtops=value_tops(run, mm))
        np.testing.assert_array_equal(a["common"]["n90"], bf["common"]["n90"])
        for ln in ("naive", "norm"):
            for v in ("signed", "code", "rel"):
                np.testing.assert_array_equal(a[ln][f"fig8_{v}"], bf[ln][f"match_{v}"], err_msg=f"{arch} {ln} {v}")


def test_fig8_shuffled_baseline_pairs_within_the_batch():
    """The shuffled baseline: each example's memories against the previous example's target in
    its batch (a roll); a batch of one has no partner (−1). A loop gives the same."""
    from ffkv.steps.compose.compute import fig8_variants

    g = torch.Generator().manual_seed(0)
    L, B, dm, V = 3, 5, 40, 7
    M = torch.randn(L, B, dm, generator=g) * (torch.rand(L, B, dm, generator=g) > 0.3)
    vpos = torch.randint(0, V, (L, dm), generator=g)
    vneg = torch.randint(0, V, (L, dm), generator=g)
    stop = torch.where(M > 0, vpos[:, None, :], vneg[:, None, :])
    ty, to = torch.randint(0, V, (L, B), generator=g), torch.randint(0, V, (L, B), generator=g)
    out = fig8_variants(M, vpos, stop, ty, to)
    for l in range(L):
        for b in range(B):
            p = (b - 1) % B
            m = M[l, b]
            sig = any(m[i] != 0 and stop[l, b, i] == ty[l, b] for i in range(dm))
            assert out["fig8_signed"][b, l] == sig
            assert out["fig8_shuf_signed"][b, l] == any(m[i] != 0 and stop[l, b, i] == ty[l, p] for i in range(dm))
            assert out["fig8_shuf_code"][b, l] == any(m[i] != 0 and stop[l, b, i] == to[l, p] for i in range(dm))
            assert out["fig8_shuf_paper"][b, l] == any(m[i] > 0 and vpos[l, i] == ty[l, p] for i in range(dm))
    one = fig8_variants(M[:, :1], vpos, stop[:, :1], ty[:, :1], to[:, :1])
    assert (one["fig8_shuf_rel"] == -1).all()


def test_hub_tokens_rule(tiny_models):
    """Hubs: the top 0.1% (at least one) of the vocabulary by e_t·ē/‖ē‖."""
    from ffkv.steps.compose.compute import hub_tokens

    mm = tiny_models["llama"]
    E = mm.hf.get_output_embeddings().weight.double()
    score = E @ (E.mean(0) / E.mean(0).norm())
    k = max(1, math.ceil(0.001 * E.shape[0]))
    assert hub_tokens(mm).tolist() == sorted(score.topk(k).indices.tolist())


def test_value_tops_cache_matches_raw_weights(runs):
    run, mm, _ = runs["gpt2"]
    t = run.read_table("value_tops").to_pydict()
    assert len(t["lens"]) == 2 * mm.n_layers * mm.d_m
    W = mm.hf.lm_head.weight.double()
    g = mm.hf.transformer.ln_f.weight.double()
    for i in range(len(t["lens"])):
        l, d, ln = t["layer"][i], t["dim"][i], t["lens"][i]
        v = mm.hf.transformer.h[l].mlp.c_proj.weight[d].double()
        z = ((v * g) if ln == "norm" else v) @ W.T
        assert (t["top_token"][i], t["top_token_neg"][i]) == (int(z.argmax()), int((-z).argmax()))


def test_value_tops_are_reused_from_the_run(runs, monkeypatch):
    import ffkv.memories.value_tops as C

    run, mm, _ = runs["llama"]
    fresh = C.value_tops(None, mm)
    monkeypatch.setattr(C, "lens_for", None)  # a recomputation would fail
    cached = C.value_tops(run, mm)
    for ln in ("naive", "norm"):
        assert torch.equal(cached[ln][0], fresh[ln][0]) and torch.equal(cached[ln][1], fresh[ln][1])
    # another model's run does not reuse them
    other, mm2, _ = runs["gpt2"]
    with pytest.raises(TypeError):
        C.value_tops(other, mm)


def test_lens_effect_table(runs):
    run, _, bf = runs["opt"]
    eff = {r["quantity"]: r for r in run.read_table("compose_lens_effect").to_pylist()}
    lay = run.read_table("compose_layers").to_pylist()
    nv = [r["r_matches_final"] for r in lay if r["lens"] == "naive"]
    nm = [r["r_matches_final"] for r in lay if r["lens"] == "norm"]
    assert eff["r_matches_final"]["mean_abs_diff"] == pytest.approx(np.abs(np.subtract(nv, nm)).mean())
    assert eff["w_differs"]["mean_abs_diff"] == pytest.approx((bf["naive"]["w"] != bf["norm"]["w"]).mean())


def test_stopwords_list():
    sw = stopwords()
    assert len(sw) == 127 and {"the", "of", "and", "a", "in"} <= sw and "paris" not in sw


def test_token_is_stop(tiny_models):
    tok = tiny_models["gpt2"].tok
    ids = [tok(" the")["input_ids"][0], tok(" of")["input_ids"][0], tok(",")["input_ids"][0]]
    assert token_is_stop(tok, ids).tolist() == [True, True, False]


def test_sampling_is_seeded_and_one_per_sentence(runs, tiny_models, tmp_path):
    run, mm, _ = runs["llama"]
    a = run.read_table("compose_prefixes").to_pydict()
    assert len(set(a["sentence_id"])) == N
    run2 = Run(tmp_path / "again", create=True)
    from ffkv.steps.compose.compute import sample_prefixes

    b = sample_prefixes(run2, mm, VALID, N, seed=0, max_sentences=300).to_pydict()
    assert a["token_ids"] == b["token_ids"] and a["position"] == b["position"]
    c = sample_prefixes(run2, mm, VALID, N, seed=1, max_sentences=300).to_pydict()
    assert c["token_ids"] != a["token_ids"]


# ---- the command -------------------------------------------------------------------------
def test_cli_compose(tiny_dirs, tmp_path):
    rd = tmp_path / "run"
    res = run_cli("compose", rd, "--model", tiny_dirs["llama"], "--corpus", VALID, "--prefixes", "50",
                  "--max-sentences", "400")
    assert res.returncode == 0, res.stderr[-3000:]
    for t in ("compose_sentences", "compose_prefixes", "value_tops", "compose_examples",
              "compose_layers", "compose_cases", "compose_lens_effect"):
        assert (rd / f"{t}.parquet").exists(), t
    man = json.loads((rd / "manifest.json").read_text())
    assert man["steps"]["compose"]["status"] == "done" and man["model"]["layers"] == 3
    run = Run(rd)
    assert run.read_table("compose_examples").num_rows == 50 * 3 * 2
    assert "Fig9" in res.stdout and "Lens choice" in res.stdout and "composition" in res.stdout
    # same settings again: skipped, summary reprinted
    again = run_cli("compose", rd, "--corpus", VALID, "--prefixes", "50", "--max-sentences", "400")
    assert again.returncode == 0 and "already done" in again.stderr and "Fig9" in again.stdout


def test_cli_fewer_sentences_than_asked(tiny_dirs, tmp_path):
    corpus = tmp_path / "few.txt"
    corpus.write_text("The cat sat on the mat. It was warm.\n\nA dog barked at the moon.\n")
    rd = tmp_path / "run"
    res = run_cli("compose", rd, "--model", tiny_dirs["gpt2"], "--corpus", corpus, "--prefixes", "50")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "only 3 usable sentences" in res.stderr and "using all 3" in res.stderr
    assert Run(rd).read_table("compose_prefixes").num_rows == 3
    assert Run(rd).step("compose")["prefixes"] == 3


@settings(max_examples=300, deadline=None)
@given(rooms=st.lists(st.integers(0, 6), min_size=1, max_size=30), n=st.integers(1, 120),
       k=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_spread_positions(rooms, n, k, seed):
    """Distinct in-range pairs, as many as asked or as there is room for, spread evenly: no
    sentence gives a j-th prefix while one with room has given fewer than j - 1."""
    from ffkv.steps.compose.compute import spread_positions

    rng = np.random.default_rng(seed)
    lo = rng.integers(0, 4, size=len(rooms))
    hi = lo + np.array(rooms)
    sent, pos = spread_positions(lo, hi, n, k, np.random.default_rng(seed))
    cap = np.minimum(rooms, k)
    assert len(sent) == min(n, int(cap.sum()))
    assert len(set(zip(sent.tolist(), pos.tolist()))) == len(sent)
    assert ((pos >= lo[sent]) & (pos < hi[sent])).all()
    assert list(zip(sent, pos)) == sorted(zip(sent, pos))
    took = np.bincount(sent, minlength=len(rooms))
    assert (took <= cap).all()
    short = took < cap  # sentences that could have given more
    if short.any():
        assert took.max() <= took[short].min() + 1
    again = spread_positions(lo, hi, n, k, np.random.default_rng(seed))
    assert np.array_equal(again[0], sent) and np.array_equal(again[1], pos)


def test_cli_several_prefixes_per_sentence(tiny_dirs, tmp_path):
    corpus = tmp_path / "few.txt"
    corpus.write_text("The cat sat on the mat. It was warm.\n\nA dog barked at the moon.\n")
    rd = tmp_path / "run"
    res = run_cli("compose", rd, "--model", tiny_dirs["gpt2"], "--corpus", corpus, "--prefixes", "7",
                  "--per-sentence", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "3 usable sentences" in res.stderr and "7 prefixes in all" in res.stderr
    run = Run(rd)
    pre = run.read_table("compose_prefixes").to_pydict()
    sents = dict(zip(*run.read_table("compose_sentences", columns=["sentence_id", "token_ids"]).to_pydict().values()))
    assert len(pre["example_id"]) == 7 and sorted(np.bincount(pre["sentence_id"]).tolist())[-3:] == [2, 2, 3]
    for sid, p, ids, tgt in zip(pre["sentence_id"], pre["position"], pre["token_ids"], pre["target"]):
        assert ids == sents[sid][:p + 1] and tgt == sents[sid][p + 1]
    assert len(set(zip(pre["sentence_id"], pre["position"]))) == 7
    assert run.settings("compose")["per_sentence"] == 3 and run.step("compose")["prefix_sentences"] == 3
    res = run_cli("compose", tmp_path / "bad", "--model", tiny_dirs["gpt2"], "--per-sentence", "0")
    assert res.returncode == 2 and "--per-sentence must be at least 1" in res.stderr


def test_cli_bad_prefixes(tiny_dirs, tmp_path):
    res = run_cli("compose", tmp_path / "run", "--model", tiny_dirs["gpt2"], "--prefixes", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert [l for l in res.stderr.strip().splitlines() if l.strip()] == \
        ["ffkv: error: --prefixes must be at least 1 (got 0)"]


# ---- the real model ----------------------------------------------------------------------
@pytest.mark.slow
def test_compose_smollm2_against_brute_force(smollm2_cut, tmp_path):
    """The real SmolLM2's first layers (real weights, tied embeddings, final norm)."""
    mm = smollm2_cut
    run = Run(tmp_path / "run", create=True)
    identity.record_model(run, mm)
    compose(run, mm, corpus=VALID, n_prefixes=12, max_sentences=200, show_progress=False)
    prefixes = run.read_table("compose_prefixes").column("token_ids").to_pylist()
    bf = brute_force(mm.hf, "llama", prefixes, 0.1, dtype=torch.float32)  # float64 would take minutes
    for ln in ("naive", "norm"):
        ex = _examples(run, ln)
        for k in ("top_r", "top_y", "top_o"):
            same = ex[k] == bf[ln][k]
            assert same.mean() >= 0.99, (ln, k, same.mean())  # allow a rare float near-tie
        np.testing.assert_allclose(ex["p_final_in_r"], bf[ln]["p"], rtol=1e-3, atol=1e-6)
        assert (ex["y_matches_memory"] == bf[ln]["match"]).mean() >= 0.99
    # compose's products run through oneDNN, the brute force's through MKL: a coefficient within
    # float32 rounding of 0 may count on one side only
    d = np.abs(ex["n_active"].astype(np.int64) - bf["common"]["n_active"])
    assert d.max() <= 1 and (d == 0).mean() >= 0.99, (d.max(), (d == 0).mean())
    np.testing.assert_array_equal(_examples(run, "norm")["top_final"][:, 0], bf["model_top"])
    last = [r for r in run.read_table("compose_layers").to_pylist() if r["layer"] == 29]
    assert all(r["o_matches_final"] == 1.0 for r in last)
