"""One sign per row, per-sign statistics and 1-based download ranks (issue 48, items 2 and 3).

A tiny Llama is mined once; its memory whose positive side carries the most activation mass is
then flipped (its up-projection row and its value negated: the model computes the same function,
but that memory's m is −m), so its negative side dominates. The flipped model is mined (both
signs) and its values read; every check compares the browser with numbers computed here from the
model's own weights and a hooked forward, not through ffkv's code."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import WT2, build_tiny, run_cli

SENTENCES, TOP_K = 40, 10
LAYER = 1


def _ok(*args):
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    return res


def _coefficients(model, sentences: list[list[int]], layer: int):
    """m of every memory of `layer` at every token: the down projection's input, hooked."""
    import torch

    got = []
    mlp = model.model.layers[layer].mlp
    h = mlp.down_proj.register_forward_pre_hook(lambda mod, args: got.append(args[0][0].detach().clone()))
    try:
        with torch.no_grad():
            for ids in sentences:
                model(torch.tensor([ids]))
    finally:
        h.remove()
    return torch.cat(got).double().numpy()  # (tokens, d_m)


@pytest.fixture(scope="module")
def flipped(tmp_path_factory, tok_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("signs")
    base = build_tiny("llama", root / "base", tok_dir)
    ref = root / "ref"
    _ok("mine", "--out", ref, "--model", base, "--corpus", WT2 / "wiki.valid.tokens",
        "--max-sentences", SENTENCES, "--top-k", TOP_K, "--negative")
    sent = pq.read_table(ref / "sentences.parquet", columns=["token_ids"]).column("token_ids").to_pylist()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    m = _coefficients(model, sent, LAYER)
    pos, neg = np.where(m > 0, m, 0).sum(0), np.where(m < 0, -m, 0).sum(0)
    dim = int(np.argmax(pos / np.maximum(neg, 1e-9)))
    assert pos[dim] > 1.5 * neg[dim]
    with torch.no_grad():
        mlp = model.model.layers[LAYER].mlp
        mlp.up_proj.weight[dim].neg_()
        mlp.down_proj.weight[:, dim].neg_()
    path = root / "flipped"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    run = root / "run"
    _ok("mine", "--out", run, "--model", path, "--corpus", WT2 / "wiki.valid.tokens",
        "--max-sentences", SENTENCES, "--top-k", TOP_K, "--negative")
    _ok("values", run, "--model", path, "--permutations", 2)
    sent = pq.read_table(run / "sentences.parquet", columns=["token_ids"]).column("token_ids").to_pylist()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return {"run": run, "model": model, "dim": dim, "m": _coefficients(model, sent, LAYER)}


@pytest.fixture(scope="module")
def client(flipped):
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    from ffkv.memories.value_index import build_index
    from ffkv.web.tokenindex import TokenIndex

    app = create_app(flipped["run"], log_fn=lambda m: None)
    b = app.state.browser  # a token index over the whole vocabulary: every trigger's rank is known
    b._index = TokenIndex(build_index(b.model(), k=b.V), b.d_m, "test")
    return TestClient(app, base_url="http://127.0.0.1:8000")


def _probs(model, layer: int, dim: int, sign: int) -> np.ndarray:
    """softmax of s·v through the norm lens, computed here: (s·v ⊙ g) · E."""
    import torch

    with torch.no_grad():
        v = model.model.layers[layer].mlp.down_proj.weight[:, dim].double() * sign
        z = (v * model.model.norm.weight.double()) @ model.lm_head.weight.double().T
        return torch.softmax(z, -1).numpy()


def _triggers(run):
    return pq.read_table(run / "triggers.parquet").to_pandas()


def test_negative_side_dominates_summary_control_and_ranks(flipped, client):
    from ffkv.display import show_token
    from ffkv.web.activations import explore_links
    from ffkv.web.measures import dominant_sign

    dim, m = flipped["dim"], flipped["m"][:, flipped["dim"]]
    assert -m[m < 0].sum() > m[m > 0].sum()  # the flip made its − side the heavier one
    b = client.app.state.browser
    assert dominant_sign(b, LAYER, dim) == -1
    page = client.get(f"/api/memory/{LAYER}/{dim}").json()
    assert page["dominant"] == -1
    # the summary describes −v and the most negative prefixes
    p = _probs(flipped["model"], LAYER, dim, -1)
    assert page["summary"].startswith("− side: ")
    assert show_token(b.tok(int(np.argmax(p)))) in page["summary"]
    t = _triggers(flipped["run"])
    neg = t[(t.layer == LAYER) & (t.dim == dim) & (t.sign == -1)].sort_values("rank")
    ids = pq.read_table(flipped["run"] / "sentences.parquet").to_pandas().set_index("sentence_id").token_ids
    ends = [int(ids[r.sentence_id][r.position]) for r in neg[neg["rank"] <= 25].itertuples()]
    counts = {tok: ends.count(tok) for tok in set(ends)}
    first = min(counts, key=lambda tok: (-counts[tok], tok))
    assert "top triggers end in " + show_token(b.tok(first)) in page["summary"]
    # "set m =" is the negative side's top coefficient
    links = explore_links(page, b)
    setm = [x for x in links if x["label"].startswith("set m =")]
    assert setm and setm[0]["label"] == f"set m = {float(neg.iloc[0].coef):.3g} everywhere"
    assert float(neg.iloc[0].coef) < 0
    # each negative trigger's "in value" rank is the rank of its next token in −v (1-based in the CSV;
    # the fixture's token index knows every rank)
    page = client.get(f"/api/memory/{LAYER}/{dim}", params={"top": 200}).json()
    checked = 0
    for t in page["triggers"]["-"]:
        if t["next_token"] is None:
            continue
        assert t["badge"]["direction"] == -1
        want = int((p > p[int(t["next_token"])]).sum())  # 0-based rank in −v
        assert t["badge"]["rank"] == want
        checked += 1
    assert checked > 0
    rows = list(csv.DictReader(io.StringIO(client.get(f"/memory/{LAYER}/{dim}/triggers.csv").text)))
    assert "title" not in rows[0]
    badge = {(1 if k == "+" else -1, t["rank"]): (t["badge"] or {}).get("rank")
             for k in ("+", "-") for t in page["triggers"][k]}
    assert len(rows) == len(badge)
    for r in rows:
        b0 = badge[(int(r["sign"]), int(r["rank"]))]
        assert r["next_token_rank_in_value_0"] == ("" if b0 is None else str(b0))
        assert r["next_token_rank_in_value"] == ("" if b0 is None else str(b0 + 1))
    assert any(r["next_token_rank_in_value"] for r in rows)


def test_layer_rows_read_one_sign(flipped, client):
    ag = pq.read_table(flipped["run"] / "values_agreement.parquet").to_pandas()
    d = client.get(f"/api/layer/{LAYER}").json()
    rows = d["best"]["agreement"] + d["best"]["sharpness"]
    assert {r["sign"] for r in rows} == {1, -1}  # both sides among the rows checked
    assert rows and any(r["dim"] == flipped["dim"] for r in d["best"]["agreement"] + d["memories"]["rows"])
    for r in rows:
        s = r["sign"]
        a = ag[(ag.layer == LAYER) & (ag.dim == r["dim"])]
        if len(a) and not math.isnan(a.iloc[0].direction):
            assert s == int(a.iloc[0].direction)
        p = _probs(flipped["model"], LAYER, r["dim"], s)
        assert r["top_token"] == int(np.argmax(p))
        assert r["max_prob"] == pytest.approx(float(p.max()), rel=1e-3)
        if r["rank"] is not None:
            nxt = int(a.iloc[0].next_token)
            assert r["rank"] == int((p > p[nxt]).sum())
            assert r["target_prob"] == pytest.approx(float(p[nxt]), rel=1e-3, abs=1e-7)
    mine = next(r for r in d["memories"]["rows"] if r["dim"] == flipped["dim"])
    a = ag[(ag.layer == LAYER) & (ag.dim == flipped["dim"])].iloc[0]
    assert mine["sign"] == int(a.direction)
    p = _probs(flipped["model"], LAYER, flipped["dim"], mine["sign"])
    assert mine["side"]["top_token"] == int(np.argmax(p))
    # the layer CSV: rank 1-based, its 0-based value beside it
    csv_rows = list(csv.DictReader(io.StringIO(client.get(f"/layer/{LAYER}", params={"format": "csv"}).text)))
    for r in csv_rows:
        if r["rank"]:
            assert int(r["rank"]) == int(r["rank_0"]) + 1
    html = client.get(f"/layer/{LAYER}").text
    assert "−v" in html


def _bin_estimate(x: np.ndarray) -> tuple[float, float]:
    """Mean and std of |x| as the histogram's bins give them, recomputed here: log-uniform within
    an octave [2^k, 2^(k+1)), uniform below 2^-10, the top octave cut at the exact max."""
    top = x.max()
    k = np.floor(np.log2(x)).astype(int)
    lo = np.where(k < -10, 0.0, 2.0 ** k)
    hi = np.where(k < -10, 2.0 ** -10, np.minimum(2.0 ** (k + 1), top))
    e1, e2 = np.empty(len(x)), np.empty(len(x))
    tiny, flat = k < -10, (k >= -10) & (hi <= lo)
    oc = ~tiny & ~flat
    r = np.log(hi[oc] / lo[oc])
    e1[oc], e2[oc] = (hi[oc] - lo[oc]) / r, (hi[oc] ** 2 - lo[oc] ** 2) / (2 * r)
    e1[tiny], e2[tiny] = hi[tiny] / 2, hi[tiny] ** 2 / 3
    e1[flat], e2[flat] = lo[flat], lo[flat] ** 2
    m1 = e1.mean()
    return m1, math.sqrt(max(e2.mean() - m1 * m1, 0))


def test_statistics_per_sign(flipped, client):
    dim, m = flipped["dim"], flipped["m"][:, flipped["dim"]]
    st = {r["sign"]: r for r in client.get(f"/api/memory/{LAYER}/{dim}").json()["stats"]["stats"]}
    assert st[1]["side_mean"] != st[-1]["side_mean"] and st[1]["side_std"] != st[-1]["side_std"]
    for s in (1, -1):
        x = m[s * m > 0] * s
        assert st[s]["side_n"] == pytest.approx(len(x), abs=2)
        est_mean, est_std = _bin_estimate(x)
        assert st[s]["side_mean"] == pytest.approx(s * est_mean, rel=1e-3)
        assert st[s]["side_std"] == pytest.approx(est_std, rel=1e-2, abs=1e-6)
        assert st[s]["side_mean"] == pytest.approx(s * x.mean(), rel=0.15)  # the estimate is near the truth
        assert st[s]["mean"] == pytest.approx(m.mean(), rel=1e-3, abs=1e-6)  # over every token, exact, kept
    html = client.get(f"/memory/{LAYER}/{dim}").text
    assert "over every token (exact)" in html
    from ffkv.web.common import fmt

    for s in (1, -1):  # the page's + and − rows show their own side's mean
        assert f">{fmt(st[s]['side_mean'])}<" in html


def test_density_is_eps_share(flipped, client):
    from ffkv.web.measures import EPS_HIST

    m = flipped["m"]
    ov = client.get("/api/overview").json()
    got = ov["rows"][LAYER]["active"]
    assert got["eps_value"] == EPS_HIST
    assert got["eps_share"] == pytest.approx(float((np.abs(m) >= EPS_HIST).mean(0).mean()), abs=2e-3)
    html = client.get("/").text
    assert "|m| ≥ 0.125" in html
    rows = list(csv.DictReader(io.StringIO(client.get("/", params={"format": "csv"}).text)))
    assert float(rows[LAYER]["active_eps_share"]) == pytest.approx(got["eps_share"])
    assert "|m| ≥ 0.125" in client.get(f"/layer/{LAYER}").text


def test_colour_scale_per_sign(flipped, client):
    dim = flipped["dim"]
    j = client.get(f"/api/memory/{LAYER}/{dim}/activations", params={"top": 5}).json()
    vals = [x for e in j["examples"].values() for x in e["m"] if x is not None]
    assert j["scale_pos"] == pytest.approx(max([x for x in vals if x > 0] + [0.0]))
    assert j["scale_neg"] == pytest.approx(max([-x for x in vals if x < 0] + [0.0]))
    assert j["scale"] == max(j["scale_pos"], j["scale_neg"])
    assert j["scale_pos"] > 0 and j["scale_neg"] > j["scale_pos"]


def test_suppressing_search_rows_read_minus_v(flipped, client):
    dim = flipped["dim"]
    p = _probs(flipped["model"], LAYER, dim, -1)
    top = int(np.argmax(p))
    params = {"token": f"#{top}", "dir": "suppress", "per_page": 500}
    res = client.get("/api/search", params=params).json()
    r = next(x for x in res["results"] if (x["layer"], x["dim"]) == (LAYER, dim))
    assert r["sign"] == -1 and r["rank"] == 0
    assert r["prob"] == pytest.approx(float(p[top]), rel=1e-3)
    assert r["max_prob"] == pytest.approx(float(p.max()), rel=1e-3)  # of −v, as the row's rank and p
    t = _triggers(flipped["run"])
    neg = t[(t.layer == LAYER) & (t.dim == dim) & (t.sign == -1) & (t["rank"] == 1)].iloc[0]
    assert (r["sentence_id"], r["position"]) == (int(neg.sentence_id), int(neg.position))
    rows = list(csv.DictReader(io.StringIO(client.get("/search", params={**params, "format": "csv"}).text)))
    got = next(x for x in rows if (int(x["layer"]), int(x["dim"])) == (LAYER, dim))
    assert (got["sign"], got["rank"], got["rank_0"]) == ("-1", "1", "0")
    assert "−v max p" in client.get("/search", params=params).text


@pytest.mark.browser
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs Debian's chromium")
def test_page_tints_each_sign_on_its_own_scale(flipped, client):
    """In chromium: the largest positive and the most negative coefficient shown both get the
    darkest tint of their hue (one symmetric ±max scale left the weak side nearly uncoloured)."""
    from playwright.sync_api import sync_playwright

    from conftest import serving
    from ffkv.report.screenshot import BROWSER_ARGS

    with serving(client.app) as url, sync_playwright() as p:
        br = p.chromium.launch(executable_path="/usr/bin/chromium", args=BROWSER_ARGS)
        try:
            page = br.new_page()
            page.goto(f"{url}/memory/{LAYER}/{flipped['dim']}?top=5")
            page.wait_for_selector(".act-status[data-state=done]", timeout=60_000)
            toks = page.eval_on_selector_all(".tk[data-m]", "els => els.map(e => [parseFloat(e.dataset.m), e.className])")
        finally:
            br.close()
    top = max(toks, key=lambda x: x[0])
    bottom = min(toks, key=lambda x: x[0])
    assert 0 < top[0] < -bottom[0]
    assert "mp8" in top[1] and "mn8" in bottom[1]
