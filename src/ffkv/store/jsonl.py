"""JSON-lines parsing shared by corpus readers and annotation import."""
from __future__ import annotations

import json
from typing import Iterator

from ffkv.errors import FfkvError


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def json_objects(text: str, where: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line; a bad line is a one-line FfkvError naming `where`."""
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield n, json_object(line, n, where)


def json_object(line: str, n: int, where: str) -> dict:
    """Line n (a non-blank line) as a JSON object; anything else is a one-line FfkvError."""
    try:
        rec = json.loads(line, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise FfkvError(f"{where} line {n}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise FfkvError(f"{where} line {n}: JSON nested too deeply") from None
    except ValueError as e:  # NaN / Infinity
        raise FfkvError(f"{where} line {n}: {e}") from None
    if not isinstance(rec, dict):
        raise FfkvError(f"{where} line {n}: expected a JSON object")
    return rec
