"""The memory browser in Debian's chromium (Playwright), against `ffkv serve` started as a user
would: pages show the run's triggers, annotation round trips through the form, no payload from
the corpus or from annotations ever runs, and everything works with JavaScript off."""
from __future__ import annotations


import pyarrow.parquet as pq
import pytest

from test_web import PAYLOADS, llama, payload_keys, triggers, web_run  # noqa: F401  (fixtures)

from conftest import CHROMIUM
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")]


@pytest.fixture(scope="module")
def server(web_run):  # noqa: F811
    from conftest import serve_cli

    with serve_cli(web_run) as url:
        yield url


class Watch:
    """Requests, console messages and dialogs of a page."""

    def __init__(self, page):
        self.requests, self.console, self.dialogs = [], [], []
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))


def test_overview_and_memory_page(server, browser, web_run):  # noqa: F811
    page = browser.new_page()
    w = Watch(page)
    page.goto(server + "/")
    assert "Overview" in page.title()
    assert page.locator("table.layers tbody tr").count() == 3
    page.goto(server + "/memory/1/5?top=50")
    t = triggers(web_run)
    for sign in (1, -1):
        rows = page.eval_on_selector_all(
            f'table.triggers[data-sign="{sign}"] tbody tr',
            "els => els.map(e => [+e.dataset.rank, +e.dataset.sentence, +e.dataset.position, +e.dataset.coef,"
            " e.querySelector('mark').textContent])")
        want = t[(t.layer == 1) & (t.dim == 5) & (t.sign == sign)].sort_values("rank")
        assert [r[:3] for r in rows] == [list(x) for x in zip(want["rank"], want["sentence_id"], want["position"])]
        assert all(abs(r[3] - c) <= 1e-5 * max(1, abs(c)) for r, c in zip(rows, want["coef"]))
        assert all(r[4] for r in rows)  # the trigger token is marked
    assert page.locator("#vocabulary table.vocab").count() >= 1
    page.click("#next")
    assert page.url.endswith("/memory/1/6")
    page.wait_for_load_state("load")  # app.js listens for keys once loaded; a busy CI machine lags
    page.keyboard.press("k")  # app.js: k = previous memory
    page.wait_for_url("**/memory/1/5")
    assert all(u.startswith(server) for u in w.requests), w.requests
    assert not [c for c in w.console if c.startswith("error")], w.console
    page.close()


def fig2_annotations(page, server, layer: int) -> int:
    page.goto(server + "/annotations")
    cell = page.locator(f'table.fig2 tr[data-layer="{layer}"] td.annotations')
    return int(cell.inner_text()) if cell.count() else 0


def test_annotate_reload_and_fig2(server, browser):
    page = browser.new_page()
    before = fig2_annotations(page, server, 0)
    page.goto(server + "/memory/0/7")
    page.fill("input[name=annotator]", "chromium-ann")
    page.fill("input[name=p0_description]", "sports results")
    page.check("input[name=p0_kind][value=semantic]")
    for i in (0, 2, 5):
        page.check(f"input[name=p0_prefixes][value='{i}']")
    page.click("#annotate-form button[type=submit]")
    page.wait_for_load_state()
    page.reload()
    ann = page.locator("#annotations table.annotations")
    assert "chromium-ann" in ann.inner_text() and "sports results" in ann.inner_text()
    assert page.input_value("input[name=annotator]") == "chromium-ann"  # the cookie
    assert page.is_checked("input[name=p0_prefixes][value='2']")
    assert fig2_annotations(page, server, 0) == before + 1
    page.close()


def test_no_payload_runs_and_text_shows_literally(server, browser, web_run):  # noqa: F811
    keys = payload_keys(web_run)
    assert keys
    page = browser.new_page()
    w = Watch(page)
    # annotations carry payloads too
    page.goto(server + "/memory/1/9")
    page.fill("input[name=annotator]", "<script>window.__xss='a1'</script>")
    page.fill("input[name=p0_description]", '"><img src=x onerror="window.__xss=\'a2\'">')
    page.check("input[name=p0_kind][value=shallow]")
    page.check("input[name=p0_prefixes][value='1']")
    page.fill("textarea[name=note]", "' onmouseover='window.__xss=3' </textarea><script>window.__xss=4</script>")
    page.click("#annotate-form button[type=submit]")
    page.wait_for_load_state()
    s = pq.read_table(web_run / "sentences.parquet").to_pydict()
    bad_sids = [i for i, x in zip(s["sentence_id"], s["text"]) if "__xss" in x or "<svg" in x]
    urls = [f"/memory/{l}/{d}?top=50" for l, d, _ in keys[:6]] + [f"/sentence/{i}" for i in bad_sids] + [
        "/memory/1/9", "/annotations", "/search?text=script", "/search?text=xss", "/search?text=svg&mode=word"]
    shown = ""
    for u in urls:
        page.goto(server + u)
        for el in page.locator("mark, .sentence span.here").all()[:20]:  # payloads aimed at mouse events
            el.hover(timeout=2000)
        assert page.evaluate("typeof window.__xss") == "undefined", u
        attrs = page.evaluate("Array.from(document.querySelectorAll('*')).flatMap(e => Array.from(e.attributes)"
                              ".map(a => a.name)).filter(n => n.startsWith('on'))")
        assert attrs == [], (u, attrs)
        assert page.locator("img").count() == 0 and page.locator("body script").count() == 0, u
        shown += page.inner_text("body")
    assert not w.dialogs, w.dialogs
    assert not [c for c in w.console if "Content Security Policy" in c or c.startswith("error")], w.console
    for text in ("<script>window.__xss", '"><img src=x onerror=', "<svg onload=window.__xss=6>",
                 "<script>window.__xss='a1'</script>", "' onmouseover='window.__xss=3'"):
        assert text in shown, text
    page.close()


def test_pages_work_without_javascript(server, browser):
    import httpx

    ctx = browser.new_context(java_script_enabled=False)
    page = ctx.new_page()
    page.goto(server + "/memory/2/3")
    assert page.locator("table.triggers tbody tr").count() == 50  # 25 top + 25 most negative
    page.fill("input[name=annotator]", "no-js")
    page.fill("input[name=p1_description]", "ends with a year")
    page.check("input[name=p1_kind][value=shallow]")
    page.check("input[name=p1_prefixes][value='4']")
    page.check("input[name=p1_prefixes][value='6']")
    page.click("#annotate-form button[type=submit]")
    page.wait_for_load_state()
    assert "/memory/2/3" in page.url and "ends with a year" in page.inner_text("#annotations")
    rec = [a for a in httpx.get(server + "/api/memory/2/3").json()["annotations"] if a["annotator"] == "no-js"]
    assert rec and rec[0]["patterns"] == [{"description": "ends with a year", "kind": "shallow", "prefixes": [4, 6]}]
    page.goto(server + "/search?sort=precision&layer=1")
    assert page.locator("table.res tbody tr").count() == 50
    page.click("text=next →")
    assert "page=2" in page.url
    ctx.close()
