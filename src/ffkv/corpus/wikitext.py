"""Undo the WikiText tokenization so a modern tokenizer sees ordinary text."""
from __future__ import annotations

import re

_HEADING = re.compile(r"^\s*(=\s+)+.*?(\s+=)+\s*$")
_RULES = [
    (re.compile(r" @(?P<c>[-,.])@ "), r"\g<c>"),  # 1 @,@ 000 -> 1,000 ; well @-@ known
    (re.compile(r" (?P<p>[.,;:!?%)\]}])"), r"\g<p>"),  # space before closing punctuation
    (re.compile(r"(?P<p>[(\[{$]) "), r"\g<p>"),  # space after opening brackets, currency
    (re.compile(r" (?P<a>'(s|re|ve|d|ll|m|t)\b)"), r"\g<a>"),  # clitics: John 's -> John's
    (re.compile(r" (?P<a>n't\b)"), r"\g<a>"),  # do n't -> don't
    (re.compile(r"(?<=s) ' "), "' "),  # the series ' rookie -> the series' rookie
    (re.compile(r"(?P<q>\") (?P<w>[^\"]*?) \""), r'\g<q>\g<w>"'),  # " quoted " -> "quoted"
    (re.compile(r"\s{2,}"), " "),
]


def is_heading(line: str) -> bool:
    return bool(_HEADING.match(line))


def detokenize(line: str) -> str:
    """One WikiText paragraph line -> plain text."""
    s = line.strip()
    for pat, rep in _RULES:
        s = pat.sub(rep, s)
    return s.strip()
