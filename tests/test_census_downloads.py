"""CSV and JSON downloads carry the census (issue 46, item 4): a download of memories (search
results, a layer's list) gains every column of census.parquet but layer and dim, as census.NAME,
after its own columns, which stay as they were; without a census it is unchanged.

A tiny Llama run (30 WikiText-2 sentences, top 3, `reference_mine`), copied bare, then censused
in process. The expected values are census.parquet read here with pyarrow."""
from __future__ import annotations

import csv
import io
import json
import math
import shutil

import pyarrow.parquet as pq
import pytest

from conftest import browser_client


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_mine, tiny_dirs, tiny_models):
    from ffkv.steps.census.compute import compute_census
    from ffkv.store.run import Run

    root = tmp_path_factory.mktemp("census-downloads")
    run, bare = root / "run", root / "bare"
    shutil.copytree(reference_mine(tiny_dirs["llama"], 30, 3), run)
    shutil.copytree(run, bare)
    compute_census(Run(run), tiny_models["llama"], show_progress=False)
    return run, bare


@pytest.fixture(scope="module")
def census(runs):
    t = pq.read_table(runs[0] / "census.parquet")
    names = [c for c in t.column_names if c not in ("layer", "dim")]
    return names, {(r["layer"], r["dim"]): r for r in t.to_pylist()}


def _browser(run):
    from ffkv.web.data import Browser

    return Browser(run, log=lambda m: None)


def _parse(resp, fmt):
    if fmt == "json":
        j = json.loads(resp.body if hasattr(resp, "body") else resp.content)
        return j["columns"], j["rows"]
    text = (resp.body if hasattr(resp, "body") else resp.content).decode("utf-8")
    rows = list(csv.reader(io.StringIO(text)))
    return rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]


def _same(cell, want, fmt) -> bool:
    """A download's cell against census.parquet's value (CSV: text as `ffkv.web.export` writes it)."""
    if fmt == "json":
        if isinstance(want, float) and not math.isfinite(want):
            return cell is None
        return cell == want
    if want is None or (isinstance(want, float) and not math.isfinite(want)):
        return cell == ""
    if isinstance(want, bool):
        return cell == ("true" if want else "false")
    if isinstance(want, float):
        return float(cell) == want
    if isinstance(want, int):
        return int(cell) == want
    return cell == want


def _check(columns, rows, own, census, fmt):
    names, by_key = census
    assert columns == [*own, *(f"census.{c}" for c in names)]
    assert rows
    for r in rows:
        want = by_key[(int(r["layer"]), int(r["dim"]))]
        for c in names:
            assert _same(r[f"census.{c}"], want[c], fmt), (fmt, r["layer"], r["dim"], c, r[f"census.{c}"], want[c])


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_layer_list_and_search_downloads_carry_the_census(runs, census, fmt):
    from ffkv.web import export
    from ffkv.web.layers import MEMORY_COLUMNS, layer_memories

    b = _browser(runs[0])
    rows = layer_memories(b, 1)
    own = export.one_based(rows, list(MEMORY_COLUMNS), ("rank",))
    _check(*_parse(export.download(rows, own, "ffkv-layer-1", fmt, census=b.census), fmt), own, census, fmt)
    res = b.search_measure(sort="max_prob", order="desc", page=1, per_page=200)["results"]
    own = ["layer", "dim", "max_prob", "top_token"]
    _check(*_parse(export.download(res, own, "ffkv-search", fmt, census=b.census), fmt), own, census, fmt)


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_without_a_census_the_download_is_unchanged(runs, fmt):
    from ffkv.web import export
    from ffkv.web.layers import MEMORY_COLUMNS, layer_memories

    b = _browser(runs[1])
    assert b.census is None
    rows = layer_memories(b, 1)
    own = export.one_based(rows, list(MEMORY_COLUMNS), ("rank",))
    plain = export.download([dict(r) for r in rows], own, "x", fmt)
    assert export.download([dict(r) for r in rows], own, "x", fmt, census=b.census).body == plain.body
    assert _parse(plain, fmt)[0] == own
    # a table without memories (no layer and dim) is left as it is, census or not
    b2 = _browser(runs[0])
    rows = [{"a": 1, "b": "x"}]
    assert _parse(export.download(rows, ["a", "b"], "x", fmt, census=b2.census), fmt)[0] == ["a", "b"]


_client = browser_client


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_the_browsers_downloads_carry_the_census(runs, census, fmt):
    c = _client(runs[0])
    cols, rows = _parse(c.get(f"/layer/1?format={fmt}"), fmt)
    own = [x for x in cols if not x.startswith("census.")]
    _check(cols, rows, own, census, fmt)
    cols, rows = _parse(c.get(f"/search?sort=max_prob&format={fmt}"), fmt)
    own = [x for x in cols if not x.startswith("census.")]
    _check(cols, rows, own, census, fmt)
