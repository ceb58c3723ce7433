"""The browser bugs of issue 26, each reproduced against the tiny Llama run of tests/test_web.py
(`web_run`, real tables, real model): an overflowing explorer edit, out-of-range pages, text
search counting (memory, list) rows as memories, the token heading's spacing, whitespace-only
trigger tokens, the memory page's two numberings, text contrast under WCAG AA, and the token
notation (␣) typed back in search and in the explorer."""
from __future__ import annotations

import html as htmllib
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_web import client, index, llama, no_traceback, sentences, triggers, web_app, web_run  # noqa: F401

CSS = Path(__file__).resolve().parents[1] / "src" / "ffkv" / "web" / "static" / "style.css"


def text_of(fragment: str) -> str:
    """An HTML fragment's text, whitespace collapsed as a browser renders it."""
    return " ".join(htmllib.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def error_detail(page: str) -> str:
    m = re.search(r'<p class="(?:detail|form-error)"[^>]*>(.*?)</p>', page, re.S)
    assert m, page[:2000]
    return htmllib.unescape(m.group(1)).strip()


def one_line_4xx(r) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    no_traceback(r.text)
    if r.headers["content-type"].startswith("application/json"):
        detail = r.json()["detail"]
    else:
        detail = error_detail(r.text)
    assert detail and "\n" not in detail, detail


def vocab(web_run) -> list[str]:  # noqa: F811
    import pyarrow.parquet as pq

    t = pq.read_table(web_run / "vocab.parquet", columns=["token_id", "text"]).to_pydict()
    out = [""] * (max(t["token_id"]) + 1)
    for i, s in zip(t["token_id"], t["text"]):
        out[i] = s
    return out


# ---- 1. an explorer edit that overflows -----------------------------------------------------------
@pytest.mark.parametrize("params", [
    {"suppress": "1:1", "scale": "1e308"},
    {"suppress": "1:1", "scale": "-1e300"},
    {"suppress": "1:1*1e300"},
    {"suppress": "1:1=1e300"},
    {"suppress": "1:1", "scale": "1000001"},
])
def test_explorer_refuses_edits_that_overflow(client, params):  # noqa: F811
    r = client.get("/explore", params={"text": "hi", **params})
    assert r.status_code == 422, r.text[:500]
    assert "too large" in error_detail(r.text)
    page = text_of(r.text)
    assert not re.search(r"\b(nan|inf)\b", page) and "changed" not in page
    api = client.get("/api/explore", params={"text": "hi", **params})
    assert api.status_code == 422 and "too large" in api.json()["detail"]


def test_explorer_edits_within_the_bound_give_finite_numbers(client):  # noqa: F811
    r = client.get("/api/explore", params={"text": "The river", "suppress": "1:1", "scale": "1e6"})
    assert r.status_code == 200
    res = r.json()

    def finite(x):
        if isinstance(x, float):
            return bool(np.isfinite(x))
        if isinstance(x, dict):
            return all(finite(v) for v in x.values())
        if isinstance(x, list):
            return all(finite(v) for v in x)
        return True

    assert finite(res) and res["intervened"] is not None


def test_a_result_with_a_non_finite_number_is_refused():
    from ffkv.web.explore import _finite

    assert _finite({"a": [1.0, {"b": 2.0}], "c": "x", "d": None})
    assert not _finite({"a": [1.0, {"b": float("nan")}]}) and not _finite([float("inf")])


# ---- 2. pages past the last one ------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    {"token": "the", "page": "999999"}, {"text": "the", "page": "999999"}, {"sort": "max_prob", "page": "999999"},
    {"text": "zzzqqq", "page": "2"},
])
def test_a_page_past_the_last_is_404(client, index, params):  # noqa: F811
    for url in ("/search", "/api/search"):
        r = client.get(url, params=params)
        assert r.status_code == 404, (url, params, r.status_code)
        one_line_4xx(r)
        assert "page" in (r.json()["detail"] if url.startswith("/api") else error_detail(r.text))


def test_the_last_page_is_served(client, index):  # noqa: F811
    res = client.get("/api/search", params={"token": "the", "per_page": 7}).json()
    last = -(-res["total"] // 7)
    assert last > 1
    r = client.get("/search", params={"token": "the", "per_page": 7, "page": last})
    assert r.status_code == 200 and f"page {last} of {last}" in text_of(r.text)
    assert client.get("/search", params={"token": "the", "per_page": 7, "page": last + 1}).status_code == 404
    assert client.get("/search", params={"text": "zzzqqq"}).status_code == 200  # page 1 of nothing: says so


# ---- 3. text search counts memories, not (memory, list) rows ---------------------------------------
def test_text_search_counts_distinct_memories(client, web_run):  # noqa: F811
    t = triggers(web_run)
    sents = sentences(web_run)
    voc = vocab(web_run)
    pat = re.compile(r"(?<!\w)the(?!\w)", re.IGNORECASE)
    rows, mems = set(), set()
    for r in t.itertuples():
        if pat.search("".join(voc[i] for i in sents[r.sentence_id][: r.position + 1])):
            rows.add((int(r.layer), int(r.dim), int(r.sign)))
            mems.add((int(r.layer), int(r.dim)))
    assert len(rows) > len(mems)  # the run has memories matched in both lists
    res = client.get("/api/search", params={"text": "the", "per_page": 500}).json()
    assert res["total"] == len(rows) and res["memories"] == len(mems)
    page = text_of(client.get("/search", params={"text": "the"}).text)
    assert f"{len(mems):,} memories" in page and f"{len(rows):,} memories" not in page


# ---- 4. the token heading's words ------------------------------------------------------------------
def test_token_search_heading_keeps_its_spaces(client, index):  # noqa: F811
    r = client.get("/search", params={"token": "the", "k": 3})
    m = re.search(r'<h2 id="token-heading">(.*?)</h2>', r.text, re.S)
    assert m, r.text[:3000]
    heading = text_of(m.group(1))
    assert re.search(r"#\d+ within the top 3 \(lens \w+\)$", heading), heading
    assert not re.search(r"#\d+(?![\d\s,])", heading), heading
    assert re.search(r"promotes \S", heading)


# ---- 5. whitespace-only trigger tokens -------------------------------------------------------------
@pytest.mark.parametrize("token, shown", [(" ", "␣"), ("\n", "↵"), ("\t", "→"), ("  \n", "␣␣↵"), ("\xa0", "\\xa0")])
def test_whitespace_tokens_are_visible_marks(token, shown):
    from ffkv.display import show_token
    from ffkv.report.build import prefix_html as report_prefix
    from ffkv.web.routers.forms import prefix_html as web_prefix

    assert show_token(token) == shown and show_token(token, inline=True) == shown
    assert f"<mark>{shown}</mark>" in str(web_prefix({"cut": False, "head": "The city", "trigger": token}))
    assert f"<mark>{shown}</mark>" in report_prefix("The city", token)
    # a token with text stays as it reads inside its prefix
    assert "<mark> of</mark>" in str(web_prefix({"cut": False, "head": "part", "trigger": " of"}))
    assert show_token(" of") == "␣of"


def test_a_whitespace_trigger_on_the_memory_page_is_marked(client, web_run):  # noqa: F811
    """A real trigger row of the run whose token is only whitespace shows marks in its <mark>."""
    t = triggers(web_run)
    sents = sentences(web_run)
    voc = vocab(web_run)
    hit = None
    for r in t.itertuples():
        if r.rank <= 25 and not voc[sents[r.sentence_id][r.position]].strip():
            hit = r
            break
    if hit is None:
        pytest.skip("no whitespace-only trigger token in this run")
    page = client.get(f"/memory/{hit.layer}/{hit.dim}").text
    marks = re.findall(r"<mark>(.*?)</mark>", page, re.S)
    assert marks and all(m.strip() for m in marks), [m for m in marks if not m.strip()][:3]


# ---- 6. one numbering of prefixes, distinct labels -------------------------------------------------
def test_memory_page_numbers_prefixes_once(client, web_run):  # noqa: F811
    import pyarrow.parquet as pq

    pk = pq.read_table(web_run / "patterns.parquet", columns=["layer", "dim", "sign"]).to_pandas()
    pk = pk[pk.sign == 1]
    assert len(pk)
    layer, dim = int(pk.iloc[0].layer), int(pk.iloc[0].dim)
    page = client.get(f"/memory/{layer}/{dim}").text
    trig = re.search(r'<table class="triggers" data-sign="1">(.*?)</table>', page, re.S).group(1)
    trig_ranks = [int(x) for x in re.findall(r'<tr data-rank="(\d+)"', trig)]
    matrix = re.search(r'<table class="matrix">(.*?)</table>', page, re.S).group(1)
    rows = re.findall(r'<tr><td class="num">(\d+)</td>', matrix)
    mat_ranks = [int(x) for x in rows]
    assert mat_ranks[0] == 1 and mat_ranks == trig_ranks[: len(mat_ranks)]
    # the checkbox values stay the stored 0-based prefix index (the POST handler reads them)
    assert re.search(r'name="p0_prefixes" value="0"', matrix)
    # automatic patterns A1…, annotation slots S1…: no label means both
    assert not re.search(r">P\d+<", page)
    assert re.search(r'<th class="pcol"[^>]*>S1</th>', matrix) and "<legend>S1</legend>" in page
    assert re.search(r">A1<", page)


# ---- 7. contrast ---------------------------------------------------------------------------------
def css_rules(text: str) -> dict[str, dict[str, str]]:
    """selector -> {property: value} of a flat stylesheet; @media blocks are left out (the light
    scheme at a desktop width: the dark scheme is checked in chromium)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"@media[^{]*\{(?:[^{}]*\{[^{}]*\})*[^{}]*\}", "", text)
    out: dict[str, dict[str, str]] = {}
    for sels, body in re.findall(r"([^{}]+)\{([^{}]*)\}", text):
        props = {k.strip(): v.strip() for k, v in (d.split(":", 1) for d in body.split(";") if ":" in d)}
        for sel in sels.split(","):
            out.setdefault(" ".join(sel.split()), {}).update(props)
    return out


def luminance(colour: str) -> float:
    """WCAG 2.x relative luminance: sRGB channels c/255 linearised (c ≤ 0.04045: c/12.92, else
    ((c + 0.055)/1.055)^2.4), then L = 0.2126 R + 0.7152 G + 0.0722 B."""
    h = colour.strip().lstrip("#")
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    assert re.fullmatch(r"[0-9a-fA-F]{6}", h), colour

    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(int(h[i:i + 2], 16) / 255) for i in (0, 2, 4))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    """WCAG contrast ratio (L_lighter + 0.05) / (L_darker + 0.05)."""
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_contrast_formula():
    assert contrast("#000", "#fff") == pytest.approx(21.0)
    assert contrast("#777", "#fff") == pytest.approx(4.48, abs=0.01)  # the numbers
    assert contrast("#777", "#f4f4f4") == pytest.approx(4.07, abs=0.01)
    assert contrast("#fff", "#2e8b57") == pytest.approx(4.25, abs=0.01)
    assert contrast("#777", "#dbe8f7") == pytest.approx(3.6, abs=0.01)


def test_text_colours_reach_wcag_aa():
    """Every (text, background) pair the browser's pages put together, read from style.css."""
    css = css_rules(CSS.read_text())

    def prop(sel, name):
        return css[sel][name]

    page, section, th = prop("body", "background"), "#fff", prop("th", "background")
    chips = [prop(s, "background") for s in (".chip", ".chip.label-shallow", ".chip.label-semantic",
                                             ".chip.label-both", ".chip.label-none", ".chip.ok", ".chip.no")]
    muted = prop(".muted", "color")
    pairs = [(muted, bg, f".muted on {bg}") for bg in [page, section, th, prop("tr.here", "background"),
                                                       prop("mark", "background"), prop(".pchip", "background"),
                                                       prop(".form-error", "background"),
                                                       prop(".notice", "background"), *chips]]
    pairs += [
        (prop(".badge.hit", "color"), prop(".badge.hit", "background"), "#1 badge"),
        (prop(".badge.far", "color"), prop(".badge.far", "background"), "far badge"),
        (prop(".badge.na", "color"), section, "missing badge"),
        (prop("footer", "color"), page, "footer"),
        (prop("dl.facts dt", "color"), section, "fact labels"),
        (prop(".legend", "color"), section, "legends"),
        (prop("svg text.lbl", "fill"), section, "plot labels"),
        (prop(".c-neg", "color"), section, "negative"),
        (prop("a", "color"), section, "links"), (prop("a", "color"), th, "links in headers"),
        (prop("body", "color"), page, "text"), (prop("table.kv th", "color"), th, "key-value headers"),
        (prop("header.top .run", "color"), prop("header.top", "background"), "run name"),
    ]
    low = [(why, fg, bg, round(contrast(fg, bg), 2)) for fg, bg, why in pairs if contrast(fg, bg) < 4.5]
    assert not low, low


# ---- 8. the token notation, typed back -------------------------------------------------------------
def test_space_mark_finds_the_token(client, index, web_run):  # noqa: F811
    voc = vocab(web_run)
    exact = [i for i, s in enumerate(voc) if s == " the"]
    merged = sorted(i for i, s in enumerate(voc) if s == " the" or s.strip().casefold() == "the")
    assert exact and len(merged) > len(exact)
    res = client.get("/api/search", params={"token": "␣the", "match": "exact"}).json()
    assert res["status"] == "ready" and [t["token"] for t in res["tokens"]] == exact
    assert all(r["token"] in exact for r in res["results"]) and res["total"] > 0
    res = client.get("/api/search", params={"token": "␣the"}).json()
    assert sorted(t["token"] for t in res["tokens"]) == merged and res["match"] == "merged"
    # escapes read the same; a real space still works
    for typed in ("\\u0020the", " the"):
        r = client.get("/api/search", params={"token": typed, "match": "exact"}).json()
        assert [t["token"] for t in r["tokens"]] == exact, typed
    # the page: a visible switch between the two
    page = client.get("/search", params={"token": "␣the"}).text
    sw = re.search(r'<p class="switch" id="match-switch">(.*?)</p>', page, re.S).group(1)
    assert "match=exact" in sw and "<strong" in sw
    # the trigger-token search reads the notation too
    r = client.get("/api/search", params={"text": "␣the", "mode": "token"})
    assert r.status_code == 200 and r.json()["total"] > 0


def test_token_search_orders_by_probability_by_default(client, index):  # noqa: F811
    res = client.get("/api/search", params={"token": "the", "per_page": 500}).json()
    assert res["sort"] == "prob"
    probs = [r["prob"] for r in res["results"]]
    assert len(probs) > 3 and probs == sorted(probs, reverse=True)
    assert "ordered by the value's probability of the token" in text_of(client.get("/search?token=the").text)


def test_explorer_contrast_reads_the_space_mark(client, web_run):  # noqa: F811
    voc = vocab(web_run)
    want = voc.index(" the")
    r = client.get("/api/explore", params={"text": "The river flows into", "contrast": "␣the"})
    assert r.status_code == 200, r.text[:500]
    assert r.json()["contrast"]["id"] == want
    r = client.get("/explore", params={"text": "The river flows into", "contrast": "\\x"})
    assert r.status_code == 422 and "hex digits" in error_detail(r.text)


def test_show_and_read_token_examples():
    from ffkv.display import read_token, show_token

    assert read_token("␣London") == " London" and read_token("a↵b→c") == "a\nb\tc"
    assert read_token("\\n\\t\\\\\\u00e9\\x41") == "\n\t\\éA" and read_token("\\q") == "\\q"
    for bad in ("\\x4", "\\u12", "\\U0011ffff", "\\ud800"):
        with pytest.raises(ValueError):
            read_token(bad)
    assert show_token("→") == "\\u2192" and read_token(show_token("→")) == "→"


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(exclude_categories=("Cs",))))
def test_read_token_inverts_show_token(s):
    from ffkv.display import read_token, show_token

    assert read_token(show_token(s)) == (s if s else "∅")


TYPED = st.one_of(
    st.text(max_size=30),
    st.text(st.sampled_from("␣↵→\\xuU0123456789abcdefABCDEF #id: é\n\t"), max_size=20),
    st.builds(lambda a, b: a + b, st.sampled_from(["#", "id:", "\\x", "\\u", "\\U", "␣", " "]), st.text(max_size=12)),
)


@settings(max_examples=300, deadline=None)
@given(TYPED)
def test_parse_token_gives_a_query_or_one_line(typed):
    from ffkv.web.data import BadQuery, TokenQuery, parse_token

    try:
        q = parse_token(typed)
    except BadQuery as e:
        assert str(e) and "\n" not in str(e)
        return
    assert isinstance(q, TokenQuery) and (q.token_id is not None or q.text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(typed=TYPED, exact=st.booleans(), text_mode=st.booleans())
def test_any_typed_token_gets_a_page_or_one_line(client, index, typed, exact, text_mode):  # noqa: F811
    params = {"text": typed, "mode": "token"} if text_mode else {"token": typed}
    if exact and not text_mode:
        params["match"] = "exact"
    for url in ("/search", "/api/search"):
        r = client.get(url, params=params)
        assert r.status_code in (200, 404, 422), (typed, r.status_code, r.text[:300])
        no_traceback(r.text)
        if r.status_code != 200:
            one_line_4xx(r)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scale=st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                       st.sampled_from(["1e308", "-1e308", "1e6", "1e-320", "0x10", "1_000", "", "nan", "--1"])),
       how=st.sampled_from(["scale", "*", "="]))
def test_explorer_numbers_give_a_finite_page_or_one_line(client, scale, how):  # noqa: F811
    params = {"text": "The river", "suppress": "1:1"}
    if how == "scale":
        params["scale"] = scale
    else:
        params["suppress"] = f"1:1{how}{scale}"
    r = client.get("/api/explore", params=params)
    assert r.status_code in (200, 422), (params, r.status_code, r.text[:300])
    if r.status_code == 422:
        one_line_4xx(r)
    else:
        page = client.get("/explore", params=params)
        assert page.status_code == 200
        shown = text_of(page.text)
        assert not re.search(r"(?<![\w.])(nan|inf|-inf)(?![\w.])", shown), shown[:500]


# ---- 7b. contrast as chromium renders the pages ----------------------------------------------------
CONTRAST_JS = """() => {
  const parse = c => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const p = m[1].split(/[ ,\\/]+/).filter(Boolean).map(Number); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
  // WCAG 2.x relative luminance and contrast ratio, as in `luminance` and `contrast` above
  const lum = ([r, g, b]) => { const f = c => { c /= 255; return c <= 0.04045 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
  const mix = (top, under) => [0, 1, 2].map(k => top[k] * top[3] + under[k] * (1 - top[3]));
  const background = el => { const layers = [];
    for (let e = el; e; e = e.parentElement) { const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; } }
    let base = [255, 255, 255]; for (let i = layers.length - 1; i >= 0; i--) base = mix(layers[i], base); return base; };
  const low = [];
  for (const el of document.querySelectorAll('body *')) {
    if (el.closest('svg') || el.closest('select')) continue;
    const text = [...el.childNodes].filter(n => n.nodeType === 3).map(n => n.textContent).join('').trim();
    if (!text) continue;
    const cs = getComputedStyle(el); const box = el.getBoundingClientRect();
    if (cs.visibility === 'hidden' || cs.display === 'none' || (!box.width && !box.height)) continue;
    const bg = background(el); const fg = mix(parse(cs.color), bg);
    const a = lum(fg), b = lum(bg); const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < 4.5) low.push([el.tagName.toLowerCase() + (el.className ? '.' + el.className : ''), text.slice(0, 30),
                              cs.color, 'rgb(' + bg.map(Math.round).join(',') + ')', Math.round(ratio * 100) / 100]);
  }
  return low;
}"""


@pytest.mark.browser
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="needs Debian's chromium (apt-get install chromium)")
@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_every_text_on_the_pages_reaches_wcag_aa(web_app, web_run, index, scheme):  # noqa: F811
    """Every element with text, on every kind of page, in chromium, in the light and the dark
    colour scheme (prefers-color-scheme): its colour against the background it is drawn on
    (ancestors' backgrounds composed, the page's canvas underneath) is at least 4.5:1."""
    import pyarrow.parquet as pq
    from playwright.sync_api import sync_playwright

    from conftest import serving
    from ffkv.report.screenshot import BROWSER_ARGS

    pk = pq.read_table(web_run / "patterns.parquet", columns=["layer", "dim"]).to_pandas()
    t = triggers(web_run)
    urls = ["/", f"/memory/{int(pk.iloc[0].layer)}/{int(pk.iloc[0].dim)}", "/memory/1/5?top=50", "/search?token=the",
            "/search?token=the&match=exact", "/search?token=zzqq", "/search?text=the", "/search?sort=max_prob",
            f"/sentence/{int(t.iloc[0].sentence_id)}?pos={int(t.iloc[0].position)}", "/annotations",
            "/explore", "/explore?text=The+river+flows+into&suppress=1:1&contrast=%E2%90%A3the",
            "/explore?text=hi&suppress=1:1&scale=1e308", "/memory/9/9", "/memory/0/0/reverify",
            "/layer/1", "/search?text=the&mode=summary", "/memory/1/5#shortcuts"]
    with serving(web_app) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900}, color_scheme=scheme)
            low = {}
            for u in urls:
                page.goto(base + u)
                got = page.evaluate(CONTRAST_JS)
                if got:
                    low[u] = got[:5]
        finally:
            browser.close()
    assert not low, low


def test_explorer_layer_table_prints_every_probability_it_has(client):  # noqa: F811
    """Layer-table probabilities print to two significant digits: an early layer's p = 0.0004
    used to print as 0.000 (issue 26, item 10)."""
    import re

    q = {"text": "The river flows into"}
    j = client.get("/api/explore", params=q).json()
    want = [row["lenses"][lens][qn]["p"] for row in j["layers"] for lens in ("naive", "norm") for qn in "ryo"]
    page = client.get("/explore", params=q).text
    table = page[page.index('class="xp-layers"'):]
    table = table[: table.index("</table>")]
    shown = [re.sub(r"<[^>]+>", "", cell) for cell in
             re.findall(r'<td class="(?:first)?"[^>]*>\s*<span class="tok">.*?</span><span class="xp-p">(.*?)</span>',
                        table, flags=re.S)]
    assert len(shown) == len(want) > 0
    for text, p in zip(shown, want):
        assert float(text) == pytest.approx(p, rel=0.06, abs=0 if p else 1e-12), (text, p)
    assert "contribution (logits)" in page


def test_every_marked_trigger_is_shown_in_the_one_token_notation():
    """A trigger token inside <mark> goes through the `trig` filter on every page, so a trigger
    that is only whitespace shows as ␣ or ↵ instead of an empty highlight (reverify.html did not)."""
    import re

    from ffkv.web.common import TEMPLATES_DIR

    for page in sorted(TEMPLATES_DIR.glob("*.html")):
        for expr in re.findall(r"<mark>\{\{(.*?)\}\}</mark>", page.read_text()):
            assert "| trig" in expr, (page.name, expr)
