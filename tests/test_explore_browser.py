"""The prediction explorer in a real browser (Playwright driving Debian chromium; see
../shared/NOTES.md): enter a text, suppress the top memory with one click, and check that the
contribution list and the changed prediction on the page are what `/api/explore` says.

A real server (uvicorn on a free loopback port) serves a run of the tiny Llama that has only
the mine step: the explorer needs nothing more than the model.
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import serving
from test_explain import TEXT, build_explore_run


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs):
    from ffkv.web.app import create_app

    run = build_explore_run(tmp_path_factory.mktemp("explore-browser"), tiny_dirs["llama"])
    with serving(create_app(run, log_fn=lambda m: None), access_log=False) as url:
        yield url


def api(url: str) -> dict:
    with urllib.request.urlopen(url.replace("/explore?", "/api/explore?"), timeout=120) as r:
        return json.load(r)


def mem_rows(page, table: str) -> list[tuple[int, int, str]]:
    return [(int(tr.get_attribute("data-layer")), int(tr.get_attribute("data-dim")),
             tr.query_selector("td.contrib").inner_text())
            for tr in page.query_selector_all(f"#{table} tbody tr")]


@pytest.mark.browser
def test_suppress_the_top_memory(server, browser):
    page = browser.new_page()
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{server}/explore")
    page.fill("#text", TEXT)
    page.click("#explain")
    page.wait_for_selector("#prediction")
    before = api(page.url)
    assert page.get_attribute("#prediction", "data-id") == str(before["prediction_id"])
    assert page.inner_text("#p") == f"p = {before['p']:.3f}"
    want = [(m["layer"], m["dim"], f"{m['contrib']:+.3f}") for m in before["top_memories"]["up"]]
    assert mem_rows(page, "up") == want
    top = before["top_memories"]["up"][0]

    # one click suppresses the top memory
    page.click("#up-0 a.suppress")
    page.wait_for_selector("#prediction-after")
    assert f"suppress={top['layer']}%3A{top['dim']}" in page.url
    after = api(page.url)
    new = after["intervened"]
    assert page.get_attribute("#prediction-after", "data-id") == str(new["prediction_id"])
    assert page.inner_text("#p-after") == f"p = {new['p']:.3f}"
    assert page.inner_text("#p-original-after") == f"{new['p_original']:.3f}"
    assert page.inner_text("#changed") == ("changed" if after["changed"] else "unchanged")
    # the edit as the API reports it: the coefficient gone, the contribution it had
    edit = page.query_selector_all("#edits tr.edit")
    assert len(edit) == 1 and edit[0].get_attribute("data-layer") == str(top["layer"])
    cells = [td.inner_text() for td in edit[0].query_selector_all("td")]
    e = after["interventions"][0]
    assert cells[2:6] == [f"{e['coef']:+.3f}", f"{e['coef_after']:+.3f}", f"{e['contrib']:+.3f}",
                          f"{e['contrib_after']:+.3f}"]
    assert e["coef_after"] == 0 and f"{e['contrib']:+.3f}" == want[0][2]
    # the contribution list (of the original pass) is unchanged, and marks the edited memory
    assert mem_rows(page, "up") == want
    assert "xp-edited" in page.get_attribute("#up-0", "class")
    # the changed top tokens, as the API says
    shown = [int(tr.get_attribute("data-id")) for tr in page.query_selector_all("#top-after tbody tr")]
    assert shown == [t["id"] for t in new["top"]]
    # every layer has its row
    assert len(page.query_selector_all("#layers tbody tr")) == len(after["layers"])

    # undo brings back the original page
    page.click("#edits a.remove")
    page.wait_for_selector("#prediction")
    assert page.query_selector("#prediction-after") is None and mem_rows(page, "up") == want
    assert not problems, problems
    page.close()
