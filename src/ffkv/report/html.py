"""Small HTML helpers for the report: escaping, tables, verdict lines, embedded images.

Everything is inlined into one file: PNGs as data URIs, CSS in the template; no script, font or
stylesheet is ever linked.
"""
from __future__ import annotations

import base64
import html
import re
from importlib import resources
from pathlib import Path
from string import Template

from ffkv.display import number
from ffkv.report.stats import DIFFERS, INCONCLUSIVE, NA, SAME, Verdict

VERDICT_CLASS = {SAME: "v-same", DIFFERS: "v-differs", INCONCLUSIVE: "v-inconclusive", NA: "v-na"}


def esc(x) -> str:
    """HTML-escaped text with control and bidi characters (NUL, an unclosed right-to-left
    override, …) shown as escapes first (`ffkv.display.printable`): corpus text never reaches the
    page raw."""
    from ffkv.display import printable

    return html.escape(printable("" if x is None else str(x)), quote=True)


def code(text: str) -> str:
    """Escape `text` and show its `backquoted` parts as code."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", esc(text))


def template() -> Template:
    return Template(resources.files("ffkv.report").joinpath("template.html").read_text(encoding="utf-8"))


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR header."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def img(png: Path, alt: str, scale: int | None = None) -> str:
    """The PNG inlined, shown at its layout size (its pixels / `scale`, the figures' `SCALE`: sharp
    on high-density screens), with `alt` (what it shows, `ffkv.report.figures.describe`)."""
    from ffkv.report.figures import SCALE

    raw = Path(png).read_bytes()
    data = base64.b64encode(raw).decode("ascii")
    try:
        w, h = png_size(raw)
        s = scale or SCALE
        size = f' width="{round(w / s)}" height="{round(h / s)}"'
    except ValueError:
        size = ""
    return f'<img src="data:image/png;base64,{data}"{size} alt="{esc(alt)}">'


def chip(v: str, cls: str | None = None) -> str:
    """A verdict chip; `cls` the verdict whose colour it takes (a claim's "holds" takes "same trend")."""
    return f'<span class="chip {VERDICT_CLASS.get(cls or v, "v-na")}">{esc(v)}</span>'


def verdict_line(v: Verdict, extra: str = "") -> str:
    return (f'<p class="verdict {VERDICT_CLASS.get(v.verdict, "v-na")}" data-verdict="{esc(v.verdict)}">'
            f'<span class="label">Verdict: {esc(v.verdict)}.</span> '
            f'<span class="measured">Measured: {code(v.measured)}{code(extra)}</span>'
            f'<span class="criterion">Criterion: {code(v.criterion)}</span></p>')


def fmt(x, digits: int = 3) -> str:
    """A report cell (`ffkv.display.number`): empty when missing."""
    return number(x, digits)


def table(headers: list[str], rows: list[list], num: set[int] | None = None, raw: set[int] | None = None,
          cls: str = "") -> str:
    """An HTML table in its own box (`.tablewrap`: a table wider than a phone's screen scrolls
    there, not the page). Cells are escaped unless their column index is in `raw` (already HTML)."""
    num, raw = num or set(), raw or set()
    th = "".join(f'<th class="num">{esc(h)}</th>' if i in num else f"<th>{esc(h)}</th>"
                 for i, h in enumerate(headers))
    body = []
    for r in rows:
        tds = []
        for i, c in enumerate(r):
            content = c if i in raw else esc(fmt(c))
            tds.append(f'<td class="num">{content}</td>' if i in num else f"<td>{content}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    return (f'<div class="tablewrap"><table class="{cls}"><thead><tr>{th}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def mem(layer: int, dim: int, text: str | None = None) -> str:
    """A memory id in the report: plain text offline (file://); `ffkv serve` turns it into a link
    to the memory's page when it serves the report (`ffkv.web.routers.site.linked_report`)."""
    layer, dim = int(layer), int(dim)
    shown = f"{layer}/{dim}" if text is None else str(text)
    return f'<span class="mem" data-memory="{layer}/{dim}">{esc(shown)}</span>'


def kv(pairs: list[tuple[str, object]]) -> str:
    return table(["", ""], [[k, v] for k, v in pairs], cls="kv").replace("<thead><tr><th></th><th></th></tr></thead>", "")


def tok(s: str | None) -> str:
    """A token shown visibly, as everywhere (`ffkv.display.show_token`): ␣ for a space at either
    end or a token of whitespace only, ↵ a newline, escapes for control characters; ∅ for empty."""
    if s is None:
        return ""
    from ffkv.display import show_token

    return f'<span class="tok">{html.escape(show_token(str(s)), quote=True)}</span>'
