"""A corpus's shape is never guessed silently (issue 49): which Parquet column holds the ids, and
text files whose lines never end."""
from __future__ import annotations

import io
import os
import threading
import time
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from conftest import run_cli
from test_cli_errors import one_line_error

from ffkv.corpus.sources import FileDocs, CorpusStats, bounded_lines
from ffkv.corpus.tokens import read_tokens
from ffkv.errors import FfkvError

IDS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _hf_file(path, order):
    """An HF-style file: ids, a mask and labels, all lists of integers, in the order given."""
    cols = {"input_ids": IDS, "attention_mask": [[1] * len(r) for r in IDS],
            "labels": [[-100] + r[1:] for r in IDS], "position_ids": [list(range(len(r))) for r in IDS]}
    pq.write_table(pa.table({c: pa.array(cols[c], pa.list_(pa.int32())) for c in order}), path)
    return path


def _rows(t):
    return [t.values[t.offsets[i]:t.offsets[i + 1]].tolist() for i in range(t.n_rows)]


@pytest.mark.parametrize("order", [("attention_mask", "input_ids"), ("labels", "position_ids", "input_ids"),
                                   ("input_ids", "labels")])
def test_the_ids_column_is_input_ids_whatever_comes_first(tmp_path, order):
    t = read_tokens(_hf_file(tmp_path / "c.parquet", order), "parquet")
    assert t.details["column"] == "input_ids"
    assert _rows(t) == IDS


def test_tokens_is_the_other_ids_name(tmp_path):
    pq.write_table(pa.table({"mask": pa.array([[1, 1]], pa.list_(pa.int64())),
                             "tokens": pa.array([[3, 4]], pa.list_(pa.int64()))}), tmp_path / "t.parquet")
    t = read_tokens(tmp_path / "t.parquet", "parquet")
    assert t.details["column"] == "tokens" and _rows(t) == [[3, 4]]


@pytest.mark.parametrize("order", [("attention_mask", "labels"), ("labels", "position_ids")])
def test_several_integer_columns_without_an_ids_name_are_refused(tmp_path, order):
    p = _hf_file(tmp_path / "amb.parquet", order)
    with pytest.raises(FfkvError) as e:
        read_tokens(p, "parquet")
    assert all(c in str(e.value) for c in order) and "--field" in str(e.value)
    named = next(c for c in order if c != "labels")  # labels hold -100: not ids
    t = read_tokens(p, "parquet", column=named)  # named: read as asked
    assert t.details["column"] == named


def test_ambiguous_file_through_the_cli_is_one_line(tmp_path):
    p = _hf_file(tmp_path / "amb.parquet", ("attention_mask", "labels"))
    one_line_error(run_cli("corpus", p), needle="--field")


def test_one_integer_column_of_any_name_is_read(tmp_path):
    pq.write_table(pa.table({"text": ["a"], "ids": pa.array([[1, 2, 3]], pa.list_(pa.int32()))}), tmp_path / "o.parquet")
    t = read_tokens(tmp_path / "o.parquet", "parquet")
    assert t.details["column"] == "ids" and _rows(t) == [[1, 2, 3]]


# --- lines without end -------------------------------------------------------------------------

def test_dev_zero_is_refused_at_once_in_constant_memory():
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(FfkvError, match="NUL"):
        FileDocs.index(__import__("pathlib").Path("/dev/zero"), CorpusStats(), "plain")
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert took < 1.0, took
    assert peak < 8 << 20, peak


@pytest.mark.parametrize("how", ["dev-zero", "jsonl-link"])
def test_dev_zero_through_the_corpus_command(tmp_path, how):
    path = "/dev/zero"
    if how == "jsonl-link":
        os.symlink("/dev/zero", tmp_path / "z.jsonl")
        path = tmp_path / "z.jsonl"
    res = run_cli("corpus", path, "--head", "1")
    line = one_line_error(res, needle="NUL")
    assert "--batch-tokens" not in line


def _fifo_writer(path, data: bytes):
    def write():
        try:
            with open(path, "wb") as f:
                for i in range(0, len(data), 1 << 16):
                    f.write(data[i:i + (1 << 16)])
        except BrokenPipeError:  # the reader refused and closed: as intended
            pass
    th = threading.Thread(target=write, daemon=True)
    th.start()
    return th


def test_a_fifo_that_never_ends_a_line_is_refused(tmp_path):
    """No NUL byte here: the length bound alone stops it."""
    fifo = tmp_path / "f.txt"
    os.mkfifo(fifo)
    th = _fifo_writer(fifo, b"a" * (3 << 20))
    with open(fifo, "rb") as f, pytest.raises(FfkvError, match="longer than 2 MiB"):
        for _ in bounded_lines(f, fifo, limit=2 << 20, piece=1 << 16):
            pass
    th.join(5)


def test_a_long_line_of_a_real_file_is_refused_through_the_cli(tmp_path):
    from ffkv.corpus import sources

    p = tmp_path / "long.txt"
    p.write_bytes(b"word " * ((sources.MAX_LINE // 5) + 10))
    one_line_error(run_cli("corpus", p, "--head", "1"), needle="longer than")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\x00", b"x")), max_size=12),
       st.integers(1, 9), st.booleans())
def test_bounded_lines_are_the_file_lines(parts, piece, trailing):
    """Under the bound, the lines are exactly what iterating the file gives, whatever the piece
    size (1 byte included)."""
    data = b"\n".join(parts) + (b"\n" if trailing else b"")
    want = io.BytesIO(data).readlines()
    assert list(bounded_lines(io.BytesIO(data), "x", limit=1000, piece=piece)) == want


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=60), st.integers(1, 7), st.integers(0, 80))
def test_any_line_past_the_bound_or_with_a_nul_is_refused(data, piece, limit):
    lines = io.BytesIO(data).readlines()
    bad = b"\x00" in data or any(len(l) > limit for l in lines)
    got = None
    try:
        got = list(bounded_lines(io.BytesIO(data), "x", limit=limit, piece=piece))
    except FfkvError as e:
        assert "\n" not in str(e)
    if not bad:
        assert got == lines
    elif b"\x00" in data:
        assert got is None


def test_a_mask_before_the_ids_mines_the_ids_and_says_which_column(tiny_dirs, tmp_path):
    """The issue's case end to end: `attention_mask` (all 1s) first, `input_ids` second. The run
    mines the ids, records the column and prints it."""
    from transformers import AutoTokenizer

    from ffkv.corpus.tokens import write_parquet

    tok = AutoTokenizer.from_pretrained(tiny_dirs["gpt2"])
    rows = [tok(t)["input_ids"] for t in ("The cat sat on the mat.", "A river runs to the sea.", "Rain fell.")]
    ids = pq.read_table(write_parquet(tmp_path / "ids.parquet", rows, tok))
    mask = pa.array([[1] * len(r) for r in rows], pa.list_(pa.int32()))
    both = pa.table({"attention_mask": mask, "input_ids": ids.column("input_ids")}).replace_schema_metadata(
        ids.schema.metadata)
    pq.write_table(both, tmp_path / "hf.parquet")
    res = run_cli("mine", "--out", tmp_path / "r", "--model", tiny_dirs["gpt2"], "--corpus", tmp_path / "hf.parquet",
                  "--top-k", "3")
    assert res.returncode == 0, res.stderr
    assert "ids from column input_ids" in res.stdout
    got = pq.read_table(tmp_path / "r" / "sentences.parquet").sort_by("sentence_id").column("token_ids").to_pylist()
    assert sorted(got) == sorted(rows)
