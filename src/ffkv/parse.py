"""Parsers of user input shared by the CLI: integer ranges such as `0,3,5-7`, memory
interventions such as `12:345,3:7*0.5`."""
from __future__ import annotations

import math
from typing import NamedTuple

from ffkv.errors import FfkvError

MAX_RANGE = 1_000_000  # a range is expanded in memory; bigger ones are typos, not requests
MAX_DIGITS = 19  # past any index, count or seed of ffkv's; Python's int() raises past 4,300 digits
SHOWN = 40  # characters of a bad value echoed back in a message


def shown(text) -> str:
    """A user's value as a message quotes it: repr'd, and cut, so that a 5,000-digit probe is one
    short line."""
    t = str(text)
    return repr(t) if len(t) <= SHOWN else repr(t[:SHOWN]) + f"… ({len(t):,} characters)"


def parse_int(text, what: str, lo: int | None = None, hi: int | None = None) -> int:
    """The one reader of a whole number a user typed (CLI values, URL query parameters): ASCII
    digits with an optional sign, at most MAX_DIGITS of them, within lo..hi. Anything else is an
    FfkvError naming `what`; never Python's ValueError."""
    t = str(text).strip()
    body = t[1:] if t[:1] in ("+", "-") else t
    if not body or not (body.isascii() and body.isdigit()):
        raise FfkvError(f"{what} must be a whole number (got {shown(text)})")
    if len(body.lstrip("0")) > MAX_DIGITS:
        raise FfkvError(f"{what} is too large (got a number of {len(body.lstrip('0')):,} digits)")
    v = int(body.lstrip("0") or "0") * (-1 if t[0] == "-" else 1)  # int() of 4,300+ chars raises, zeros too
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        where = (f"between {lo} and {hi}" if lo is not None and hi is not None
                 else f"at least {lo}" if lo is not None else f"at most {hi}")
        raise FfkvError(f"{what} must be {where} (got {v})")
    return v


def parse_ranges(text: str, what: str, upper: int | None = None) -> list[int]:
    """'0,3,5-7' -> [0, 3, 5, 6, 7] (sorted, unique). Empty items are ignored.

    Raises FfkvError naming `what` for a non-number, a reversed range (5-2), a value outside
    0..upper-1 (when `upper` is given) or a range longer than MAX_RANGE.
    """
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part[1:]:
                a_s, b_s = part[0] + part[1:].split("-", 1)[0], part[1:].split("-", 1)[1]
                a, b = parse_int(a_s, what), parse_int(b_s, what)
            else:
                a = b = parse_int(part, what)
        except FfkvError as e:
            why = "is too large" if "too large" in str(e) else "is not an integer or a range like 5-7"
            raise FfkvError(f"{what} {shown(text)}: {shown(part)} {why}") from None
        if b < a:
            raise FfkvError(f"{what} {shown(text)}: the range {shown(part)} is reversed; write {b}-{a}")
        if b - a + 1 > MAX_RANGE:
            raise FfkvError(f"{what} {shown(text)}: the range {shown(part)} is longer than {MAX_RANGE:,}")
        if upper is not None and (a < 0 or b >= upper):
            bad = a if a < 0 or a >= upper else b
            raise FfkvError(f"{what} {bad} out of range 0..{upper - 1}")
        out.update(range(a, b + 1))
    return sorted(out)


def parse_int_list(text: str | None, upper: int, what: str) -> list[int] | None:
    """`--layers`/`--dims`: None, '' or 'all' mean every index; else `parse_ranges`."""
    if text is None or text.strip() in ("", "all"):
        return None
    out = parse_ranges(text, f"--{what}", upper)
    if not out:
        raise FfkvError(f"--{what} {shown(text)} selects nothing")
    return out


# ---- memory interventions: `L:D`, `L:D*F`, `L:D=V`, comma-separated ---------------------------

MAX_INTERVENTIONS = 10_000  # one URL or command line; more is a typo or an attack, not a request
INTERVENTION_OPS = ("scale", "set")


class Intervention(NamedTuple):
    """Edit memory `dim` of `layer`: op "scale" multiplies its coefficient m_i by `value`
    (0 suppresses it), op "set" replaces m_i by `value`."""
    layer: int
    dim: int
    op: str
    value: float

    def __str__(self) -> str:
        return f"{self.layer}:{self.dim}{'*' if self.op == 'scale' else '='}{self.value!r}"


def _finite(s: str, item: str, what: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise FfkvError(f"{what}: {shown(item)}: {shown(s)} is not a number") from None
    if not math.isfinite(v):
        raise FfkvError(f"{what}: {shown(item)}: {shown(s)} is not a finite number")
    return v


def parse_interventions(text: str | None, n_layers: int | None = None, d_m: int | None = None,
                        scale: float = 0.0, what: str = "--suppress") -> list[Intervention]:
    """'3:17,5:2*0.5,7:9=1.25' -> Interventions, in the order given.

    `L:D` scales memory D of layer L by `scale` (default 0: suppress it); `L:D*F` scales it by F;
    `L:D=V` sets its coefficient to V. Empty items are ignored; an item repeated identically counts
    once. Raises FfkvError naming `what` for a malformed item, a layer outside 0..n_layers-1 or a dim
    outside 0..d_m-1 (when given), a non-finite number, one memory given two different edits, or
    more than MAX_INTERVENTIONS items.
    """
    if not math.isfinite(scale):
        raise FfkvError(f"{what}: the scale {scale!r} is not a finite number")
    out: dict[tuple[int, int], Intervention] = {}
    items = [p.strip() for p in str(text or "").split(",")]
    items = [p for p in items if p]
    if len(items) > MAX_INTERVENTIONS:
        raise FfkvError(f"{what}: {len(items):,} memories; at most {MAX_INTERVENTIONS:,} at once")
    for item in items:
        head, op, val = item, "scale", scale
        for sym, name in (("=", "set"), ("*", "scale")):
            if sym in item:
                head, v = item.split(sym, 1)
                op, val = name, _finite(v.strip(), item, what)
                break
        parts = head.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() and p.strip().isascii() for p in parts):
            raise FfkvError(f"{what}: {shown(item)} is not LAYER:DIM (e.g. 12:345, 12:345*0.5 or 12:345=2.0)")
        layer, dim = (parse_int(p, f"{what}: {shown(item)}: the {n}", lo=0) for p, n in zip(parts, ("layer", "dim")))
        if n_layers is not None and layer >= n_layers:
            raise FfkvError(f"{what}: {shown(item)}: layer {layer} out of range 0..{n_layers - 1}")
        if d_m is not None and dim >= d_m:
            raise FfkvError(f"{what}: {shown(item)}: dim {dim} out of range 0..{d_m - 1}")
        iv = Intervention(layer, dim, op, float(val))
        prev = out.get((layer, dim))
        if prev is not None and prev != iv:
            raise FfkvError(f"{what}: memory {layer}:{dim} is given twice ({prev} and {iv})")
        out[(layer, dim)] = iv
    return list(out.values())


def format_interventions(ivs) -> str:
    """The inverse of `parse_interventions`: every item explicit (`L:D*F` or `L:D=V`)."""
    return ",".join(str(Intervention(*iv)) for iv in ivs)


def parse_sign(s) -> int:
    """+ or - (also +1/1/pos/positive, -1/neg/negative) -> 1 or -1; anything else: one line."""
    v = str(s).strip().lower()
    if v in ("+", "+1", "1", "pos", "positive"):
        return 1
    if v in ("-", "-1", "neg", "negative"):
        return -1
    raise FfkvError(f"--sign must be + or - (got {s!r})")
