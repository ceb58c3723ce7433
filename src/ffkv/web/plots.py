"""Small inline SVG plots for server-rendered pages (no script, no style attribute: the CSP allows
neither). Every number is formatted here and every label escaped; colours come from CSS classes
in static/style.css.
"""
from __future__ import annotations

import math

from markupsafe import Markup, escape


def _num(x: float) -> str:
    return f"{float(x):.2f}".rstrip("0").rstrip(".") if x == x else "0"


def _ok(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and not math.isnan(float(x))


def bar(frac, width: int = 120, height: int = 12, cls: str = "bar", label: str = "") -> Markup:
    """A horizontal bar filled to `frac` (0..1)."""
    if not _ok(frac):
        return Markup('<span class="muted">–</span>')
    f = min(max(float(frac), 0.0), 1.0)
    return Markup(f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
                  f'role="img" aria-label="{escape(label)}"><title>{escape(label)}</title>'
                  f'<rect class="track" x="0" y="0" width="{width}" height="{height}"/>'
                  f'<rect class="{escape(cls)}" x="0" y="0" width="{_num(f * width)}" height="{height}"/></svg>')


def interval(value, lo, hi, baseline=None, vmax: float = 1.0, width: int = 140, height: int = 14,
             label: str = "") -> Markup:
    """A point with its interval on a 0..vmax axis, and a baseline tick (e.g. shuffled pairing)."""
    if not _ok(value):
        return Markup('<span class="muted">–</span>')
    vmax = vmax if vmax and vmax > 0 else 1.0
    sx = lambda v: _num(min(max(float(v), 0.0), vmax) / vmax * (width - 4) + 2)  # noqa: E731
    parts = [f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{escape(label)}"><title>{escape(label)}</title>',
             f'<line class="axis" x1="0" y1="{height - 1}" x2="{width}" y2="{height - 1}"/>']
    if _ok(lo) and _ok(hi):
        parts.append(f'<line class="ci" x1="{sx(lo)}" y1="{height / 2}" x2="{sx(hi)}" y2="{height / 2}"/>')
    if _ok(baseline):
        parts.append(f'<line class="base" x1="{sx(baseline)}" y1="1" x2="{sx(baseline)}" y2="{height - 2}"/>')
    parts.append(f'<circle class="pt" cx="{sx(value)}" cy="{height / 2}" r="3"/></svg>')
    return Markup("".join(parts))


def stacked(parts: list[tuple[float, str, str]], width: int = 160, height: int = 12, label: str = "") -> Markup:
    """Shares (value, css class, name) as one stacked bar; shares are normalised to their sum."""
    vals = [(float(v), c, n) for v, c, n in parts if _ok(v) and v > 0]
    tot = sum(v for v, _, _ in vals)
    if tot <= 0:
        return Markup('<span class="muted">–</span>')
    x = 0.0
    out = [f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{escape(label)}"><title>{escape(label)}</title>']
    for v, c, n in vals:
        w = v / tot * width
        out.append(f'<rect class="{escape(c)}" x="{_num(x)}" y="0" width="{_num(w)}" height="{height}">'
                   f'<title>{escape(n)}: {100 * v / tot:.1f}%</title></rect>')
        x += w
    out.append("</svg>")
    return Markup("".join(out))


def histogram(counts: list[float], labels: list[str] | None = None, classes: list[str] | None = None,
              axis: tuple[str, str, str] | None = None, width: int = 380, height: int = 96, label: str = "",
              log: bool = True) -> Markup:
    """Bars of `counts` (log scale by default), each with a tooltip (`labels`) and a CSS class
    (`classes`, e.g. by sign); `axis` = texts under the left end, the middle and the right end."""
    if not counts:
        return Markup('<span class="muted">–</span>')
    ys = [math.log1p(max(float(c), 0.0)) if log else max(float(c), 0.0) for c in counts]
    top = max(ys) or 1.0
    n = len(ys)
    bw = (width - 2) / n
    h = height - 16
    out = [f'<svg class="hist" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{escape(label)}"><title>{escape(label)}</title>']
    for i, (y, c) in enumerate(zip(ys, counts)):
        bh = y / top * h
        cls = classes[i] if classes else "bar"
        tip = f"{labels[i]}: " if labels else ""
        out.append(f'<rect class="{escape(cls)}" x="{_num(1 + i * bw)}" y="{_num(h - bh)}" '
                   f'width="{_num(max(bw - 1, 0.5))}" height="{_num(bh)}"><title>{escape(tip)}'
                   f'{escape(f"{float(c):,.0f}")}</title></rect>')
    out.append(f'<line class="axis" x1="0" y1="{h}" x2="{width}" y2="{h}"/>')
    if axis:
        out.append(f'<text x="1" y="{height - 3}" class="lbl">{escape(axis[0])}</text>')
        out.append(f'<text x="{width / 2}" y="{height - 3}" class="lbl mid">{escape(axis[1])}</text>')
        out.append(f'<text x="{width - 1}" y="{height - 3}" class="lbl end">{escape(axis[2])}</text>')
    out.append("</svg>")
    return Markup("".join(out))
