"""CSV downloads are safe to open in a spreadsheet (issue 49): text cells that a spreadsheet would
run as a formula carry a leading `'`; numbers keep their sign; JSON keeps the raw text."""
from __future__ import annotations

import csv
import io
import json

from hypothesis import given, settings, strategies as st

from ffkv.web.export import FORMULA, download, to_csv

RISKY = ["=HYPERLINK(\"http://x\",\"click\")", "+1+1", "-2+3", "@SUM(A1)", "\tlead", "\rlead", "=1"]


def _parse(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text, newline="")))


def test_formula_cells_are_escaped_and_numbers_are_not():
    rows = [{"note": s, "coef": -0.5, "n": -3} for s in RISKY] + [{"note": "plain = text", "coef": 1.0, "n": 2}]
    got = _parse(to_csv(rows, ["note", "coef", "n"]))
    assert [r["note"] for r in got] == ["'" + s for s in RISKY] + ["plain = text"]
    assert [float(r["coef"]) for r in got] == [-0.5] * len(RISKY) + [1.0]
    assert [int(r["n"]) for r in got] == [-3] * len(RISKY) + [2]


def test_json_download_keeps_the_raw_text():
    rows = [{"note": s} for s in RISKY]
    body = json.loads(download(rows, ["note"], "x", "json").body)
    assert [r[0] if isinstance(r, list) else r["note"] for r in body["rows"]] == RISKY
    csv_body = download(rows, ["note"], "x", "csv").body.decode()
    assert [r["note"] for r in _parse(csv_body)] == ["'" + s for s in RISKY]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=30), min_size=1, max_size=5))
def test_any_text_reads_back_as_itself_or_escaped(texts):
    got = [r["t"] for r in _parse(to_csv([{"t": t} for t in texts], ["t"]))]
    for t, g in zip(texts, got):
        assert g == ("'" + t if t.startswith(FORMULA) else t)
        assert not g.startswith(FORMULA)
