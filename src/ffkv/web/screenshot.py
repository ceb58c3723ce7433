"""A screenshot of a memory browser page in headless Debian chromium (for the README's
docs/memory_page.png).

    python -m ffkv.web.screenshot RUN docs/memory_page.png [--page /memory/20/5] [--height 1400]

Serves RUN on a free localhost port in this process (the same app as `ffkv serve`), opens the
page and saves a PNG of its top `--height` pixels. Without `--page`, the memory with the
highest value max-probability among keys whose top-1 trigger agrees with the value (a readable
example). Needs the `playwright` package and /usr/bin/chromium; never downloads a browser.
"""
from __future__ import annotations

import argparse
import socket
import threading
import time
from pathlib import Path


def pick_memory(browser) -> str:
    res = browser.search_measure(sort="max_prob", agree=True, per_page=1)
    if not res["results"]:
        res = browser.search_measure(sort="max_prob", per_page=1)
    r = res["results"][0]
    return f"/memory/{r['layer']}/{r['dim']}"


def screenshot(run, png: Path, page: str | None = None, width: int = 1400, height: int = 1400,
               full_page: bool = False, build_index: bool = True) -> tuple[Path, str]:
    import uvicorn

    from ffkv.report.screenshot import browser_check, capture
    from ffkv.web.app import create_app

    browser_check()
    app = create_app(run, log_fn=lambda msg: None)
    b = app.state.browser
    if build_index:  # both lenses in the vocabulary views: the token index (built in memory if absent)
        b.wait_index()
    page = page or pick_memory(b)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        while not server.started:
            time.sleep(0.05)
        png = capture(f"http://127.0.0.1:{port}{page}", png, width, height, full_page)
    finally:
        server.should_exit = True
        th.join(10)
    return png, page


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ffkv.web.screenshot", description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a run directory")
    ap.add_argument("png", type=Path, help="where to write the PNG")
    ap.add_argument("--page", help="a path such as /memory/20/5 (default: a readable memory)")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1400)
    ap.add_argument("--full", action="store_true", help="the whole page instead of the top")
    ap.add_argument("--no-index", action="store_true", help="do not build the token index first")
    a = ap.parse_args(argv)
    png, page = screenshot(a.run, a.png, a.page, a.width, a.height, a.full, not a.no_index)
    print(f"{png} ({page})")


if __name__ == "__main__":
    main()
