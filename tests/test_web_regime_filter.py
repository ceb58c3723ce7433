"""`?regime=NAME[,NAME…]` (and `?min_regime_share=X`) on every search and on layer lists (issue 46,
item 4: "search and layer lists filter by class", here the sign regimes of GLUScope's four (gate sign,
input sign) combinations), in the pages, their JSON and their CSV/JSON downloads; one-line 422s for an
unknown regime, a run without a census or without regimes.

A tiny Llama mined on 30 WikiText-2 sentences with --regimes (the session's `reference_mine`), copied
before the census (the bare run), then censused and given `ffkv worth`; and the plain mined run
(no --regimes) censused: a census without regimes. Every expected set is read here from
census.parquet and memory_worth.parquet with pyarrow and filtered by hand, not through the browser's
code: the dominant regime is the census's `regime` column, a share the sum of the named regime_*
columns in float64."""
from __future__ import annotations

import csv
import io
import math
import shutil

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import all_search, browser_client, run_cli, step_and_bare

CODES = ("pp", "pn", "np", "nn")  # (gate sign, input sign): ++, +−, −+, −−
SIGNS = {"pp": "(+,+)", "pn": "(+,-)", "np": "(-,+)", "nn": "(-,-)"}
NO_REGIMES = "`ffkv mine --regimes`"
NO_CENSUS = "run `ffkv census RUN`"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dirs, reference_mine):
    """(censused with regimes and worth, bare: mined with --regimes, no census)."""
    run, bare = step_and_bare(reference_mine(tiny_dirs["llama"], 30, 3, "--regimes"),
                              tmp_path_factory.mktemp("regime-web"), "census")
    r = run_cli("worth", run, "--tokens", "120", "--check", "0")
    assert r.returncode == 0, r.stderr
    return run, bare


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_dirs, reference_mine):
    """A run mined without --regimes, censused: its regime columns are all null."""
    run = tmp_path_factory.mktemp("regime-plain") / "run"
    shutil.copytree(reference_mine(tiny_dirs["llama"], 30, 3), run)
    r = run_cli("census", run)
    assert r.returncode == 0, r.stderr
    return run


@pytest.fixture(scope="module")
def client(runs):
    return browser_client(runs[0])


@pytest.fixture(scope="module")
def census(runs) -> dict[tuple[int, int], dict]:
    cols = ["layer", "dim", "regime", *(f"regime_{c}" for c in CODES)]
    return {(r["layer"], r["dim"]): r for r in pq.read_table(runs[0] / "census.parquet", columns=cols).to_pylist()}


@pytest.fixture(scope="module")
def worth(runs) -> dict[tuple[int, int], float]:
    t = pq.read_table(runs[0] / "memory_worth.parquet", columns=["layer", "dim", "worth"]).to_pylist()
    return {(r["layer"], r["dim"]): r["worth"] for r in t}


def dominant(census, names) -> set:
    return {k for k, r in census.items() if r["regime"] in names}


def share(r, names) -> float | None:
    """The mass share of memory row `r` in the regimes `names` together (None without mass)."""
    vals = [r[f"regime_{c}"] for c in CODES if c in names]
    return None if any(v is None for v in vals) else sum(vals)


def at_least(census, names, x) -> set:
    return {k for k, r in census.items() if share(r, names) is not None and share(r, names) >= x}


def _keys(rows) -> set:
    return {(int(r["layer"]), int(r["dim"])) for r in rows}


def _all_search(client, **params) -> list[dict]:
    return all_search(client, params)


def _layers(census) -> list[int]:
    return sorted({k[0] for k in census})


def test_the_run_has_regimes_to_filter(census):
    """The data can tell a wrong filter from a right one: several regimes dominate somewhere, and
    the shares sum to 1."""
    by = {c: len(dominant(census, [c])) for c in CODES}
    assert sum(1 for n in by.values() if n >= 3) >= 2, by
    assert all(r["regime"] is not None for r in census.values())  # every memory of the tiny run has mass
    for r in census.values():
        assert share(r, CODES) == pytest.approx(1.0, abs=1e-5)


# ---- layer lists ----------------------------------------------------------------------------------
def test_layer_lists_hold_exactly_the_dominant_regime(client, census):
    for layer in _layers(census):
        listed = _keys(client.get(f"/api/layer/{layer}", params={"per_page": "1000"}).json()["memories"]["rows"])
        for c in CODES:
            want = {k for k in dominant(census, [c]) if k[0] == layer} & listed
            d = client.get(f"/api/layer/{layer}", params={"regime": c, "per_page": "1000"}).json()
            assert d["regime"] == [c] and d["min_regime_share"] is None and d["has_regimes"]
            assert _keys(d["memories"]["rows"]) == want, (layer, c)
            assert d["memories"]["total"] == len(want)
            assert _keys(d["best"]["sharpness"] or []) <= want and _keys(d["best"]["agreement"] or []) <= want
    # a comma-separated or a repeated list means any of them, in REGIMES' order
    want = {k for k in dominant(census, ["nn", "pp"]) if k[0] == 1}
    for params in ({"regime": "nn,pp"}, {"regime": ["nn", "pp"]}, {"regime": " nn , pp ,"}):
        d = client.get("/api/layer/1", params={**params, "per_page": "1000"}).json()
        assert d["regime"] == ["pp", "nn"] and _keys(d["memories"]["rows"]) == want, params


def test_layer_regime_mix_counts_and_links(client, census, plain):
    for layer in _layers(census):
        mix = client.get(f"/api/layer/{layer}").json()["census"]["regimes"]
        assert [m["regime"] for m in mix] == list(CODES) and [m["signs"] for m in mix] == [SIGNS[c] for c in CODES]
        for m in mix:
            assert m["count"] == sum(1 for k, r in census.items() if k[0] == layer and r["regime"] == m["regime"])
        html = client.get(f"/layer/{layer}").text
        for m in mix:  # each count links to its list
            assert f'<a href="/layer/{layer}?regime={m["regime"]}#memories">{m["count"]}</a>' in html
    assert browser_client(plain).get("/api/layer/1").json()["census"]["regimes"] is None


def test_layer_lists_by_share(client, census):
    names = ["pp", "nn"]
    rows1 = {k: r for k, r in census.items() if k[0] == 1}
    x = sorted(share(r, names) for r in rows1.values())[len(rows1) // 2]  # the median: one memory sits on it
    want = {k for k in at_least(census, names, x) if k[0] == 1}
    assert 0 < len(want) < len(rows1) and any(share(rows1[k], names) == x for k in want)
    d = client.get("/api/layer/1", params={"regime": "pp,nn", "min_regime_share": repr(x), "per_page": "1000"}).json()
    assert d["min_regime_share"] == x and _keys(d["memories"]["rows"]) == want
    # a share of 0 keeps every memory with mass, 1 only those wholly in the regimes
    d0 = client.get("/api/layer/1", params={"regime": "pn", "min_regime_share": "0", "per_page": "1000"}).json()
    assert _keys(d0["memories"]["rows"]) == set(rows1)
    d1 = client.get("/api/layer/1", params={"regime": "pn", "min_regime_share": "1", "per_page": "1000"}).json()
    assert _keys(d1["memories"]["rows"]) == {k for k in at_least(census, ["pn"], 1.0) if k[0] == 1}


def test_layer_page_form_filter_line_and_links(client, census):
    c = "pp"
    want = {k for k in dominant(census, [c]) if k[0] == 1}
    r = client.get("/layer/1", params={"regime": c, "per_page": "5"})
    assert r.status_code == 200 and 'id="regime-filter"' in r.text and 'id="layer-filter"' in r.text
    html = r.text.replace("&amp;", "&")
    assert '<select name="regime"' in html and '<option value="pp" selected>' in html
    assert "/layer/1?regime=pp&format=csv" in html
    if len(want) > 5:  # the pages keep the filter
        nxt = html.rsplit('rel="next"', 1)[0].rsplit("<a", 1)[1]  # the list's pager (the layer's is first)
        assert "regime=pp" in nxt and "per_page=5" in nxt
    dims = [int(x.split('"')[0]) for x in html.split('<tr data-dim="')[1:]]
    assert set(dims[-min(5, len(want)):]) <= {k[1] for k in want}  # the list is the page's last table
    # "any regime" drops it and keeps the rest
    both = client.get("/layer/1", params={"regime": c, "min_regime_share": "0.3", "pos0": "hide"}).text
    assert "at least 0.3 of their activation mass" in both
    assert 'href="/layer/1?pos0=hide#memories">any regime</a>' in both


def test_layer_downloads_carry_the_filter(client, census):
    want = {k for k in dominant(census, ["pn", "np"]) if k[0] == 1}
    r = client.get("/layer/1", params={"regime": "pn,np", "format": "csv"})
    assert r.status_code == 200 and "regime-pn-np" in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert _keys(rows) == want
    assert all(row["census.regime"] in ("pn", "np") for row in rows)  # each row's census columns agree
    j = client.get("/layer/1", params={"regime": "pn,np", "format": "json", "min_regime_share": "0.4"}).json()
    assert _keys(j["rows"]) == {k for k in at_least(census, ["pn", "np"], 0.4) if k[0] == 1}


# ---- search -----------------------------------------------------------------------------------------
def test_measure_search_filters_and_composes(client, census, worth):
    for c in CODES:
        got = _all_search(client, sort="layer", regime=c)
        assert _keys(got) == dominant(census, [c]), c  # every memory of the tiny run is mined
        one = _all_search(client, sort="layer", layer="1", regime=c)
        assert _keys(one) == {k for k in dominant(census, [c]) if k[0] == 1}
    x = 0.3
    got = _all_search(client, sort="layer", regime="np,nn", min_regime_share=repr(x))
    assert _keys(got) == at_least(census, ["np", "nn"], x)
    # with min_worth and sort=worth: the intersection, the largest worth first
    floor = sorted(worth.values())[len(worth) // 2]
    got = _all_search(client, sort="worth", regime="pp", min_worth=repr(floor))
    want = sorted((k for k in dominant(census, ["pp"]) if worth[k] >= floor), key=lambda k: (-worth[k], k))
    assert [(r["layer"], r["dim"]) for r in got] == want and want


def test_text_and_summary_search_filter(client, census):
    allowed = dominant(census, ["pp", "nn"])
    for q in ({"text": "the"}, {"text": "e", "mode": "token"}, {"text": "the", "sign": "1"}):
        full = _all_search(client, **q)
        cut = _all_search(client, **q, regime="pp,nn")
        assert cut == [r for r in full if (r["layer"], r["dim"]) in allowed] and cut, q
    full = _all_search(client, text="the", mode="summary")
    cut = _all_search(client, text="the", mode="summary", regime="np")
    assert _keys(cut) == _keys(full) & dominant(census, ["np"])
    by_share = _all_search(client, text="the", regime="pp", min_regime_share="0.25")
    assert by_share == [r for r in _all_search(client, text="the")
                        if (r["layer"], r["dim"]) in at_least(census, ["pp"], 0.25)]


def test_token_search_filter(client, census):
    client.app.state.browser.wait_index(120)
    full = _all_search(client, token="the", k="20")
    assert full
    for c in CODES:
        cut = _all_search(client, token="the", k="20", regime=c)
        assert cut == [r for r in full if (r["layer"], r["dim"]) in dominant(census, [c])], c


def test_search_pages_and_downloads(client, census):
    want = dominant(census, ["nn"])
    page = client.get("/search", params={"sort": "layer", "regime": "nn", "per_page": "5"})
    assert page.status_code == 200 and 'id="regime-filter"' in page.text
    assert '<option value="nn" selected>nn (-,-)</option>' in page.text and 'name="min_regime_share"' in page.text
    if len(want) > 5:
        assert "regime=nn" in page.text.split('rel="next"')[0].rsplit("<a", 1)[1]
    # the token and text forms carry the filter on
    tok = client.get("/search", params={"token": "the", "regime": "nn", "min_regime_share": "0.2"}).text
    assert tok.count('<input type="hidden" name="regime" value="nn">') == 2
    assert tok.count('<input type="hidden" name="min_regime_share" value="0.2">') == 2
    r = client.get("/search", params={"sort": "layer", "regime": "nn", "format": "csv"})
    assert r.status_code == 200 and "regime-nn" in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert _keys(rows) == want and {row["census.regime"] for row in rows} == {"nn"}
    j = client.get("/search", params={"sort": "layer", "regime": "nn", "format": "json"}).json()
    assert _keys(j["rows"]) == want


def test_pages_without_regime_are_unchanged(client, runs, plain):
    """Without `regime` the lists are the bare run's; a run without regimes shows no regime menu."""
    bare = browser_client(runs[1])
    for url in ("/api/layer/1?per_page=1000", "/api/layer/0?pos0=hide&per_page=1000"):
        a, b = client.get(url).json(), bare.get(url).json()
        assert _keys(a["memories"]["rows"]) == _keys(b["memories"]["rows"]) and a["regime"] == b["regime"] == []
        assert a["has_regimes"] and not b["has_regimes"]
    assert _keys(_all_search(client, sort="layer")) == _keys(_all_search(bare, sort="layer"))
    for c in (bare, browser_client(plain)):
        assert 'name="regime"' not in c.get("/search", params={"sort": "layer"}).text
        assert 'name="regime"' not in c.get("/layer/1").text
        assert not c.get("/api/layer/1").json()["has_regimes"]


# ---- errors -----------------------------------------------------------------------------------------
URLS = [("/api/layer/1", {}), ("/layer/1", {}), ("/layer/1", {"format": "csv"}), ("/api/search", {"sort": "layer"}),
        ("/search", {"sort": "layer"}), ("/api/search", {"text": "the"}),
        ("/search", {"text": "the", "mode": "summary"}),
        ("/api/search", {"token": "the"}), ("/search", {"sort": "layer", "format": "json"})]


def _detail(path, r) -> str:
    return r.json()["detail"] if path.startswith("/api/") else r.text


@pytest.mark.parametrize("path, params", URLS)
def test_unknown_regime_lists_the_names(client, path, params):
    for bad in ("zz", "pp,zz", "PP", "(+,+)"):
        r = client.get(path, params={**params, "regime": bad})
        assert r.status_code == 422, r.text
        text = _detail(path, r)
        assert "regime must be one of pp (+,+), pn (+,-), np (-,+), nn (-,-)" in text and "Traceback" not in text


@pytest.mark.parametrize("path, params", URLS)
def test_runs_without_census_or_regimes_are_one_line(runs, plain, path, params):
    for run, fix in ((runs[1], NO_CENSUS), (plain, NO_REGIMES)):
        r = browser_client(run).get(path, params={**params, "regime": "pp"})
        assert r.status_code == 422, r.text
        text = _detail(path, r)
        assert fix in text and "Traceback" not in text
        if path.startswith("/api/"):
            assert "\n" not in text


@pytest.mark.parametrize("params, msg", [
    ({"min_regime_share": "0.5"}, "min_regime_share needs regime="),
    ({"regime": "pp", "min_regime_share": "1.5"}, "min_regime_share must be from 0 to 1"),
    ({"regime": "pp", "min_regime_share": "-0.1"}, "min_regime_share must be from 0 to 1"),
    ({"regime": "pp", "min_regime_share": "nan"}, "min_regime_share must be a finite number"),
    ({"regime": "pp", "min_regime_share": "half"}, "min_regime_share must be a finite number"),
])
def test_bad_shares_are_one_line(client, params, msg):
    for path in ("/api/layer/1", "/api/search"):
        r = client.get(path, params=params)
        assert r.status_code == 422 and msg in r.json()["detail"], r.text


def _valid_regime(v: str) -> bool:
    names = [x.strip() for x in v.split(",") if x.strip()]
    return all(n in CODES for n in names)


def _valid_number(v: str) -> bool:
    try:
        return len(v.strip()) <= 40 and math.isfinite(float(v.strip())) if v.strip() else True
    except ValueError:
        return False


ODD = st.one_of(st.text(max_size=24), st.text(st.sampled_from("pnx, +-()0.5e"), max_size=12),
                st.sampled_from(["", ",", "pp,", " pp ", "pp,pp", "PP", "p", "ppp", "pp;nn", "1e308", "-0", "0x1",
                                 "inf", "nan", "1_0", "١", "0.5 ", "1" * 60, "pp\x00", "ñn"]))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(v=ODD, which=st.sampled_from(["regime", "min_regime_share", "min_worth"]),
       path=st.sampled_from(["/api/layer/1", "/api/search", "/search", "/layer/1"]))
def test_any_filter_value_is_a_page_or_one_line(client, v, which, path):
    params = {which: v}
    if which == "min_regime_share":
        params["regime"] = "pp"
    r = client.get(path, params=params)
    assert r.status_code in (200, 422), (params, r.status_code, r.text[:300])
    assert "Traceback" not in r.text
    valid = _valid_regime(v) if which == "regime" else _valid_number(v)
    if which == "min_regime_share" and valid and v.strip():
        valid = 0 <= float(v.strip()) <= 1
    assert (r.status_code == 200) == valid, (params, r.text[:300])
    if r.status_code == 422 and path.startswith("/api/"):
        d = r.json()["detail"]
        assert d and "\n" not in d and which in d


# ---- layout ------------------------------------------------------------------------------------------
from test_web_crawl import WIDTHS, crawl, in_chromium  # noqa: E402  (the crawl's check; its browser is conftest's)


@in_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_filtered_pages_fit(browser, runs, width):  # noqa: F811
    """The regime and worth forms and filter lines cut no text and overflow nothing, at 390 and 1280 px."""
    from conftest import serving
    from ffkv.web.app import create_app

    urls = ["/layer/1?regime=pp,nn&min_regime_share=0.25&min_worth=0&sort=worth&per_page=5",
            "/search?sort=layer&regime=np&min_regime_share=0.3&min_worth=0&per_page=5",
            "/search?text=the&regime=pp&sort=worth", "/search?text=the&mode=summary&regime=nn&sort=worth"]
    with serving(create_app(runs[0], log_fn=lambda m: None)) as base:
        faults = crawl(browser, base, urls, width)
    assert not faults, "\n".join(f"{u}: {f}" for u, fs in faults.items() for f in fs)


@pytest.mark.parametrize("path", ["/search?sort=layer&regime=pp&regime=nn", "/layer/1?regime=pp&regime=nn"])
def test_the_pos0_toggle_keeps_a_repeated_regime(client, path):
    """The first-position toggle's link keeps every value of a repeated parameter (it kept only
    the last one, so toggling narrowed ?regime=pp&regime=nn to nn)."""
    import html as H
    import re
    from urllib.parse import parse_qs, urlsplit

    r = client.get(path)
    assert r.status_code == 200
    href = H.unescape(re.search(r'<a href="([^"]+)" data-pos0="hide"', r.text).group(1))
    q = parse_qs(urlsplit(href).query)
    assert q["regime"] == ["pp", "nn"] and q["pos0"] == ["hide"] and "page" not in q
