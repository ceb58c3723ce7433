"""Worth in the browser (issue 48, item 6): layer lists sort by it (`?sort=worth`, the largest first)
and filter by it (`?min_worth=X`), and search finds memories by it (`?min_worth=X` on every search,
`sort=worth` on the measure, token and text searches), in the pages, their JSON and their CSV; a run
without `ffkv worth` gets a one-line 422 naming it.

A tiny Llama mined on 30 sentences, copied before `ffkv worth` (the bare run) and after it. Every
expected order is read here from memory_worth.parquet with pyarrow and sorted by hand (worth
descending, then layer and dim), not through the browser's code."""
from __future__ import annotations

import csv
import io
import re

import pyarrow.parquet as pq
import pytest

from conftest import browser_client, step_and_bare

LAYER = 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dirs, reference_mine):
    return step_and_bare(reference_mine(tiny_dirs["llama"], 30, 3), tmp_path_factory.mktemp("worth-web"),
                         "worth", "--tokens", "120", "--check", "0")


_client = browser_client


@pytest.fixture(scope="module")
def client(runs):
    return _client(runs[0])


@pytest.fixture(scope="module")
def worth(runs) -> dict[tuple[int, int], float]:
    t = pq.read_table(runs[0] / "memory_worth.parquet", columns=["layer", "dim", "worth"]).to_pylist()
    return {(r["layer"], r["dim"]): r["worth"] for r in t}


@pytest.fixture(scope="module")
def mined(runs) -> set:
    t = pq.read_table(runs[0] / "triggers.parquet", columns=["layer", "dim"])
    return set(zip(t.column("layer").to_pylist(), t.column("dim").to_pylist()))


def by_worth(keys, worth) -> list[tuple[int, int]]:
    return sorted(keys, key=lambda k: (-worth[k], k))


def test_layer_list_sorted_by_worth(client, worth, mined):
    want = by_worth([k for k in worth if k[0] == LAYER and k in mined], worth)
    assert len(want) > 20 and len({worth[k] for k in want}) > 20  # distinct worths: the order means something
    j = client.get(f"/api/layer/{LAYER}", params={"sort": "worth", "per_page": "1000"}).json()
    assert j["sort"] == "worth" and j["has_worth"]
    got = [(r["layer"], r["dim"]) for r in j["memories"]["rows"]]
    assert got == want
    assert [r["worth"] for r in j["memories"]["rows"]] == [worth[k] for k in want]
    # paged: page 2 of 10 continues the order, and its links keep sort=worth
    p2 = client.get(f"/api/layer/{LAYER}", params={"sort": "worth", "per_page": "10", "page": "2"}).json()
    assert [(r["layer"], r["dim"]) for r in p2["memories"]["rows"]] == want[10:20]
    page = client.get(f"/layer/{LAYER}", params={"sort": "worth", "per_page": "10"})
    assert page.status_code == 200
    dims = [int(d) for d in re.findall(r'<tr data-dim="(\d+)"><td><a href="/memory/', page.text)]
    assert dims[-10:] == [d for _, d in want[:10]]  # the list is the page's last table
    assert "sort=worth#memories\" rel=\"next\"" in page.text.replace("&amp;", "&")
    assert 'class="num worth"' in page.text and 'id="layer-sort"' in page.text
    # the default stays by dim, with each row's worth
    d = client.get(f"/api/layer/{LAYER}", params={"per_page": "1000"}).json()
    assert [r["dim"] for r in d["memories"]["rows"]] == sorted(k[1] for k in want)
    assert all(r["worth"] == worth[(r["layer"], r["dim"])] for r in d["memories"]["rows"])
    # the CSV: the same order, a worth column
    rows = list(csv.DictReader(io.StringIO(client.get(f"/layer/{LAYER}", params={"sort": "worth",
                                                                                  "format": "csv"}).text)))
    assert [(int(r["layer"]), int(r["dim"])) for r in rows] == want
    assert [float(r["worth"]) for r in rows] == pytest.approx([worth[k] for k in want], rel=1e-9)


def _all(client, **params) -> list[dict]:
    rows, page = [], 1
    while True:
        j = client.get("/api/search", params={**params, "page": str(page), "per_page": "500"}).json()
        rows += j["results"]
        if page * 500 >= j["total"]:
            return rows
        page += 1


def test_search_by_worth(client, worth, mined):
    # the measure search sorted by worth: every mined memory, the largest first
    got = _all(client, sort="worth")
    assert [(r["layer"], r["dim"]) for r in got] == by_worth(mined, worth)
    assert [r["worth"] for r in got] == [worth[(r["layer"], r["dim"])] for r in got]
    asc = client.get("/api/search", params={"sort": "worth", "order": "asc", "per_page": "5"}).json()["results"]
    assert [(r["layer"], r["dim"]) for r in asc] == sorted(mined, key=lambda k: (worth[k], k))[:5]
    # min_worth: a floor at the 20th largest keeps exactly those 20 (the measure search, in a layer too)
    top = by_worth(mined, worth)
    floor = worth[top[19]]
    got = _all(client, sort="worth", min_worth=repr(floor))
    assert [(r["layer"], r["dim"]) for r in got] == top[:20]
    got = _all(client, layer=str(LAYER), min_worth=repr(floor))  # default order (max p), the same set
    assert {(r["layer"], r["dim"]) for r in got} == {k for k in top[:20] if k[0] == LAYER}
    # … and on the text search: the memories with a trigger there and worth at least the floor
    text = _all(client, text="e", mode="token")
    kept = _all(client, text="e", mode="token", min_worth=repr(floor))
    assert kept and {(r["layer"], r["dim"]) for r in kept} == {
        (r["layer"], r["dim"]) for r in text if worth[(r["layer"], r["dim"])] >= floor}
    # the page: a worth column, sortable, and the filter said with a way back
    page = client.get("/search", params={"sort": "worth", "min_worth": repr(floor)})
    assert page.status_code == 200 and 'id="worth-filter"' in page.text and 'class="num worth"' in page.text
    assert '<option value="worth" selected>' in page.text
    csv_rows = list(csv.DictReader(io.StringIO(client.get("/search", params={
        "sort": "worth", "min_worth": repr(floor), "format": "csv"}).text)))
    assert [(int(r["layer"]), int(r["dim"])) for r in csv_rows] == top[:20] and "worth" in csv_rows[0]


def test_layer_list_filtered_by_worth(client, worth, mined):
    listed = [k for k in worth if k[0] == LAYER and k in mined]
    floor = sorted(worth[k] for k in listed)[len(listed) // 2]  # the median: one memory sits on it
    want = sorted(k for k in listed if worth[k] >= floor)
    assert 0 < len(want) < len(listed)
    j = client.get(f"/api/layer/{LAYER}", params={"min_worth": repr(floor), "per_page": "1000"}).json()
    assert j["min_worth"] == floor and [(r["layer"], r["dim"]) for r in j["memories"]["rows"]] == want
    assert {(r["layer"], r["dim"]) for r in j["best"]["sharpness"] or []} <= set(want)
    # with sort=worth: the same memories, the largest first
    j = client.get(f"/api/layer/{LAYER}", params={"min_worth": repr(floor), "sort": "worth", "per_page": "1000"}).json()
    assert [(r["layer"], r["dim"]) for r in j["memories"]["rows"]] == by_worth(want, worth)
    # the page: the filter said with a way back, a form, its links and downloads keep it
    page = client.get(f"/layer/{LAYER}", params={"min_worth": repr(floor), "sort": "worth", "per_page": "5"})
    assert page.status_code == 200 and 'id="worth-filter"' in page.text and 'name="min_worth"' in page.text
    html = page.text.replace("&amp;", "&")
    assert f'href="/layer/{LAYER}?sort=worth#memories">any worth</a>' in html
    assert f"/layer/{LAYER}?min_worth={floor!r}&sort=worth&format=csv" in html
    assert f"min_worth={floor!r}&sort=worth#memories\" rel=\"next\"" in html
    rows = list(csv.DictReader(io.StringIO(client.get(f"/layer/{LAYER}", params={
        "min_worth": repr(floor), "sort": "worth", "format": "csv"}).text)))
    assert [(int(r["layer"]), int(r["dim"])) for r in rows] == by_worth(want, worth)
    j = client.get(f"/layer/{LAYER}", params={"min_worth": repr(floor), "format": "json"}).json()
    assert sorted((r["layer"], r["dim"]) for r in j["rows"]) == want


def test_token_and_text_search_sorted_by_worth(client, worth):
    """sort=worth on the token search (then by rank, layer, dim) and on the text searches (then by
    layer, dim and list, + first), both directions; each row carries its memory's worth."""
    client.app.state.browser.wait_index(120)
    full = _all(client, token="the", k="20")
    assert len({(r["layer"], r["dim"]) for r in full}) > 5
    got = _all(client, token="the", k="20", sort="worth")
    assert got == sorted(full, key=lambda r: (-worth[(r["layer"], r["dim"])], r["rank"], r["layer"], r["dim"]))
    asc = _all(client, token="the", k="20", sort="worth", order="asc")
    assert asc == sorted(full, key=lambda r: (worth[(r["layer"], r["dim"])], r["rank"], r["layer"], r["dim"]))
    for q in ({"text": "the"}, {"text": "e", "mode": "token"}):  # the text index's path and DuckDB's
        full = _all(client, **q)
        assert len(full) > 5 and all(r["worth"] == worth[(r["layer"], r["dim"])] for r in full)
        for order, s in (("desc", -1), ("asc", 1)):
            got = _all(client, **q, sort="worth", order=order)
            assert got == sorted(full, key=lambda r: (s * worth[(r["layer"], r["dim"])], r["layer"], r["dim"],
                                                      -r["sign"])), (q, order)
    full = _all(client, text="the", mode="summary")
    got = _all(client, text="the", mode="summary", sort="worth")
    assert [(r["layer"], r["dim"]) for r in got] == by_worth([(r["layer"], r["dim"]) for r in full], worth)
    # the pages: worth is a sort link of the token and text tables
    for params in ({"token": "the", "k": "20"}, {"text": "the"}, {"text": "the", "mode": "summary", "sort": "worth"}):
        page = client.get("/search", params=params)
        assert page.status_code == 200 and 'class="num worth"' in page.text
        assert re.search(r'<a class="sort[^"]*" href="/search\?[^"]*sort=worth[^"]*">worth', page.text), params
    csv_rows = list(csv.DictReader(io.StringIO(client.get("/search", params={
        "text": "the", "sort": "worth", "format": "csv"}).text)))
    assert [float(r["worth"]) for r in csv_rows] == sorted((float(r["worth"]) for r in csv_rows), reverse=True)


@pytest.mark.parametrize("path, params, msg", [
    ("/api/layer/1", {"sort": "size"}, "sort must be dim or worth"),
    ("/api/layer/1", {"min_worth": "abc"}, "min_worth must be a finite number"),
    ("/api/search", {"token": "the", "sort": "size"},
     "sort must be one of prob, rank, max_prob, precision, layer, worth"),
    ("/api/search", {"min_worth": "abc"}, "min_worth must be a finite number"),
    ("/api/search", {"min_worth": "nan"}, "min_worth must be a finite number"),
    ("/api/search", {"min_worth": "1" * 5000}, "min_worth must be a finite number"),
])
def test_bad_worth_parameters_are_one_line(client, path, params, msg):
    r = client.get(path, params=params)
    assert r.status_code == 422 and msg in r.json()["detail"], r.text


def test_odd_worth_values_never_500(client):
    for v in ("0", "-1", "1e308", "-1e308", "inf", "0x10", "1.5", " 1 ", "", "١", "1_000", "-0", "1E-3", "𝟙", "-"):
        for path, name in (("/api/search", "min_worth"), ("/api/layer/0", "sort"), ("/search", "min_worth"),
                           ("/api/layer/0", "min_worth"), ("/layer/0", "min_worth")):
            r = client.get(path, params={name: v})
            assert r.status_code in (200, 422), (path, name, v, r.text)


@pytest.mark.parametrize("path, params", [
    ("/api/layer/1", {"sort": "worth"}), ("/layer/1", {"sort": "worth"}),
    ("/layer/1", {"sort": "worth", "format": "csv"}),
    ("/api/search", {"sort": "worth"}), ("/search", {"sort": "worth"}), ("/api/search", {"min_worth": "0"}),
    ("/api/search", {"text": "e", "mode": "token", "min_worth": "0"}), ("/search", {"min_worth": "0.1"}),
    ("/api/layer/1", {"min_worth": "0"}), ("/layer/1", {"min_worth": "0"}),
    ("/layer/1", {"min_worth": "0", "format": "csv"}),
    ("/api/search", {"token": "the", "sort": "worth"}), ("/search", {"token": "the", "sort": "worth"}),
    ("/api/search", {"text": "the", "sort": "worth"}), ("/api/search", {"text": "e", "mode": "token", "sort": "worth"}),
    ("/api/search", {"text": "the", "mode": "summary", "sort": "worth"}),
])
def test_a_run_without_worth_is_one_line(runs, path, params):
    c = _client(runs[1])
    r = c.get(path, params=params)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"] if path.startswith("/api/") else r.text
    assert "run `ffkv worth RUN`" in detail and "Traceback" not in detail
    # without the table the pages stay as they were: no worth column, no worth in the sort menu
    assert "worth" not in c.get("/api/layer/1").json()["memories"]["rows"][0]
    page = c.get("/search")
    assert '<option value="worth"' not in page.text and 'name="min_worth"' not in page.text
    assert 'name="min_worth"' not in c.get("/layer/1").text
