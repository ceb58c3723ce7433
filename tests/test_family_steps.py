"""Every step on every family: mine, values (both lenses), compose, mutate, patterns, normalize,
census, explain and the memory page, through the CLI on each tiny model of `test_families.FAMILIES` and of
`test_moe.MOE` (Mixtral's and Qwen2-MoE's compose, mutate, patterns and page: `test_moe_steps`).

One number per step, each held to a computation of its own on the model, each prefix run alone
(`test_families._brute_m`: m from hooks on the model's own value projection; for a mixture of
experts `test_moe._brute_coefficients` from the raw fused weights):
- mine: the top trigger's coefficient, both signs;
- census: one row per memory (expert columns for a mixture of experts), two memories a layer's
  vocabulary moments by scipy and input-output class from the cosines;
- values: each layer's mean max-probability of v_i under both lenses, projected here (v_i and the
  final norm's gain are ffkv's, which `test_families` holds to the model's residual stream);
- compose: top(y) under both lenses and the final prediction, y read from the model's residual
  stream and projected through the model's own final norm and unembedding;
- mutate: coefficients before and after a mutation of each kind;
- patterns: each key's prefixes are its mined triggers;
- normalize: the intact loss is the model's own next-token loss on its evaluation sentences
  (soft-cap and logit divisor included);
- explain: the prediction and its logit are the model's own, and each shown memory's coefficient
  is m at the last position;
- the memory page: per-token coefficients and the re-verified trigger.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import WT2, run_cli
from test_families import FAMILIES, _blocks, _brute_m, _own_ffn_writes, family_model  # noqa: F401
from test_families import _supported as _dense
from test_moe import FAM as MOE_FAM
from test_moe import _brute_coefficients, moe_model  # noqa: F401

TEXT = "The cat sat on the"


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _close(got, want, rel=1e-4, atol=1e-5):
    return abs(float(got) - float(want)) <= atol + rel * abs(float(want))


def _cached(f):
    """f(mm, ids, last) once per prefix; `last`: only m at the last position, (L, d_m), else (L, T, d_m)."""
    seen: dict = {}

    def g(mm, ids, last=False):
        key = (tuple(ids), last)
        if key not in seen:
            full = seen.get((tuple(ids), False))
            seen[key] = full[:, -1] if last and full is not None else f(mm, tuple(ids), last)
        return seen[key]
    return g


def _coefs_dense(name):
    fam = FAMILIES[name]

    @_cached
    def coefs(mm, ids, last):
        """m (L, T, d_m) of `ids` run alone."""
        got = _brute_m(mm, fam, [list(ids)])
        m = torch.stack([got[(0, j)] for j in range(len(ids))], 1)
        return m[:, -1] if last else m
    return coefs


def _coefs_moe(name):
    @_cached
    def coefs(mm, ids, last):
        """m of `ids` run alone, token by token from the raw weights (only the last one: `last`)."""
        x = {}
        hs = [blk.mlp.register_forward_pre_hook(lambda mod, a, l=l: x.__setitem__(l, a[0][0]))
              for l, blk in enumerate(mm.hf.model.layers)]
        try:
            mm.hf(input_ids=torch.tensor([list(ids)]), use_cache=False)
        finally:
            for h in hs:
                h.remove()
        return torch.stack([_brute_coefficients(name, mm.hf.model.layers[l].mlp, x[l][-1:] if last else x[l])[-1 if last else slice(None)]
                            for l in range(mm.n_layers)])
    return coefs


def _run_steps(mm, run, steps):
    model = mm.spec.model_id
    args = {
        "mine": ("mine", "--out", run, "--model", model, "--corpus", WT2 / "wiki.valid.tokens",
                 "--max-sentences", "24", "--top-k", "3", "--negative"),
        "values": ("values", run, "--permutations", "2", "--table2", "5", "--precision-k", "3"),
        "compose": ("compose", run, "--corpus", WT2 / "wiki.test.tokens", "--prefixes", "6",
                    "--max-sentences", "60"),
        "mutate": ("mutate", run, "--keys-per-layer", "2", "--examples", "2"),
        "patterns": ("patterns", run, "--keys-per-layer", "2", "--no-semantic", "--background", "50"),
        "normalize": ("normalize", run, "--corpus", WT2 / "wiki.test.tokens", "--tokens", "120",
                      "--fit-tokens", "60", "--sweep-tokens", "0", "--synthetic-draws", "10"),
        "census": ("census", run),
    }
    for s in steps:
        res = run_cli(*args[s])
        assert res.returncode == 0, (s, res.stderr[-3000:])
    from ffkv.store.run import Run

    return Run(run)


def check_mine(mm, run, coefs, label):
    trig = run.read_table("triggers").to_pandas()
    sents = dict(zip(*run.read_table("sentences", columns=["sentence_id", "token_ids"]).to_pydict().values()))
    top = trig[trig["rank"] == 1]
    rows = top.groupby(["layer", "sign"]).head(1)  # a key per layer and sign
    assert set(rows.sign) == {1, -1} and len(rows) == 2 * mm.n_layers, label
    for t in rows.itertuples():
        m = coefs(mm, sents[t.sentence_id][:t.position + 1], last=True)[t.layer, t.dim]
        assert _close(t.coef, m), (label, t)
        assert t.sign * float(m) >= 0


def check_values(mm, run, label):
    E = mm.hf.get_output_embeddings().weight.double()
    gain = mm.lens.gain.double()
    lay = run.read_table("values_lenses").to_pandas().set_index(["lens", "layer"])
    assert set(lay.index.get_level_values(0)) == {"naive", "norm"}, label
    for l in range(mm.n_layers):
        V = mm.values(l).double()
        for ln, v in (("naive", V), ("norm", V * gain)):
            p = torch.softmax(v @ E.T, -1).max(-1).values.mean()
            assert _close(lay.loc[(ln, l), "value_max_prob_mean"], p, rel=1e-4), (label, ln, l)


def check_census(mm, run, label):
    """One row per memory ((layer, expert, dim) for a mixture of experts, its shared expert named);
    two memories a layer: the vocabulary moments are scipy's over cos(W_U, v) in float64 (W_U the
    model's own unembedding, times the final norm's gain under the norm lens) and the input-output
    class follows from the key-value cosines."""
    from scipy import stats

    from ffkv.steps.census.compute import io_classes

    t = run.read_table("census").to_pandas().set_index(["layer", "dim"])
    assert len(t) == mm.n_layers * mm.d_m, label
    if mm.expert_of(0) is not None:
        routed = int(mm.arch.n_experts(mm.blocks[0]))
        assert (t["shared_expert"] == (t["expert"] == routed)).all(), label
        assert [mm.expert_of(i) for i in (0, mm.d_m - 1)] == [tuple(t.loc[(0, i), ["expert", "expert_dim"]])
                                                           for i in (0, mm.d_m - 1)], label
    rec = run.manifest["settings"]["census"]
    W = mm.hf.get_output_embeddings().weight.double()
    if rec["lens"] == "norm":
        W = W * mm.lens.gain.double()
    Wn = W / W.norm(dim=1, keepdim=True).clamp_min(1e-300)
    for l in range(mm.n_layers):
        V, K, U = mm.values(l).double(), mm.keys(l).double(), mm.up_keys(l)
        for i in (0, mm.d_m // 2):
            c = (Wn @ (V[i] / V[i].norm())).numpy()
            row = t.loc[(l, i)]
            assert _close(row["skew"], stats.skew(c), rel=1e-3, atol=1e-3), (label, l, i)
            assert _close(row["kurtosis"], stats.kurtosis(c), rel=1e-3, atol=1e-3), (label, l, i)
            cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
            if U is None:
                want = io_classes(None, None, [cos(K[i], V[i])], rec["cos"], False)[0]
            else:
                u = U[i].double()
                want = io_classes([cos(K[i], u)], [cos(K[i], V[i])], [cos(u, V[i])], rec["cos"], True)[0]
            assert row.io_class == want, (label, l, i)


def check_compose(mm, run, label, fam):
    from ffkv.model.arch import ARCHITECTURES, get_path

    final_norm = get_path(mm.hf, ARCHITECTURES[mm.arch.name].final_norm)
    unembed = mm.hf.get_output_embeddings()
    lens = {"naive": lambda h: unembed(h), "norm": lambda h: unembed(final_norm(h))}
    ex = run.read_table("compose_examples").to_pandas().set_index(["lens", "layer", "example_id"])
    prefixes = run.read_table("compose_prefixes").column("token_ids").to_pylist()
    assert len(prefixes) == 6
    for e, ids in enumerate(prefixes):
        t = torch.tensor([ids])
        writes, logits = _own_ffn_writes(mm, fam, t, torch.ones_like(t))
        for ln, f in lens.items():
            for l in range(mm.n_layers):
                row = ex.loc[(ln, l, e)]
                z = f(writes[l][0, -1]).double()
                assert float(z.max() - z[int(row.top_y)]) < 1e-5, (label, ln, e, l)  # argmax, ties aside
            if ln == "norm":
                z = logits[0, -1]
                assert float(z.max() - z[int(ex.loc[(ln, 0, e)].top_final)]) < 1e-5, (label, e)


def check_mutate(mm, run, coefs, label):
    mut = run.read_table("mutations").to_pandas()
    sents = dict(zip(*run.read_table("sentences", columns=["sentence_id", "token_ids"]).to_pydict().values()))
    assert len(mut) > 0, label
    rows = [g.iloc[i % len(g)] for i, (_, g) in enumerate(mut.groupby("mutation"))]  # one of each kind
    assert len(rows) == 3, label
    for t in rows:
        prefix = sents[t.sentence_id][:t.position + 1]
        mutated = prefix[:t.removed_position] + prefix[t.removed_position + 1:]
        assert _close(t.old_coef, coefs(mm, prefix, last=True)[t.layer, t.dim]), (label, t)
        assert _close(t.new_coef, coefs(mm, mutated, last=True)[t.layer, t.dim]), (label, t)


def check_patterns(mm, run, label):
    keys = run.read_table("pattern_keys").to_pandas()
    trig = run.read_table("triggers").to_pandas()
    assert len(keys) == 2 * mm.n_layers, label
    for k in keys.itertuples():
        assert k.n_prefixes == ((trig.layer == k.layer) & (trig.dim == k.dim) & (trig.sign == k.sign)).sum() == 3


def check_normalize(mm, run, label):
    lay = run.read_table("normalize_layers").to_pandas()
    sents = run.read_table("normalize_sentences").to_pandas()
    nll, n = 0.0, 0
    for ids in sents[sents.split == "eval"].token_ids:
        ids = list(ids)
        z = mm.hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
        nll += float((torch.logsumexp(z[:-1], -1) - z[torch.arange(len(ids) - 1), ids[1:]]).sum())
        n += len(ids) - 1
    assert int(lay.tokens.iloc[0]) == n, label
    assert _close(lay.loss_intact.iloc[0], nll / n, rel=1e-4), label
    assert lay.loss.notna().all() and math.isfinite(lay.loss.sum())


def check_explain(mm, coefs, label):
    res = run_cli("explain", TEXT, "--model", mm.spec.model_id, "--json", "--top", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    ids = mm.tok(TEXT)["input_ids"]
    z = mm.hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    assert out["n_tokens"] == len(ids) and out["lens"] == "norm"
    assert float(z.max() - z[out["prediction_id"]]) < 1e-5 and _close(out["logit"], z[out["prediction_id"]]), label
    m = coefs(mm, ids, last=True)
    shown = [mem for lay in out["layers"] for mem in lay["memories"] + lay["memories_down"]]
    assert len(shown) >= 2 * mm.n_layers
    for mem in shown:
        assert _close(mem["coef"], m[mem["layer"], mem["dim"]]), (label, mem)


def check_memory_page(mm, run, coefs, label):
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    client = TestClient(create_app(run.path, log_fn=lambda m: None), base_url="http://127.0.0.1:8000",
                        headers={"sec-fetch-site": "same-origin"})
    sents = dict(zip(*run.read_table("sentences", columns=["sentence_id", "token_ids"]).to_pydict().values()))
    layer, dim = mm.n_layers - 1, 5
    assert client.get(f"/memory/{layer}/{dim}").status_code == 200
    acts = client.get(f"/api/memory/{layer}/{dim}/activations", params={"top": 1, "samples": "none"}).json()
    assert len(acts["examples"]) >= 1, label
    for sid, a in acts["examples"].items():
        want = coefs(mm, sents[int(sid)])[layer, :, dim]
        shown = torch.tensor(a["m"], dtype=torch.float32)
        assert torch.allclose(shown, want[a["start"]:a["start"] + len(shown)], atol=1e-4, rtol=1e-3), (label, sid)
    rv = client.get(f"/api/memory/{layer}/{dim}/reverify").json()
    want = coefs(mm, sents[rv["sentence_id"]][:rv["position"] + 1], last=True)[layer, dim]
    assert _close(rv["now"], want) and rv["rel_diff"] < 1e-4, label


@pytest.mark.parametrize("family_model", _dense(), indirect=True)
def test_every_step_on_a_dense_family(family_model, tmp_path):
    name, mm = family_model
    fam, coefs = FAMILIES[name], _coefs_dense(name)
    run = _run_steps(mm, tmp_path / "run", ("mine", "values", "compose", "mutate", "patterns", "normalize", "census"))
    check_mine(mm, run, coefs, name)
    check_census(mm, run, name)
    check_values(mm, run, name)
    check_compose(mm, run, name, fam)
    check_mutate(mm, run, coefs, name)
    check_patterns(mm, run, name)
    check_normalize(mm, run, name)
    check_explain(mm, coefs, name)
    check_memory_page(mm, run, coefs, name)


# test_moe_steps holds compose, mutate, patterns and the page to its own brute force on these two
IN_MOE_STEPS = ("mixtral", "qwen2_moe")


@pytest.mark.parametrize("moe_model", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"], indirect=True)
def test_every_step_on_a_mixture_of_experts(moe_model, tmp_path):
    name, mm = moe_model
    coefs = _coefs_moe(name)
    every = name not in IN_MOE_STEPS
    steps = ("mine", "values", "compose", "mutate", "patterns", "normalize") if every else ("mine", "values", "normalize")
    run = _run_steps(mm, tmp_path / "run", (*steps, "census"))
    check_mine(mm, run, coefs, name)
    check_census(mm, run, name)
    check_values(mm, run, name)
    if every:
        check_compose(mm, run, name, MOE_FAM)
        check_mutate(mm, run, coefs, name)
        check_patterns(mm, run, name)
        check_memory_page(mm, run, coefs, name)
    check_normalize(mm, run, name)
    check_explain(mm, coefs, name)
