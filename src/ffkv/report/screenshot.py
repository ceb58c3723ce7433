"""A screenshot of a report in headless Debian chromium (for the README's docs/report.png).

    python -m ffkv.report.screenshot RUN docs/report.png [--full] [--height 1600]

RUN is a run directory (its report is rebuilt first) or a report .html file. Needs the `playwright`
package (the `test` extra) and Debian's /usr/bin/chromium; never downloads a browser.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ffkv.errors import FfkvError

CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def browser_check():
    """sync_playwright, after checking that Debian's chromium and the playwright package are here."""
    if not Path(CHROMIUM).exists():
        raise FfkvError(f"{CHROMIUM} is missing; install Debian's chromium (`apt-get install -y chromium`)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise FfkvError("the `playwright` package is needed (pip install playwright; no browser download)") from None
    return sync_playwright


def capture(url: str, png: Path, width: int, height: int, full_page: bool = False) -> Path:
    """Load `url` in headless chromium and save a PNG of its top `height` pixels (or the whole page)."""
    sync_playwright = browser_check()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url, wait_until="load")
            page.screenshot(path=str(png), full_page=full_page)
        finally:
            browser.close()
    return png


def screenshot(html: Path, png: Path, width: int = 1280, height: int = 1600, full_page: bool = False) -> Path:
    """Open `html` from file:// and save a PNG of its top `height` pixels (or the whole page)."""
    return capture(Path(html).resolve().as_uri(), png, width, height, full_page)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ffkv.report.screenshot", description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a run directory (the report is rebuilt) or a report .html")
    ap.add_argument("png", type=Path, help="where to write the PNG")
    ap.add_argument("--full", action="store_true", help="the whole page instead of the top")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=1600)
    a = ap.parse_args(argv)
    html = a.source
    if html.is_dir():
        from ffkv.report.build import build_report

        html = build_report(html)
    print(screenshot(html, a.png, a.width, a.height, a.full))


if __name__ == "__main__":
    main()
