"""The census step (issue 46, first piece), each number against a computation of its own:

- the vocabulary moments equal scipy.stats.skew / kurtosis (and numpy's variance) of cos(W_U, v)
  over the full vocabulary, computed here in float64 from the raw weight matrices of the model's own
  modules (lm_head, the final norm, down_proj's columns; Gemma 3: times the post-FFN norm's 1 + w);
- the key-value cosines and their input-output classes equal a brute force from the raw gate, up
  (or fused gate_up: Phi-3) and down weights, the classes decided memory by memory by the
  definitions written out again here; an ungated family (GPT-2, Conv1D weights) too;
- `active` and `dead` equal a hooked forward of the raw model over the run's own sentences,
  counting |m| at down_proj's input; a memory made dead by zeroing its gate row is found dead;
- top_token, token_share and ngram_share equal counts over the positive triggers' last tokens read
  from the sentences; self_rank equals the token's place in the value's float64 logits (E times the
  final norm's gain); the chance positions equal a brute force over every position of every
  sentence, pos_tv and the seeded shuffled draw's a direct computation;
- settings out of range are one line and exit 2, before any model loads.
"""
from __future__ import annotations

import json
import shutil


import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats

from conftest import mine_tiny, run_cli, tiny_with_a_dead_memory

DEAD = (1, 7)  # (layer, dim) whose gate row is zeroed: m = silu(0)·(x·u) = 0 on every token


@pytest.fixture(scope="module")
def census_run(tmp_path_factory, tok_dir):
    """A tiny Llama with one memory forced dead, mined on 40 WikiText-2 sentences, then censused."""
    root = tmp_path_factory.mktemp("census")
    path, hf = tiny_with_a_dead_memory(root / "llama", tok_dir, DEAD)
    run = mine_tiny(root / "run", path, 40, 5)
    r = run_cli("census", run)
    assert r.returncode == 0, r.stderr
    assert "census: 240 memories" in r.stdout
    return run, hf.eval()


def _table(run, name="census"):
    return pq.read_table(run / f"{name}.parquet").to_pandas()


def _cos_vocab(W_U: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """(V,) cos(W_U[t], v) in float64; 0 for a zero row of W_U (a padding token's: Gemma's)."""
    W, v = W_U.detach().double(), v.detach().double()
    n = W.norm(dim=1) * v.norm()
    return torch.where(n > 0, (W @ v) / torch.where(n > 0, n, 1.0), 0.0).numpy()


def _moments_brute(W_U, values_rows):
    out = []
    for v in values_rows:
        c = _cos_vocab(W_U, v)
        out.append((stats.skew(c), stats.kurtosis(c), np.var(c)))
    return np.array(out)


def _cos(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float(a @ b / (a.norm() * b.norm()))


def _io_class(cg_in, cg_out, c_in_out, tau, gated):
    """The classes of `ffkv.steps.census.compute`, decided one memory at a time."""
    def t(c):
        return 1 if c > tau else -1 if c < -tau else 0

    if not gated:
        return {1: "enrichment", -1: "depletion", 0: "orthogonal_output"}[t(c_in_out)]
    if t(cg_out) == 0 and t(c_in_out) == 0:
        return "orthogonal_output"
    s = t(cg_in)
    if s == 0:
        return "proportional_change"
    e_g, e_u = t(s * cg_out), t(c_in_out)
    if e_g >= 0 and e_u >= 0:
        return "enrichment"
    if e_g <= 0 and e_u <= 0:
        return "depletion"
    return "conditional_enrichment" if e_u > 0 else "conditional_depletion"


# ---- the step on a mined run ----------------------------------------------------------------------
def test_moments_equal_scipy_over_the_full_vocabulary(census_run):
    run, hf = census_run
    df = _table(run)
    W_U = hf.lm_head.weight.detach() * hf.model.norm.weight.detach()  # the run's lens: norm (gain folded in)
    assert W_U.shape[0] == hf.config.vocab_size
    for l in range(hf.config.num_hidden_layers):
        down = hf.model.layers[l].mlp.down_proj.weight.detach()  # (d, d_m): value i is column i
        dims = sorted([0, 5, 33, 79] + ([DEAD[1]] if l == DEAD[0] else []))
        want = _moments_brute(W_U, [down[:, i] for i in dims])
        got = df[(df.layer == l) & df.dim.isin(dims)].sort_values("dim")[["skew", "kurtosis", "variance"]].to_numpy()
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-4)
    # the classes follow the recorded thresholds
    d = hf.config.hidden_size
    _classes_follow(df, 10.0, 2.0, d)


def test_moments_are_scipys_bit_for_bit():
    """`_moments` shares scipy's float32 steps among the three statistics: the same bits as
    scipy.stats.skew / kurtosis and ndarray.var, a zero row and a constant one (NaN) included."""
    from ffkv.steps.census.compute import SCIPY_ROWS, _moments

    rng = np.random.default_rng(0)
    C = (rng.standard_t(3, size=(2 * SCIPY_ROWS + 5, 4099)) * 0.05).astype(np.float32)
    C[3], C[7] = 0.0, 0.25
    C[9] = np.abs(C[9])  # skewed
    got = _moments(C)
    want = (stats.skew(C, axis=1), stats.kurtosis(C, axis=1), C.var(axis=1))
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, w)


def test_modes_by_packed_codes_equal_lexsort():
    """The packed-code `_modes` gives lexsort's keys, totals, modes and tie-breaks (smallest tuple)."""
    from ffkv.steps.census.compute import _modes, _modes_lexsort

    rng = np.random.default_rng(1)
    for _ in range(100):
        n = int(rng.integers(1, 300))
        key = rng.integers(0, int(rng.integers(1, 20)), n) * int(rng.integers(1, 5))
        prev, tok = rng.integers(-1, int(rng.integers(1, 8)), n), rng.integers(0, 5, n)
        for cols in ((tok,), (prev, tok)):
            got, want = _modes(key, *cols), _modes_lexsort(key, *cols)
            for g, w in zip((*got[:3], *got[3]), (*want[:3], *want[3])):
                np.testing.assert_array_equal(g, w)


def _classes_follow(df, kurtosis, partition, d):
    k, s = df["kurtosis"], df["skew"]
    assert (df.prediction == ((k > kurtosis) & (s > 0))).all()
    assert (df.suppression == ((k > kurtosis) & (s < 0))).all()
    assert (df.partition == (df.variance * d > partition)).all()


def test_cosine_classes_equal_a_brute_force_from_the_raw_weights(census_run):
    run, hf = census_run
    df = _table(run).set_index(["layer", "dim"])
    for l in range(hf.config.num_hidden_layers):
        mlp = hf.model.layers[l].mlp
        for i in range(0, hf.config.intermediate_size, 3):
            g, u, v = mlp.gate_proj.weight[i], mlp.up_proj.weight[i], mlp.down_proj.weight[:, i]
            want = (_cos(g, u), _cos(g, v), _cos(u, v))
            row = df.loc[(l, i)]
            if l == DEAD[0] and i == DEAD[1]:
                continue  # a zero gate row: its cosines are 0 by ffkv's guard, undefined here
            assert (row.cos_gate_in, row.cos_gate_out, row.cos_in_out) == pytest.approx(want, abs=1e-5)
            assert row.io_class == _io_class(*want, 0.1, True), (l, i)


def test_dead_and_active_equal_a_hooked_forward(census_run, tmp_path):
    run, hf = census_run
    df = _table(run)
    sents = pq.read_table(run / "sentences.parquet").column("token_ids").to_pylist()
    L, d_m = hf.config.num_hidden_layers, hf.config.intermediate_size
    nonzero = np.zeros((L, d_m), np.int64)
    half = np.zeros((L, d_m), np.int64)  # |m| ≥ 0.5: --eps 0.3 rounds up to the histogram's edge 2^-1
    seen = {}

    def hook(l):
        def pre(mod, args):
            seen[l] = args[0][0].detach()
        return pre

    hs = [hf.model.layers[l].mlp.down_proj.register_forward_pre_hook(hook(l)) for l in range(L)]
    try:
        with torch.no_grad():
            for ids in sents:
                hf(torch.tensor([ids]))
                for l in range(L):
                    m = seen[l].abs()
                    nonzero[l] += (m >= 2.0 ** -126).sum(0).numpy()
                    half[l] += (m >= 0.5).sum(0).numpy()
    finally:
        for h in hs:
            h.remove()
    n_tokens = sum(map(len, sents))
    assert (df.tokens == n_tokens).all()
    got = df.sort_values(["layer", "dim"]).active.to_numpy().reshape(L, d_m)
    np.testing.assert_array_equal(got, nonzero)
    dead = set(map(tuple, df[df.dead][["layer", "dim"]].to_numpy().tolist()))
    assert dead == set(zip(*np.nonzero(nonzero == 0))) == {DEAD}
    assert (df.rare == (~df.dead & (df.active < 1e-4 * n_tokens))).all()
    lay = _table(run, "census_layers")
    assert lay.dead.tolist() == pytest.approx([(1 / d_m if l == DEAD[0] else 0.0) for l in range(L)])

    other = tmp_path / "eps"
    shutil.copytree(run, other)  # the module's run keeps the default census
    r = run_cli("census", other, "--eps", "0.3", "--json")
    assert r.returncode == 0, r.stderr
    summ = json.loads(r.stdout)
    assert (summ["eps"], summ["eps_used"]) == (0.3, 0.5)
    df2 = _table(other).sort_values(["layer", "dim"])
    np.testing.assert_array_equal(df2.active.to_numpy().reshape(L, d_m), half)
    assert summ["dead"] == int((half == 0).sum()) >= 1


def test_layer_table_is_the_census_table_by_layer(census_run):
    run, hf = census_run
    df, lay = _table(run), _table(run, "census_layers")
    from ffkv.steps.census.compute import IO_CLASSES

    for _, row in lay.iterrows():
        part = df[df.layer == row.layer]
        assert row.memories == len(part) == row.mined
        for c in ("prediction", "suppression", "partition"):
            assert row[c] == pytest.approx(part[c].mean())
        for c in IO_CLASSES:
            assert row[c] == pytest.approx((part.io_class == c).mean())
        assert sum(row[c] for c in IO_CLASSES) == pytest.approx(1.0)


@pytest.mark.parametrize("args, flag", [(("--eps", "-0.5"), "--eps"), (("--cos", "1.5"), "--cos"),
                                        (("--rare", "2"), "--rare"), (("--kurtosis", "-1"), "--kurtosis")])
def test_settings_out_of_range_are_one_line_before_the_model_loads(census_run, monkeypatch, args, flag):
    from ffkv.model import identity

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(identity, "open_model", no_model)
    run, _ = census_run
    r = run_cli("census", run, *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and flag in r.stderr and "Traceback" not in r.stderr


def test_a_run_without_key_statistics_is_refused_in_one_line(tmp_path, tiny_dirs):
    run = mine_tiny(tmp_path / "nostats", tiny_dirs["gpt2"], 5, 2, "--no-stats")
    r = run_cli("census", run)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--no-stats" in r.stderr


# ---- the library call on other families -----------------------------------------------------------
def _families(tok_dir, tmp_path_factory):
    from test_families import FAMILIES, open_tiny

    built: dict = {}
    return {n: open_tiny(n, FAMILIES[n].config, lambda: tmp_path_factory.mktemp("census_fam"), tok_dir, built)[1]
            for n in ("phi3", "gemma3_text")}


@pytest.fixture(scope="module")
def families(tok_dir, tmp_path_factory):
    return _families(tok_dir, tmp_path_factory)


@pytest.mark.parametrize("name", ["phi3", "gemma3_text"])
def test_layer_census_on_fused_and_post_norm_families(families, name):
    """Phi-3's fused gate_up rows split by hand; Gemma 3's value after its post-FFN norm's gain
    (1 + w), and its final norm's gain (1 + w) folded into W_U."""
    from ffkv.steps.census.compute import layer_census

    mm = families[name]
    hf = mm.hf
    layer = 1
    mlp = hf.model.layers[layer].mlp
    d_m = hf.config.intermediate_size
    if name == "phi3":
        gate, up = mlp.gate_up_proj.weight[:d_m], mlp.gate_up_proj.weight[d_m:]
        values = mlp.down_proj.weight.T
        final = hf.model.norm.weight
    else:
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
        post = 1 + hf.model.layers[layer].post_feedforward_layernorm.weight
        values = mlp.down_proj.weight.T * post
        final = 1 + hf.model.norm.weight
    dims = [0, 3, 17, d_m - 1]
    for lens, W_U in (("norm", hf.lm_head.weight * final), ("naive", hf.lm_head.weight)):
        t = layer_census(mm, layer, dims, lens=lens).to_pandas()
        assert t.dim.tolist() == dims and (t.layer == layer).all()
        want = _moments_brute(W_U.detach(), [values[i].detach() for i in dims])
        np.testing.assert_allclose(t[["skew", "kurtosis", "variance"]].to_numpy(), want, rtol=1e-3, atol=2e-4)
    for k, i in enumerate(dims):
        want = (_cos(gate[i], up[i]), _cos(gate[i], values[i]), _cos(up[i], values[i]))
        got = t.iloc[k]
        assert (got.cos_gate_in, got.cos_gate_out, got.cos_in_out) == pytest.approx(want, abs=1e-5)
        assert got.io_class == _io_class(*want, 0.1, True)
    whole = layer_census(mm, layer).to_pandas()
    assert len(whole) == d_m
    # thresholds in the middle of the layer's own moments: every class has members and follows them
    k, p = float(whole["kurtosis"].median()), float((whole.variance * mm.d).median())
    some = layer_census(mm, layer, kurtosis=k, partition=p).to_pandas()
    assert some.prediction.any() and some.suppression.any() and some.partition.any() and not some.partition.all()
    _classes_follow(some, k, p, hf.config.hidden_size)
    np.testing.assert_allclose(whole.iloc[dims][["skew", "kurtosis", "cos_in_out"]].to_numpy(),
                               layer_census(mm, layer, dims).to_pandas()[["skew", "kurtosis", "cos_in_out"]].to_numpy(),
                               rtol=1e-5, atol=1e-6)


def test_layer_census_on_an_ungated_family(tiny_models):
    """GPT-2 (Conv1D: c_fc's weight is (d, d_m), c_proj's (d_m, d)): cos(k, v) and three classes."""
    from ffkv.steps.census.compute import layer_census

    mm = tiny_models["gpt2"]
    hf = mm.hf
    mlp = hf.transformer.h[0].mlp
    t = layer_census(mm, 0, cos=0.2).to_pandas()
    assert t.cos_gate_in.isna().all() and t.cos_gate_out.isna().all()
    for i in range(0, mlp.c_fc.weight.shape[1], 7):
        c = _cos(mlp.c_fc.weight[:, i], mlp.c_proj.weight[i])
        assert t.cos_in_out[i] == pytest.approx(c, abs=1e-5)
        assert t.io_class[i] == _io_class(None, None, c, 0.2, False)
    W_U = hf.lm_head.weight * hf.transformer.ln_f.weight
    want = _moments_brute(W_U.detach(), [mlp.c_proj.weight[i].detach() for i in (0, 9)])
    np.testing.assert_allclose(t.iloc[[0, 9]][["skew", "kurtosis", "variance"]].to_numpy(), want, rtol=1e-3, atol=2e-4)
    assert not t[["skew", "kurtosis", "variance"]].isna().any().any()


def test_library_defaults_are_the_steps():
    from dataclasses import fields

    from ffkv.steps.census import CensusSettings
    from ffkv.steps.census.compute import DEFAULTS

    d = {f.name: f.default for f in fields(CensusSettings)}
    assert {k: d[k] for k in DEFAULTS} == DEFAULTS


def test_report_section_and_memory_panel(census_run, tmp_path):
    """The report's census by depth (a figure and the table of census_layers) and the memory page's
    panel (through `ffkv.web.panels.step_panels`, as every step's), the forced-dead memory's saying so."""
    from ffkv.steps.registry import get
    from ffkv.store.run import Run
    from ffkv.web.panels import step_panels

    run, hf = census_run
    secs = get("census").sections(Run(run), tmp_path)
    assert [s.id for s in secs] == ["census"]
    assert (tmp_path / "census_depth.png").exists() and "<table" in secs[0].html and "<figure>" in secs[0].html
    assert secs[0].html.count("<tr>") == 1 + hf.config.num_hidden_layers
    panels = [p for p in step_panels(Run(run), *DEAD) if p["step"] == "census"]
    assert len(panels) == 1 and panels[0]["rows"][0][1] == "dead"
    row = _table(run).set_index(["layer", "dim"]).loc[DEAD]
    assert panels[0]["rows"][2][1] == row.io_class.replace("_", " ")
    assert [x[0] for x in panels[0]["rows"][3:]] == ["detector", "position"]
    alive = [p for p in step_panels(Run(run), 0, 0) if p["step"] == "census"]
    assert alive[0]["rows"][0][1] in ("alive", "rare")

    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    c = TestClient(create_app(run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")
    page = c.get(f"/memory/{DEAD[0]}/{DEAD[1]}")
    assert page.status_code == 200 and "Census" in page.text and "excess kurtosis" in page.text
    ov = c.get("/api/overview").json()
    titles = [x["title"] for x in ov["step_columns"] if x["step"] == "census"]
    lay = _table(run, "census_layers")
    assert titles == [f"census: {k}" for k in ("dead", "prediction", "suppression", "partition",
                                                 "enrichment", "depletion")]
    for k in titles:
        got = [r["steps"]["census"][k] for r in ov["rows"]]
        assert got == pytest.approx(lay[k.split(": ")[1]].tolist())
    assert "census: dead" in c.get("/").text


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_layer_census_on_a_mixture_of_experts(name, tmp_path_factory, tok_dir):
    """Each memory is (layer, expert, dim): the expert columns, the shared expert named (Qwen2-MoE's,
    expert E after the E routed ones), the cosines from the fused 3D gate_up weights (gate rows
    first) and the moments from the down projections' columns."""
    from test_moe import MOE, _BUILT
    from test_families import open_tiny

    from ffkv.steps.census.compute import layer_census

    mm = open_tiny(name, MOE[name][0], lambda: tmp_path_factory.mktemp("census_moe"), tok_dir, _BUILT)[1]
    hf, layer = mm.hf, 2
    mlp = hf.model.layers[layer].mlp
    gu, dn = mlp.experts.gate_up_proj, mlp.experts.down_proj  # (E, 2·de, d), (E, d, de)
    E, de = dn.shape[0], dn.shape[2]
    t = layer_census(mm, layer).to_pandas()
    shared = MOE[name][2]
    ds = mlp.shared_expert.down_proj.weight.shape[1] if shared else 0
    assert len(t) == E * de + ds
    assert t.expert.tolist() == [i // de for i in range(E * de)] + [E] * ds
    assert t.expert_dim.tolist() == [i % de for i in range(E * de)] + list(range(ds))
    assert t.shared_expert.tolist() == [False] * (E * de) + [True] * ds
    picks = [(e, i) for e in range(E) for i in (0, de - 1)] + ([(E, 0), (E, ds - 1)] if shared else [])
    W_U = hf.lm_head.weight * hf.model.norm.weight
    for e, i in picks:
        if e < E:
            g, u, v = gu[e, i], gu[e, de + i], dn[e, :, i]
        else:
            s = mlp.shared_expert
            g, u, v = s.gate_proj.weight[i], s.up_proj.weight[i], s.down_proj.weight[:, i]
        row = t[(t.expert == e) & (t.expert_dim == i)].iloc[0]
        want = (_cos(g, u), _cos(g, v), _cos(u, v))
        assert (row.cos_gate_in, row.cos_gate_out, row.cos_in_out) == pytest.approx(want, abs=1e-5)
        assert row.io_class == _io_class(*want, 0.1, True)
        np.testing.assert_allclose([row["skew"], row["kurtosis"], row["variance"]], _moments_brute(W_U, [v])[0],
                                   rtol=1e-3, atol=2e-4)


# ---- token and n-gram detectors, self-suppression, position (issue 46, item 1) --------------------
def test_detector_shares_equal_a_brute_force_from_triggers_and_sentences(census_run):
    from collections import Counter

    run, hf = census_run
    df = _table(run).set_index(["layer", "dim"])
    tr = _table(run, "triggers")
    tr = tr[tr.sign == 1]
    sents = dict(zip(*[pq.read_table(run / "sentences.parquet").column(c).to_pylist()
                       for c in ("sentence_id", "token_ids")]))
    for (l, d), g in tr.groupby(["layer", "dim"]):
        toks = [sents[s][p] for s, p in zip(g.sentence_id, g.position)]
        grams = [((sents[s][p - 1] if p > 0 else -1), sents[s][p]) for s, p in zip(g.sentence_id, g.position)]
        tc = Counter(toks)
        best = max(tc.values())
        row = df.loc[(l, d)]
        assert row.n_triggers == len(g)
        assert row.top_token == min(t for t, c in tc.items() if c == best)
        assert row.token_share == pytest.approx(best / len(g))
        assert row.ngram_share == pytest.approx(max(Counter(grams).values()) / len(g))
        assert row.token_detector == (len(g) >= 5 and best / len(g) >= 0.5)
        assert row.ngram_detector == (len(g) >= 5 and row.ngram_share >= 0.5)
    assert (~df.ngram_detector | df.token_detector).all()


def test_self_rank_equals_the_low_end_position_in_the_value_logits(census_run):
    run, hf = census_run
    df = _table(run)
    det = df[df.token_detector.fillna(False).astype(bool)]
    assert df[~df.token_detector.fillna(False).astype(bool)].self_rank.isna().all()
    assert len(det), "no token detector in the tiny run"
    E = (hf.lm_head.weight * hf.model.norm.weight).detach().double()  # the run's lens: norm
    for _, r in det.head(30).iterrows():
        v = hf.model.layers[int(r.layer)].mlp.down_proj.weight[:, int(r.dim)].detach().double()
        lg = (E @ v).numpy()
        want = int((lg < lg[int(r.top_token)]).sum())  # its place in an ascending argsort, ties aside
        assert r.self_rank == want
        assert r.self_suppressing == (want < 0.01 * len(lg))


def test_position_baseline_and_tv_equal_a_direct_computation(census_run):
    from ffkv.mine.rules import pos_bucket
    from ffkv.steps.census.compute import position_baseline

    run, _ = census_run
    lengths = [len(x) for x in pq.read_table(run / "sentences.parquet").column("token_ids").to_pylist()]
    brute = np.zeros(16)
    for n in lengths:
        for p in range(n):
            brute[pos_bucket(p)] += 1 / n
    brute /= len(lengths)
    base = position_baseline(np.array(lengths), 16)
    np.testing.assert_allclose(base, brute, atol=1e-12)
    assert position_baseline(np.array([40000]), 16)[15] == pytest.approx((40000 - 2 ** 14) / 40000)
    ks = _table(run, "key_stats")
    ks = ks[ks.sign == 1].set_index(["layer", "dim"])
    df = _table(run).set_index(["layer", "dim"])
    for key in list(ks.index)[::7]:
        h = np.asarray(ks.loc[key].pos_hist, float)
        tv = 0.5 * np.abs(h / h.sum() - brute).sum()
        row = df.loc[key]
        assert row.pos_tv == pytest.approx(tv, abs=1e-5)
        assert 0 <= row.pos_tv_chance <= 1
        assert row.positional == (row.pos_tv >= 0.5 and row.pos_tv > 2 * row.pos_tv_chance and not row.dead)
    dead = df.loc[DEAD]  # all ties at 0: every sentence's best at position 0, far from chance, yet not positional
    assert dead.pos_tv > 0.9 and not dead.positional
    # the shuffled draw: one seeded multinomial of each memory's sentence count, memories in table order
    n = np.array([sum(h) for h in ks.pos_hist])
    draw = np.random.default_rng(0).multinomial(n, brute / brute.sum())
    chance = 0.5 * np.abs(draw / n[:, None] - brute).sum(1)
    np.testing.assert_allclose(df.loc[ks.index].pos_tv_chance.to_numpy(), chance, atol=1e-5)
    lay = _table(run, "census_layers")
    for _, r in lay.iterrows():
        part = df.loc[int(r.layer)]
        assert r.positional == pytest.approx(part.positional.astype(float).mean())
        assert r.token_detector == pytest.approx(part.token_detector.astype(float).mean())


@pytest.mark.parametrize("args, flag", [(("--detector", "1.5"), "--detector"), (("--positional", "-1"), "--positional")])
def test_detector_settings_out_of_range_are_refused(census_run, monkeypatch, args, flag):
    test_settings_out_of_range_are_one_line_before_the_model_loads(census_run, monkeypatch, args, flag)


# ---- chance baselines and verdicts ---------------------------------------------------------------------
def test_chance_baselines_equal_a_brute_force(census_run):
    """Random directions' vocabulary classes (the seeded draw, moments by scipy over float64 cosines
    with the raw lm_head times the final norm's gain) and each layer's shuffled-pairing input-output
    classes (the seeded permutation, cosines from the raw gate, up and down weights)."""
    from ffkv.steps.census.compute import CHANCE_DIRECTIONS, CHANCE_SEED

    run, hf = census_run
    lay = _table(run, "census_layers")
    d = hf.config.hidden_size
    W_U = hf.lm_head.weight.detach() * hf.model.norm.weight.detach()
    R = torch.randn(CHANCE_DIRECTIONS, d, generator=torch.Generator().manual_seed(CHANCE_SEED))
    m = _moments_brute(W_U, R[:CHANCE_DIRECTIONS])
    pred = ((m[:, 1] > 10) & (m[:, 0] > 0)).mean()
    supp = ((m[:, 1] > 10) & (m[:, 0] < 0)).mean()
    part = (m[:, 2] * d > 2).mean()
    assert lay.prediction_chance.tolist() == pytest.approx([pred] * len(lay), abs=2 / CHANCE_DIRECTIONS)
    assert lay.suppression_chance.tolist() == pytest.approx([supp] * len(lay), abs=2 / CHANCE_DIRECTIONS)
    assert lay.partition_chance.tolist() == pytest.approx([part] * len(lay), abs=2 / CHANCE_DIRECTIONS)
    d_m = hf.config.intermediate_size
    for l in range(hf.config.num_hidden_layers):
        mlp = hf.model.layers[l].mlp
        perm = np.random.default_rng([CHANCE_SEED, l]).permutation(d_m)
        got = [_io_class(_cos(mlp.gate_proj.weight[i], mlp.up_proj.weight[i]),
                         _cos(mlp.gate_proj.weight[i], mlp.down_proj.weight[:, perm[i]]),
                         _cos(mlp.up_proj.weight[i], mlp.down_proj.weight[:, perm[i]]), 0.1, True)
               if not (l == DEAD[0] and i == DEAD[1]) else "proportional_change" for i in range(d_m)]
        for c in ("enrichment", "depletion"):
            assert lay.loc[l, f"{c}_chance"] == pytest.approx(np.mean([g == c for g in got]), abs=1.5 / d_m)


def _layers(**cols):
    import pandas as pd

    n = len(next(iter(cols.values()), [0] * 6))
    base = {"layer": list(range(n)), "memories": [1000] * n, "mined": [1000] * n}
    for c in ("dead", "prediction", "suppression", "enrichment", "depletion"):
        base[c] = [0.0] * n
    for c in ("prediction_chance", "suppression_chance", "enrichment_chance", "depletion_chance"):
        base[c] = [0.001] * n
    return pd.DataFrame({**base, **cols})


def test_verdicts_follow_each_papers_trend_on_hand_built_tables():
    """Each verdict on hand-made census_layers: the trend, its reverse, no effect, at chance."""
    from ffkv.report.stats import DIFFERS, INCONCLUSIVE, NA, SAME
    from ffkv.steps.census import verdicts as V

    ramp = [0.0, 0.0, 0.01, 0.02, 0.05, 0.1]
    assert V.dead(_layers(dead=ramp[::-1]), 6).verdict == SAME
    assert V.dead(_layers(dead=ramp), 6).verdict == DIFFERS
    assert V.dead(_layers(), 6, "silu").verdict == NA and "silu" in V.dead(_layers(), 6, "silu").measured
    assert V.prediction(_layers(prediction=ramp), 6).verdict == SAME
    assert V.prediction(_layers(prediction=ramp[::-1]), 6).verdict == DIFFERS
    flat = [0.02] * 6
    assert V.prediction(_layers(prediction=flat), 6).verdict == INCONCLUSIVE
    # rising, but not above its chance share
    at_chance = _layers(prediction=ramp, prediction_chance=[0.2] * 6)
    assert V.prediction(at_chance, 6).verdict == INCONCLUSIVE and "not above it" in V.prediction(at_chance, 6).measured
    assert V.suppression(_layers(suppression=[0, 0, 0, 0, 0.01, 0.2]), 6).verdict == SAME
    assert V.suppression(_layers(suppression=[0.2, 0.1, 0.1, 0.1, 0.0, 0.0]), 6).verdict == DIFFERS
    io = _layers(enrichment=[0.3, 0.3, 0.3, 0.3, 0.1, 0.05], depletion=[0.05, 0.05, 0.05, 0.1, 0.2, 0.3])
    assert V.io(io, 6).verdict == SAME
    assert V.io(_layers(enrichment=[0.1] * 6, depletion=[0.05, 0.05, 0.05, 0.1, 0.2, 0.3]), 6).verdict == INCONCLUSIVE
    assert V.io(_layers(enrichment=[0.0] * 4 + [0.3] * 2, depletion=[0.05] * 6), 6).verdict == DIFFERS
    # the pooled difference is the one computed here: layers 4-5 vs 0-1 of 6 (thirds by relative depth)
    v = V.prediction(_layers(prediction=ramp), 6)
    assert f"{100 * (0.075 - 0.0):+.2f} points" in v.measured


def test_census_verdicts_reach_verdicts_json_and_the_comparison(census_run, tmp_path):
    """The report's verdicts.json carries the census's four verdicts (ids, titles), so `ffkv
    verdicts A B` sets them side by side; each one equals the verdict function on the run's table."""
    from ffkv.steps.census import verdicts as V

    run, hf = census_run
    r = run_cli("report", run)
    assert r.returncode == 0, r.stderr
    recs = {x["id"]: x for x in json.loads((run / "report" / "verdicts.json").read_text())}
    lay = _table(run, "census_layers")
    for vid, v in V.records(lay, hf.config.num_hidden_layers, "silu"):
        assert recs[vid]["verdict"] == v.verdict and recs[vid]["measured"] == v.measured
        assert recs[vid]["title"] == V.TITLES[vid]
    r = run_cli("verdicts", run, run)
    assert r.returncode == 0, r.stderr
    for vid in V.TITLES:
        assert V.TITLES[vid].split(" (")[0] in r.stdout or vid in r.stdout


def test_sign_regimes_join_the_census(tmp_path, tiny_dirs, reference_mine):
    """A run mined with --regimes: the census's regime shares are sign_regimes' (which
    test_regimes holds to a brute force), its regime the one with the most mass, the layer table
    their mean, and the memory page's panel says it."""
    from ffkv.steps.registry import get
    from ffkv.store.run import Run

    run = tmp_path / "run"
    shutil.copytree(reference_mine(tiny_dirs["llama"], 30, 3, "--regimes"), run)
    r = run_cli("census", run)
    assert r.returncode == 0, r.stderr
    df = _table(run).set_index(["layer", "dim"])
    sr = pq.read_table(run / "sign_regimes.parquet").to_pandas().set_index(["layer", "dim"])
    keys = ["pp", "pn", "np", "nn"]
    for k in keys:
        np.testing.assert_allclose(df[f"regime_{k}"], sr.loc[df.index, f"share_{k}"].astype(np.float32), rtol=1e-6)
    best = sr[[f"share_{k}" for k in keys]].to_numpy().argmax(1)
    assert (df["regime"].to_numpy() == np.array(keys)[best]).all()
    lay = _table(run, "census_layers")
    assert lay["regime_pp"].tolist() == pytest.approx(df.groupby("layer")["regime_pp"].mean().tolist(), rel=1e-5)
    l, d = df.index[0]
    rows = [p for p in get("census").panels(Run(run), l, d)][0].rows
    assert rows[-1][0] == "sign regime" and rows[-1][1] in ("(+,+)", "(+,−)", "(−,+)", "(−,−)")
