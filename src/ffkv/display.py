r"""Text from a corpus or a vocabulary, made safe to show on a terminal or in a page.

Control characters (NUL, escape sequences) and bidirectional overrides in corpus text would
otherwise reach a terminal or the report raw: an unclosed right-to-left override reverses
everything after it. They are shown as visible escapes instead; the stored text is unchanged.

A token is shown, and typed back, in one notation (`show_token` and its inverse `read_token`,
used by the browser, the explorer and the report): ␣ for a space (at a token's ends, or
everywhere in a token that has one there or is only whitespace), ↵ for a newline, → for a tab;
other control, bidi and invisible whitespace characters as \xNN / \uNNNN; a backslash that
would start one of these escapes as \\; the three marks themselves, when a token really holds
them, as \u2423, \u21b5 and \u2192. So `read_token(show_token(t)) == t` for every string
(but lone surrogates, which are no text).
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


# ---- one notation for tokens ---------------------------------------------------------------------
SPACE, NEWLINE, TAB = "\u2423", "\u21b5", "\u2192"  # ␣ ↵ →
MARKS = {SPACE: " ", NEWLINE: "\n", TAB: "\t"}
_ESCAPE_NEXT = set("\\ntrxuU")  # a backslash before one of these starts an escape when read


def _shown_char(c: str) -> str:
    if c == "\n":
        return NEWLINE
    if c == "\t":
        return TAB
    o = ord(c)
    if c in MARKS or _UNSAFE.match(c) or (c.isspace() and c != " ") or 0xD800 <= o <= 0xDFFF:
        # a real ␣, ↵ or → is escaped too, so that it reads back as itself
        return f"\\x{o:02x}" if o < 0x100 else (f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return c


def show_token(text: str | None, inline: bool = False) -> str:
    """A vocabulary token made visible (escaping for HTML is the caller's job).

    Alone (`inline=False`: a token in a table or a list): ∅ for a missing or empty token; spaces
    as ␣ when the token starts or ends with one or is only whitespace, newlines as ↵, tabs as →,
    invisible characters as escapes (see the module docstring; `read_token` reads it back).
    Inline (the marked trigger at the end of a prefix, where the text runs on): the token as
    `printable` shows it, unless it is only whitespace, which would be an empty mark: then
    the same marks as alone.
    """
    if text is None or text == "":
        return "∅"
    s = str(text)
    if inline and s.strip():
        return printable(s)
    pieces = [_shown_char(c) for c in s]
    for i in range(len(s) - 1):  # a backslash that would read as an escape with what follows it
        if s[i] == "\\" and pieces[i + 1][0] in _ESCAPE_NEXT:
            pieces[i] = "\\\\"
    out = "".join(pieces)
    if s.strip(" ") != s or not s.strip():
        out = out.replace(" ", SPACE)
    return out


_READ = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[\\ntr])|\\([xuU])|[\u2423\u21b5\u2192]")


def read_token(typed: str) -> str:
    """The token text a user typed in `show_token`'s notation: ␣ → space, ↵ → newline,
    → → tab; escapes \\n \\t \\r \\\\ \\xNN \\uNNNN \\UNNNNNNNN. Any other backslash stays
    itself. A \\x, \\u or \\U without its hex digits, or a code point that is not a
    character, is a ValueError with a one-line reason."""
    def one(m: re.Match) -> str:
        if m.group(2):
            n = {"x": 2, "u": 4, "U": 8}[m.group(2)]
            raise ValueError(f"\\{m.group(2)} must be followed by {n} hex digits (type \\\\ for a backslash)")
        e = m.group(1)
        if e is None:
            return MARKS[m.group()]
        if len(e) == 1:
            return {"\\": "\\", "n": "\n", "t": "\t", "r": "\r"}[e]
        cp = int(e[1:], 16)
        if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
            raise ValueError(f"\\{e} is not a unicode character")
        return chr(cp)

    return _READ.sub(one, typed)
