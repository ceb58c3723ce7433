"""Issue 48: a memory page left before its later panels (`Step.later_panels`, a model forward) or its colours are
computed costs the server no forward, so a quick `j` does not queue the next page's colours behind
them on the model's lock. In Debian's chromium (Playwright) against the browser served in process
(uvicorn, `conftest.serving`) on a tiny censused Llama run (`test_census_regimes_web`'s).

No timing: the test holds the server's forward lock itself while page A's later-panels request
reaches the server, so the request is certain to be waiting for the model when the page is left;
what ran is read from counting wrappers of the real functions (the regimes' `scan`, the colours'
`compute`, the route's `model_turn`) and from the server's log, in the order it happened."""
from __future__ import annotations


import pyarrow.parquet as pq
import pytest

from test_census_regimes_web import _censused

from conftest import CHROMIUM
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (apt-get install chromium)")]
WAIT = 300  # seconds any one wait may take on a busy machine before the test fails (no assertion on time)


@pytest.fixture(scope="module")
def run(tmp_path_factory, reference_mine, tiny_dirs, tiny_models):
    return _censused(tmp_path_factory, reference_mine, tiny_dirs["llama"], tiny_models["llama"], "later-cancel")


def _pair(run) -> tuple[tuple[int, int], tuple[int, int]]:
    """Two mined memories of layer 1, the second the first's next (`j`), both alive in the census
    (so both pages offer later panels)."""
    keys = sorted({(int(l), int(d)) for l, d in zip(*pq.read_table(run / "triggers.parquet",
                                                                   columns=["layer", "dim"]).to_pydict().values())})
    c = pq.read_table(run / "census.parquet", columns=["layer", "dim", "dead"]).to_pylist()
    alive = {(r["layer"], r["dim"]) for r in c if not r["dead"]}
    for a, b in zip(keys, keys[1:]):
        if a[0] == b[0] == 1 and a in alive and b in alive:
            return a, b
    raise AssertionError("the tiny run has no two neighbouring alive memories in layer 1")


def _watched(monkeypatch) -> list[tuple]:
    """A list the server's colour forwards ("colours", memories) and waits for the model ("waits",
    path) are appended to as they happen, through counting wrappers of the real functions."""
    from ffkv.web import activations
    from ffkv.web.routers import memory as M

    events: list[tuple] = []
    real_compute, real_turn = activations.compute, M.model_turn

    def compute(mm, seqs, jobs, *a, **k):
        events.append(("colours", tuple(sorted({tuple(x) for j in jobs for x in j}))))
        return real_compute(mm, seqs, jobs, *a, **k)

    def model_turn(request, lock):
        events.append(("waits", request.url.path))
        return real_turn(request, lock)

    monkeypatch.setattr(activations, "compute", compute)
    monkeypatch.setattr(M, "model_turn", model_turn)
    return events


def _until(page, cond, what: str):
    for _ in range(WAIT * 20):
        if cond():
            return
        page.wait_for_timeout(50)  # lets Playwright run the route handler meanwhile
    raise AssertionError(f"never happened: {what}")


def test_a_page_left_before_its_later_panels_runs_no_forward(run, browser, monkeypatch):
    from conftest import serving
    from ffkv.steps.census import regimes as R
    from ffkv.web.app import create_app

    (la, da), (lb, db) = _pair(run)
    events = _watched(monkeypatch)  # what the server did, in order
    real_scan = R.scan

    def scan(mm, layer, dim, *a, **k):
        events.append(("regimes", (layer, dim)))
        return real_scan(mm, layer, dim, *a, **k)

    monkeypatch.setattr(R, "scan", scan)
    app = create_app(run, log_fn=lambda msg: events.append(("log", msg)))
    lock = app.state.browser.model_lock
    a_later = f"/memory/{la}/{da}/later-panels"
    held, failed = [], []

    def hold(route):  # page A's later panels: the test takes the model first, as another forward would
        if route.request.url.endswith(a_later) and not held:
            lock.acquire()
            held.append(route.request.url)
        route.continue_()

    with serving(app) as url:
        page = browser.new_page()
        page.on("requestfailed", lambda r: failed.append(r.url))
        page.route("**/later-panels", hold)
        page.goto(f"{url}/memory/{la}/{da}")
        assert page.get_attribute("#next", "href") == f"/memory/{lb}/{db}"
        # A's colours were painted, then its later panels asked for: the server waits for the model
        _until(page, lambda: ("waits", a_later) in events, "page A's later-panels request reached the server")
        assert page.get_attribute("[data-act-src]", "data-state") == "done"
        page.keyboard.press("j")  # next memory, while A's request waits
        page.wait_for_url(f"**/memory/{lb}/{db}")
        # the server sees A's client gone and gives up its turn, while the test still holds the model
        _until(page, lambda: any(e[0] == "log" and f"memory {la}/{da} not computed" in e[1] for e in events),
               "the server skipped page A's later panels")
        lock.release()
        # B's colours, then its later panels, as usual
        page.wait_for_selector('[data-act-src][data-state="done"]', timeout=WAIT * 1000)
        page.wait_for_selector('[data-regime]', state="attached", timeout=WAIT * 1000)
        assert page.locator("[data-later-src]").count() == 0
        page.close()

    assert held and any(u.endswith(a_later) for u in failed), failed  # the browser dropped A's request
    did = [e for e in events if e[0] in ("colours", "regimes") or (e[0] == "log" and "not computed" in e[1])]
    skip = [i for i, e in enumerate(did) if e[0] == "log" and "not computed" in e[1]]
    assert len(skip) == 1 and f"memory {la}/{da}" in did[skip[0]][1], did
    # no forward ever ran for A's later panels; B's colours came after the skip, then B's panels
    assert ("regimes", (la, da)) not in did, did
    # ("colours": a colours forward asked for, which then waits for the model; B's may be asked
    # before or after A's turn is given up)
    colours_b = [i for i, e in enumerate(did) if e[0] == "colours" and (lb, db) in e[1]]
    assert did[0][0] == "colours" and (la, da) in did[0][1], did
    assert [e for e in did if e[0] == "regimes"] == [("regimes", (lb, db))], did
    assert colours_b and max(skip[0], colours_b[0]) < did.index(("regimes", (lb, db))), did


def test_colours_asked_by_a_page_left_run_no_forward(run, monkeypatch):
    """The colours' request of a page left while it waits for the model (its client gone: the
    socket closed) is answered 499 with a log line, and computes nothing; the same request from
    a client that stays is then computed as ever. Over a raw socket against uvicorn in process,
    no browser: the test holds the colours' lock itself while the request waits."""
    import socket
    import time
    from urllib.parse import urlparse

    import httpx

    from conftest import serving
    from ffkv.web import activations
    from ffkv.web.app import create_app

    (la, da), _ = _pair(run)
    events = _watched(monkeypatch)
    app = create_app(run, log_fn=lambda msg: events.append(("log", msg)))
    path = f"/api/memory/{la}/{da}/activations"
    compute_lock = activations.cache(app.state).compute

    def until(cond, what):
        for _ in range(WAIT * 20):
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError(f"never happened: {what}")

    with serving(app) as url:
        u = urlparse(url)
        compute_lock.acquire()  # another page's colours, as the server sees it
        try:
            sock = socket.create_connection((u.hostname, u.port))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n\r\n".encode())
            until(lambda: ("waits", path) in events, "the colours' request waited for the model")
            sock.close()  # the page is left
            until(lambda: any(e[0] == "log" and path in e[1] and "not computed" in e[1] for e in events),
                  "the server gave up the left page's colours")
        finally:
            compute_lock.release()
        assert not [e for e in events if e[0] == "colours"], events
        j = httpx.get(url + path, timeout=WAIT).json()  # a client that stays gets them
    assert [e for e in events if e[0] == "colours"] == [("colours", ((la, da),))], events
    assert j["computed"] > 0 and j["examples"]
