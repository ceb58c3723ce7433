"""The memory browser (`ffkv serve`): pages and API against the run's tables and independent
computations, the token index against a direct projection, errors without tracebacks, writes
protected, 200 concurrent annotation posts, and a server that never writes the run's tables.

One real run of the tiny Llama (gated SiLU, 3 layers × 80 memories) on WikiText-2 sentences plus
a few documents carrying `<script>` and attribute-breaking payloads (the browser test checks that
none of them runs). Shared with tests/test_web_browser.py through `web_run`.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import WT2, build_tiny, free_port, serving, wikitext_sentences

PAYLOADS = [
    'The <script>window.__xss = "s1"</script> river flows into the sea.',
    'A tag "><img src=x onerror="window.__xss=\'i2\'"> was found in the city.',
    "An attribute ' onmouseover='window.__xss=3' x=' breaks the quote in the town.",
    "He wrote </textarea><script>window.__xss=4</script> in the book of the year.",
    "The link javascript:window.__xss=5 and {{ 7*7 }} appear in the text.",
    "<svg onload=window.__xss=6> was the title of the song in 1990.",
]
_BUILT: dict[str, Path] = {}


def cli(*args) -> str:
    from typer.testing import CliRunner

    from ffkv.cli import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, f"ffkv {args[0]} failed: {res.exception!r}\n{res.output[-2000:]}"
    return res.output


def build_web_run(root: Path, model: Path) -> Path:
    """mine (both signs) + values + compose + mutate + shallow patterns on 200 WikiText-2 sentences and
    the payloads."""
    corpus = root / "corpus.txt"
    docs = wikitext_sentences(200) + PAYLOADS
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    run = root / "run"
    cli("mine", "--out", run, "--model", model, "--corpus", corpus, "--top-k", 25, "--negative")
    cli("values", run, "--model", model, "--permutations", 5)
    cli("compose", run, "--model", model, "--prefixes", 50, "--corpus", WT2 / "wiki.test.tokens",
        "--max-sentences", 100)
    cli("mutate", run, "--keys-per-layer", 1, "--examples", 5)
    cli("patterns", run, "--no-semantic", "--background", 50, "--alpha", 1)
    return run


def parquet_digest(run: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.glob("*.parquet"))}


@pytest.fixture(scope="session")
def llama(tmp_path_factory, tok_dir) -> Path:
    """The tiny Llama of conftest's `tiny_dirs` (same config and seed), built alone."""
    if "llama" not in _BUILT:
        _BUILT["llama"] = build_tiny("llama", tmp_path_factory.mktemp("web-llama") / "llama", tok_dir)
    return _BUILT["llama"]


@pytest.fixture(scope="session")
def web_run(tmp_path_factory, llama) -> Path:
    if "run" not in _BUILT:
        _BUILT["run"] = build_web_run(tmp_path_factory.mktemp("web"), llama)
        _BUILT["digest"] = parquet_digest(_BUILT["run"])
    return _BUILT["run"]


@pytest.fixture(scope="session")
def web_app(web_run):
    from ffkv.web.app import create_app

    return create_app(web_run, log_fn=lambda msg: None)


@pytest.fixture(scope="session")
def client(web_app):
    from fastapi.testclient import TestClient

    return TestClient(web_app, base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="session")
def index(web_app):
    return web_app.state.browser.wait_index(timeout=300)


def as_older_run(run: Path) -> None:
    """A copy left without some tables, made as a run of an older ffkv that never wrote them: its
    manifest records none of them (a recorded table that is missing is damage, refused)."""
    p = run / "manifest.json"
    m = json.loads(p.read_text())
    m["tables"] = {t: r for t, r in (m.get("tables") or {}).items() if (run / f"{t}.parquet").exists()}
    p.write_text(json.dumps(m))


@pytest.fixture(scope="session")
def memory_client(web_run, tmp_path_factory):
    """The server on a copy of the run without `value_index` (a run made before the values step
    wrote it): it builds the index in memory, and never writes it."""
    import shutil

    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    run = tmp_path_factory.mktemp("web-old") / "run"
    shutil.copytree(web_run, run, ignore=shutil.ignore_patterns("value_index.parquet", "annotations.sqlite*"))
    as_older_run(run)
    app = create_app(run, log_fn=lambda m: None)
    assert app.state.browser.index_status()["status"] == "absent"
    app.state.browser.wait_index(timeout=300)
    assert app.state.browser.index_status()["source"] == "built in memory"
    assert not (run / "value_index.parquet").exists()
    return TestClient(app, base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="session")
def mm(llama):
    from ffkv.model.memories import open_model

    return open_model(str(llama), device="cpu")


def triggers(run: Path):
    return pq.read_table(run / "triggers.parquet").to_pandas()


def sentences(run: Path) -> dict[int, list[int]]:
    t = pq.read_table(run / "sentences.parquet", columns=["sentence_id", "token_ids"]).to_pydict()
    return dict(zip(t["sentence_id"], t["token_ids"]))


def payload_keys(run: Path) -> list[tuple[int, int, int]]:
    """(layer, dim, sign) whose top-25 triggers include a payload sentence."""
    s = pq.read_table(run / "sentences.parquet", columns=["sentence_id", "text"]).to_pydict()
    bad = {i for i, t in zip(s["sentence_id"], s["text"]) if "__xss" in t or "<svg" in t}
    t = triggers(run)
    t = t[t.sentence_id.isin(bad)]
    return sorted({(int(r.layer), int(r.dim), int(r.sign)) for r in t.itertuples()})


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and 'File "' not in text


# ---- the token index ------------------------------------------------------------------------------
def brute_ranks(mm, lens: str, sign: int, token: int):
    """(L, d_m) exact rank of `token` in softmax(sign·v·E) of every value: counting logits above."""
    import torch

    from ffkv.model.memories import lens_for, rank_of

    ln = lens_for(mm, lens)
    out = []
    for l in range(mm.n_layers):
        z = sign * ln.direction_logits(mm.values(l)).float()
        out.append(rank_of(z, torch.full((z.shape[0],), token, dtype=torch.long)).numpy())
    return np.stack(out)


def test_value_index_is_exact_including_ties(llama):
    """build_index == every (value, sign, lens, token) with rank_of < k, also when logits tie."""
    import torch

    from ffkv.memories.value_index import build_index, index_k
    from ffkv.model.memories import lens_for, open_model

    mm = open_model(str(llama), device="cpu")
    with torch.no_grad():  # tie tokens: identical unembedding rows give identical logits in every row
        E = mm.lens.E
        E[7].copy_(E[5])
        E[9].copy_(E[5])
        E[11].copy_(E[3])
    k = 6
    t = build_index(mm, k=k, chunk=29)
    assert index_k(t) == k and t.schema.names == ["lens", "sign", "token", "rank", "prob", "layer", "dim"]
    got = set(zip(*(t.column(c).to_pylist() for c in ("lens", "sign", "layer", "dim", "token", "rank"))))
    want = set()
    for lens in ("naive", "norm"):
        ln = lens_for(mm, lens)
        for l in range(mm.n_layers):
            z = ln.direction_logits(mm.values(l)).float()
            for s in (1, -1):
                zz = s * z  # (d_m, V); rank of every token = number of logits strictly above it
                ranks = zz.shape[1] - torch.searchsorted(zz.sort(-1).values, zz, right=True)
                for i, w in torch.nonzero(ranks < k).tolist():
                    want.add((lens, s, l, i, w, int(ranks[i, w])))
    assert got == want
    per_row = t.group_by(["lens", "sign", "layer", "dim"]).aggregate([("token", "count")])
    assert max(per_row.column("token_count").to_pylist()) > k  # ties kept beyond k
    # probabilities: softmax of the row
    import pyarrow.compute as pc

    row = t.filter((pc.field("lens") == "norm") & (pc.field("layer") == 1) & (pc.field("dim") == 4)
                   & (pc.field("sign") == -1)).to_pylist()
    p = torch.softmax(-lens_for(mm, "norm").direction_logits(mm.values(1)[4]).float(), -1)
    assert all(abs(r["prob"] - float(p[r["token"]])) < 1e-6 for r in row)
    # sorted by lens, sign, token, rank, layer, dim
    keys = list(zip(*(t.column(c).to_pylist() for c in ("lens", "sign", "token", "rank", "layer", "dim"))))
    assert keys == sorted(keys, key=lambda x: (x[0], -x[1], x[2], x[3], x[4], x[5]))


@pytest.mark.parametrize("query, source", [("the", "run"), (" of", "run"), ("#70", "run"), ("the", "memory")])
def test_token_search_matches_direct_projection(client, memory_client, index, mm, tok_dir, query, source):
    """Against every value projected here: the run's `value_index` (when the values step wrote
    it) and the index the server builds in memory for a run without it."""
    from transformers import AutoTokenizer

    if source == "memory":
        client = memory_client

    tok = AutoTokenizer.from_pretrained(tok_dir)
    vocab = [tok.decode([i]) for i in range(len(tok))]
    if query.startswith("#"):
        ids = [int(query[1:])]
    else:
        ids = sorted(i for i, s in enumerate(vocab) if s == query or s.strip().casefold() == query.strip().casefold())
    assert ids
    for lens in ("naive", "norm"):
        for direction, sign in (("promote", 1), ("suppress", -1)):
            for k in (1, 5, index.k):
                want = {}
                for t in ids:
                    r = brute_ranks(mm, lens, sign, t)
                    for l, i in zip(*np.nonzero(r < k)):
                        want[(int(l), int(i), t)] = int(r[l, i])
                res = client.get("/api/search", params={"token": query, "k": k, "lens": lens, "dir": direction,
                                                        "per_page": 500}).json()
                assert res["status"] == "ready" and sorted(x["token"] for x in res["tokens"]) == ids
                got = {(r["layer"], r["dim"], r["token"]): r["rank"] for r in res["results"]}
                assert got == want, (lens, direction, k)
                assert res["total"] == len(want)
                probs = [r["prob"] for r in res["results"]]
                assert probs == sorted(probs, reverse=True)  # default order: the value's p of the token (issue 26)


def test_token_search_paging_and_sorting(client, index):
    full = client.get("/api/search", params={"token": "the", "k": index.k, "sort": "prob", "per_page": 500}).json()
    assert full["total"] > 7
    probs = [r["prob"] for r in full["results"]]
    assert probs == sorted(probs, reverse=True)
    pages = []
    for page in range(1, 100):
        r = client.get("/api/search", params={"token": "the", "k": index.k, "sort": "prob", "per_page": 7,
                                              "page": page}).json()
        pages += r["results"]
        if page * 7 >= r["total"]:
            break
    assert pages == full["results"]
    asc = client.get("/api/search", params={"token": "the", "k": index.k, "sort": "prob", "order": "asc",
                                            "per_page": 500}).json()["results"]
    assert [r["prob"] for r in asc] == sorted(probs)
    html = client.get("/search", params={"token": "the", "k": 3})
    assert html.status_code == 200 and "Memories whose value promotes" in html.text


# ---- memory pages -----------------------------------------------------------------------------------
def test_memory_api_matches_triggers_table(client, web_run, tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    t = triggers(web_run)
    sents = sentences(web_run)
    keys = [(0, 0), (1, 5), (2, 79)] + [(l, d) for l, d, _ in payload_keys(web_run)[:3]]
    for layer, dim in keys:
        m = client.get(f"/api/memory/{layer}/{dim}", params={"top": 50}).json()
        for sign, name in ((1, "+"), (-1, "-")):
            want = t[(t.layer == layer) & (t.dim == dim) & (t.sign == sign)].sort_values("rank")
            got = m["triggers"][name]
            assert [r["rank"] for r in got] == want["rank"].tolist()
            assert [r["sentence_id"] for r in got] == want["sentence_id"].tolist()
            assert [r["position"] for r in got] == want["position"].tolist()
            assert np.allclose([r["coef"] for r in got], want["coef"].to_numpy(), rtol=0, atol=0)
            assert [r["next_token"] for r in got] == [None if np.isnan(x) else int(x) for x in
                                                     want["next_token"].astype(float)]
            for r in got:
                ids = sents[r["sentence_id"]][: r["position"] + 1]
                assert r["prefix"]["trigger"] == tok.decode([ids[-1]])
                assert r["prefix"]["full"] == "".join(tok.decode([i]) for i in ids)
                assert r["next_token_text"] == (tok.decode([r["next_token"]]) if r["next_token"] is not None else None)
        assert m["n_triggers"] == {"+": 25, "-": 25}
    # the page shows the same rows (data attributes), top 25 by default
    page = client.get("/memory/1/5").text
    rows = re.findall(r'<tr data-rank="(\d+)" data-sentence="(\d+)" data-position="(\d+)"', page)
    want = t[(t.layer == 1) & (t.dim == 5)].sort_values(["sign", "rank"], ascending=[False, True])
    assert [tuple(map(int, r)) for r in rows] == list(zip(want["rank"], want["sentence_id"], want["position"]))


def test_badges_and_vocab_views_match_direct_projection(client, index, mm, web_run):
    """Each trigger's badge: the exact rank of its next token in ±v (sign of its coefficient)."""
    import torch

    from ffkv.model.memories import lens_for, rank_of

    lens = client.get("/api/overview").json()["lens"]
    ln = lens_for(mm, lens)
    checked = 0
    for layer, dim in [(0, 3), (1, 5), (2, 40)]:
        m = client.get(f"/api/memory/{layer}/{dim}", params={"top": 50}).json()
        z = ln.direction_logits(mm.values(layer)[dim]).float()
        for name in ("+", "-"):
            for r in m["triggers"][name]:
                if r["next_token"] is None:
                    assert r["badge"] is None
                    continue
                s = 1 if r["coef"] >= 0 else -1
                want = int(rank_of(s * z[None], torch.tensor([r["next_token"]]))[0])
                assert r["badge"]["direction"] == s and r["badge"]["bound"] == index.k
                assert r["badge"]["rank"] == (want if want < index.k else None)
                checked += 1
        for ln_name in ("naive", "norm"):
            zz = lens_for(mm, ln_name).direction_logits(mm.values(layer)[dim]).float()
            for key, s in (("+v", 1), ("-v", -1)):
                got = [x["token"] for x in m["vocab_views"]["lenses"][ln_name][key]]
                assert got == torch.topk(s * zz, 10).indices.tolist()
    assert checked > 100


def test_memory_page_shows_what_the_steps_know(client, web_run):
    mut = pq.read_table(web_run / "mutations.parquet").to_pandas()
    layer, dim = int(mut.layer.iloc[0]), int(mut.dim.iloc[0])
    m = client.get(f"/api/memory/{layer}/{dim}").json()
    assert {r["mutation"] for r in m["mutations"]} == {"first", "last", "random"}
    for r in m["mutations"]:
        x = mut[(mut.layer == layer) & (mut.dim == dim) & (mut.mutation == r["mutation"])].rel_change
        assert r["n"] == len(x) and abs(r["mean"] - x.mean()) < 1e-6
    row = next(r for r in m["triggers"]["+"] if r["rank"] == 1)
    assert set(row["mutations"]) == {"first", "last", "random"}
    pk = pq.read_table(web_run / "pattern_keys.parquet").to_pandas()
    pat = pq.read_table(web_run / "patterns.parquet").to_pandas()
    key = pat.iloc[0]
    m = client.get(f"/api/memory/{key.layer}/{key.dim}").json()
    assert len(m["patterns"]) == int(((pat.layer == key.layer) & (pat.dim == key.dim)).sum())
    assert m["pattern_keys"][0]["label"] == pk[(pk.layer == key.layer) & (pk.dim == key.dim)].label.iloc[0]
    covered = set(int(i) for i in key.covered)
    marked = {r["rank"] - 1 for r in m["triggers"]["+"] if int(key.pattern_id) in r["patterns"]}
    assert marked == covered
    page = client.get(f"/memory/{key.layer}/{key.dim}").text
    assert "Automatic patterns" in page and 'id="annotations"' in page
    assert set(m["values"]) == {"value", "neg_value", "key"}
    assert m["agreement"]["layer"] == key.layer


def test_key_statistics(client, web_run, tmp_path):
    """The key-statistics tables of `ffkv mine` (key_stats, key_hist, key_samples), shown when
    present, checked against the tables and the manifest's bin layout."""
    import json
    import shutil

    import duckdb
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    if not (web_run / "key_stats.parquet").exists():
        pytest.skip("this `ffkv mine` wrote no key statistics")
    p = str(web_run)
    layout = json.loads((web_run / "manifest.json").read_text())["steps"]["mine"]["stats"]
    for layer, dim in ((1, 5), (2, 40)):
        st = client.get(f"/api/memory/{layer}/{dim}").json()["stats"]
        ks = duckdb.sql(f"select * from '{p}/key_stats.parquet' where layer = {layer} and dim = {dim} "
                        f"order by sign desc").fetchall()
        cols = [c[0] for c in duckdb.sql(f"describe select * from '{p}/key_stats.parquet'").fetchall()]
        assert len(st["stats"]) == len(ks) == 2
        for got, row in zip(st["stats"], ks):
            want = dict(zip(cols, row))
            assert [x["count"] for x in got["positions"]] == want.pop("pos_hist")
            assert {k: got[k] for k in want} == pytest.approx(want, nan_ok=True)
        hist = dict(duckdb.sql(f"select bin, count from '{p}/key_hist.parquet' where layer = {layer} and dim = {dim}").fetchall())
        assert st["hist"]["counts"] == [hist.get(b, 0) for b in range(layout["bins"])]
        assert st["hist"]["total"] == dict(zip(cols, ks[0]))["count"]
        smp = duckdb.sql(f"select sign, bin, sentence_id, position, coef from '{p}/key_samples.parquet' "
                         f"where layer = {layer} and dim = {dim}").fetchall()
        assert sorted((r["sign"], r["bin"], r["sentence_id"], r["position"], r["coef"]) for r in st["samples"]) \
            == sorted(smp)
        for r in st["samples"]:  # the level shown is the sample's bin: its |coef| lies in [lo, hi)
            b = r["bin"]
            hi = layout["hi"][b] if layout["hi"][b] is not None else float("inf")
            assert layout["sign"][b] == r["sign"] and layout["lo"][b] <= abs(r["coef"]) < hi
            assert ("−" in r["level"]) == (r["sign"] < 0)
        strength = [r["sign"] * r["bin"] for r in st["samples"] if r["sign"] == 1]
        assert strength == sorted(strength, reverse=True)  # strongest first
    page = client.get("/memory/1/5").text
    assert "Activation statistics" in page and 'class="hist"' in page and "Samples by activation level" in page
    bare = tmp_path / "bare"  # a run without them: no section, nothing breaks
    shutil.copytree(web_run, bare, ignore=shutil.ignore_patterns("key_*", "annotations.sqlite*"))
    as_older_run(bare)
    c = TestClient(create_app(bare, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")
    assert c.get("/api/memory/1/5").json()["stats"] is None
    r = c.get("/memory/1/5")
    assert r.status_code == 200 and "Activation statistics" not in r.text


def test_a_run_with_only_mine(web_run, tmp_path):
    """Runs made with `ffkv mine` alone (or older runs): every page works, showing what there is."""
    import shutil

    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    run = tmp_path / "mine-only"
    run.mkdir()
    for name in ("manifest.json", "sentences.parquet", "triggers.parquet", "vocab.parquet"):
        shutil.copy(web_run / name, run / name)
    as_older_run(run)
    c = TestClient(create_app(run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")
    for url in ("/", "/memory/1/5", "/memory/1/5?top=50&annotate_sign=-1", "/search", "/search?sort=precision",
                "/search?text=river", "/search?text=the&mode=token", "/annotations", "/sentence/3",
                "/api/memory/0/0", "/api/overview"):
        r = c.get(url)
        assert r.status_code == 200, (url, r.text[:500])
    m = c.get("/api/memory/1/5").json()
    assert m["values"] == {} and m["agreement"] is None and m["patterns"] == [] and m["stats"] is None
    assert all(r["badge"] is None for r in m["triggers"]["+"])  # no value distribution to rank in
    assert "needs values" in c.get("/").text


def test_navigation_sentence_and_reverify(client, web_run):
    m = client.get("/api/memory/0/0").json()
    assert m["links"]["prev"] == {"layer": 2, "dim": 79} and m["links"]["next"] == {"layer": 0, "dim": 1}
    r = client.get("/random", follow_redirects=False)
    assert r.status_code == 302 and re.fullmatch(r"/memory/\d+/\d+", r.headers["location"])
    row = m["triggers"]["+"][0]
    s = client.get(row["permalink"])
    assert s.status_code == 200 and f"Sentence {row['sentence_id']}" in s.text
    sj = client.get(f"/api/sentence/{row['sentence_id']}", params={"pos": row["position"]}).json()
    man = __import__("json").loads((web_run / "manifest.json").read_text())
    assert sj["corpus_sha256"] == man["corpus"]["sha256"] and sj["doc_id"] == row["doc_id"]
    assert any(t["layer"] == 0 and t["dim"] == 0 and t["position"] == row["position"] for t in sj["triggers"])
    v = client.get("/api/memory/0/0/reverify", params={"sign": 1, "rank": 1}).json()
    assert v["stored"] == pytest.approx(row["coef"]) and v["abs_diff"] <= 1e-4 * max(1, abs(v["stored"]))
    v = client.get("/api/memory/2/7/reverify", params={"sign": -1, "rank": 3}).json()
    assert v["stored"] < 0 and v["abs_diff"] <= 1e-4 * max(1, abs(v["stored"]))
    assert client.get("/memory/0/0/reverify?sign=1&rank=2").status_code == 200


# ---- search by text and by measure ------------------------------------------------------------------
def test_text_search_matches_a_direct_scan(client, web_run, tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    t = triggers(web_run)
    sents = sentences(web_run)
    vocab = [tok.decode([i]) for i in range(len(tok))]
    for word in ("river", "the", "script"):
        pat = re.compile(r"(?<!\w)" + re.escape(word) + r"(?!\w)", re.IGNORECASE)
        want = {}
        for r in t.itertuples():
            ids = sents[r.sentence_id][: r.position + 1]
            if pat.search("".join(vocab[i] for i in ids)):
                k = (int(r.layer), int(r.dim), int(r.sign))
                want[k] = want.get(k, 0) + 1
        res = client.get("/api/search", params={"text": word, "per_page": 500}).json()
        got = {(r["layer"], r["dim"], r["sign"]): r["n"] for r in res["results"]}
        assert res["total"] == len(want) and (len(want) <= 500 and got == want), word
        counts = [r["n"] for r in res["results"]]
        assert counts == sorted(counts, reverse=True)
    # the trigger token itself (decoded, spaces ignored, case folded)
    ids = {i for i, s in enumerate(vocab) if s.strip().casefold() == "the"}
    want = {}
    for r in t.itertuples():
        if sents[r.sentence_id][r.position] in ids:
            k = (int(r.layer), int(r.dim), int(r.sign))
            want[k] = want.get(k, 0) + 1
    res = client.get("/api/search", params={"text": "the", "mode": "token", "per_page": 500, "sort": "rank"}).json()
    assert {(r["layer"], r["dim"], r["sign"]): r["n"] for r in res["results"]} == want
    assert [r["best_rank"] for r in res["results"]] == sorted(r["best_rank"] for r in res["results"])
    assert client.get("/search", params={"text": "script", "sign": "-1"}).status_code == 200


def test_measure_search_matches_the_tables(client, web_run):
    import duckdb

    p = str(web_run)
    want = duckdb.sql(f"select layer, dim, max_prob from '{p}/values.parquet' where kind = 'value' "
                      f"order by max_prob desc, layer, dim limit 30").fetchall()
    res = client.get("/api/search", params={"sort": "max_prob", "per_page": 30}).json()
    assert [(r["layer"], r["dim"]) for r in res["results"]] == [(l, d) for l, d, _ in want]
    assert res["total"] == 240
    # precision@50 computed here from the triggers and the values tables
    prec = dict(((l, d), x) for l, d, x in duckdb.sql(f"""
        select t.layer, t.dim, avg(case when t.next_token = v.top_tokens[1] then 1.0 else 0.0 end)
        from '{p}/triggers.parquet' t join '{p}/values.parquet' v on t.layer = v.layer and t.dim = v.dim
        where v.kind = 'value' and t.sign = 1 and t.rank <= 50 group by t.layer, t.dim""").fetchall())
    res = client.get("/api/search", params={"sort": "precision", "layer": 2, "per_page": 500}).json()
    assert res["total"] == 80 and all(r["layer"] == 2 for r in res["results"])
    for r in res["results"]:
        assert r["precision"] == pytest.approx(prec[(r["layer"], r["dim"])], abs=1e-6)
    vals = [r["precision"] for r in res["results"]]
    assert vals == sorted(vals, reverse=True)
    lab = client.get("/api/search", params={"sort": "coverage", "label": "shallow", "per_page": 500}).json()
    pk = duckdb.sql(f"select count(*) from '{p}/pattern_keys.parquet' where sign = 1 and label = 'shallow'").fetchall()
    assert lab["total"] == pk[0][0] and all(r["label"] == "shallow" for r in lab["results"])
    ag = client.get("/api/search", params={"sort": "agreement", "agree": "no", "per_page": 5}).json()
    assert all(r["agree"] is False for r in ag["results"])
    assert client.get("/search", params={"sort": "precision", "order": "asc", "page": 2, "per_page": 10}).status_code == 200


# ---- overview and annotation --------------------------------------------------------------------------
def test_overview(client, web_run, tmp_path):
    import shutil

    import duckdb
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    ov = client.get("/api/overview").json()
    assert ov["layers"] == 3 and ov["d_m"] == 80 and ov["mined"] == 240 and ov["triggers"] == 12000
    ag = duckdb.sql(f"select layer, agreement from '{web_run}/values_layers.parquet' order by layer").fetchall()
    assert [r["agreement"]["agreement"] for r in ov["rows"]] == pytest.approx([a for _, a in ag])
    f2 = duckdb.sql(f"select layer, shallow from '{web_run}/patterns_fig2.parquet' where scope = 'all' "
                    f"order by layer").fetchall()
    assert [r["patterns"]["shallow"] for r in ov["rows"]] == pytest.approx([s for _, s in f2])
    act = duckdb.sql(f"select layer, active_mean from '{web_run}/compose_layers.parquet' where lens = "
                     f"'{ov['lens']}' order by layer").fetchall()
    assert [r["active"]["mean"] for r in ov["rows"]] == pytest.approx([a for _, a in act])
    if (web_run / "key_stats.parquet").exists():  # without compose, the active share is key_stats' density
        bare = tmp_path / "no-compose"
        shutil.copytree(web_run, bare, ignore=shutil.ignore_patterns("compose_*", "annotations.sqlite*"))
        as_older_run(bare)
        c = TestClient(create_app(bare, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")
        act = duckdb.sql(f"select layer, avg(frac_active) from '{web_run}/key_stats.parquet' where sign = 1 "
                         f"group by layer order by layer").fetchall()
        rows = c.get("/api/overview").json()["rows"]
        assert [r["active"]["mean"] for r in rows] == pytest.approx([a for _, a in act], rel=1e-5)
    page = client.get("/")
    assert page.status_code == 200 and page.text.count("<tr>") >= 3


def annotation_form(annotator, sign=1, desc="dates", kind="shallow", prefixes=(0, 1, 2), note=""):
    data = {"annotator": annotator, "sign": str(sign), "note": note, "p0_description": desc, "p0_kind": kind,
            "p0_prefixes": [str(i) for i in prefixes], "p1_description": "", "p2_description": ""}
    return data


def test_annotation_form_round_trip_and_fig2(client, web_run):
    from ffkv.store.annotations import AnnotationStore

    origin = {"Origin": "http://127.0.0.1:8000"}
    before = client.get("/api/annotations").json()
    n_before = len(before["annotations"])
    r = client.post("/memory/2/11/annotate", data=annotation_form("ann-form", prefixes=(0, 3, 4)),
                    headers=origin, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/memory/2/11")
    assert "ffkv_annotator=ann-form" in r.headers["set-cookie"] and "samesite=strict" in r.headers["set-cookie"].lower()
    st = AnnotationStore(web_run)
    rec = st.get("ann-form", 2, 11)
    assert rec["patterns"] == [{"description": "dates", "kind": "shallow", "prefixes": [0, 3, 4]}]
    from fastapi.testclient import TestClient

    page = TestClient(client.app, base_url="http://127.0.0.1:8000",
                      cookies={"ffkv_annotator": "ann-form"}).get("/memory/2/11").text
    assert "ann-form" in page and "dates" in page
    assert re.search(r'name="p0_prefixes" value="3"[^>]*checked', page)  # the form shows the saved ticks
    stats = client.get("/api/annotations").json()
    assert len(stats["annotations"]) == n_before + 1
    assert stats["stats"]["fig2"] == AnnotationStore(web_run).stats()["fig2"]
    layer2 = next(r for r in stats["stats"]["fig2"] if r["layer"] == 2)
    old2 = next((r for r in (before["stats"] or {}).get("fig2") or [] if r["layer"] == 2), {"annotations": 0})
    assert layer2["annotations"] == old2["annotations"] + 1
    assert "ann-form" in client.get("/annotations").text
    # invalid input: 422, the form again with the message, nothing written
    for bad, needle in ((annotation_form("x-bad", kind=""), "kind must be shallow or semantic"),
                        (annotation_form("x-bad", prefixes=(0, 30)), "outside"),
                        (annotation_form("", prefixes=(1,)), "annotator"),
                        (annotation_form("x-bad", desc="", prefixes=()) | {"p0_prefixes": ["a"]}, "not an integer"),
                        (annotation_form("x-bad", note="n" * 6000), "note")):
        r = client.post("/memory/2/11/annotate", data=bad, headers=origin)
        assert r.status_code == 422 and needle in r.text, (needle, r.text[:300])
        no_traceback(r.text)
    assert st.get("x-bad", 2, 11) is None
    r = client.post("/memory/2/11/annotate", data=annotation_form("x-big", desc="d" * 300_000), headers=origin)
    assert r.status_code == 413 and st.get("x-big", 2, 11) is None
    # the JSON API
    r = client.post("/api/memory/1/2/annotations", headers=origin,
                    json={"annotator": "ann-json", "sign": -1, "patterns": [
                        {"description": "years", "kind": "semantic", "prefixes": [0, 1]}]})
    assert r.status_code == 201 and r.json()["saved"]["sign"] == -1
    assert st.get("ann-json", 1, 2, sign=-1)["patterns"][0]["kind"] == "semantic"
    r = client.post("/api/memory/1/2/annotations", headers=origin, json={"annotator": "a", "patterns": "x"})
    assert r.status_code == 422 and "patterns" in r.json()["detail"]


def test_cross_origin_posts_are_refused(client, web_run):
    from ffkv.store.annotations import AnnotationStore

    form = annotation_form("evil")
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Origin": "http://127.0.0.1:9999"}, {"Referer": "http://evil.example/page"},
                    {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:8000"}):
        r = client.post("/memory/0/1/annotate", data=form, headers=headers, follow_redirects=False)
        assert r.status_code == 403, headers
        r = client.post("/api/memory/0/1/annotations", headers=headers,
                        json={"annotator": "evil", "patterns": []})
        assert r.status_code == 403, headers
        r = client.post("/index/build", headers=headers, follow_redirects=False)
        assert r.status_code == 403
    assert AnnotationStore(web_run).get("evil", 0, 1) is None
    # GETs that load the model or build the index: not as another site's subresource, but a
    # shared link (a top-level navigation) still opens
    for url in ("/memory/0/1/reverify", "/api/memory/0/1/reverify", "/search?token=the", "/api/search?token=the"):
        r = client.get(url, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"})
        assert r.status_code == 403, url
    r = client.get("/search?sort=max_prob", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})
    assert r.status_code == 200
    # DNS rebinding: another Host name is refused before any route runs
    r = client.get("/", headers={"Host": "evil.example"})
    assert r.status_code == 400
    # a GET never writes
    assert client.get("/memory/0/1/annotate").status_code == 405


# ---- errors and static files ------------------------------------------------------------------------
@pytest.mark.parametrize("url, status", [
    ("/memory/3/0", 404), ("/memory/0/80", 404), ("/memory/-1/0", 404), ("/memory/0/-5", 404),
    ("/memory/abc/1", 422), ("/memory/1/1.5", 422), ("/memory/1/1?top=0", 422), ("/memory/1/1?top=x", 422),
    ("/sentence/999999", 404), ("/sentence/1?pos=9999", 404), ("/sentence/x", 422),
    ("/search?page=0", 422), ("/search?page=x", 422), ("/search?sort=bogus", 422),
    ("/search?token=the&k=0", 422), ("/search?token=the&lens=bogus", 422), ("/search?token=the&dir=up", 422),
    ("/search?text=the&mode=regex", 422), ("/search?layer=9&sort=max_prob", 422), ("/search?label=odd&sort=max_prob", 422),
    ("/search?agree=maybe&sort=max_prob", 422), ("/search?per_page=100000&sort=max_prob", 422),
    ("/search?bogus=1", 422), ("/search?token=" + "x" * 300, 422), ("/search?text=%20", 422),
    ("/no/such/page", 404), ("/static/nope.css", 404), ("/static/..%2Fapp.py", 404), ("/static/%2e%2e/data.py", 404),
    ("/report/figures/..%2F..%2Fmanifest.json", 404), ("/report/figures/x.png", 404), ("/report/", 404),
    ("/memory/0/0/reverify?rank=99", 404), ("/memory/0/0/reverify?sign=2", 422),
])
def test_error_pages_have_no_traceback(client, url, status):
    r = client.get(url)
    assert r.status_code == status, (url, r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("text/html") and r.text.startswith("<!DOCTYPE html>")
    assert "Content-Security-Policy" in r.headers
    no_traceback(r.text)
    api_url = "/api" + url if url.startswith(("/memory", "/sentence", "/search")) else None
    if api_url:
        r = client.get(api_url)
        assert r.status_code == status and r.headers["content-type"] == "application/json"
        assert set(r.json()) == {"error", "detail", "status"} and "Traceback" not in r.text


def test_api_errors_and_headers(client):
    r = client.get("/api/search")  # no query: memories by value max-probability
    assert r.status_code == 200 and r.json()["mode"] == "measure" and r.json()["sort"] == "max_prob"
    r = client.post("/api/memory/0/1/annotations", content=b"{not json", headers={"Origin": "http://127.0.0.1:8000",
                                                                                  "Content-Type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["detail"]
    r = client.post("/api/memory/0/1/annotations", json={"annotator": "a", "patterns": [], "extra": 1},
                    headers={"Origin": "http://127.0.0.1:8000"})
    assert r.status_code == 422
    r = client.post("/api/memory/9/1/annotations", json={"annotator": "a", "patterns": []},
                    headers={"Origin": "http://127.0.0.1:8000"})
    assert r.status_code == 404
    r = client.get("/memory/1/5")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "<script src=\"/static/app.js\"" in r.text and "<script>" not in r.text.replace("&lt;script&gt;", "")
    assert not re.search(r'<[^>]*\sstyle=', r.text) and not re.search(r"<[^>]*\son[a-z]+=", r.text)
    assert not re.search(r'(src|href)="(https?:)?//', r.text)  # nothing from another origin
    s = client.get("/static/style.css")
    assert s.status_code == 200 and s.headers["content-type"].startswith("text/css")


def test_payloads_are_escaped(client, web_run):
    keys = payload_keys(web_run)
    assert keys, "no payload sentence among the triggers"
    seen = 0
    for layer, dim, _ in keys[:8]:
        page = client.get(f"/memory/{layer}/{dim}", params={"top": 25}).text
        assert "<script>window" not in page and "<img src=x" not in page and "<svg onload" not in page
        assert "onerror=\"window" not in page and "' onmouseover='" not in page
        text = re.sub(r"<[^>]+>", "", page)  # the page's text, still escaped: examples are one span per token
        seen += text.count("&lt;script&gt;window.__xss") + text.count("&lt;svg onload") + text.count("&lt;img src=x")
    assert seen > 0
    r = client.get("/search", params={"text": "script"}).text
    assert "<script>window" not in r and "&lt;script&gt;" in re.sub(r"<[^>]+>", "", r)  # rows: a span per token


# ---- a real server: concurrency ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(web_app):
    with serving(web_app) as url:
        yield url


def test_200_concurrent_annotation_posts_all_persist(live, web_run):
    import httpx

    from ffkv.store.annotations import AnnotationStore

    keys = [(l, d) for l in range(3) for d in range(80)][:200]

    async def main():
        async with httpx.AsyncClient(base_url=live, timeout=120, limits=httpx.Limits(max_connections=200)) as c:
            async def post(j, key):
                return await c.post(f"/api/memory/{key[0]}/{key[1]}/annotations",
                                    headers={"Origin": live},
                                    json={"annotator": f"crowd-{j:03d}", "note": f"n{j}",
                                          "patterns": [{"description": f"p{j}", "kind": "semantic",
                                                        "prefixes": [j % 25]}]})
            return await asyncio.gather(*(post(j, k) for j, k in enumerate(keys)))

    res = asyncio.run(main())
    assert [r.status_code for r in res] == [201] * 200
    st = AnnotationStore(web_run)
    got = {(r["annotator"], r["layer"], r["dim"]): r for r in st.list() if r["annotator"].startswith("crowd-")}
    assert len(got) == 200
    for j, (l, d) in enumerate(keys):
        r = got[(f"crowd-{j:03d}", l, d)]
        assert r["note"] == f"n{j}" and r["patterns"] == [{"description": f"p{j}", "kind": "semantic",
                                                           "prefixes": [j % 25]}]


def test_50_concurrent_pages(live):
    import httpx

    urls = [f"/memory/{j % 3}/{(7 * j) % 80}" for j in range(40)] + ["/", "/search?sort=precision",
                                                                     "/search?text=river", "/annotations",
                                                                     "/search?token=the", "/api/memory/1/1",
                                                                     "/sentence/3", "/api/overview",
                                                                     "/search?text=the&mode=token", "/random"]

    async def main():
        async with httpx.AsyncClient(base_url=live, timeout=120, limits=httpx.Limits(max_connections=50)) as c:
            return await asyncio.gather(*(c.get(u, follow_redirects=True) for u in urls))

    res = asyncio.run(main())
    assert len(res) == 50 and [r.status_code for r in res] == [200] * 50


# ---- the command line ---------------------------------------------------------------------------------
def test_serve_cli(web_run, tmp_path, capsys):
    from ffkv.cli import main

    def fails(*args) -> str:
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        return err

    assert "does not exist" in fails("serve", tmp_path / "nope", "--port", free_port())
    with socket.socket() as s:  # a taken port
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert "cannot listen" in fails("serve", web_run, "--port", s.getsockname()[1])
    assert "--port" in fails("serve", web_run, "--port", 70000)
    port = free_port()  # a real server (on loopback: beyond it needs --allow-remote, tests/test_server_hardening.py)
    p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", "serve", str(web_run), "--port", str(port)],
                         stderr=subprocess.DEVNULL, text=True)
    try:
        import httpx

        for _ in range(600):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert r.status_code == 200 and "Layers" in r.text
    finally:
        p.terminate()
        p.wait(10)


def test_the_server_never_writes_the_runs_tables(web_run, client):
    """Run last: every test above used the server; the Parquet tables are as `ffkv` wrote them
    (an index the server builds lives in memory only: `memory_client`)."""
    client.get("/search", params={"token": "the"})
    assert parquet_digest(web_run) == _BUILT["digest"]  # the same files, byte for byte


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.sampled_from([1, -1]), st.integers(0, 2**31 - 1))
def test_top_rows_brute_force_with_ties(C, k, sign, seed):
    """_top_rows on sign·z, for small integer logits (ties everywhere), equals counting."""
    import torch

    from ffkv.memories.value_index import _top_rows

    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-3, 4, (C, 13), generator=g).float()
    row, tok, rank, logit = _top_rows(z, k, sign=sign)
    zz = sign * z
    want = set()
    for r in range(C):
        for w in range(zz.shape[1]):
            rk = int((zz[r] > zz[r, w]).sum())
            if rk < k:
                want.add((r, w, rk, float(zz[r, w])))
    got = set(zip(row.tolist(), tok.tolist(), rank.tolist(), logit.tolist()))
    assert got == want and len(got) == len(row)
    # from a longer top list the caller already has (the values step's top-k): the same rows
    vals, idx = zz.topk(min(k + 3, 13), dim=-1)
    row, tok, rank, logit = _top_rows(z, k, sign=sign, top=(vals, idx))
    got = set(zip(row.tolist(), tok.tolist(), rank.tolist(), logit.tolist()))
    assert got == want and len(got) == len(row)


def test_token_index_same_from_a_shuffled_table(llama):
    """The stored order lets TokenIndex skip a sort; any other row order gives the same lookups."""
    from ffkv.memories.value_index import build_index
    from ffkv.model.memories import open_model
    from ffkv.web.data import TokenIndex

    mm = open_model(str(llama), device="cpu")
    t = build_index(mm, k=5)
    perm = np.random.default_rng(0).permutation(t.num_rows)
    a, b = TokenIndex(t, mm.d_m, "run"), TokenIndex(t.take(perm), mm.d_m, "run")
    assert a.parts.keys() == b.parts.keys()
    for key in a.parts:
        for c in ("token", "rank", "mem", "tok_sorted"):
            assert np.array_equal(a.parts[key][c], b.parts[key][c]), (key, c)
        pa_, pb = a.parts[key], b.parts[key]
        assert np.array_equal(pa_["mem"][pa_["by_token"]], pb["mem"][pb["by_token"]])
        assert np.array_equal(pa_["rank"][pa_["by_token"]], pb["rank"][pb["by_token"]])


def test_serve_loads_the_model_before_the_first_explorer_request(web_run, tmp_path):
    """`ffkv serve` loads the model in the background as it starts (issue 26): its log says so
    while no request but the overview's has been made; the explorer then answers at once."""
    import httpx

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", "serve", str(web_run), "--port", str(port)],
                             stderr=err, stdout=subprocess.DEVNULL, text=True)
    try:
        for _ in range(1200):
            if "model loaded in" in log.read_text():
                break
            assert p.poll() is None, log.read_text()
            time.sleep(0.1)
        assert "model loaded in" in log.read_text(), log.read_text()
        r = httpx.get(f"http://127.0.0.1:{port}/api/explore", params={"text": "The river"}, timeout=60)
        assert r.status_code == 200 and log.read_text().count("model loaded in") == 1
    finally:
        p.terminate()
        p.wait(10)
