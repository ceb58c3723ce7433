"""Parsers of user input shared by the CLI: integer ranges such as `0,3,5-7`."""
from __future__ import annotations

from ffkv.errors import FfkvError

MAX_RANGE = 1_000_000  # a range is expanded in memory; bigger ones are typos, not requests


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
                a, b = int(a_s), int(b_s)
            else:
                a = b = int(part)
        except ValueError:
            raise FfkvError(f"{what} {text!r}: {part!r} is not a number or a range like 5-7") from None
        if b < a:
            raise FfkvError(f"{what} {text!r}: the range {part!r} is reversed; write {b}-{a}")
        if b - a + 1 > MAX_RANGE:
            raise FfkvError(f"{what} {text!r}: the range {part!r} is longer than {MAX_RANGE:,}")
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
        raise FfkvError(f"--{what} {text!r} selects nothing")
    return out
