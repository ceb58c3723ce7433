"""JSON-lines parsing shared by corpus readers and annotation import."""
from __future__ import annotations

import json
from typing import Iterator

from ffkv.errors import FfkvError


def json_objects(text: str, where: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line; a bad line is a one-line FfkvError naming `where`."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise FfkvError(f"{where} line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise FfkvError(f"{where} line {n}: expected a JSON object")
        yield n, rec
