"""The memory browser and the report at any width (issue 26 item 8) and the browser's comfort
features (item 10), in Debian's chromium: no page of the browser, nor the report (served at
`/report/` and opened as a file), scrolls sideways at 390 px (wide tables scroll inside their own
box), words of a prefix never break mid-word, layouts hold at 1920 px, and the `?` overlay lists
the keyboard shortcuts."""
from __future__ import annotations


import pyarrow.parquet as pq
import pytest

from test_web import client, index, llama, triggers, web_app, web_run  # noqa: F401  (fixtures)

from conftest import CHROMIUM
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")]


def page_urls(web_run) -> list[str]:  # noqa: F811
    """One URL of every kind of page the browser serves (and the widest variants)."""
    pk = pq.read_table(web_run / "patterns.parquet", columns=["layer", "dim"]).to_pandas()
    t = triggers(web_run)
    neg = t[t.sign == -1].iloc[0]
    first = t.iloc[0]
    return ["/", "/layer/0", "/layer/1?per_page=5", "/layer/2",
            f"/memory/{int(pk.iloc[0].layer)}/{int(pk.iloc[0].dim)}", "/memory/1/5?top=200",
            f"/memory/{int(neg.layer)}/{int(neg.dim)}?annotate_sign=-1&samples=all",
            "/search?token=the", "/search?token=the&match=exact", "/search?token=zzqq", "/search?text=the",
            "/search?text=the&mode=token", "/search?text=the&mode=summary", "/search?sort=max_prob",
            "/search?sort=precision&layer=1",
            f"/sentence/{int(first.sentence_id)}?pos={int(first.position)}", "/annotations",
            "/explore", "/explore?text=The+river+flows+into&suppress=1:1&contrast=%E2%90%A3the",
            "/explore?text=hi&suppress=1:1&scale=1e308", "/explore?text=The+city+of&suppress=2:5&continue=20",
            "/memory/0/0/reverify", "/memory/9/9", "/nowhere"]


# sections without a table, figure or code block (prose, token runs, forms) that scroll inside
# their own box: text there must wrap instead (a table may scroll in its box)
PROSE_SCROLLS_JS = r"""() => [...document.querySelectorAll('section')]
  .filter(s => !s.querySelector('table, svg, pre, img') && s.scrollWidth > s.clientWidth + 1)
  .map(s => (s.id || s.className || 'section') + ' ' + s.scrollWidth + '>' + s.clientWidth)"""


# the words of every prefix (and summary) on the page that chromium broke between two letters
BROKEN_WORDS_JS = r"""() => {
  const out = [];
  for (const el of document.querySelectorAll('.prefix, .summary')) {
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      const re = /\S+/g; let m;
      while ((m = re.exec(n.textContent))) {
        if (m[0].length > 20) continue;  // a word wider than its box may break
        // broken mid-word: two letters or digits in a row laid out on different lines (a break at
        // a hyphen or beside punctuation is an ordinary line-break opportunity)
        const top = i => { const r = document.createRange(); r.setStart(n, m.index + i); r.setEnd(n, m.index + i + 1);
                           const b = [...r.getClientRects()].filter(x => x.width > 0); return b.length ? Math.round(b[0].top) : null; };
        for (let i = 0; i + 1 < m[0].length; i++) {
          if (!/[\p{L}\p{N}]/u.test(m[0][i]) || !/[\p{L}\p{N}]/u.test(m[0][i + 1])) continue;
          const a = top(i), b = top(i + 1);
          if (a !== null && b !== null && a !== b) { out.push(m[0]); break; }
        }
      }
    }
  }
  return out.slice(0, 20);
}"""


@pytest.fixture(scope="module")
def chromium_pages(web_app, web_run, index):  # noqa: F811
    from playwright.sync_api import sync_playwright

    from conftest import serving
    from ffkv.report.screenshot import BROWSER_ARGS

    with serving(web_app) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            yield base, browser
        finally:
            browser.close()


def test_no_page_scrolls_sideways_at_390px(chromium_pages, web_run):  # noqa: F811
    base, browser = chromium_pages
    page = browser.new_page(viewport={"width": 390, "height": 844})
    wide, broken, inner = {}, {}, {}
    for u in page_urls(web_run):
        page.goto(base + u)
        w = page.evaluate("document.documentElement.scrollWidth")
        if w > 390:
            wide[u] = w
        b = page.evaluate(BROKEN_WORDS_JS)
        if b:
            broken[u] = b
        s = page.evaluate(PROSE_SCROLLS_JS)
        if s:
            inner[u] = s
    page.close()
    assert not wide and not broken and not inner, (f"pages wider than 390 px: {wide}; words broken between "
                                                   f"letters: {broken}; text that scrolls in its box: {inner}")


@pytest.fixture(scope="module")
def report_pages(web_run, tmp_path_factory, chromium_pages):  # noqa: F811
    """The report of a copy of the web run (every step but normalize), served by the browser at
    `/report/` and as a file: the URLs of its every page (the report is one page)."""
    import shutil

    from conftest import serving
    from ffkv.report import build_report
    from ffkv.web.app import create_app

    run = tmp_path_factory.mktemp("web-report") / "run"
    shutil.copytree(web_run, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
    index = build_report(run)
    with serving(create_app(run, log_fn=lambda m: None)) as base:
        yield [base + "/report/", index.resolve().as_uri()]


@pytest.mark.parametrize("width", [390, 1920])
def test_the_report_fits_the_screen(chromium_pages, report_pages, width):
    _, browser = chromium_pages
    page = browser.new_page(viewport={"width": width, "height": 844})
    wide, broken = {}, {}
    for u in report_pages:
        page.goto(u)
        assert page.locator("main section").count() > 5, u  # the report itself, not an error page
        w = page.evaluate("document.documentElement.scrollWidth")
        if w > width:
            wide[u] = w
        b = page.evaluate(BROKEN_WORDS_JS)
        if b:
            broken[u] = b
    # its tables wider than the screen scroll inside their own box
    boxes = page.evaluate("""() => [...document.querySelectorAll('table')].filter(t => t.scrollWidth > innerWidth)
      .map(t => { let box = t.parentElement; while (box && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
                  return box ? box.clientWidth <= innerWidth && box.scrollWidth > box.clientWidth : false; })""")
    page.close()
    assert not wide and not broken, f"report wider than {width} px: {wide}; words broken between letters: {broken}"
    assert all(boxes), boxes


def test_wide_tables_scroll_in_their_own_box(chromium_pages, web_run):  # noqa: F811
    """At 390 px the memory page's trigger table is wider than the screen, and its box scrolls."""
    base, browser = chromium_pages
    page = browser.new_page(viewport={"width": 390, "height": 844})
    page.goto(base + "/memory/1/5?top=50")
    got = page.evaluate("""() => { const t = document.querySelector('table.triggers'); if (!t) return null;
      let box = t.parentElement; while (box && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
      return {table: t.scrollWidth, box: box ? box.clientWidth : null, scrolls: box ? box.scrollWidth > box.clientWidth : null}; }""")
    page.close()
    assert got is not None
    if got["table"] > 390:
        assert got["box"] <= 390 and got["scrolls"], got


def test_layouts_hold_at_1920px(chromium_pages, web_run):  # noqa: F811
    base, browser = chromium_pages
    page = browser.new_page(viewport={"width": 1920, "height": 1080})
    for u in page_urls(web_run):
        page.goto(base + u)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1920, u
    page.goto(base + "/memory/1/5")
    cols = page.evaluate("""() => [...document.querySelectorAll('.cols > *')].map(e => {
      const r = e.getBoundingClientRect(); return [Math.round(r.left), Math.round(r.width)]; })""")
    page.close()
    assert len(cols) == 2 and cols[1][0] > cols[0][0] + cols[0][1] - 1, cols  # side by side
    assert min(w for _, w in cols) > 400, cols


def test_question_mark_lists_the_shortcuts(chromium_pages):
    base, browser = chromium_pages
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(base + "/memory/1/5")
    box = page.locator("#shortcuts")
    assert not box.is_visible()
    page.keyboard.press("?")
    assert box.is_visible()
    text = box.inner_text()
    for key in ("j", "k", "r", "?", "Esc"):
        assert key in text
    page.keyboard.press("Escape")
    assert not box.is_visible()
    page.fill("input[name=token]", "")
    page.focus("input[name=token]")
    page.keyboard.press("?")  # typed into a field: no overlay
    assert not box.is_visible()
    page.close()
    # without JavaScript the footer link opens it (:target)
    ctx = browser.new_context(java_script_enabled=False)
    p2 = ctx.new_page()
    p2.goto(base + "/")
    assert not p2.locator("#shortcuts").is_visible()
    p2.click("#shortcuts-link")
    assert p2.locator("#shortcuts").is_visible()
    ctx.close()
