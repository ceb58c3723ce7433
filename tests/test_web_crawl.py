"""Every page kind of the browser at 390 and 1280 px, measured in Debian's chromium (issue 48 item 7):
no text is cut or overflows. A reviewer saw a layer table overflow its card at 1280 px, a column
clipped, percentages drawn over bars at 390 px and explorer columns hidden behind an unmarked scroll;
each check below reads the laid-out geometry, so a layout that does that again fails here."""
from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from test_web import client, index, llama, triggers, web_app, web_run  # noqa: F401  (fixtures)
from test_web_width import CHROMIUM, page_urls


def in_chromium(f):
    """A test that drives Debian's chromium."""
    f = pytest.mark.browser(f)
    return pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")(f)


WIDTHS = (390, 1280)
FITS = 1280  # from this width on, no box scrolls sideways: every table fits its card

# The faults of the page as laid out, one line each (empty: none):
# - page: the page scrolls sideways;
# - cut: an element clips its own text (overflow hidden/clip, or an ellipsis) while its content
#   is larger than its box, or scrolls it up and down; an SVG whose text runs past its edge;
# - overflow: a table, figure or code block sticks out of a box that neither scrolls nor clips
#   (its cell, card or column), so it runs over its neighbours;
# - overlap: text drawn over other text, or over a figure it is not part of;
# - unmarked: a box that scrolls sideways, with columns hidden past its edge, and no visible mark
#   (the fade app.js and style.css give it) saying there is more; from 1280 px on, any box that
#   scrolls sideways at all (scrolls).
CRAWL_JS = r"""(fits) => {
  const out = [], W = document.documentElement.clientWidth;
  const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') +
    (typeof e.className === 'string' && e.className ? '.' + e.className.trim().split(/\s+/).join('.') : '');
  const txt = e => (e.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 40);
  const shown = e => e.getClientRects().length > 0 && getComputedStyle(e).visibility !== 'hidden';
  if (document.documentElement.scrollWidth > W) out.push('page: ' + document.documentElement.scrollWidth + ' px wide');
  const all = [...document.body.querySelectorAll('*')].filter(e => !e.closest('[hidden], script, style, template'));
  const FORM = /^(INPUT|TEXTAREA|SELECT|OPTION|BUTTON)$/;
  for (const e of all) {
    if (!(e instanceof HTMLElement) || FORM.test(e.tagName) || !shown(e) || !txt(e)) continue;
    const s = getComputedStyle(e);
    const clipX = /hidden|clip/.test(s.overflowX) || s.textOverflow === 'ellipsis';
    const clipY = /hidden|clip/.test(s.overflowY);
    // a box that scrolls up and down hides its lines as surely: no box of the browser is meant to
    const vscroll = /auto|scroll/.test(s.overflowY) && e.scrollHeight > e.clientHeight + 1;
    if ((clipX && e.scrollWidth > e.clientWidth + 1) || ((clipY || vscroll) && e.scrollHeight > e.clientHeight + 1))
      out.push('cut: ' + name(e) + ' ' + e.scrollWidth + 'x' + e.scrollHeight + ' in ' + e.clientWidth + 'x' +
               e.clientHeight + ' "' + txt(e) + '"');
  }
  for (const svg of document.querySelectorAll('svg')) {
    if (!shown(svg)) continue;
    const b = svg.getBoundingClientRect();
    for (const t of svg.querySelectorAll('text')) {
      const r = t.getBoundingClientRect();
      if (r.width && (r.left < b.left - 1 || r.right > b.right + 1 || r.top < b.top - 1 || r.bottom > b.bottom + 1))
        out.push('cut: svg text "' + txt(t) + '" past its figure (' + Math.round(r.left) + '..' + Math.round(r.right) +
                 ' of ' + Math.round(b.left) + '..' + Math.round(b.right) + ')');
    }
  }
  for (const e of document.querySelectorAll('table, svg, img, pre, figure')) {
    if (!shown(e) || (e.tagName.toLowerCase() === 'svg' && e.parentElement.closest('svg'))) continue;
    const r = e.getBoundingClientRect();
    for (let p = e.parentElement; p && p !== document.body; p = p.parentElement) {
      const s = getComputedStyle(p);
      if (s.overflowX !== 'visible') break;  // a box that scrolls (checked for its mark) or clips (cut)
      const q = p.getBoundingClientRect(), right = q.right - parseFloat(s.borderRightWidth);
      if (r.right > right + 1) {
        out.push('overflow: ' + name(e) + ' "' + txt(e) + '" ends at ' + Math.round(r.right) + ', past ' + name(p) +
                 ' (' + Math.round(right) + ')');
        break;
      }
    }
  }
  // text boxes: one per line of each text node; figures: svg and img; each cut to what the boxes
  // around it that scroll or clip let show (a table's hidden columns are drawn over nothing)
  const clips = new Map();
  const clipOf = e => {
    if (!e || e === document.body) return {left: -1e9, top: -1e9, right: 1e9, bottom: 1e9};
    if (clips.has(e)) return clips.get(e);
    let c = clipOf(e.parentElement);
    const s = getComputedStyle(e);
    if (s.overflowX !== 'visible' && e instanceof HTMLElement) {
      const q = e.getBoundingClientRect(), l = q.left + e.clientLeft, t = q.top + e.clientTop;
      c = {left: Math.max(c.left, l), top: Math.max(c.top, t), right: Math.min(c.right, l + e.clientWidth),
           bottom: Math.min(c.bottom, t + e.clientHeight)};
    }
    clips.set(e, c);
    return c;
  };
  const cut = (r, e) => { const c = clipOf(e);
    return {left: Math.max(r.left, c.left), top: Math.max(r.top, c.top), right: Math.min(r.right, c.right),
            bottom: Math.min(r.bottom, c.bottom)}; };
  const boxes = [], walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (!n.textContent.trim() || !el) continue;
    if (el.closest('[hidden], script, style, title, textarea, select, option')) continue;
    const range = document.createRange(); range.selectNodeContents(n);
    for (const q of range.getClientRects()) {
      const r = cut(q, el);
      if (r.right - r.left > 0.5 && r.bottom - r.top > 0.5) boxes.push({r, el, node: n, fig: null});
    }
  }
  for (const f of document.querySelectorAll('svg, img')) {
    if (!shown(f) || (f.tagName.toLowerCase() === 'svg' && f.parentElement.closest('svg'))) continue;
    const r = cut(f.getBoundingClientRect(), f.parentElement);
    if (r.right - r.left > 0.5 && r.bottom - r.top > 0.5) boxes.push({r, el: f, node: null, fig: f});
  }
  boxes.sort((a, b) => a.r.top - b.r.top);
  const seen = new Set();
  for (let i = 0; i < boxes.length; i++) {
    const a = boxes[i];
    for (let j = i + 1; j < boxes.length && boxes[j].r.top < a.r.bottom; j++) {
      const b = boxes[j];
      if (a.fig && b.fig) continue;
      if (a.node && a.node === b.node) continue;
      const f = a.fig || b.fig, t = a.fig ? b : a;
      if (f && f.contains(t.el)) continue;  // a figure's own labels
      const dx = Math.min(a.r.right, b.r.right) - Math.max(a.r.left, b.r.left);
      const dy = Math.min(a.r.bottom, b.r.bottom) - Math.max(a.r.top, b.r.top);
      if (dx > 2 && dy > 2) {
        const k = f ? 'figure ' + name(f) + ' "' + (f.getAttribute('aria-label') || '') + '" / "' + txt(t.el) + '"'
                    : '"' + txt(a.el) + '" / "' + txt(b.el) + '"';
        if (!seen.has(k)) { seen.add(k); out.push('overlap: ' + k); }
      }
    }
  }
  for (const e of all) {
    if (!(e instanceof HTMLElement) || !shown(e)) continue;
    const s = getComputedStyle(e);
    if (!/auto|scroll/.test(s.overflowX) || e.scrollWidth <= e.clientWidth + 1 || FORM.test(e.tagName)) continue;
    if (fits) { out.push('scrolls: ' + name(e) + ' ' + e.scrollWidth + ' in ' + e.clientWidth + ' px'); continue; }
    const mark = [s.maskImage, s.webkitMaskImage, s.boxShadow].some(m => m && m !== 'none');
    if (!mark && e.scrollLeft + e.clientWidth < e.scrollWidth - 1)
      out.push('unmarked: ' + name(e) + ' scrolls ' + e.scrollWidth + ' in ' + e.clientWidth + ' px with no mark');
  }
  return out.slice(0, 40);
}"""


def extra_urls(web_run) -> list[str]:  # noqa: F811
    """Page kinds `page_urls` leaves out: first-position views, a form with more pattern slots,
    searches by sign, direction and label, the typed-text box, a chosen position in the explorer,
    a long text, sentence paging, word search for punctuation, 422 pages."""
    t = triggers(web_run)
    busiest = int(t.groupby("sentence_id").size().idxmax())
    first = t.iloc[0]
    mem = f"/memory/{int(first.layer)}/{int(first.dim)}"
    return [f"{mem}?pos0=hide", f"{mem}?slots=6&annotate_sign=-1", "/search?text=the&sign=-1",
            "/search?token=the&dir=suppress", "/search?label=shallow&sort=max_prob", "/layer/1?pos0=hide",
            "/search?token=the&pos0=hide", "/search?sort=max_prob&pos0=hide",
            f"{mem}/text", f"{mem}/text?text=The+river+flows+into+the+sea+near+the+old+city+of+Paris",
            "/explore?text=The+river+flows+into+the&pos=1",
            "/explore?text=" + "+".join(["word"] * 60),
            f"/sentence/{busiest}", f"/sentence/{busiest}?pos=1&memory={int(first.layer)}/{int(first.dim)}",
            f"/sentence/{busiest}?per_page=50&page=2", "/search?text=%25", "/layer/1?page=zz", "/layer/1?sort=nonsense"]


@pytest.fixture(scope="module")
def step_run(web_run, tmp_path_factory):  # noqa: F811
    """A copy of the web run with the steps whose pages the web run lacks: census, worth and two
    facts (a causal trace and a saved edit)."""
    from conftest import run_cli

    run = tmp_path_factory.mktemp("crawl") / "run"
    shutil.copytree(web_run, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
    for args in (["census", run], ["worth", run, "--tokens", "120", "--check", "0"],
                 ["facts", "trace", run, "--prompt", "{} is in the city of", "--subject", "The tower",
                  "--samples", "2"],
                 ["facts", "edit", run, "--prompt", "{} is in", "--subject", "The tower", "--new", " the", "--method",
                  "values", "--layer", "1", "--top", "4", "--steps", "3", "--prefixes", "1", "--tokens", "0",
                  "--name", "tower"]):
        r = run_cli(*args)
        assert r.returncode == 0, (args[0], r.stderr[-2000:])
    return run


def step_urls(run) -> list[str]:
    """Census-, worth- and facts-bearing page kinds of `step_run`."""
    c = pq.read_table(run / "census.parquet", columns=["layer", "dim", "io_class"]).to_pylist()
    mem = f"/memory/{c[0]['layer']}/{c[0]['dim']}"
    return ["/", "/layer/1", "/layer/1?sort=worth", f"/layer/1?class={c[0]['io_class']}", mem,
            "/search?sort=worth", "/search?token=the&min_worth=0", f"/search?sort=max_prob&class={c[0]['io_class']}",
            "/facts", "/facts/locate?prompt=%7B%7D+is+in+the+city+of&subject=The+tower", "/facts/edit/tower",
            "/facts/edit/nothing"]


# error pages of the crawl (every other URL must answer 200)
ERRORS = {"/nowhere", "/memory/9/9", "/explore?text=hi&suppress=1:1&scale=1e308", "/layer/1?page=zz",
          "/layer/1?sort=nonsense", "/facts/edit/nothing"}


# a memory page's later panels (Step.later_panels) are in, or have failed: its placeholder is gone
LATER_SETTLED = "() => !document.querySelector('[data-later-src]:not([data-state=failed])')"
LATER_FAILED = "() => [...document.querySelectorAll('[data-later-src]')].map(e => 'later: ' + e.textContent.trim())"


def crawl(browser, base: str, urls: list[str], width: int) -> dict[str, list[str]]:
    """{url: its faults} over `urls` at `width` px, each measured once its later panels are in; a
    page that answers another status than the URL means (an error page for `ERRORS`, else 200) is a
    fault too: a crawl of error pages alone would measure nothing."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    faults = {}
    try:
        for u in urls:
            status = page.goto(base + u).status
            page.wait_for_function(LATER_SETTLED, timeout=120_000)
            got = page.evaluate(CRAWL_JS, width >= FITS) + page.evaluate(LATER_FAILED)
            if (status >= 400) != (u in ERRORS):
                got.append(f"status {status}")
            if got:
                faults[u] = got
    finally:
        page.close()
    return faults


@in_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_no_text_cut_or_overflowing(browser, web_app, web_run, index, width):  # noqa: F811
    from conftest import serving

    with serving(web_app) as base:
        faults = crawl(browser, base, page_urls(web_run) + extra_urls(web_run), width)
    assert not faults, "\n".join(f"{u}: {f}" for u, fs in faults.items() for f in fs)


@pytest.fixture(scope="module")
def step_base(step_run):
    """The browser on `step_run`, with its report built (served at /report/)."""
    from conftest import serving
    from ffkv.report import build_report
    from ffkv.web.app import create_app

    build_report(step_run)
    with serving(create_app(step_run, log_fn=lambda m: None)) as base:
        yield base


@in_chromium
@pytest.mark.parametrize("width", WIDTHS)
def test_step_pages_no_text_cut_or_overflowing(browser, step_run, step_base, width):
    faults = crawl(browser, step_base, step_urls(step_run), width)
    assert not faults, "\n".join(f"{u}: {f}" for u, fs in faults.items() for f in fs)


@in_chromium
def test_the_later_panels_arrive_after_the_colours(browser, step_run, step_base):
    """A census memory's page comes without its sign-regime panels (a model forward) and fetches
    them once its colours have settled, so they never hold the colours back; then they are in the
    page, drawn as the later-panels page draws them."""
    c = pq.read_table(step_run / "census.parquet", columns=["layer", "dim", "dead", "tokens"]).to_pylist()
    r = next(x for x in c if x["tokens"] is not None and not x["dead"])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    log = []
    page.on("request", lambda q: log.append(("asked", q.url)))
    page.on("requestfinished", lambda q: log.append(("done", q.url)))
    page.on("requestfailed", lambda q: log.append(("done", q.url)))
    try:
        page.goto(f"{step_base}/memory/{r['layer']}/{r['dim']}")
        page.wait_for_function(LATER_SETTLED, timeout=120_000)
        assert page.evaluate(LATER_FAILED) == []
        assert page.locator("section.step-panel[data-step=census] .regime-examples").count() == 1
        assert page.locator("h2", has_text="Sign regimes over the searched tokens").count() == 1
        assert page.get_attribute("[data-act-src]", "data-state") == "done"
    finally:
        page.close()
    colours = next(i for i, (k, u) in enumerate(log) if k == "done" and "/activations" in u)
    later = next(i for i, (k, u) in enumerate(log) if k == "asked" and u.endswith("/later-panels"))
    assert colours < later, log


@in_chromium
def test_the_report_no_text_cut_or_overflowing(browser, step_base):
    """The report (its own stylesheet, no script: its CSP allows none) at 390 and 1280 px: figures
    inside their figure, wide tables scrolling with a CSS-only mark, the census's 17-column table
    fitting its card at 1280 px."""
    faults = {w: crawl(browser, step_base, ["/report/"], w) for w in WIDTHS}
    assert not any(faults.values()), faults


BAD_PAGE = """<!DOCTYPE html><html><body style="margin:0">
<div id="cut" style="width:80px; overflow:hidden; white-space:nowrap">a sentence much wider than its box</div>
<div id="dots" style="width:80px; overflow:hidden; text-overflow:ellipsis; white-space:nowrap">
  another long sentence here</div>
<div id="short" style="height:20px; overflow-y:auto">three<br>short<br>lines</div>
<svg width="60" height="20"><text x="10" y="15">a label past the edge</text></svg>
<div id="card" style="width:150px; border:1px solid"><table style="width:300px"><tr><td>wide</td></tr></table></div>
<div style="position:relative; height:30px"><span style="position:absolute; left:0">overlapping</span>
  <span style="position:absolute; left:20px">text here</span></div>
<div id="scroller" style="width:120px; overflow-x:auto">
  <table style="width:400px"><tr><td>hidden columns</td></tr></table></div>
<div style="width:2000px">a page wider than the screen</div>
</body></html>"""


@in_chromium
def test_the_crawl_sees_each_fault(browser):
    """Each kind of fault the crawl names, drawn on purpose, is reported (and nothing on a blank page)."""
    page = browser.new_page(viewport={"width": 390, "height": 600})
    try:
        page.set_content("<!DOCTYPE html><html><body><p>fine</p></body></html>")
        assert page.evaluate(CRAWL_JS, False) == []
        page.set_content(BAD_PAGE)
        got = page.evaluate(CRAWL_JS, False)
        strict = page.evaluate(CRAWL_JS, True)
    finally:
        page.close()
    kinds = [g.split(":")[0] for g in got]
    assert kinds.count("cut") == 4, got  # overflow hidden, an ellipsis, a box scrolling its lines, the svg label
    assert "overflow" in kinds and "overlap" in kinds and "page" in kinds, got
    assert any(g.startswith("unmarked: div#scroller") for g in got), got
    assert any(g.startswith("scrolls: div#scroller") for g in strict), strict


def test_sentence_pages_page_through_every_trigger_row(client, web_run):  # noqa: F811
    """A sentence page once showed "the first 200 of 1,863 trigger rows" and no way to the rest,
    with a position but not its token: its pages now hold every row of the sentence once, those
    at the chosen position first, each with the token at its position."""
    import re
    from html import unescape

    from ffkv.web.common import show_token

    t = triggers(web_run)
    sid = int(t.groupby("sentence_id").size().idxmax())
    want = t[t.sentence_id == sid]
    assert len(want) > 100
    toks = {x["i"]: x["text"] for x in client.get(f"/api/sentence/{sid}").json()["tokens"]}
    pos, per, rows, page = int(want.position.iloc[-1]), 40, [], 1
    while True:
        r = client.get(f"/sentence/{sid}", params={"pos": pos, "per_page": per, "page": page})
        assert r.status_code == 200, r.text[:300]
        body = r.text.split('id="sentence-triggers"')[1].split("</table>")[0]
        got = re.findall(r'<a href="/memory/(\d+)/(\d+)">.*?<td>([+−])</td><td class="num">(\d+)</td>'
                         r'<td class="num">[^<]*</td><td class="num"><a [^>]*>(\d+)</a></td><td class="tok">(.*?)</td>',
                         body)
        assert len(got) == min(per, len(want) - len(rows)), (page, len(got))
        for layer, dim, sign, rank, p, tok in got:
            assert unescape(tok) == show_token(toks[int(p)])  # the token beside its position
            rows.append((int(layer), int(dim), 1 if sign == "+" else -1, int(rank), int(p)))
        nxt = 'rel="next"' in r.text
        assert nxt == (len(rows) < len(want)), page
        if not nxt:
            break
        page += 1
    assert page == -(-len(want) // per) > 1
    assert sorted(rows) == sorted(zip(want.layer, want.dim, want.sign, want["rank"], want.position))
    firsts = [p for *_, p in rows[:int((want.position == pos).sum())]]
    assert set(firsts) == {pos}  # the chosen position's rows come first
    assert client.get(f"/sentence/{sid}", params={"per_page": per, "page": page + 1}).status_code == 404
    assert client.get(f"/sentence/{sid}", params={"page": "two"}).status_code == 422
    assert f"{len(want)} trigger rows" in client.get(f"/sentence/{sid}").text
    # the JSON twin pages alike: the same rows, in the same order, with where each page stands
    api_rows = []
    for k in range(1, page + 1):
        j = client.get(f"/api/sentence/{sid}", params={"pos": pos, "per_page": per, "page": k}).json()
        assert (j["page"], j["pages"], j["per_page"], j["first"], j["n_triggers"]) == (k, page, per, len(api_rows),
                                                                                       len(want))
        api_rows += [(r["layer"], r["dim"], r["sign"], r["rank"], r["position"]) for r in j["triggers"]]
    assert api_rows == rows
    assert client.get(f"/api/sentence/{sid}", params={"page": page + 1, "per_page": per}).status_code == 404
    assert len(client.get(f"/api/sentence/{sid}").json()["triggers"]) == min(200, len(want))  # the page's default


def test_one_of_a_thing_is_singular(client, web_run, tmp_path):  # noqa: F811
    """"1 memories" and "1 human annotations" read wrong: a count of one takes the singular."""
    import re

    from conftest import browser_client
    from test_web import annotation_form

    run = tmp_path / "run"
    shutil.copytree(web_run, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
    c = browser_client(run)
    assert re.search(r"\b0 human annotations\b", c.get("/").text)
    r = c.post("/memory/2/11/annotate", data=annotation_form("one"), headers={"Origin": "http://127.0.0.1:8000"},
               follow_redirects=False)
    assert r.status_code == 303
    page = c.get("/").text
    assert re.search(r"\b1 human annotation\b(?!s)", page), re.findall(r"\d+ human annot\w+", page)
    one = client.get("/explore", params={"text": "a"})
    n = client.get("/api/explore", params={"text": "a"}).json()["n_tokens"]
    assert f"({n} token{'' if n == 1 else 's'})" in one.text


@in_chromium
def test_the_scroll_mark_follows_the_hidden_side(browser, web_app):  # noqa: F811
    """The mark sits on the edge that has columns past it: the right one at first, the left one
    once the box is scrolled to its end (a mark that stayed would fade the last column)."""
    from conftest import serving

    page = browser.new_page(viewport={"width": 390, "height": 900})
    try:
        with serving(web_app) as base:
            page.goto(base + "/memory/1/5?top=50")
            box = page.locator(".tablewrap:has(table.triggers)").first
            mask = "e => [e.className, getComputedStyle(e).maskImage]"
            cls, m = box.evaluate(mask)
            assert "x-more-r" in cls and "x-more-l" not in cls and m != "none", (cls, m)
            box.evaluate("e => { e.scrollLeft = e.scrollWidth; }")
            page.wait_for_function("() => document.querySelector('.tablewrap.x-more-l') !== null")
            cls, m = box.evaluate(mask)
            assert "x-more-l" in cls and "x-more-r" not in cls and m != "none", (cls, m)
    finally:
        page.close()
