"""The read API: DuckDB views equal the Parquet tables; damaged tables are one-line errors."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from ffkv.errors import FfkvError
from ffkv.store import query
from ffkv.store.run import Run


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path / "r", create=True)
    r.save()
    rng = np.random.default_rng(0)
    r.write_table("t", pa.table({"layer": rng.integers(0, 4, 500), "x": rng.normal(size=500)}))
    return r


def test_sql_equals_the_table(run):
    got = query.sql(run, "select layer, sum(x) s from t where layer >= ? group by layer order by layer", [1])
    t = query.table(run, "t")
    for layer, s in zip(got["layer"].to_pylist(), got["s"].to_pylist()):
        want = pc.sum(t.filter(pc.equal(t["layer"], layer))["x"]).as_py()
        assert s == pytest.approx(want)
    assert got["layer"].to_pylist() == [1, 2, 3]
    assert query.tables(run) == ["t"]


def test_damaged_or_missing_tables_are_one_line(run):
    (run.path / "t.parquet").write_bytes(b"not parquet")
    with pytest.raises(FfkvError, match="unreadable"):
        query.table(run, "t")
    with pytest.raises(FfkvError, match="no `u` table"):
        query.table(run, "u")
