"""Sign regimes on mixture-of-experts families (issue 46's census): `ffkv mine --regimes` on the tiny
Mixtral and Qwen2-MoE (with its shared expert, and packed rows) of `test_moe`, and the census's
regime columns and the memory page's later regime panels on those runs.

Every expected value is a brute force written here from the raw weights: the MoE block's input x
from a hooked forward of each sentence alone; the router's softmax, top-k and (Mixtral)
renormalisation; for each expert e, g = x·G_e and u = x·U_e from gate_up_proj[e] (gate rows
first), m = w_e·silu(g)·u on the tokens routed to e (nothing elsewhere); the shared expert's
gate_proj and up_proj on every token, times sigmoid of its gate. A token's regime is the signs of
g and u, on the tokens routed to the expert only."""
from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import browser_client, mine_tiny
from test_families import open_tiny
from test_moe import _BUILT, MOE
from test_regimes import _check_table

CODES = ("pp", "pn", "np", "nn")
FAMILIES = {"mixtral": (), "qwen2_moe": ("--pack", "64")}  # name: extra mining arguments
_RUNS: dict = {}


@pytest.fixture(params=list(FAMILIES))
def moe_run(request, tmp_path_factory, tok_dir):
    """(name, ffkv's model, run folder): the tiny model mined with --regimes, once per family."""
    name = request.param
    _, mm = open_tiny(name, MOE[name][0], lambda: tmp_path_factory.mktemp("moe"), tok_dir, _BUILT)
    if name not in _RUNS:
        out = tmp_path_factory.mktemp(f"regimes_{name}") / "run"
        _RUNS[name] = mine_tiny(out, mm.spec.model_id, 24, 3, "--regimes", "--batch-tokens", "256",
                                *FAMILIES[name])
    return name, mm, _RUNS[name]


_X: dict = {}  # (family, sentence_id) -> {layer: x}


@torch.no_grad()
def _block_inputs(name, hf, run, sids: list[int]) -> dict[int, dict[int, torch.Tensor]]:
    """{sentence_id: {layer: the MoE block's input x (T, d) float64}}, each sentence run alone (no
    padding), one forward each (kept for the module)."""
    from ffkv.store import query
    from ffkv.store.run import Run

    todo = [s for s in sids if (name, s) not in _X]
    toks = query.sentence_lookup(Run(run), todo) if todo else {}
    for sid in todo:
        got = {}
        hs = [blk.mlp.register_forward_pre_hook(lambda mod, args, l=l: got.__setitem__(l, args[0].detach()[0].double()))
              for l, blk in enumerate(hf.model.layers)]
        try:
            hf(input_ids=torch.tensor([list(toks[sid])]), use_cache=False)
        finally:
            for h in hs:
                h.remove()
        _X[(name, sid)] = got
    return {s: _X[(name, s)] for s in sids}


@torch.no_grad()
def _brute(name, hf, layer: int, x: torch.Tensor):
    """(g, u, m, routed), each (N, d_m), for MoE-block inputs x (N, d) float64, from the raw weights:
    g 0 and routed False where a token is not routed to the memory's expert."""
    _, renorm, shared = MOE[name]
    mlp = hf.model.layers[layer].mlp
    k = hf.config.num_experts_per_tok
    gu = mlp.experts.gate_up_proj.double()  # (E, 2·de, d), gate rows first
    E, de = gu.shape[0], gu.shape[1] // 2
    p = torch.softmax(x @ mlp.gate.weight.double().T, -1)
    top = p.argsort(-1, descending=True)[:, :k]
    w = torch.zeros_like(p).scatter_(1, top, p.gather(1, top))
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    routed = torch.zeros(p.shape, dtype=torch.bool).scatter_(1, top, True)
    G = torch.einsum("nd,eid->nei", x, gu[:, :de])
    U = torch.einsum("nd,eid->nei", x, gu[:, de:])
    M = w[:, :, None] * torch.nn.functional.silu(G) * U * routed[:, :, None]
    R = routed[:, :, None].expand(-1, -1, de)
    g, u, m, r = (t.reshape(x.shape[0], E * de) for t in (G * R, U, M, R))
    if shared:
        s = mlp.shared_expert
        gs, us = x @ s.gate_proj.weight.double().T, x @ s.up_proj.weight.double().T
        ms = torch.sigmoid(x @ mlp.shared_expert_gate.weight.double().T) * torch.nn.functional.silu(gs) * us
        g, u, m = torch.cat([g, gs], 1), torch.cat([u, us], 1), torch.cat([m, ms], 1)
        r = torch.cat([r, torch.ones_like(gs, dtype=torch.bool)], 1)
    return g, u, m, r


def _table_brute(name, hf, layer, xs):
    """(mass (4, d_m), tokens (4, d_m), valid tokens) as `test_regimes._check_table` reads them."""
    g, u, m, r = _brute(name, hf, layer, torch.cat([x[layer] for x in xs.values()]))
    mass, cnt = np.zeros((4, g.shape[1])), np.zeros((4, g.shape[1]), np.int64)
    for i, (gs, us) in enumerate(((1, 1), (1, -1), (-1, 1), (-1, -1))):
        sel = r & (torch.sign(g) == gs) & (torch.sign(u) == us)
        mass[i] = (m.abs() * sel).sum(0).numpy()
        cnt[i] = sel.sum(0).numpy()
    return mass, cnt, g.shape[0]


def test_mined_regimes_equal_a_brute_force_from_the_experts(moe_run):
    from ffkv.store import query
    from ffkv.store.run import Run

    name, mm, out = moe_run
    run = Run(out)
    sids = query.table(run, "sentences", columns=["sentence_id"]).column("sentence_id").to_pylist()
    xs = _block_inputs(name, mm.hf, out, sids)
    t = query.sign_regimes(run)
    assert t.num_rows == mm.n_layers * mm.d_m
    brute = {l: _table_brute(name, mm.hf, l, xs) for l in range(mm.n_layers)}
    _check_table(t, brute, range(mm.n_layers))  # masses, counts, shares summing to 1
    E, de = mm.info()["experts"], mm.info()["d_expert"]
    for l, (mass, cnt, n) in brute.items():
        per_expert = cnt[:, :E * de].sum(0).reshape(E, de)
        assert (per_expert.max(1) < n).all()  # no routed expert sees every token (top-k of 4)
        if MOE[name][2]:  # the shared expert: every token, in some regime
            assert (cnt[:, E * de:].sum(0) == n).all()


def _census(run, mm):
    from ffkv.steps.census.compute import compute_census
    from ffkv.store.run import Run

    if not (run / "census.parquet").exists():
        compute_census(Run(run), mm, show_progress=False)
    return pq.read_table(run / "census.parquet").to_pandas()


def test_census_regime_columns_are_the_mined_shares(moe_run):
    name, mm, run = moe_run
    df = _census(run, mm).set_index(["layer", "dim"])
    sr = pq.read_table(run / "sign_regimes.parquet").to_pandas().set_index(["layer", "dim"])
    assert len(df) == len(sr) == mm.n_layers * mm.d_m
    shares = np.stack([sr.loc[df.index, f"share_{k}"].to_numpy(np.float32) for k in CODES])
    for i, k in enumerate(CODES):
        np.testing.assert_array_equal(df[f"regime_{k}"].to_numpy(np.float32), shares[i])
    has = np.isfinite(shares).all(0)
    assert has.all()  # every memory of a random model has mass
    assert (df["regime"].to_numpy() == np.array(CODES)[shares.argmax(0)]).all()


def _searched(run, layer: int, dim: int, note: str) -> list[int]:
    """The sentences the panel searched, as its note states them: the memory's top-trigger ones
    (both lists, ranks ≤ TOP_RANK), then the seeded sample."""
    from ffkv.steps.census import regimes as R

    n_top, n_sample = map(int, re.search(r"this memory's (\d+) top-trigger .*? and (\d+) more", note).groups())
    trig = pq.read_table(run / "triggers.parquet").to_pandas()
    trig = trig[(trig.layer == layer) & (trig.dim == dim) & (trig["rank"] <= R.TOP_RANK)]
    top = list(dict.fromkeys(trig.sort_values(["sign", "rank"], ascending=[False, True]).sentence_id.tolist()))
    ids = pq.read_table(run / "sentences.parquet", columns=["sentence_id"]).column("sentence_id").to_numpy()
    ids = np.sort(ids)
    sample = np.sort(ids[np.random.default_rng(R.SEED).choice(len(ids), min(R.SAMPLE, len(ids)), replace=False)])
    searched = top + [int(s) for s in sample if int(s) not in top]
    assert len(top) == n_top > 0 and len(searched) == n_top + n_sample
    return searched


def _memories(run, mm, layer):
    """A routed memory (an expert's dim with the most triggers) and, where there is one, a shared one."""
    t = pq.read_table(run / "triggers.parquet", columns=["layer", "dim"]).to_pandas()
    n = t[t.layer == layer].groupby("dim").size()
    E, de = mm.info()["experts"], mm.info()["d_expert"]
    out = []
    for part in (n[n.index < E * de], n[n.index >= E * de]):
        if len(part):
            out.append(int(part[part == part.max()].index.min()))
    return out


def test_later_regime_panels_for_routed_and_shared_memories(moe_run):
    """The memory page's later panels on a routed expert's memory (and Qwen2-MoE's shared expert's):
    shares, counts and every example's gate, input and m as the brute force; tokens not routed to
    the expert show gate 0 and m 0 and are in no regime."""
    from ffkv.steps.census import regimes as R

    name, mm, run = moe_run
    _census(run, mm)
    layer = mm.n_layers - 1
    dims = _memories(run, mm, layer)
    E, de = mm.info()["experts"], mm.info()["d_expert"]
    assert len(dims) == (2 if MOE[name][2] else 1) and dims[0] < E * de
    c = browser_client(run)
    for dim in dims:
        panels = {p["title"]: p for p in c.get(f"/api/memory/{layer}/{dim}").json()["panels"]}
        shares, ex = panels["Sign regimes over the searched tokens"], panels["Sign regimes: strongest examples"]
        searched = _searched(run, layer, dim, shares["note"])
        brute = {}
        for sid, x in _block_inputs(name, mm.hf, run, searched).items():  # causal: a prefix's x is its own
            g, u, m, r = _brute(name, mm.hf, layer, x[layer][:R.MAX_TOKENS])
            brute[sid] = (g[:, dim].numpy(), u[:, dim].numpy(), m[:, dim].numpy(), r[:, dim].numpy())
        mass, count = dict.fromkeys(CODES, 0.0), dict.fromkeys(CODES, 0)
        for g, u, m, r in brute.values():
            for gi, ui, mi in zip(g[r], u[r], m[r]):
                k = ("p" if gi > 0 else "n") + ("p" if ui > 0 else "n")
                mass[k] += abs(mi)
                count[k] += 1
        rows = {row[0]: row for row in shares["rows"]}
        total = sum(mass.values())
        assert sum(row[3] for row in shares["rows"]) == pytest.approx(1.0, abs=1e-9)
        for k in CODES:
            assert rows[k][2] == count[k], (name, dim, k)
            assert rows[k][3] == pytest.approx(mass[k] / total, rel=1e-4, abs=1e-6)
        if dim < E * de:
            assert sum(count.values()) < sum(len(g) for g, *_ in brute.values())  # not every token routed
        assert ex["rows"]
        unrouted = 0
        for row in ex["rows"]:
            row = dict(zip(ex["columns"], row))
            g, u, m, r = brute[row["sentence_id"]]
            i = row["i"]
            assert row["gate"] == pytest.approx(g[i], rel=1e-4, abs=1e-5)
            assert row["input"] == pytest.approx(u[i], rel=1e-4, abs=1e-5)
            assert row["m"] == pytest.approx(m[i], rel=1e-4, abs=1e-5)
            if not r[i]:
                assert row["gate"] == 0 and row["m"] == 0 and i != row["position"]
                unrouted += 1
            if i == row["position"]:
                assert r[i] and row["regime"] == ("p" if g[i] > 0 else "n") + ("p" if u[i] > 0 else "n")
        if dim < E * de:
            assert unrouted > 0  # the context shown holds tokens sent to other experts
        later = c.get(f"/memory/{layer}/{dim}/later-panels")
        assert later.status_code == 200 and "could not recompute" not in later.text
        assert all(f'id="regime-{k}"' in later.text for k in CODES)


def test_a_shared_expert_whose_activation_loses_the_sign_is_refused(tmp_path_factory, tok_dir):
    """The shared expert's own activation is checked too (the routed experts' keeps the sign here)."""
    from ffkv.mine import regimes as R

    _, mm = open_tiny("qwen2_moe", MOE["qwen2_moe"][0], lambda: tmp_path_factory.mktemp("moe"), tok_dir, _BUILT)
    assert R.refusal(mm) is None
    shared = mm.arch.module(mm.blocks[1], mm.arch.shared)
    own = shared.act_fn
    shared.act_fn = torch.nn.Sigmoid()
    try:
        why = R.refusal(mm)
    finally:
        shared.act_fn = own
    assert why and "Sigmoid (its shared expert's) (layer 1) does not keep its input's sign" in why, why
