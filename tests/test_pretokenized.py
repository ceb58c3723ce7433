"""Pre-tokenized corpora (`ffkv.corpus.tokens`): Parquet, .npy and flat uint16/uint32 streams mine
exactly as the same token ids given as text, and every malformed file is one line and exit 2."""
from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from conftest import WT2, mine_tiny, run_cli
from test_cli_errors import one_line_error
from test_mine import _assert_same_mine
from ffkv.corpus.sources import open_corpus, tokenize
from ffkv.corpus.tokens import vocab_digest, windows, write_parquet
from ffkv.errors import FfkvError

MINE = ("--top-k", "5", "--negative")


def _tok(tiny_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["gpt2"])


def _mine(out: Path, model: Path, corpus: Path, *extra) -> Path:
    res = run_cli("mine", "--out", out, "--model", model, "--corpus", corpus, *MINE, *extra)
    assert res.returncode == 0, res.stderr
    return out


def _sentences(run: Path) -> pa.Table:
    return pq.read_table(run / "sentences.parquet").sort_by("sentence_id")


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


# ---- the same ids, as text and as ids ----------------------------------------------------------
def test_text_and_parquet_ids_mine_alike(tiny_dirs, tmp_path):
    """The text run's own token ids, written to Parquet in the rows that the same seeded shuffle
    puts back in the text run's order, mine to the same triggers and key statistics."""
    text = mine_tiny(tmp_path / "text", tiny_dirs["gpt2"], 40, 5, "--negative")
    ids = _sentences(text).column("token_ids").to_pylist()
    perm = np.random.default_rng(0).permutation(len(ids))  # the source's document order (seed 0)
    rows = [None] * len(ids)
    for k, row in enumerate(perm):
        rows[row] = ids[k]
    p = write_parquet(tmp_path / "ids.parquet", rows, _tok(tiny_dirs))
    got = _mine(tmp_path / "ids", tiny_dirs["gpt2"], p)
    _assert_same_mine(got, text)
    g, w = _sentences(got), _sentences(text)
    assert g.column("token_ids").to_pylist() == ids
    assert g.column("n_tokens").equals(w.column("n_tokens"))
    assert g.column("doc_id").to_pylist() == [int(r) for r in perm]  # one row, one document
    tok = _tok(tiny_dirs)
    assert g.column("text").to_pylist() == tok.batch_decode(ids, skip_special_tokens=True)
    rec = _manifest(got)["corpus"]
    assert rec["kind"] == "parquet" and rec["column"] == "input_ids"
    assert rec["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert _manifest(text)["corpus"]["kind"] == "wikitext"


def test_parquet_npy_and_streams_mine_alike(tiny_dirs, tmp_path):
    """One stream of ids cut into rows of T: as Parquet rows, as an (N, T) .npy, as a .u16 and a
    .u32 stream with --context T, and as text-free rows of a Parquet file named by --field."""
    tok, T = _tok(tiny_dirs), 24
    text = " ".join((WT2 / "wiki.valid.tokens").read_text().split()[:3000])
    flat = np.array(tok(text)["input_ids"][: 30 * T], dtype=np.int64)
    rows = flat.reshape(-1, T)
    pq.write_table(pa.table({"note": ["x"] * len(rows), "ids": pa.array(rows.tolist(), pa.list_(pa.int64()))}),
                   tmp_path / "rows.parquet")
    np.save(tmp_path / "rows.npy", rows.astype(np.int32))
    flat.astype("<u2").tofile(tmp_path / "s.u16")
    flat.astype("<u4").tofile(tmp_path / "s.u32")
    flat.astype("<u2").tofile(tmp_path / "s.bin")
    want = _mine(tmp_path / "pq", tiny_dirs["gpt2"], tmp_path / "rows.parquet")
    assert _sentences(want).column("token_ids").to_pylist() == [
        rows[d].tolist() for d in np.random.default_rng(0).permutation(len(rows))]
    for name, src, extra in (("npy", "rows.npy", ()), ("u16", "s.u16", ("--context", T)),
                             ("u32", "s.u32", ("--context", T)), ("bin", "s.bin:u16", ("--context", T))):
        got = _mine(tmp_path / name, tiny_dirs["gpt2"], tmp_path / src, *extra)
        _assert_same_mine(got, want)
        assert _sentences(got).equals(_sentences(want)), name
        rec = _manifest(got)["corpus"]
        assert rec["kind"] == (name if name != "bin" else "u16")
        assert rec.get("context") == (T if name != "npy" else None)


def test_empty_rows_are_skipped_and_said(tiny_dirs, tmp_path):
    """Rows with no token are no sentences: left out of the tables, counted in the manifest and
    said in the summary, while the other rows keep their own row numbers as doc_id."""
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 200, size=int(n)).tolist() for n in rng.integers(1, 12, size=20)]
    for i in (4, 11, 17):
        rows[i] = []
    p = write_parquet(tmp_path / "ids.parquet", rows, _tok(tiny_dirs))
    res = run_cli("mine", "--out", tmp_path / "r", "--model", tiny_dirs["gpt2"], "--corpus", p, *MINE)
    assert res.returncode == 0, res.stderr
    assert "3 empty rows skipped" in res.stdout
    assert _manifest(tmp_path / "r")["corpus"]["counts"]["empty_rows"] == 3
    got = _sentences(tmp_path / "r")
    assert sorted(got.column("doc_id").to_pylist()) == [i for i in range(20) if rows[i]]
    assert all(got.column("token_ids").to_pylist()[k] == rows[d] for k, d in enumerate(got.column("doc_id").to_pylist()))


def test_stream_windows_are_the_hand_cut(tiny_dirs, tmp_path):
    """A stream of 10 ids in windows of 4: [0:4], [4:8], [8:10] (the last keeps the rest)."""
    ids = np.array([5, 7, 9, 11, 13, 15, 17, 19, 21, 23])
    assert windows(10, 4).tolist() == [0, 4, 8, 10]
    assert windows(8, 4).tolist() == [0, 4, 8]
    assert windows(3, 4).tolist() == [0, 3]
    assert windows(3, 1).tolist() == [0, 1, 2, 3]
    ids.astype("<u2").tofile(tmp_path / "t.u16")
    sents = open_corpus(str(tmp_path / "t.u16"), context=4).sentences(shuffle=False)
    assert [s.token_ids for s in sents] == [[5, 7, 9, 11], [13, 15, 17, 19], [21, 23]]
    assert [s.doc_id for s in sents] == [0, 1, 2]
    out = _mine(tmp_path / "r", tiny_dirs["gpt2"], tmp_path / "t.u16", "--context", "4")
    got = pq.read_table(out / "sentences.parquet").sort_by("doc_id")
    assert got.column("token_ids").to_pylist() == [[5, 7, 9, 11], [13, 15, 17, 19], [21, 23]]
    assert got.column("n_tokens").to_pylist() == [4, 4, 2]
    assert got.schema.names == ["sentence_id", "doc_id", "text", "token_ids", "n_tokens"]
    assert _manifest(out)["settings"]["mine"]["context"] == 4
    res = run_cli("corpus", tmp_path / "t.u16", "--context", "3", "--model", tiny_dirs["gpt2"], "--json")
    c = json.loads(res.stdout)
    assert (c["kind"], c["context"], c["documents"], c["sentences"], c["tokens"]) == ("u16", 3, 4, 4, 10)


def test_max_sentences_and_seed_pick_rows_as_for_documents(tmp_path):
    rows = [[i, i + 1] for i in range(1, 21)]
    write_parquet(tmp_path / "r.parquet", rows)
    for seed in (0, 3):
        sents = open_corpus(str(tmp_path / "r.parquet"), seed=seed).sentences(max_sentences=5)
        order = np.random.default_rng(seed).permutation(20)[:5]
        assert [s.token_ids for s in sents] == [rows[i] for i in order]
        assert [s.sentence_id for s in sents] == list(range(5))


def test_the_tokenizer_convention(tiny_dirs, tmp_path):
    """`write_parquet` names the tokenizer by its vocabulary's digest: the model's own is accepted;
    another vocabulary, or a bare name that is not the tokenizer's, is refused."""
    tok = _tok(tiny_dirs)
    meta = json.loads(pq.read_schema(write_parquet(tmp_path / "a.parquet", [[1, 2, 3]], tok)).metadata[b"tokenizer"])
    assert meta["vocab_sha256"] == vocab_digest(tok)
    sents = open_corpus(str(tmp_path / "a.parquet")).sentences()
    assert tokenize(tok, sents, 128)[0] == [[1, 2, 3]]
    for value in (json.dumps({"name": "gpt2", "vocab_sha256": "0" * 64}), "EleutherAI/pythia-70m"):
        t = pa.table({"input_ids": [[1, 2, 3]]}).replace_schema_metadata({"tokenizer": value})
        pq.write_table(t, tmp_path / "b.parquet")
        with pytest.raises(FfkvError, match="tokenized by"):
            tokenize(tok, open_corpus(str(tmp_path / "b.parquet")).sentences(), 128)
    t = pa.table({"input_ids": [[1, 2, 3]]}).replace_schema_metadata({"tokenizer": str(tiny_dirs["gpt2"])})
    pq.write_table(t, tmp_path / "c.parquet")
    assert tokenize(tok, open_corpus(str(tmp_path / "c.parquet")).sentences(), 128)[0] == [[1, 2, 3]]


# ---- malformed files: one line, exit 2, before any forward pass -------------------------------
def _malformed(tmp_path: Path, vocab: int) -> dict[str, tuple[str, tuple, str]]:
    """name -> (corpus spec, extra flags, a word of the error)."""
    d = tmp_path
    np.save(d / "float.npy", np.ones((2, 3), np.float32))
    np.save(d / "flat.npy", np.ones(6, np.int64))
    np.save(d / "cube.npy", np.ones((2, 3, 4), np.int64))
    np.save(d / "none.npy", np.zeros((0, 4), np.int64))
    np.save(d / "neg.npy", np.array([[1, 2], [3, -1]]))
    np.save(d / "big.npy", np.array([[1, 2], [3, vocab]]))
    np.save(d / "bool.npy", np.ones((2, 2), bool))
    (d / "obj.npy").write_bytes(pickle.dumps([[1, 2]]))
    (d / "noise.npy").write_bytes(bytes(range(200)))
    pq.write_table(pa.table({"text": ["a", "b"]}), d / "text.parquet")
    pq.write_table(pa.table({"x": pa.array([[1.0]], pa.list_(pa.float32()))}), d / "floats.parquet")
    pq.write_table(pa.table({"ids": pa.array([], pa.list_(pa.int32()))}), d / "rows0.parquet")
    pq.write_table(pa.table({"ids": pa.array([[], []], pa.list_(pa.int32()))}), d / "empty_rows.parquet")
    pq.write_table(pa.table({"ids": pa.array([[1], None], pa.list_(pa.int32()))}), d / "null.parquet")
    pq.write_table(pa.table({"ids": pa.array([[1, None]], pa.list_(pa.int32()))}), d / "nullid.parquet")
    pq.write_table(pa.table({"ids": pa.array([[1, vocab + 5]], pa.list_(pa.int32()))}), d / "big.parquet")
    pq.write_table(pa.table({"ids": pa.array([[1, 2]], pa.list_(pa.int32()))}).replace_schema_metadata(
        {"tokenizer": json.dumps({"name": "meta-llama/Llama-3.2-1B", "vocab_sha256": "ab" * 32})}), d / "other.parquet")
    (d / "noise.parquet").write_bytes(b"PAR1" + bytes(range(100)))
    (d / "empty.u16").write_bytes(b"")
    (d / "odd.u16").write_bytes(b"\x01\x00\x02")
    np.array([1, 65535], "<u2").tofile(d / "big.u16")
    np.array([1, 2**31], "<u4").tofile(d / "big.u32")
    np.array([1, 2, 3], "<u2").tofile(d / "ok.u16")
    return {
        "float": ("float.npy", (), "integers"), "1-D": ("flat.npy", (), "shape"),
        "3-D": ("cube.npy", (), "shape"), "no rows": ("none.npy", (), "empty"),
        "negative": ("neg.npy", (), "negative"), "past vocab (npy)": ("big.npy", (), "vocabulary"),
        "bool": ("bool.npy", (), "integers"), "pickle": ("obj.npy", (), "not a readable"),
        "noise npy": ("noise.npy", (), "not a readable"), "text parquet": ("text.parquet", (), "list-of-integers"),
        "float lists": ("floats.parquet", (), "list-of-integers"), "0 rows": ("rows0.parquet", (), "empty"),
        "empty rows": ("empty_rows.parquet", (), "empty"), "null row": ("null.parquet", (), "null"),
        "null id": ("nullid.parquet", (), "null"), "past vocab (parquet)": ("big.parquet", (), "vocabulary"),
        "other tokenizer": ("other.parquet", (), "tokenized by"), "noise parquet": ("noise.parquet", (), "Parquet"),
        "no such column": ("big.parquet:input", (), "no column"), "column not ids": ("text.parquet:text", (), "not lists"),
        "field not ids": ("text.parquet", ("--field", "text2"), "no column"),
        "empty stream": ("empty.u16", (), "empty"), "odd bytes": ("odd.u16", (), "whole number"),
        "past vocab (u16)": ("big.u16", (), "vocabulary"), "past vocab (u32)": ("big.u32", (), "vocabulary"),
        "context past the model's": ("ok.u16", ("--context", "129"), "context"),
    }


@pytest.mark.parametrize("prefetch", ["0", "2"])
def test_malformed_files_are_one_line(tiny_dirs, tmp_path, prefetch):
    """Also when the stream runs in the prefetch thread, where the ids past the vocabulary are
    found (`ffkv.corpus.stream.prefetched` raises its errors in the miner's thread)."""
    vocab = len(_tok(tiny_dirs))
    for name, (src, extra, needle) in _malformed(tmp_path, vocab).items():
        out = tmp_path / "r"
        res = run_cli("mine", "--out", out, "--model", tiny_dirs["gpt2"], "--corpus", tmp_path / src,
                      "--prefetch", prefetch, *extra)
        line = one_line_error(res, needle=needle)
        assert not (out / "triggers.parquet").exists(), name
        assert line, name


def test_malformed_file_through_corpus_command(tiny_dirs, tmp_path):
    np.save(tmp_path / "big.npy", np.array([[1, 2], [3, 10**6]]))
    one_line_error(run_cli("corpus", tmp_path / "big.npy", "--model", tiny_dirs["gpt2"]), needle="vocabulary")


DTYPES = st.sampled_from(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                          "float32", "float64", "bool"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_npy_is_read_or_one_line(tiny_dirs, tmp_path, data):
    """Any array of any dtype and shape: accepted exactly when it is (N, T) of integers in the
    vocabulary with a token, otherwise one line through the CLI (exit 2)."""
    tok = _tok(tiny_dirs)
    dtype = np.dtype(data.draw(DTYPES))
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    elems = st.integers(-3, len(tok) + 3) if dtype.kind in "iu" else None
    if elems is not None:
        info = np.iinfo(dtype)
        elems = st.integers(max(-3, int(info.min)), min(len(tok) + 3, int(info.max)))
    a = data.draw(hnp.arrays(dtype, shape, elements=elems))
    f = tmp_path / "c.npy"
    np.save(f, a)
    ok = (dtype.kind in "iu" and a.ndim == 2 and a.size > 0 and int(a.min()) >= 0 and int(a.max()) < len(tok))
    res = run_cli("corpus", f, "--model", tiny_dirs["gpt2"], "--json")
    if ok:
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["tokens"] == a.size
    else:
        one_line_error(res)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64), st.sampled_from([".u16", ".u32", ".npy", ".parquet"]))
def test_any_bytes_are_read_or_one_line(tiny_dirs, tmp_path, data, suffix):
    """Any bytes under a token file's name: a stream is accepted exactly when it is a whole number
    of ids, at least one, all in the vocabulary; anything else is one line."""
    vocab = len(_tok(tiny_dirs))
    f = tmp_path / f"c{suffix}"
    f.write_bytes(data)
    res = run_cli("corpus", f, "--model", tiny_dirs["gpt2"], "--json")
    if suffix in (".u16", ".u32"):
        w = 2 if suffix == ".u16" else 4
        ids = np.frombuffer(data, f"<u{w}") if len(data) % w == 0 else None
        ok = ids is not None and len(ids) > 0 and int(ids.max()) < vocab
        if ok:
            assert res.returncode == 0, res.stderr
            assert json.loads(res.stdout)["tokens"] == len(ids)
            return
    if res.returncode != 0 or suffix in (".u16", ".u32"):
        one_line_error(res)


LIST_TYPES = st.sampled_from(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                              "float32", "string"])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_parquet_list_column_is_read_or_one_line(tiny_dirs, tmp_path, data):
    """Rows of any list type, with null rows and null ids: accepted exactly when the lists hold
    integers, nothing is null, at least one id, all in the vocabulary."""
    vocab = len(_tok(tiny_dirs))
    kind = data.draw(LIST_TYPES)
    item = st.text(max_size=3) if kind == "string" else (
        st.floats(-2, vocab + 2, allow_nan=False) if kind == "float32" else st.integers(
            max(-3, int(np.iinfo(kind).min)), min(vocab + 3, int(np.iinfo(kind).max))))
    rows = data.draw(st.lists(st.none() | st.lists(st.none() | item, max_size=5), max_size=5))
    f = tmp_path / "c.parquet"
    pq.write_table(pa.table({"ids": pa.array(rows, pa.list_(pa.from_numpy_dtype(np.dtype(kind))
                                                            if kind != "string" else pa.string()))}), f)
    ids = [v for r in rows if r is not None for v in r]
    ok = (kind not in ("string", "float32") and all(r is not None for r in rows) and len(ids) > 0
          and None not in ids and min(ids) >= 0 and max(ids) < vocab)
    res = run_cli("corpus", f, "--model", tiny_dirs["gpt2"], "--json")
    if ok:
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["tokens"] == len(ids)
    else:
        one_line_error(res)


def test_context_enters_the_record_only_when_set():
    """Runs mined before --context existed keep their record (so they resume, or are done)."""
    from ffkv.steps.mine import MineSettings

    assert "context" not in MineSettings().record()
    assert MineSettings(context=64).record()["context"] == 64
