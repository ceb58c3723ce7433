"""Downloads of the browser's tables: CSV and JSON (`?format=csv|json` on a table page).

`download(rows, columns, name, fmt)` is the one place that builds them: CSV with a header row
(Python's csv module: quoting of commas, quotes and newlines in corpus text), lists and dicts as
JSON inside a cell, missing and non-finite numbers as empty cells, and text that a spreadsheet
would run as a formula (a leading =, +, -, @, tab or carriage return) behind a `'`; JSON as
{"columns", "rows"}, text raw, with non-finite numbers as null. The file name says what it holds (`ffkv-layer-3.csv`).

Ranks in downloads are 1-based (1 = the value's top token, as the pages show them and as a trigger's
`rank` is). A column that held a 0-based rank before (`rank` of the token, measure and layer
tables, `next_token_rank_in_value` of triggers.csv) is now 1-based, and its 0-based value stays
under the same name with `_0` (`one_based`), so a script reading the old numbers has a named column.

With the run's census (`ffkv census`; `download(..., census=Browser.census)`), a download whose rows
name memories (layer and dim columns: search results, layer lists) also carries each memory's row of
census.parquet, every column but layer and dim as `census.NAME` (class labels and the numbers behind
them, as the table stores them: `ffkv.steps.census.compute` documents them), after the download's
own columns (`with_census`). Without a census the download is as it was.
"""
from __future__ import annotations

import csv
import io
import json
import math
import re

from fastapi.responses import Response

FORMATS = ("csv", "json")


FORMULA = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet runs a cell starting so as a formula (OWASP)


def _cell(v):
    if v is None:
        return ""
    if isinstance(v, str):  # text only: a number's minus sign is no formula
        return "'" + v if v.startswith(FORMULA) else v
    if isinstance(v, float):
        return "" if math.isnan(v) or math.isinf(v) else repr(v)
    if isinstance(v, (list, tuple, dict, set)):
        return json.dumps(jsonable(v), ensure_ascii=False)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def jsonable(v):
    """JSON-safe: dict keys as text, sets sorted, numpy and torch scalars as Python, NaN/inf as None;
    what every JSON answer and download holds (`ffkv.web.params.api` too)."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [jsonable(x) for x in (sorted(v) if isinstance(v, set) else v)]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def to_csv(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([_cell(jsonable(r.get(c))) for c in columns])
    return buf.getvalue()


def one_based(rows: list[dict], columns: list[str], names) -> list[str]:
    """Each of `names` among `columns` (a 0-based rank) made 1-based in `rows`, its 0-based value
    kept as NAME_0 right after it; returns the columns with those added."""
    out = []
    for c in columns:
        out.append(c)
        if c in names:
            out.append(c + "_0")
            for r in rows:
                v = r.get(c)
                r[c + "_0"] = v
                r[c] = None if v is None else int(v) + 1
    return out


def check_format(fmt: str | None) -> str | None:
    """None for the HTML page; csv or json; anything else is a BadQuery."""
    from ffkv.web.tables import BadQuery

    if fmt is None or str(fmt).strip() in ("", "html"):
        return None
    if fmt not in FORMATS:
        raise BadQuery(f"format must be csv or json (got {str(fmt)[:20]!r})")
    return fmt


CENSUS_PREFIX = "census."  # a census column's name in a download: census.dead, census.skew, …


def with_census(rows: list[dict], columns: list[str], census) -> list[str]:
    """`columns` and then census.NAME for every column NAME of the `census` table (pyarrow, one row
    per memory; None: no census) but layer and dim, each row given its memory's values (None for a
    memory the census lacks). Rows without both layer and dim columns are left as they are."""
    if census is None or "layer" not in columns or "dim" not in columns:
        return columns
    import numpy as np

    names = [c for c in census.column_names if c not in ("layer", "dim")]
    layer = census.column("layer").to_numpy().astype(np.int64)
    dim = census.column("dim").to_numpy().astype(np.int64)
    width = int(dim.max()) + 1 if len(dim) else 1
    key = layer * width + dim
    order = np.argsort(key, kind="stable")
    want = np.array([-1 if r.get("layer") is None or r.get("dim") is None or not 0 <= int(r["dim"]) < width
                     else int(r["layer"]) * width + int(r["dim"]) for r in rows], np.int64)
    at = np.minimum(np.searchsorted(key[order], want), max(len(key) - 1, 0))
    found = (want >= 0) & (key[order][at] == want) if len(key) else np.zeros(len(rows), bool)
    got = census.select(names).take(order[at[found]]).to_pylist() if found.any() else []
    it = iter(got)
    for r, ok in zip(rows, found.tolist()):
        vals = next(it) if ok else {}
        for c in names:
            r[CENSUS_PREFIX + c] = vals.get(c)
    return [*columns, *(CENSUS_PREFIX + c for c in names)]


def download(rows: list[dict], columns: list[str], name: str, fmt: str, census=None) -> Response:
    """The rows as a CSV or JSON file named `name`.csv / .json (an attachment); with `census` (the
    run's census table, `Browser.census`) and rows of memories, their census columns after them
    (`with_census`)."""
    columns = with_census(rows, list(columns), census)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "ffkv"
    if fmt == "csv":
        body, media = to_csv(rows, columns), "text/csv; charset=utf-8"
    else:
        body = json.dumps({"columns": list(columns), "rows": [{c: jsonable(r.get(c)) for c in columns} for r in rows]},
                          ensure_ascii=False)
        media = "application/json"
    return Response(body, media_type=media,
                    headers={"Content-Disposition": f'attachment; filename="{name}.{fmt}"'})
