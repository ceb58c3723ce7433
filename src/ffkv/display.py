"""Text from a corpus or a vocabulary, made safe to show on a terminal or in a page.

Control characters (NUL, escape sequences) and bidirectional overrides in corpus text would
otherwise reach a terminal or the report raw: an unclosed right-to-left override reverses
everything after it. They are shown as visible escapes instead; the stored text is unchanged.
"""
from __future__ import annotations

import math
import numbers
import re

# C0 and C1 controls except tab and newline, DEL, and the bidi embedding/override/isolate marks.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str | None, newlines: bool = True) -> str | None:
    """`text` with every unsafe character replaced by its escape (e.g. \\x00, \\u202e)."""
    if text is None:
        return None
    out = _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    return out if newlines else out.replace("\n", "\\n").replace("\t", " ")


def number(x, digits: int = 3, missing: str = "", yes_no: bool = False, whole_from: float = 100) -> str:
    """A table cell: integers with thousands separators, reals from `whole_from` up as whole
    numbers, smaller ones to `digits` significant digits; `missing` for None and NaN. The report
    and the browser differ only in those options."""
    if x is None:
        return missing
    if isinstance(x, bool):
        return ("yes" if x else "no") if yes_no else str(x)
    if isinstance(x, numbers.Integral):
        return f"{int(x):,}"
    if isinstance(x, numbers.Real):
        x = float(x)
        if math.isnan(x):
            return missing
        if x == 0:
            return "0"
        return f"{x:,.0f}" if abs(x) >= whole_from else f"{x:.{digits}g}"
    return str(x)
