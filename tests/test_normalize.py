"""The `normalize` step: substitution machinery, variants, variance, tables, verdicts, CLI."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import ARCHS, run_cli, wikitext_sentences

from ffkv.steps.normalize.tail import Targets, intact, tail, tail_delta, token_nll
from ffkv.steps.normalize.variants import (TAU_GRID, Sums, Variant, coefficients, concentration,
                                                 grid_sums, random_slots, replacement, softmax_weights,
                                                 top_slots)
from ffkv.steps.normalize.variance import synthetic
from ffkv.steps.normalize import report as N
from ffkv.model import identity

SMALL = dict(tokens=400, fit_tokens=200, sweep_tokens=200, capacity_n=(16,), synthetic_draws=50,
             variance_repeats=2, batch_tokens=512)


def _batch(mm, n: int = 6, seed: int = 0):
    ids = [mm.tok(s)["input_ids"][:40] for s in wikitext_sentences(n, seed=seed)]
    return mm.batch([i for i in ids if len(i) >= 2])


# ---- the substitution machinery ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_identity_substitution_leaves_logits_unchanged_exactly(tiny_models, arch):
    mm = tiny_models[arch]
    ids, mask = _batch(mm)
    cache = intact(mm, ids, mask)
    tg = Targets.of(ids, mask)
    with torch.no_grad():
        ref = mm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits[tg.rows, tg.pos]
    head = lambda h: mm.lens.unembed(mm.lens.final_norm(h[tg.rows, tg.pos]))  # noqa: E731
    assert torch.equal(head(cache.final), ref)
    for layer in range(mm.n_layers):
        assert torch.equal(head(tail_delta(mm, cache, layer, None)), ref)
        assert torch.equal(head(tail(mm, cache, layer, lambda x, m: None)), ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_intact_loss_equals_transformers_labels_loss(tiny_models, arch):
    mm = tiny_models[arch]
    ids, mask = _batch(mm, 8, seed=1)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = mm.hf(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    nll = token_nll(mm, intact(mm, ids, mask).final, Targets.of(ids, mask), chunk=7)
    assert int((labels[:, 1:] != -100).sum()) == len(nll)
    torch.testing.assert_close(nll.double().mean(), ref.double(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_delta_path_equals_hook_path(tiny_models, arch):
    """Adding y' − y to the cached block output = replacing the FFN inside the block."""
    mm = tiny_models[arch]
    ids, mask = _batch(mm, 5, seed=2)
    layer = mm.n_layers // 2
    caps = {}
    cache = intact(mm, ids, mask, callback=lambda l, n, t: caps.__setitem__((l, n), t), what=("x", "m", "y"))
    for v in (Variant("softmax", layer, "all", mm.d_m, tau=0.3, scale=20.0),
              Variant("scaled_relu", layer, "all", mm.d_m, scale=0.5),
              Variant("original", layer, "random", 16)):
        y_new = replacement(mm, v)(caps[(layer, "x")], caps[(layer, "m")])
        a = tail_delta(mm, cache, layer, y_new - caps[(layer, "y")])
        b = tail(mm, cache, layer, replacement(mm, v))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(a, cache.final)
    # the model's own coefficients through ffn_from_memories give back the intact model
    same = tail(mm, cache, layer, replacement(mm, Variant("original", layer, "all", mm.d_m)))
    torch.testing.assert_close(same, cache.final, rtol=1e-5, atol=1e-5)


# ---- variants ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gated", [False, True])
def test_softmax_tau_to_zero_is_hard_top_selection(gated):
    g = torch.Generator().manual_seed(0)
    m = torch.randn(50, 96, generator=g)
    top = (m.abs() if gated else m).argmax(-1)
    hard = torch.zeros_like(m).scatter_(-1, top[:, None], 1.0) * (torch.sign(m) if gated else 1)
    assert torch.equal(softmax_weights(m, 0.0, gated), hard)
    assert torch.equal(softmax_weights(m, 1e-6, gated), hard)
    # over one slot (each token's top memory), any τ gives the hard selection
    for tau in (1e-3, 1.0, 1e3):
        assert torch.equal(softmax_weights(m, tau, gated, top_slots(m, 1) if gated else
                                           torch.zeros_like(m, dtype=torch.bool).scatter_(-1, top[:, None], True)),
                           hard)
    # τ → ∞: uniform weights
    torch.testing.assert_close(softmax_weights(m, 1e9, gated).abs(), torch.full_like(m, 1 / 96))


def test_softmax_tau_to_zero_writes_the_top_value(tiny_models):
    mm = tiny_models["llama"]
    m = torch.randn(7, mm.d_m, generator=torch.Generator().manual_seed(1))
    v = Variant("softmax", 1, "top", 1, tau=0.5, scale=3.0)
    out = mm.ffn_from_memories(1, coefficients(mm, v, None, m))
    i = m.abs().argmax(-1)
    want = 3.0 * torch.sign(m[torch.arange(7), i])[:, None] * mm.values(1)[i]
    torch.testing.assert_close(out, want)


def test_scaled_relu_of_a_relu_ffn_is_the_ffn(tiny_models):
    """OPT's FFN is a ReLU: the scaled ReLU variant with scale 1 gives back its coefficients; for the
    gated Llama FFN it is ReLU(x·g)·(x·u), the model's SiLU gate replaced."""
    for arch in ("opt", "llama"):
        mm = tiny_models[arch]
        ids, mask = _batch(mm, 3, seed=4)
        caps = {}
        intact(mm, ids, mask, callback=lambda l, n, t: caps.__setitem__((l, n), t), what=("x", "m"))
        x, m = caps[(1, "x")], caps[(1, "m")]
        a = coefficients(mm, Variant("scaled_relu", 1, "all", mm.d_m, scale=1.0), x, m)
        if arch == "opt":
            torch.testing.assert_close(a, m, rtol=1e-5, atol=1e-6)
        else:
            with torch.no_grad():
                want = torch.relu(x @ mm.keys(1).T) * (x @ mm.up_keys(1).T)
            torch.testing.assert_close(a, want)
            assert not torch.allclose(a, m)


def test_sums_fit_algebra():
    g = torch.Generator().manual_seed(2)
    z, y = torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g)
    s = Sums()
    s.add(z[:20], y[:20])
    s.add(z[20:], y[20:])
    k = s.norm_scale()
    assert math.isclose(float((k * z).norm() ** 2), float(y.norm() ** 2), rel_tol=1e-5)
    direct = float(((k * z - y) ** 2).sum() / (y ** 2).sum())
    cos = float((z * y).sum() / (z.norm() * y.norm()))
    assert math.isclose(s.rel_err(k), direct, rel_tol=1e-5)
    assert math.isclose(s.rel_err(k), 2 * (1 - cos), rel_tol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_grid_sums_match_softmax_weights(tiny_models, arch):
    mm = tiny_models[arch]
    g = torch.Generator().manual_seed(3)
    m, y = torch.randn(30, mm.d_m, generator=g), torch.randn(30, mm.d, generator=g)
    taus = [0.1, 1.0, 30.0]
    for keep in (None, random_slots(mm.d_m, 16, 0, 1), top_slots(m, 16)):
        sums = [Sums() for _ in taus]
        grid_sums(mm, 1, m, y, taus, sums, keep)
        for t, s in zip(taus, sums):
            ref = Sums()
            with torch.no_grad():
                ref.add(softmax_weights(m, t, mm.gated, keep) @ mm.values(1), y)
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in ((s.zz, ref.zz), (s.zy, ref.zy), (s.yy, ref.yy)))


def test_concentration():
    w = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [-2, 2, 0, 0]])
    c = concentration(w)
    torch.testing.assert_close(c["entropy"], torch.tensor([0.0, math.log(4), math.log(2)], dtype=torch.float64))
    torch.testing.assert_close(c["top1"], torch.tensor([1.0, 0.25, 0.5], dtype=torch.float64))
    assert torch.all(c["top10"] == 1) and torch.all(c["top100"] == 1)


def test_reproduce_settings():
    from ffkv.steps.normalize import default_capacity_layers, reproduce_settings

    s = reproduce_settings(30)
    assert s.layers == tuple(range(0, 30, 4)) and set(s.capacity_layers) <= set(s.layers)
    assert len(s.capacity_layers) == 3 and default_capacity_layers(30) == [4, 14, 24]
    assert reproduce_settings(3).layers == (0, 1, 2)


def test_report_knows_the_tau_grid():
    assert N.TAU_EDGES == (min(TAU_GRID), max(TAU_GRID))


# ---- variance ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [1.5])
def test_synthetic_variance_recovers_n_over_2_and_scaled_stays_flat(gamma):
    rows = pd.DataFrame(synthetic(draws=2000, gamma=gamma, seed=0))
    assert sorted(rows["n"].unique()) == [2 ** k for k in range(4, 15)]
    raw, scaled = rows[rows["kind"] == "raw"], rows[rows["kind"] == "scaled"]
    assert np.allclose(raw["expected"], raw["n"] / 2)
    assert ((raw["variance"] - raw["n"] / 2).abs() <= 3 * raw["se"]).all()
    assert ((scaled["variance"] - 1 / gamma ** 2).abs() <= 3 * scaled["se"]).all()
    assert scaled["variance"].max() / scaled["variance"].min() < 1.3
    assert N.c3(rows).measured.startswith("synthetic: within 3 SE of n/2 at 11 of 11")


def test_synthetic_variance_se_is_honest():
    """Across seeds, about 95% of the n land within 2 SE of n/2 (the SE is not inflated)."""
    rows = pd.concat([pd.DataFrame(synthetic(ns=(16, 64), draws=400, seed=s)) for s in range(40)])
    raw = rows[rows["kind"] == "raw"]
    share = float(((raw["variance"] - raw["expected"]).abs() <= 2 * raw["se"]).mean())
    assert 0.85 <= share <= 1.0


# ---- the step on a tiny model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tiny_dirs, tiny_models, tmp_path_factory):
    from ffkv.steps.normalize import NormalizeSettings
    from ffkv.store.run import Run
    from ffkv.steps.lifecycle import execute

    run = Run(tmp_path_factory.mktemp("norm") / "r", create=True)
    mm = tiny_models["llama"]
    identity.record_model(run, mm)
    run.save()
    s = NormalizeSettings(**SMALL)
    out = execute(run, "normalize", s, mm=mm, show_progress=False)
    return run, mm, s, out


def test_step_tables_and_columns(tiny_run):
    run, mm, s, out = tiny_run
    assert out.status == "done"
    lay = run.read_table("normalize_layers").to_pandas()
    assert len(lay) == 2 * mm.n_layers and set(lay["variant"]) == {"softmax", "scaled_relu"}
    for c in ("layer", "variant", "tau", "tau_rel", "scale", "gamma", "fit_rel_err", "eval_rel_err", "loss",
              "loss_intact", "delta_loss", "delta_loss_se", "ppl", "ppl_intact", "entropy_m", "entropy_w",
              "top1_m", "top10_w", "top100_m", "entropy_diff_se", "top10_diff_se", "entropy_uniform"):
        assert c in lay.columns, c
    assert lay["loss_intact"].nunique() == 1
    assert np.allclose(lay["loss"] - lay["loss_intact"], lay["delta_loss"])
    assert (lay["entropy_m"] <= lay["entropy_uniform"] + 1e-9).all()
    sm = lay[lay["variant"] == "softmax"]
    assert sm["tau"].notna().all() and sm["tau_rel"].isin(TAU_GRID).all()
    cap = run.read_table("normalize_capacity").to_pandas()
    assert set(cap["n"]) == {16, mm.d_m} and set(cap["selection"]) == {"random", "top"}
    full = cap[cap["n"] == mm.d_m]
    assert np.allclose(full["loss_original"], full["loss_intact"])
    assert (full.groupby("layer")["loss_softmax"].nunique() == 1).all()  # both selections keep every slot
    assert np.allclose(cap[cap["n"] == 16]["gap_change"], 0)
    var = run.read_table("normalize_variance").to_pandas()
    assert set(var["source"]) == {"synthetic", "model"} and set(var["kind"]) == {"raw", "scaled"}
    sent = run.read_table("normalize_sentences").to_pandas()
    ev, fi = sent[sent["split"] == "eval"], sent[sent["split"] == "fit"]
    assert ev["n_tokens"].sum() >= s.tokens and fi["n_tokens"].sum() >= s.fit_tokens
    assert not set(ev["doc_id"]) & set(fi["doc_id"])
    assert sent["in_sweep"].sum() >= 1 and not fi["in_sweep"].any()
    assert int(lay["tokens"].iloc[0]) == int((ev["n_tokens"] - 1).sum())


def test_step_intact_loss_equals_transformers(tiny_run):
    run, mm, _, _ = tiny_run
    sent = run.read_table("normalize_sentences").to_pandas()
    ids, mask = mm.batch([list(t) for t in sent[sent["split"] == "eval"]["token_ids"]])
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = float(mm.hf(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss)
    lay = run.read_table("normalize_layers").to_pandas()
    assert math.isclose(float(lay["loss_intact"].iloc[0]), ref, rel_tol=1e-5)


def test_step_skips_when_done_and_redoes_on_other_settings(tiny_run):
    from dataclasses import replace

    from ffkv.steps.normalize import record
    from ffkv.steps.lifecycle import is_done, get

    run, mm, s, _ = tiny_run
    assert is_done(run, get("normalize"), record(run, s))
    assert is_done(run, get("normalize"), record(run, replace(s, batch_tokens=64)))  # speed only
    assert not is_done(run, get("normalize"), record(run, replace(s, tokens=500)))


def test_step_results_do_not_depend_on_batch_size(tiny_models):
    from ffkv.steps.normalize import NormalizeSettings
    from ffkv.steps.normalize.compute import normalize

    mm = tiny_models["gpt2"]
    kw = {**SMALL, "capacity_layers": (), "layers": (1,)}
    a = normalize(mm, NormalizeSettings(**{**kw, "batch_tokens": 64}), show_progress=False)["tables"]
    b = normalize(mm, NormalizeSettings(**{**kw, "batch_tokens": 4096}), show_progress=False)["tables"]
    ta, tb = a["normalize_layers"].to_pandas(), b["normalize_layers"].to_pandas()
    for c in ("loss", "loss_intact", "tau", "scale", "entropy_m", "entropy_w", "eval_rel_err"):
        assert np.allclose(ta[c].astype(float), tb[c].astype(float), rtol=1e-4, equal_nan=True), c


def test_settings_errors(tiny_run):
    from dataclasses import replace

    from ffkv.errors import FfkvError
    from ffkv.steps.normalize import STEP

    run, _, s, _ = tiny_run
    for bad in (dict(tokens=0), dict(variance_repeats=1), dict(gamma=0.0), dict(layers=(0, 99)),
                dict(capacity_layers=(-1,)), dict(capacity_n=(0, 16))):
        with pytest.raises(FfkvError):  # the fields' own checks, then the layers against the run's model
            STEP.recorded(run, replace(s, **bad))


def test_report_items(tiny_run, tmp_path):
    run, mm, _, _ = tiny_run
    get = lambda t: run.read_table(t).to_pandas() if run.has_table(t) else None  # noqa: E731
    its = N.items(get, tmp_path, gated=mm.gated)
    assert [i.id for i in its] == list(N.CLAIMS)
    for it in its:
        assert it.verdict.verdict in (N.HOLDS, N.NOT_HOLDS, N.NA) and it.verdict.criterion
        assert it.figure["png"].stat().st_size > 1000 and it.figure["svg"].exists()
    assert any(N.GATED_NOTE in i.notes for i in its)
    html = N.section_html(its)
    assert html.count('class="verdict ') == 5 and "norm_c5.png" in html and "data:image/png;base64," in html
    assert [r["id"] for r in N.verdict_records(its)] == list(N.CLAIMS)
    none = N.items(lambda t: None, tmp_path)
    assert all(i.verdict.verdict == N.NA and i.missing and i.figure is None for i in none)
    assert "ffkv normalize" in N.section_html(none)


# ---- verdicts on constructed tables -------------------------------------------------------------------
def _layers(delta, se=0.01, ent_m=5.0, ent_w=3.0, ent_se=0.05):
    rows = []
    for l, d in enumerate(delta):
        base = {"layer": l, "entropy_m": ent_m, "entropy_uniform": 7.3, "top10_m": .1, "top10_w": .5,
                "tau_rel": 1.0, "loss_intact": 3.0, "ppl_intact": 20.0, "entropy_diff_se": ent_se}
        rows.append({**base, "variant": "softmax", "entropy_w": ent_w, "delta_loss": d, "delta_loss_se": se,
                     "ppl": 20 * math.exp(d)})
        rows.append({**base, "variant": "scaled_relu", "entropy_w": ent_m, "delta_loss": 0.0,
                     "delta_loss_se": se, "ppl": 20.0})
    return pd.DataFrame(rows)


def test_c1_and_c5_verdicts():
    assert N.c1(_layers([0.0] * 4)).verdict == N.HOLDS
    assert N.c1(_layers([0.0] * 4, ent_w=6.0)).verdict == N.NOT_HOLDS
    assert N.c1(_layers([0.0] * 4, ent_w=4.95)).verdict == N.NA
    assert N.c5(_layers([0.001, 0.0, 0.01])).verdict == N.HOLDS
    assert N.c5(_layers([1.0, 2.0, 0.0])).verdict == N.NOT_HOLDS
    assert N.c5(_layers([0.045, 0.04, 0.0])).verdict == N.NA  # within 2 SE of the tolerance
    assert N.c5(None).verdict == N.NA and "ffkv normalize" in N.c5(None).criterion


def _capacity(gaps_by_n, se=0.01):
    rows = []
    for layer in (0, 1):
        for sel in ("random", "top"):
            g0 = gaps_by_n[0][1]
            for n, g in gaps_by_n:
                rows.append({"layer": layer, "selection": sel, "n": n, "gap": g, "gap_se": se,
                             "gap_change": g - g0, "gap_change_se": se})
    return pd.DataFrame(rows)


def test_c2_verdict():
    assert N.c2(_capacity([(16, 0.1), (64, 0.5), (256, 1.0)])).verdict == N.HOLDS
    assert N.c2(_capacity([(16, 1.0), (64, 0.5), (256, 0.1)])).verdict == N.NOT_HOLDS
    assert N.c2(_capacity([(16, 0.1), (64, 0.1), (256, 0.105)])).verdict == N.NA
    assert N.c2(_capacity([(16, 0.1)]).iloc[0:0]).verdict == N.NA


def _variance(slope, layers=4, noise=0.02):
    rows = synthetic(ns=(16, 64), draws=500)
    rng = np.random.default_rng(0)
    for l in range(layers):
        for n in (16, 64, 256, 1024):
            v = 3.0 * n ** (slope + rng.normal(0, noise))
            rows += [{"source": "model", "layer": l, "n": n, "kind": "raw", "variance": v, "se": 0.0},
                     {"source": "model", "layer": l, "n": n, "kind": "scaled", "variance": v / (n / 2), "se": 0.0}]
    return pd.DataFrame(rows)


def test_c3_c4_verdicts():
    assert N.c3(_variance(1.0)).verdict == N.HOLDS and N.c4(_variance(1.0)).verdict == N.HOLDS
    assert N.c3(_variance(0.5)).verdict == N.NOT_HOLDS and N.c4(_variance(0.5)).verdict == N.NOT_HOLDS
    assert N.c3(_variance(0.8)).verdict == N.NA  # the interval straddles the band's edge
    assert N.c3(_variance(1.0, layers=1)).verdict == N.NA
    broken = _variance(1.0)
    broken.loc[(broken["source"] == "synthetic") & (broken["kind"] == "raw"), "variance"] *= 3
    assert N.c3(broken).verdict == N.NOT_HOLDS


# ---- CLI -----------------------------------------------------------------------------------------------
def test_cli_normalize(tiny_dirs, tmp_path):
    args = ["--tokens", "300", "--fit-tokens", "150", "--sweep-tokens", "150", "--capacity-n", "16",
            "--capacity-layers", "1", "--layers", "0,2", "--synthetic-draws", "50", "--variance-repeats", "2"]
    r = run_cli("normalize", tmp_path / "r", "--model", tiny_dirs["llama"], *args, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["status"] == "done" and set(out["verdicts"]) == set(N.CLAIMS)
    r2 = run_cli("normalize", tmp_path / "r", *args)
    assert r2.returncode == 0, r2.stderr
    assert "already done" in r2.stderr and "C5:" in r2.stdout
    bad = run_cli("normalize", tmp_path / "r", "--layers", "0,7")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "out of range" in bad.stderr


# ---- the real model ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_identity_and_loss(smollm2):
    mm = smollm2
    ids, mask = _batch(mm, 6, seed=3)
    cache = intact(mm, ids, mask)
    tg = Targets.of(ids, mask)
    for layer in (0, 14, mm.n_layers - 1):
        assert torch.equal(tail_delta(mm, cache, layer, None), cache.final)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = mm.hf(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    torch.testing.assert_close(token_nll(mm, cache.final, tg).double().mean(), ref.double(), rtol=1e-5, atol=0)
    # the softmax memory is a real change, and a hard top-1 one hurts more than the fitted one
    caps = {}
    intact(mm, ids, mask, callback=lambda l, n, t: caps.__setitem__((l, n), t), what=("m", "y"))
    m, y = caps[(14, "m")], caps[(14, "y")]
    with torch.no_grad():
        s = float(y.norm() / (softmax_weights(m, 0, True) @ mm.values(14)).norm())
    hard = Variant("softmax", 14, "all", mm.d_m, tau=0.0, scale=s)
    d = mm.ffn_from_memories(14, coefficients(mm, hard, None, m)) - y
    assert token_nll(mm, tail_delta(mm, cache, 14, d), tg).mean() > token_nll(mm, cache.final, tg).mean()
