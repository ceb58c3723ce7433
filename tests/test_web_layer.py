"""Layer pages, downloads (CSV and JSON) and one-line summaries of the memory browser (issue 26
items 5, 6 and 7), against the tiny Llama run of tests/test_web.py: every number is compared
with the run's Parquet tables read directly, not through the browser's code."""
from __future__ import annotations

import csv
import io
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from test_web import as_older_run, client, llama, no_traceback, triggers, web_app, web_run  # noqa: F401  (fixtures)


def table(run, name):
    return pq.read_table(run / f"{name}.parquet").to_pandas()


def read_csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


@pytest.fixture(scope="module")
def bare_client(web_run, tmp_path_factory):  # noqa: F811
    """The server on a copy of the run with only what `ffkv mine --no-stats` writes."""
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    run = tmp_path_factory.mktemp("web-bare") / "run"
    keep = {"sentences", "triggers", "vocab"}
    shutil.copytree(web_run, run, ignore=lambda d, names: [n for n in names if n.endswith(".parquet")
                                                           and n[:-8] not in keep] + [n for n in names
                                                                                      if n.startswith("annotations")])
    as_older_run(run)
    app = create_app(run, log_fn=lambda m: None)
    return TestClient(app, base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def own_client(web_run, tmp_path_factory):  # noqa: F811
    """The server on a full copy of the run (its annotations are this module's own)."""
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    run = tmp_path_factory.mktemp("web-own") / "run"
    shutil.copytree(web_run, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
    return TestClient(create_app(run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")


# ---- the layer page -------------------------------------------------------------------------------
def test_overview_links_every_layer(client):  # noqa: F811
    html = client.get("/").text
    n = client.get("/api/overview").json()["layers"]
    for layer in range(n):
        assert f'href="/layer/{layer}"' in html
        r = client.get(f"/layer/{layer}")
        assert r.status_code == 200, r.text[:500]
        assert f"Layer {layer}" in r.text


def test_layer_density_is_the_key_statistics(client, web_run):  # noqa: F811
    ks = table(web_run, "key_stats")
    kh_all = table(web_run, "key_hist")
    for layer in sorted(ks.layer.unique()):
        d = client.get(f"/api/layer/{layer}").json()["density"]
        for sign in (1, -1):
            x = ks[(ks.layer == layer) & (ks.sign == sign)].frac_active.to_numpy(np.float64)
            got = [r for r in d["rows"] if r["sign"] == sign]
            if not len(x):
                assert not got
                continue
            assert got[0]["keys"] == len(x)
            assert got[0]["density_mean"] == pytest.approx(x.mean(), rel=1e-6)
            assert got[0]["density_median"] == pytest.approx(np.median(x), rel=1e-6)
            assert got[0]["density_max"] == pytest.approx(x.max(), rel=1e-6)
        # the keys' histogram is of |m| ≥ 1/8 (issue 48: m > 0 is ~50% for every key of a gated FFN),
        # read from key_hist: bins whose lower edge is at least 1/8, either side
        lo = np.array(json.loads((web_run / "manifest.json").read_text())["steps"]["mine"]["stats"]["lo"])
        kh = kh_all[kh_all.layer == layer]
        big = kh[lo[kh.bin.to_numpy()] >= 0.125].groupby("dim")["count"].sum()
        x = (big.reindex(kh.dim.unique(), fill_value=0) / kh.groupby("dim")["count"].sum()).to_numpy(np.float64)
        want = np.histogram(x, bins=20, range=(0, 1))[0]
        assert d["eps"] == 0.125 and d["hist"]["measure"] == "|m| ≥ 0.125"
        assert d["hist"]["counts"] == want.tolist() and d["hist"]["total"] == len(x)


def test_layer_best_memories_match_the_values_tables(client, web_run):  # noqa: F811
    allv = table(web_run, "values")
    vals = allv[allv.kind == "value"]
    ag = table(web_run, "values_agreement")
    for layer in sorted(vals.layer.unique()):
        d = client.get(f"/api/layer/{layer}", params={"per_page": 1000}).json()
        best = d["best"]
        # one sign per row (issue 48): the agreement's direction where compared, else the dominant side;
        # the sharpest values are ranked by the max probability of that side's s·v
        sign = {r["dim"]: r["sign"] for r in d["memories"]["rows"]}
        for r in ag[(ag.layer == layer) & ag.direction.notna()].itertuples():
            assert sign.get(r.dim, int(r.direction)) == int(r.direction)
        v = allv[(allv.layer == layer) & (allv.kind == allv.dim.map(
            lambda x: "neg_value" if sign.get(x, 1) == -1 else "value"))]
        v = v.sort_values(["max_prob", "dim"], ascending=[False, True])
        assert [r["dim"] for r in best["sharpness"]] == v.dim.head(10).tolist()
        assert [r["max_prob"] for r in best["sharpness"]] == pytest.approx(v.max_prob.head(10).tolist())
        assert [r["sign"] for r in best["sharpness"]] == [sign.get(x, 1) for x in v.dim.head(10)]
        a = ag[(ag.layer == layer) & ag["rank"].notna()].copy()
        a["tp"] = a.target_prob.fillna(-1.0)
        a = a.sort_values(["rank", "tp", "dim"], ascending=[True, False, True])
        assert [r["dim"] for r in best["agreement"]] == a.dim.head(10).tolist()
        assert [r["rank"] for r in best["agreement"]] == a["rank"].head(10).astype(int).tolist()
        first = a.iloc[0]
        if first["rank"] == 0:
            assert best["agreement"][0]["top_token"] == int(first.next_token)


def test_layer_pattern_mix_and_memories(client, web_run):  # noqa: F811
    pk = table(web_run, "pattern_keys")
    f2 = table(web_run, "patterns_fig2")
    t = triggers(web_run)
    vals = table(web_run, "values")
    for layer in sorted(t.layer.unique()):
        d = client.get(f"/api/layer/{layer}").json()
        sub = pk[(pk.layer == layer) & (pk.sign == 1)]
        assert d["patterns"]["labels"] == {k: int(n) for k, n in sub.label.fillna("none").value_counts().items()}
        assert sorted(r["scope"] for r in d["patterns"]["fig2"]) == sorted(f2[f2.layer == layer].scope)
        dims = sorted(set(t[t.layer == layer].dim) | set(vals[vals.layer == layer].dim))
        assert d["memories"]["total"] == len(dims)
        assert d["mined"] == t[t.layer == layer].dim.nunique()
        got = []
        for page in range(1, d["memories"]["total"] // 7 + 2):
            got += [r["dim"] for r in client.get(f"/api/layer/{layer}", params={"per_page": 7, "page": page}).json()
                    ["memories"]["rows"]]
        assert got == dims
        html = client.get(f"/layer/{layer}", params={"per_page": 7}).text
        assert f'href="/memory/{layer}/{dims[0]}"' in html and "page 1 of" in html


@pytest.mark.parametrize("url,status", [("/layer/99", 404), ("/api/layer/99", 404), ("/layer/-1", 404),
                                        ("/layer/x", 422), ("/layer/0?page=999", 404), ("/layer/0?page=0", 422),
                                        ("/layer/0?per_page=abc", 422), ("/layer/0?format=xml", 422)])
def test_layer_page_errors_are_one_line(client, url, status):  # noqa: F811
    r = client.get(url)
    assert r.status_code == status, (url, r.status_code)
    no_traceback(r.text)


def test_missing_tables_name_their_command(bare_client):
    r = bare_client.get("/layer/1")
    assert r.status_code == 200
    assert "`ffkv values RUN`" in r.text and "`ffkv patterns RUN`" in r.text and "`ffkv mine`" in r.text
    d = bare_client.get("/api/layer/1").json()
    assert d["density"] is None and d["patterns"] is None and d["best"] == {"agreement": None, "sharpness": None}
    assert set(d["missing"]) == {"key_stats", "values", "patterns"}


# ---- downloads ------------------------------------------------------------------------------------
def test_layer_download_csv_and_json(client, web_run):  # noqa: F811
    api = client.get("/api/layer/1", params={"per_page": 1000}).json()["memories"]["rows"]
    r = client.get("/layer/1", params={"format": "csv"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert 'filename="ffkv-layer-1-memories.csv"' in r.headers["content-disposition"]
    rows = read_csv(r.text)
    assert [int(x["dim"]) for x in rows] == [x["dim"] for x in api]
    vals = table(web_run, "values")
    mp = {int(d): p for d, p in zip(vals[(vals.layer == 1) & (vals.kind == "value")].dim,
                                    vals[(vals.layer == 1) & (vals.kind == "value")].max_prob)}
    for x in rows:
        if int(x["dim"]) in mp:
            assert float(x["max_prob"]) == pytest.approx(mp[int(x["dim"])], rel=1e-6)
    j = client.get("/layer/1", params={"format": "json"}).json()
    assert [x["dim"] for x in j["rows"]] == [int(x["dim"]) for x in rows]
    assert j["rows"][0]["summary"] == rows[0]["summary"]


def test_search_download_holds_every_page(client):  # noqa: F811
    params = {"sort": "max_prob", "per_page": 7}
    want, page = [], 1
    while True:
        res = client.get("/api/search", params={**params, "page": page}).json()
        want += [(r["layer"], r["dim"]) for r in res["results"]]
        if page * 7 >= res["total"]:
            break
        page += 1
    r = client.get("/search", params={**params, "format": "csv"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert [(int(x["layer"]), int(x["dim"])) for x in read_csv(r.text)] == want
    j = client.get("/search", params={**params, "format": "json"}).json()
    assert [(x["layer"], x["dim"]) for x in j["rows"]] == want
    html = client.get("/search", params=params).text
    assert "format=csv" in html and "format=json" in html


def test_text_search_download(client):  # noqa: F811
    res = client.get("/api/search", params={"text": "the", "per_page": 500}).json()
    rows = read_csv(client.get("/search", params={"text": "the", "format": "csv"}).text)
    assert [(int(x["layer"]), int(x["dim"]), int(x["sign"]), int(x["n"])) for x in rows] == \
        [(r["layer"], r["dim"], r["sign"], r["n"]) for r in res["results"]]
    assert rows[0]["prefix"] == res["results"][0]["prefix"]["full"]


def test_memory_triggers_download(client, web_run):  # noqa: F811
    t = triggers(web_run)
    layer, dim = int(t.iloc[0].layer), int(t.iloc[0].dim)
    want = t[(t.layer == layer) & (t.dim == dim)].sort_values(["sign", "rank"], ascending=[False, True])
    html = client.get(f"/memory/{layer}/{dim}").text
    assert f"/memory/{layer}/{dim}/triggers.csv" in html and f"/memory/{layer}/{dim}/triggers.json" in html
    rows = read_csv(client.get(f"/memory/{layer}/{dim}/triggers.csv").text)
    assert [(int(x["sign"]), int(x["rank"]), int(x["sentence_id"]), int(x["position"])) for x in rows] == \
        [(int(r.sign), int(r.rank), int(r.sentence_id), int(r.position)) for r in want.itertuples()]
    assert [float(x["coef"]) for x in rows] == pytest.approx(want.coef.tolist(), rel=1e-6)
    sent = {s: ids for s, ids in zip(*pq.read_table(web_run / "sentences.parquet",
                                                    columns=["sentence_id", "token_ids"]).to_pydict().values())}
    voc = dict(zip(*pq.read_table(web_run / "vocab.parquet", columns=["token_id", "text"]).to_pydict().values()))
    for x in rows[:5]:
        ids = sent[int(x["sentence_id"])][: int(x["position"]) + 1]
        assert x["prefix"] == "".join(voc[i] for i in ids)
    j = client.get(f"/api/memory/{layer}/{dim}/triggers.json").json()
    assert len(j["rows"]) == len(rows)
    assert client.get(f"/memory/{layer}/{dim}/triggers.xml").status_code == 422


def test_annotations_and_overview_downloads(own_client):
    body = {"annotator": "csv, \"quoted\"", "sign": 1, "note": "a note\nwith a newline",
            "patterns": [{"description": "ends in a city, or a town", "kind": "semantic", "prefixes": [0, 2]}]}
    t = own_client.get("/api/search", params={"sort": "layer"}).json()["results"][0]
    assert own_client.post(f"/api/memory/{t['layer']}/{t['dim']}/annotations", json=body).status_code == 201
    rows = read_csv(own_client.get("/annotations", params={"format": "csv"}).text)
    assert len(rows) == 1
    assert rows[0]["annotator"] == body["annotator"] and rows[0]["note"] == body["note"]
    assert rows[0]["description"] == "ends in a city, or a town" and json.loads(rows[0]["prefixes"]) == [1, 3]
    assert "format=csv" in own_client.get("/annotations").text
    ov = own_client.get("/api/overview").json()
    rows = read_csv(own_client.get("/", params={"format": "csv"}).text)
    assert [int(r["layer"]) for r in rows] == list(range(ov["layers"]))
    assert [int(r["mined"]) for r in rows] == [r["mined"] for r in ov["rows"]]


# ---- one-line summaries ---------------------------------------------------------------------------
def test_summary_is_built_from_the_run(client, web_run):  # noqa: F811
    from ffkv.display import show_token

    allv = table(web_run, "values")
    vals = allv[allv.kind == "value"]
    voc = dict(zip(*pq.read_table(web_run / "vocab.parquet", columns=["token_id", "text"]).to_pydict().values()))
    t = triggers(web_run)
    sent = {s: ids for s, ids in zip(*pq.read_table(web_run / "sentences.parquet",
                                                    columns=["sentence_id", "token_ids"]).to_pydict().values())}
    pats = table(web_run, "patterns")
    for r in vals.head(12).itertuples():
        m = client.get(f"/api/memory/{r.layer}/{r.dim}").json()
        s, side = m["summary"], m["dominant"]  # every part of the line is of its dominant side (issue 48)
        assert s.startswith("− side: ") == (side == -1)
        r = allv[(allv.layer == r.layer) & (allv.dim == r.dim)
                 & (allv.kind == ("value" if side == 1 else "neg_value"))].iloc[0]
        assert "value promotes " + ", ".join(show_token(voc[int(x)]) for x in r.top_tokens[:3]) in s
        tt = t[(t.layer == r.layer) & (t.dim == r.dim) & (t.sign == side) & (t["rank"] <= 25)]
        if len(tt):
            ends = [voc[sent[int(x.sentence_id)][int(x.position)]] for x in tt.itertuples()]
            top = max(set(ends), key=lambda w: (ends.count(w), -min(i for i, e in enumerate(ends) if e == w)))
            assert show_token(top) in s.split("top triggers end in ")[1]
            assert f"(of {len(tt)})" in s
        p = pats[(pats.layer == r.layer) & (pats.dim == r.dim) & (pats.sign == side)]
        ks = table(web_run, "key_stats")
        k = ks[(ks.layer == r.layer) & (ks.dim == r.dim) & (ks.sign == side)]
        first = bool(len(k)) and k.pos_hist.iloc[0][0] / k.sentences.iloc[0] > 0.5  # peaks at position 0
        assert s.removeprefix("− side: ").startswith("first-position memory") == first, s
        if len(p) and not first:  # a first-position memory's pattern is left out
            assert "pattern “" in s
        html = client.get(f"/memory/{r.layer}/{r.dim}").text
        assert 'id="summary"' in html


def test_summary_on_search_rows_and_searchable(client, web_run):  # noqa: F811
    res = client.get("/api/search", params={"sort": "max_prob", "per_page": 5}).json()
    for r in res["results"]:
        assert r["summary"] == client.get(f"/api/memory/{r['layer']}/{r['dim']}").json()["summary"]
    word = res["results"][0]["summary"].split("value promotes ")[1].split(",")[0].split(" (")[0]
    found = client.get("/api/search", params={"text": word, "mode": "summary", "per_page": 500}).json()
    assert (res["results"][0]["layer"], res["results"][0]["dim"]) in {(r["layer"], r["dim"]) for r in found["results"]}
    assert all(word.casefold() in r["summary"].casefold() for r in found["results"])
    # every memory whose summary holds the word is found (brute force over the API's summaries)
    allm = client.get("/api/search", params={"sort": "layer", "per_page": 500}).json()
    assert found["total"] >= sum(word.casefold() in r["summary"].casefold() for r in allm["results"])
    page = client.get("/search", params={"text": word, "mode": "summary"}).text
    assert 'id="summary-count"' in page


def test_summary_carries_the_annotation(own_client):
    t = own_client.get("/api/search", params={"sort": "layer"}).json()["results"][1]
    body = {"annotator": "sum-ann", "sign": 1, "note": "",
            "patterns": [{"description": "zebra crossing words", "kind": "shallow", "prefixes": [0]}]}
    assert own_client.post(f"/api/memory/{t['layer']}/{t['dim']}/annotations", json=body).status_code == 201
    s = own_client.get(f"/api/memory/{t['layer']}/{t['dim']}").json()["summary"]
    assert "annotated by sum-ann: “zebra crossing words”" in s
    found = own_client.get("/api/search", params={"text": "zebra crossing", "mode": "summary"}).json()
    assert [(r["layer"], r["dim"]) for r in found["results"]] == [(t["layer"], t["dim"])]


# ---- similar memories -----------------------------------------------------------------------------
def brute_nearest(x: np.ndarray, top: int = 10):
    """Every pair's cosine in float64 (the full N × N matrix), itself excluded, largest first."""
    x = x.astype(np.float64)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    u = x / np.where(n > 0, n, 1)
    s = u @ u.T
    np.fill_diagonal(s, -np.inf)
    order = np.lexsort((np.broadcast_to(np.arange(len(s)), s.shape), -s), axis=1)[:, :top]
    return order, np.take_along_axis(s, order, 1)


@pytest.mark.parametrize("kind", ["value", "key"])
def test_similar_by_direction_is_a_brute_force_cosine(client, web_app, llama, kind):  # noqa: F811
    import torch

    from ffkv.model.memories import open_model

    mm = open_model(str(llama), device="cpu")
    with torch.no_grad():
        x = np.concatenate([(mm.values(l) if kind == "value" else mm.keys(l)).float().numpy()
                            for l in range(mm.n_layers)])
    d_m = x.shape[0] // mm.n_layers
    want_i, want_c = brute_nearest(x)
    web_app.state.browser.neighbours_state.wait(timeout=300)
    for code in range(0, x.shape[0], 7):
        layer, dim = divmod(code, d_m)
        got = client.get(f"/api/memory/{layer}/{dim}/similar").json()
        assert got["status"] == "ready"
        rows = got[kind]
        assert [r["cosine"] for r in rows] == pytest.approx(want_c[code].tolist(), abs=1e-5)
        # the same memories, up to the order of cosines equal within rounding
        close = np.abs(np.diff(want_c[code])) < 1e-6
        if not close.any():
            assert [r["layer"] * d_m + r["dim"] for r in rows] == want_i[code].tolist()
        assert all((r["layer"], r["dim"]) != (layer, dim) for r in rows)


def test_similar_by_coactivation_counts_shared_sentences(client, web_run):  # noqa: F811
    t = triggers(web_run)
    t = t[t.sign == 1]
    sets = {k: set(g.sentence_id) for k, g in t.groupby(["layer", "dim"])}
    for (layer, dim) in list(sets)[::17]:
        mine = sets[(layer, dim)]
        want = []
        for k, s in sets.items():
            if k == (layer, dim) or not (mine & s):
                continue
            sh = len(mine & s)
            want.append((-sh, -sh / len(mine | s), k[0], k[1], sh))
        want.sort()
        got = client.get(f"/api/memory/{layer}/{dim}/similar").json()["coactivation"]
        assert [(r["layer"], r["dim"], r["shared"]) for r in got] == [(w[2], w[3], w[4]) for w in want[:10]]
        assert [r["jaccard"] for r in got] == pytest.approx([-w[1] for w in want[:10]])


def test_memory_page_shows_similar_memories(client, web_app):  # noqa: F811
    web_app.state.browser.neighbours_state.wait(timeout=300)
    m = client.get("/api/memory/1/5").json()
    html = client.get("/memory/1/5").text
    assert 'id="similar"' in html and "cosine similarity of the value vectors" in html
    for r in m["similar"]["value"][:3]:
        assert f'href="/memory/{r["layer"]}/{r["dim"]}"' in html


def test_similar_memories_build_waits_while_a_person_waits(web_run, tmp_path, monkeypatch):  # noqa: F811
    """The build of the cosine lists (minutes of CPU on a real model) pauses between its chunks
    while a request a person waits on runs (a page's colours, the explorer, verify), and goes on
    after; chunked with pauses, it gives the lists of one pass."""
    import threading
    import time

    import torch

    from ffkv.web.data import Browser
    from ffkv.web.neighbours import nearest

    monkeypatch.setenv("FFKV_CACHE", str(tmp_path / "cache"))  # nothing stored: it computes
    b = Browser(web_run)
    b.model()
    nb = b.neighbours_state
    with b.foreground.busy():
        nb.start()
        time.sleep(1.5)
        assert nb.status == "building"  # it has not run a chunk
    nb.wait(timeout=120)
    assert nb.status == "ready"
    x = torch.randn(50, 8)
    calls = []
    i1, c1 = nearest(x, 5, chunk=7, pause=lambda: calls.append(threading.get_ident()))
    i2, c2 = nearest(x, 5, chunk=1000)
    assert len(calls) == 8 and (i1 == i2).all() and np.allclose(c1, c2)


def test_similar_memories_are_stored_once_outside_the_run(web_run, tmp_path, monkeypatch):  # noqa: F811
    """Computed once, stored in ffkv's cache folder under a digest of the weights (not in the run,
    which the server never writes but for annotations), and read back by the next server."""
    from ffkv.web.data import Browser
    from test_web import parquet_digest

    monkeypatch.setenv("FFKV_CACHE", str(tmp_path / "cache"))
    before = sorted(p.name for p in web_run.iterdir()), parquet_digest(web_run)
    first = Browser(web_run)
    first.neighbours_state.wait(timeout=300)
    assert first.neighbours_state.source.startswith("computed")
    stored = list((tmp_path / "cache" / "neighbours").glob("*.parquet"))
    assert len(stored) == 1
    second = Browser(web_run)
    second.neighbours_state.wait(timeout=300)
    assert second.neighbours_state.source.startswith("stored by an earlier server")
    for code in range(0, first.L * first.d_m, 11):
        layer, dim = divmod(code, first.d_m)
        for kind in ("value", "key"):
            assert second.neighbours_state.of(kind, layer, dim) == first.neighbours_state.of(kind, layer, dim)
    assert (sorted(p.name for p in web_run.iterdir()), parquet_digest(web_run)) == before
    stored[0].write_bytes(b"not parquet")  # a damaged file is computed again
    third = Browser(web_run)
    third.neighbours_state.wait(timeout=300)
    assert third.neighbours_state.source.startswith("computed")
