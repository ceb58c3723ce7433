"""The census in the browser (issue 46, item 4): `?class=NAME[,NAME…]` on search and layer lists
(HTML, JSON, CSV), each layer's class mix, and one-line 422s for a run without a census or an
unknown class.

A tiny Llama with one memory forced dead (its gate row zeroed), mined on 40 WikiText-2 sentences,
copied before the census (the bare run), then censused. Every expected set is read here from
census.parquet and census_layers.parquet with pyarrow, not through the browser's code."""
from __future__ import annotations

import csv
import io

import pyarrow.parquet as pq
import pytest

from conftest import all_search, browser_client, mine_tiny, step_and_bare, tiny_with_a_dead_memory

DEAD = (1, 7)  # (layer, dim) whose gate row is zeroed: dead on every token
FLAGS = ("dead", "rare", "prediction", "suppression", "partition", "token_detector", "ngram_detector",
         "self_suppressing", "positional")
IO = ("enrichment", "depletion", "conditional_enrichment", "conditional_depletion", "proportional_change",
      "orthogonal_output")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tok_dir):
    root = tmp_path_factory.mktemp("web-census")
    path, _ = tiny_with_a_dead_memory(root / "llama", tok_dir, DEAD)
    return step_and_bare(mine_tiny(root / "mined", path, 40, 5, "--negative"), root, "census")


_client = browser_client


@pytest.fixture(scope="module")
def client(runs):
    return _client(runs[0])


@pytest.fixture(scope="module")
def bare_client(runs):
    return _client(runs[1])


@pytest.fixture(scope="module")
def members(runs) -> dict[str, set]:
    """class -> {(layer, dim)} of its memories, from census.parquet: a flag that is true, or io_class."""
    rows = pq.read_table(runs[0] / "census.parquet").to_pylist()
    out = {c: {(r["layer"], r["dim"]) for r in rows if r[c] is True} for c in FLAGS}
    out.update({c: {(r["layer"], r["dim"]) for r in rows if r["io_class"] == c} for c in IO})
    return out


@pytest.fixture(scope="module")
def mined(runs) -> set:
    t = pq.read_table(runs[0] / "triggers.parquet", columns=["layer", "dim"])
    return set(zip(t.column("layer").to_pylist(), t.column("dim").to_pylist()))


def _layers(runs) -> int:
    return len(pq.read_table(runs[0] / "census_layers.parquet"))


def _keys(rows) -> set:
    return {(int(r["layer"]), int(r["dim"])) for r in rows}


_all_search = all_search


def test_the_tiny_run_has_classes_to_filter(members):
    assert DEAD in members["dead"]
    assert sum(1 for c in members if members[c]) >= 3  # dead and at least two io classes


def test_layer_lists_hold_exactly_the_class(client, runs, members):
    for layer in range(_layers(runs)):
        for c, keys in members.items():
            want = {k for k in keys if k[0] == layer}
            d = client.get(f"/api/layer/{layer}?class={c}&per_page=1000").json()
            assert d["class"] == [c]
            assert _keys(d["memories"]["rows"]) == want, (layer, c)
            assert d["memories"]["total"] == len(want)
            assert all(_keys([r]) <= want for r in d["best"]["sharpness"] or [])
    # a comma-separated list means any of them, in the census's order
    d = client.get("/api/layer/1?class=orthogonal_output,dead&per_page=1000").json()
    assert d["class"] == ["dead", "orthogonal_output"]
    assert _keys(d["memories"]["rows"]) == {k for k in members["dead"] | members["orthogonal_output"] if k[0] == 1}
    # the HTML list: the heading, one row per member, the downloads keep the filter
    r = client.get("/layer/1?class=dead")
    assert r.status_code == 200 and 'id="class-filter"' in r.text
    assert r.text.count(f'<tr data-dim="{DEAD[1]}"><td><a href="/memory/1/{DEAD[1]}">') == 1
    assert "/layer/1?class=dead&format=csv" in r.text.replace("&amp;", "&")


def test_layer_class_mix_counts_and_links(client, runs, members):
    lt = {r["layer"]: r for r in pq.read_table(runs[0] / "census_layers.parquet").to_pylist()}
    for layer in range(_layers(runs)):
        mix = client.get(f"/api/layer/{layer}").json()["census"]["classes"]
        assert [m["class"] for m in mix] == list(FLAGS[:5] + IO + FLAGS[5:])
        for m in mix:
            assert m["count"] == sum(1 for k in members[m["class"]] if k[0] == layer), m
            share = lt[layer][m["class"]]
            assert (m["share"] is None) if share is None else m["share"] == pytest.approx(share)
        html = client.get(f"/layer/{layer}").text
        for m in mix:  # each count links to its list
            assert f'<a href="/layer/{layer}?class={m["class"]}#memories">{m["count"]}</a>' in html


def test_layer_downloads_carry_the_filter(client, members):
    want = {k for k in members["dead"] | members["enrichment"] if k[0] == 1}
    r = client.get("/layer/1?class=dead,enrichment&format=csv")
    assert r.status_code == 200 and "dead-enrichment" in r.headers["content-disposition"]
    assert _keys(csv.DictReader(io.StringIO(r.text))) == want
    j = client.get("/layer/1?class=dead,enrichment&format=json").json()
    assert _keys(j["rows"]) == want


def test_measure_search_filters_and_composes(client, members, mined):
    for c in ("dead", "enrichment", "orthogonal_output", "prediction"):
        rows = _all_search(client, f"sort=layer&class={c}")
        assert _keys(rows) == members[c] & mined, c  # the measure list holds mined memories
        one = _all_search(client, f"sort=layer&layer=1&class={c}")
        assert _keys(one) == {k for k in members[c] & mined if k[0] == 1}
    # with ?pos0=hide: the first-position-free list cut to the class
    both = _keys(_all_search(client, "sort=layer&class=enrichment,depletion&pos0=hide"))
    assert both == _keys(_all_search(client, "sort=layer&pos0=hide")) & (members["enrichment"] | members["depletion"])
    # the HTML page: a class menu, the filter line, the pages keep it
    r = client.get("/search?sort=layer&class=enrichment&per_page=5")
    assert r.status_code == 200 and 'id="class-filter"' in r.text and 'name="class"' in r.text
    if len(members["enrichment"] & mined) > 5:
        assert "class=enrichment" in r.text.split('rel="next"')[0].rsplit("<a", 1)[1]


def test_text_and_summary_search_filter(client, members):
    allc = members["enrichment"] | members["dead"]
    for q in ("text=the", "text=the&mode=token", "text=the&sign=1"):
        full = _all_search(client, q)
        cut = _all_search(client, q + "&class=dead,enrichment")
        assert cut == [r for r in full if (r["layer"], r["dim"]) in allc], q
    full = _all_search(client, "text=the&mode=summary")
    cut = _all_search(client, "text=the&mode=summary&class=enrichment")
    assert _keys(cut) == _keys(full) & members["enrichment"]


def test_token_search_filter(client, members):
    client.app.state.browser.wait_index(120)
    full = _all_search(client, "token=the&k=20")
    assert full
    cut = _all_search(client, "token=the&k=20&class=orthogonal_output")
    assert cut == [r for r in full if (r["layer"], r["dim"]) in members["orthogonal_output"]]


def test_search_downloads_carry_the_filter(client, members, mined):
    want = members["orthogonal_output"] & mined
    r = client.get("/search?sort=layer&class=orthogonal_output&format=csv")
    assert r.status_code == 200
    assert _keys(csv.DictReader(io.StringIO(r.text))) == want
    j = client.get("/search?sort=layer&class=orthogonal_output&format=json").json()
    assert _keys(j["rows"]) == want


def test_pages_without_class_are_unchanged(client, bare_client):
    """The censused run and its copy from before the census list the same memories without `class`."""
    for url in ("/api/layer/1?per_page=1000", "/api/layer/0?pos0=hide&per_page=1000"):
        a, b = client.get(url).json(), bare_client.get(url).json()
        assert a["memories"] == b["memories"] and a["best"] == b["best"] and a["class"] == b["class"] == []
        assert b["census"] is None and a["census"] is not None
    for q in ("sort=layer", "text=the", "sort=max_prob&pos0=hide"):
        assert _all_search(client, q) == _all_search(bare_client, q)
    for url in ("/layer/1?format=csv", "/search?sort=layer&format=csv"):  # the census's columns added after
        a = list(csv.DictReader(io.StringIO(client.get(url).text)))
        b = list(csv.DictReader(io.StringIO(bare_client.get(url).text)))
        assert len(a) == len(b) and [{k: r[k] for k in rb} for r, rb in zip(a, b)] == b
        assert all(k.startswith("census.") for k in set(a[0]) - set(b[0])) and len(a[0]) > len(b[0])
    html = bare_client.get("/layer/1").text  # no census: no class mix, no filter link
    assert "?class=" not in html and "&amp;class=" not in html and 'id="census"' not in html
    assert 'name="class"' not in bare_client.get("/search?sort=layer").text


@pytest.mark.parametrize("url", ["/layer/1?class=dead", "/api/layer/1?class=dead", "/layer/1?class=dead&format=csv",
                                 "/search?sort=layer&class=dead", "/api/search?text=the&class=dead",
                                 "/search?sort=layer&class=dead&format=json"])
def test_no_census_is_one_line(bare_client, url):
    r = bare_client.get(url)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"] if url.startswith("/api/") else r.text
    assert "this run has no census: run `ffkv census RUN`" in detail
    assert "Traceback" not in r.text


@pytest.mark.parametrize("url", ["/layer/1?class=zombie", "/api/layer/1?class=dead,zombie",
                                 "/api/search?sort=layer&class=token detector", "/search?sort=layer&class=zombie"])
def test_unknown_class_lists_the_valid_names(client, url):
    r = client.get(url)
    assert r.status_code == 422, r.text
    text = r.json()["detail"] if url.startswith("/api/") else r.text
    assert "class must be one of dead, rare, prediction" in text and "positional" in text
    assert "\n" not in r.json()["detail"] if url.startswith("/api/") else "Traceback" not in text
