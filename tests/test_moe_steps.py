"""The steps after mining on a mixture of experts (tiny Mixtral, and Qwen2-MoE with its shared
expert), through the CLI, each number held to a brute force from the model's own MoE blocks and
its raw fused weights (`test_moe._brute_coefficients`: router softmax, top-k, the expert's gated
MLP; 0 on experts not routed), each prefix run alone:

- compose (paper §5, Figs 7-11): per example and layer, the active memories (never more than a
  token reaches: its top-k experts' and the shared expert's), the mass shares, and top(r), top(y),
  top(o) and Fig 8's match under both lenses, y being the MoE block's own output;
- mutate (Fig 3): every re-scored coefficient, the original and the mutated prefix; a mutation
  that moves the token to other experts gives exactly 0;
- patterns: keys of every expert, each with its mined prefixes (the step reads trigger texts only);
- the memory page (`ffkv serve`): a key of a later expert and of the shared expert renders, and
  its per-token coefficients and the re-verified trigger are the brute force's.

Every definition of these steps is one of m, v, y, r, o: none needs the FFN to be dense, so none
is refused on a mixture of experts.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import WT2, run_cli
from test_moe import MOE, _brute_coefficients, _brute_values, _run_blocks, moe_model  # noqa: F401

NAMES = ["mixtral", "qwen2_moe"]
_RUNS: dict = {}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def moe_run(moe_model, tmp_path_factory):
    """mine, compose, mutate and patterns on the tiny model, through the CLI (once per model)."""
    name, mm = moe_model
    if name not in _RUNS:
        run = tmp_path_factory.mktemp(f"moe_run_{name}") / "run"
        model = mm.spec.model_id
        for args in (("mine", "--out", run, "--model", model, "--corpus", WT2 / "wiki.valid.tokens",
                      "--max-sentences", "40", "--top-k", "6"),
                     ("compose", run, "--corpus", WT2 / "wiki.test.tokens", "--prefixes", "24",
                      "--max-sentences", "200", "--batch-tokens", "256"),
                     ("mutate", run, "--keys-per-layer", "4", "--examples", "4"),
                     ("patterns", run, "--keys-per-layer", "8", "--no-semantic", "--background", "60")):
            res = run_cli(*args)
            assert res.returncode == 0, (args[0], res.stderr[-3000:])
        _RUNS[name] = run
    from ffkv.store.run import Run

    return name, mm, Run(_RUNS[name])


def _alone(mm, ids):
    """Per layer: the MoE block's input x and output y, the residual r entering the FFN (the
    post-attention norm's input) and the block's output o, for `ids` run alone."""
    got = {l: {} for l in range(mm.n_layers)}
    hs = []
    for l, blk in enumerate(mm.hf.model.layers):
        hs.append(blk.post_attention_layernorm.register_forward_pre_hook(
            lambda mod, a, l=l: got[l].__setitem__("r", a[0][0])))
        hs.append(blk.register_forward_hook(
            lambda mod, a, o, l=l: got[l].__setitem__("o", (o[0] if isinstance(o, tuple) else o)[0])))
    try:
        own, _ = _run_blocks(mm, torch.tensor([ids]))
    finally:
        for h in hs:
            h.remove()
    for l in got:
        got[l]["x"], got[l]["y"] = own[l]["x"][0], own[l]["y"][0]
    return got


@pytest.mark.parametrize("moe_model", NAMES, indirect=True)
def test_compose_matches_the_blocks_brute_force(moe_run):
    name, mm, run = moe_run
    hf = mm.hf
    W = hf.lm_head.weight.double()
    g = hf.model.norm.weight.double()
    lens = {"naive": lambda h: h.double() @ W.T, "norm": lambda h: hf.lm_head(hf.model.norm(h)).double()}
    direction = {"naive": lambda v: v.double() @ W.T, "norm": lambda v: (v.double() * g) @ W.T}
    V = [_brute_values(name, blk.mlp) for blk in hf.model.layers]
    vtop = {ln: [direction[ln](v).argmax(-1) for v in V] for ln in lens}
    per_token = mm.info()["memories_per_token"]
    ex = run.read_table("compose_examples").to_pandas().set_index(["lens", "layer", "example_id"])
    prefixes = run.read_table("compose_prefixes").column("token_ids").to_pylist()
    assert len(prefixes) == 24
    seen_routed_zero = 0
    for e, ids in enumerate(prefixes):
        got = _alone(mm, ids)
        for l in range(mm.n_layers):
            blk = hf.model.layers[l]
            m = _brute_coefficients(name, blk.mlp, got[l]["x"][-1:])[0]
            y, r, o = got[l]["y"][-1], got[l]["r"][-1], got[l]["o"][-1]
            assert torch.allclose(r + y, o, atol=1e-5)
            assert torch.allclose(m @ V[l], y, atol=1e-5)  # the brute force is the block's output
            row = ex.loc[("naive", l, e)]
            assert int(row.n_active) == int((m > 0).sum()) <= per_token, (name, e, l)
            seen_routed_zero += int((m == 0).sum())
            c = np.sort((m.double().abs() * V[l].double().norm(dim=-1)).numpy())[::-1]
            for p in (1, 10, 50):
                want = c[:math.ceil(p / 100 * len(c))].sum() / c.sum()
                assert abs(float(row[f"mass_top{p}"]) - want) < 1e-5, (name, e, l, p)
            for ln, f in lens.items():
                row = ex.loc[(ln, l, e)]
                for col, h in (("top_r", r), ("top_y", y), ("top_o", o)):
                    z = f(h)
                    assert float(z.max() - z[int(row[col])]) < 1e-5, (name, ln, e, l, col)  # argmax, ties aside
                ty = int(f(y).argmax())
                assert bool(row.y_matches_memory) == bool(((m > 0) & (vtop[ln][l] == ty)).any())
    assert seen_routed_zero >= 24 * mm.n_layers * (mm.d_m - per_token)  # the experts not routed: m = 0


@pytest.mark.parametrize("moe_model", NAMES, indirect=True)
def test_mutations_match_the_blocks_brute_force(moe_run):
    name, mm, run = moe_run
    mut = run.read_table("mutations").to_pandas()
    sents = dict(zip(*run.read_table("sentences", columns=["sentence_id", "token_ids"]).to_pydict().values()))
    E, de = mm.info()["experts"], mm.info()["d_expert"]
    assert len(mut) > 0 and set(mut.mutation) == {"first", "last", "random"}
    cache: dict = {}

    def coef(ids, layer, dim):
        key = (tuple(ids), layer)
        if key not in cache:
            got = _alone(mm, list(ids))
            cache[key] = _brute_coefficients(name, mm.hf.model.layers[layer].mlp, got[layer]["x"][-1:])[0]
        return float(cache[key][dim])

    zeros = 0
    for t in mut.itertuples():
        prefix = sents[t.sentence_id][:t.position + 1]
        mutated = prefix[:t.removed_position] + prefix[t.removed_position + 1:]
        assert len(mutated) == t.n_tokens and prefix[t.removed_position] == t.removed_token
        old, new = coef(prefix, t.layer, t.dim), coef(mutated, t.layer, t.dim)
        assert abs(t.old_coef - old) <= 1e-5 + 1e-4 * abs(old), (name, t)
        assert abs(t.new_coef - new) <= 1e-5 + 1e-4 * abs(new), (name, t)
        assert (t.new_coef == 0) == (new == 0), (name, t)  # routed away: exactly 0 in both
        zeros += t.new_coef == 0
        if t.dim < E * de:
            assert t.old_coef != 0  # a trigger of a routed expert's key was routed there
    assert zeros > 0  # some mutation sent the token to other experts


@pytest.mark.parametrize("moe_model", NAMES, indirect=True)
def test_patterns_cover_keys_of_every_expert(moe_run):
    name, mm, run = moe_run
    keys = run.read_table("pattern_keys").to_pandas()
    trig = run.read_table("triggers").to_pandas()
    experts = {mm.expert_of(int(d))[0] for d in keys.dim}
    assert len(keys) == 8 * mm.n_layers and len(experts) >= 3
    for k in keys.itertuples():
        n = ((trig.layer == k.layer) & (trig.dim == k.dim) & (trig.sign == k.sign)).sum()
        assert k.n_prefixes == n == 6


@pytest.mark.parametrize("moe_model", NAMES, indirect=True)
def test_memory_page_of_an_expert_is_the_brute_force(moe_run):
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    name, mm, run = moe_run
    client = TestClient(create_app(run.path, log_fn=lambda m: None), base_url="http://127.0.0.1:8000",
                        headers={"sec-fetch-site": "same-origin"})
    E, de = mm.info()["experts"], mm.info()["d_expert"]
    layer = mm.n_layers - 1
    dims = [3 * de + 7] + ([mm.d_m - 2] if MOE[name][2] else [])  # expert 3; the shared expert
    sents = dict(zip(*run.read_table("sentences", columns=["sentence_id", "token_ids"]).to_pydict().values()))
    for dim in dims:
        assert client.get(f"/memory/{layer}/{dim}").status_code == 200
        acts = client.get(f"/api/memory/{layer}/{dim}/activations", params={"top": 3, "samples": "none"}).json()
        assert len(acts["examples"]) == 3
        for sid, a in acts["examples"].items():
            ids = sents[int(sid)]
            got = _alone(mm, ids)
            m = _brute_coefficients(name, mm.hf.model.layers[layer].mlp, got[layer]["x"])[:, dim]
            shown = torch.tensor(a["m"], dtype=torch.float32)
            want = m[a["start"]:a["start"] + len(shown)]
            assert torch.allclose(shown, want, atol=1e-4, rtol=1e-3), (name, dim, sid)
            if dim < E * de:
                assert ((shown == 0) == (want == 0)).all()  # tokens not routed to the expert
        rv = client.get(f"/api/memory/{layer}/{dim}/reverify").json()
        got = _alone(mm, sents[rv["sentence_id"]][:rv["position"] + 1])
        want = float(_brute_coefficients(name, mm.hf.model.layers[layer].mlp, got[layer]["x"][-1:])[0, dim])
        assert abs(rv["now"] - want) <= 1e-5 + 1e-4 * abs(want) and rv["rel_diff"] < 1e-4
