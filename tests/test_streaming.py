"""The streamed corpus (`ffkv.corpus.stream`) and the mining pass over it (issue 24 item 3): the
same rows and tables whatever the chunk size, task size or number of worker processes, and a
SIGKILL mid-stream resumes without a sentence lost or repeated."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import WT2, kill_mine_when, run_cli
from test_mine import _assert_same_mine

CORPUS = WT2 / "wiki.valid.tokens"
ARGS = ("--corpus", CORPUS, "--top-k", "5", "--negative", "--batch-tokens", "64")


def _tok(tiny_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["gpt2"])


def _expected(tok, spec, max_sentences, max_length, min_tokens=1, seed=0) -> pa.Table:
    """The rows as the whole-corpus path builds them: every sentence split, then tokenized."""
    from ffkv.corpus.sources import open_corpus, tokenize

    sents = open_corpus(spec, seed=seed).sentences(max_sentences=max_sentences)
    ids, _ = tokenize(tok, sents, max_length, None)
    keep = [i for i, t in enumerate(ids) if len(t) >= min_tokens]
    return pa.table({"sentence_id": pa.array([sents[i].sentence_id for i in keep], pa.int64()),
                     "doc_id": pa.array([sents[i].doc_id for i in keep], pa.int64()),
                     "text": pa.array([sents[i].text for i in keep], pa.string()),
                     "token_ids": pa.array([ids[i] for i in keep], pa.list_(pa.int32())),
                     "n_tokens": pa.array([len(ids[i]) for i in keep], pa.int32())})


def _streamed(tok, spec, max_sentences, max_length, **kw):
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import SentenceStream

    s = SentenceStream(open_corpus(spec, seed=kw.pop("seed", 0)), tok, max_length, None, max_sentences, **kw)
    chunks = list(s)
    from ffkv.corpus.stream import SCHEMA

    return chunks, pa.concat_tables([c.table() for c in chunks]) if chunks else SCHEMA.empty_table(), s.counts


@pytest.mark.parametrize("chunk,per_task,workers", [(4096, 32, 0), (37, 1, 0), (1, 7, 0), (50, 5, 2)])
def test_stream_rows_do_not_depend_on_chunks_tasks_or_workers(tiny_dirs, chunk, per_task, workers):
    tok = _tok(tiny_dirs)
    want = _expected(tok, str(CORPUS), 300, 24, min_tokens=3, seed=2)
    chunks, got, counts = _streamed(tok, str(CORPUS), 300, 24, min_tokens=3, seed=2, chunk=chunk,
                                    docs_per_task=per_task, workers=workers)
    assert got.cast(want.schema).equals(want)
    assert [len(c) for c in chunks[:-1]] == [chunk] * (len(chunks) - 1) and 0 < len(chunks[-1]) <= chunk
    assert counts["sentences"] == want.num_rows and counts["tokens"] == pc_sum(want["n_tokens"])
    assert counts["sentences"] + counts["dropped_short"] == 300
    texts = _all_texts(str(CORPUS), 300, seed=2)  # every sentence split, the short ones too
    assert counts["truncated"] == sum(len(ids) > 24 for ids in tok(texts)["input_ids"])


def pc_sum(col) -> int:
    return int(np.asarray(col).sum())


def _all_texts(spec, n, seed):
    from ffkv.corpus.sources import open_corpus

    return [s.text for s in open_corpus(spec, seed=seed).sentences(max_sentences=n)]


@pytest.mark.parametrize("context", [20, 64])
def test_stream_of_a_pretokenized_corpus(tiny_dirs, tmp_path, context):
    """Rows of token ids stream as they are (empty rows skipped, long ones cut), text decoded; with
    no row cut, the flat ids pass through untouched."""
    from ffkv.corpus.tokens import write_parquet

    tok = _tok(tiny_dirs)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 200, size=int(n)).tolist() for n in rng.integers(0, 30, size=90)]
    path = write_parquet(tmp_path / "ids.parquet", rows, tok)
    chunks, got, counts = _streamed(tok, str(path), 50, context, chunk=8)
    order = np.random.default_rng(0).permutation(len(rows))
    kept = [int(d) for d in order if rows[d]][:50]
    assert got.column("doc_id").to_pylist() == kept
    assert got.column("sentence_id").to_pylist() == list(range(50))
    assert got.column("token_ids").to_pylist() == [rows[d][:context] for d in kept]
    assert got.column("text").to_pylist() == tok.batch_decode([rows[d] for d in kept], skip_special_tokens=True)
    assert counts["truncated"] == sum(len(rows[d]) > context for d in kept)
    assert (counts["truncated"] > 0) == (context == 20)
    assert counts["empty_rows"] == sum(not r for r in rows) > 0  # skipped, and said


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 25), min_size=1, max_size=60), st.integers(1, 9), st.integers(4, 30),
       st.one_of(st.none(), st.integers(1, 70)), st.data())
def test_chunk_ranges_are_the_whole_streams_chunks(tiny_dirs, tmp_path_factory, lengths, chunk, context, cap,
                                                   data):
    """What Ray's actors prepare for themselves (issue 24 item 4): any run of chunks of a
    pre-tokenized corpus, its rows read alone from the file and decoded, equals those chunks of
    the whole stream, and the plan's lengths and counts, known without decoding a row, equal the
    stream's."""
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import SentenceStream
    from ffkv.corpus.tokens import write_parquet

    tok = _tok(tiny_dirs)
    rng = np.random.default_rng(len(lengths))
    rows = [rng.integers(0, 200, size=n).tolist() for n in lengths]
    path = write_parquet(tmp_path_factory.mktemp("ids") / "ids.parquet", rows, tok)
    stream = lambda: SentenceStream(open_corpus(str(path), seed=3), tok, context, None, cap, chunk=chunk)  # noqa: E731
    if not any(lengths):
        return  # every row empty: no sentence, refused (test_pretokenized)
    whole = stream()
    chunks = list(whole)
    planned = stream()
    lens = planned.rows_plan()
    assert lens.tolist() == np.concatenate([c.lengths for c in chunks]).tolist()
    assert planned.counts == whole.counts
    c0 = data.draw(st.integers(0, len(chunks)))
    c1 = data.draw(st.integers(c0, len(chunks) + 2))
    # an actor's way: the plan's rows of those chunks read alone from the file, then decoded
    from ffkv.corpus.stream import chunks_of
    from ffkv.corpus.tokens import read_some

    rows = planned.order[c0 * chunk:c1 * chunk]
    got = list(chunks_of(tok, context, rows, *read_some(path, "parquet", rows), c0, chunk)) if len(rows) else []
    assert [c.index for c in got] == list(range(c0, min(c1, len(chunks))))
    for g in got:
        assert g.table().equals(chunks[g.index].table())


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["parquet", "npy", "u16"]), st.integers(1, 9), st.integers(1, 40), st.data())
def test_read_some_is_those_rows_of_the_whole_file(tmp_path_factory, kind, width, n, data):
    """The rows a Ray actor reads of a pre-tokenized file (any rows, any order, repeats) equal
    those rows of the file read whole, for each kind; a Parquet file of several row groups."""
    from ffkv.corpus.tokens import read_some, read_tokens

    rng = np.random.default_rng(n * 10 + width)
    d = tmp_path_factory.mktemp("some")
    if kind == "parquet":
        rows = [rng.integers(0, 500, size=int(k)).tolist() for k in rng.integers(0, 12, size=n)]
        path = d / "ids.parquet"
        pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path, row_group_size=7)
    elif kind == "npy":
        path = d / "ids.npy"
        np.save(path, rng.integers(0, 500, size=(n, width)).astype(np.int32))
    else:
        path = d / "ids.u16"
        rng.integers(0, 500, size=n * width + n % 3).astype("<u2").tofile(path)
    whole = read_tokens(path, kind, None, width)
    want = np.asarray(data.draw(st.lists(st.integers(0, whole.n_rows - 1), max_size=30)), np.int64)
    vals, offs = read_some(path, kind, want, None, width)
    assert [vals[offs[i]:offs[i + 1]].tolist() for i in range(len(want))] == [whole.row(int(r)) for r in want]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(0, 599), max_size=12), max_size=8), st.booleans())
def test_batch_decode_is_transformers(tiny_dirs, rows, clean):
    """The stream's decode (the Rust tokenizer's batch call where that is all transformers does)
    gives `tok.batch_decode`'s texts for any rows, special tokens included; a tokenizer that
    cleans up spaces goes through transformers. No rows, no texts (transformers says [''])."""
    from ffkv.corpus.stream import batch_decode

    tok = _tok(tiny_dirs)
    tok.clean_up_tokenization_spaces = clean
    assert batch_decode(tok, rows) == (tok.batch_decode(rows, skip_special_tokens=True) if rows else [])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=60), st.integers(16, 200), st.integers(1, 20))
def test_plan_layout_summed_over_chunks(lengths, budget, chunk):
    """The manifest's batch layout, summed chunk by chunk, is `batching.layout` of the same batches."""
    from ffkv.corpus.batching import Layout, layout, pack

    lengths = np.array(lengths)
    plan, batches = Layout(budget), []
    for a in range(0, len(lengths), chunk):
        part = pack(lengths[a:a + chunk], budget)
        plan.add(lengths[a:a + chunk], part)
        batches += [b + a for b in part]
    assert plan.record() == layout(lengths, batches, budget)


def test_batch_tensors_equal_the_models_batch(tiny_models):
    from ffkv.mine.engine import FlatTokens, batch_tensors

    mm = tiny_models["gpt2"]
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 100, size=int(n)) for n in rng.integers(1, 12, size=20)]
    flat = FlatTokens(values=np.concatenate(rows).astype(np.int32),
                      offsets=np.concatenate([[0], np.cumsum([len(r) for r in rows])]))
    for idx in ([3], [0, 5, 19, 2], list(range(20))[::-1]):
        ids, mask, lens = batch_tensors(mm, flat, idx)
        want_ids, want_mask = mm.batch([rows[i].tolist() for i in idx])
        assert ids.equal(want_ids) and mask.equal(want_mask) and lens == [len(rows[i]) for i in idx]


def _sentences(run):
    return pq.read_table(run / "sentences.parquet")


def test_mine_tables_equal_in_one_chunk_or_many_and_any_workers(tmp_path, tiny_dirs):
    """One chunk, chunks of 37 sentences, chunks made by two worker processes, and chunks made
    ahead by the prefetch thread: the same
    sentences table, row for row, and the same mined tables (up to a float rounding)."""
    model = tiny_dirs["gpt2"]
    runs = {}
    for tag, extra in (("one", ["--chunk-sentences", "4096"]), ("many", ["--chunk-sentences", "37"]),
                       ("workers", ["--chunk-sentences", "37", "--workers", "2"]),
                       ("prefetch", ["--chunk-sentences", "37", "--prefetch", "3"])):
        out = tmp_path / tag
        res = run_cli("mine", "--out", out, "--model", model, *ARGS, "--max-sentences", "120", *extra)
        assert res.returncode == 0, res.stderr
        runs[tag] = out
    want = _sentences(runs["one"])
    assert want.num_rows == 120 and want.column("sentence_id").to_pylist() == list(range(120))
    for tag in ("many", "workers", "prefetch"):
        got = _sentences(runs[tag])
        assert got.equals(want), tag
        assert pq.ParquetFile(runs[tag] / "sentences.parquet").metadata.num_row_groups == 4  # 3 × 37 + 9
        _assert_same_mine(runs[tag], runs["one"])
        m = json.loads((runs[tag] / "manifest.json").read_text())
        assert m["corpus"]["counts"] == json.loads((runs["one"] / "manifest.json").read_text())["corpus"]["counts"]


def test_sigkill_mid_stream_resumes_without_lost_or_repeated_sentences(tmp_path, tiny_dirs):
    args = ["--model", tiny_dirs["gpt2"], *ARGS, "--max-sentences", "300", "--chunk-sentences", "60",
            "--checkpoint-every", "0", "--prefetch", "2"]  # chunks made ahead, not yet mined, are not lost
    ref = tmp_path / "ref"
    assert run_cli("mine", "--out", ref, *args).returncode == 0
    out = tmp_path / "killed"
    ck = out / ".mine_checkpoint.npz"

    def cursor():
        try:
            with np.load(ck) as z:
                return int(z["__cursor"][0])
        except Exception:  # noqa: BLE001  (not there yet, or being replaced)
            return 0

    kill_mine_when(out, args, lambda: cursor() >= 40, wait=300)  # past the first chunks
    assert not (out / "sentences.parquet").exists(), "the table appears only when the stream is whole"
    assert list(out.glob(".sentences.parquet.tmp*")) or list(out.glob("sentences.parquet.tmp*")), \
        "the half-written table of the killed run"
    res = run_cli("mine", "--out", out, *args)
    assert res.returncode == 0, res.stderr
    assert "resuming from checkpoint" in res.stdout
    got, want = _sentences(out), _sentences(ref)
    ids = got.column("sentence_id").to_numpy()
    assert len(np.unique(ids)) == len(ids) == 300, "a sentence lost or repeated"
    assert got.equals(want)
    _assert_same_mine(out, ref)
    assert not list(out.glob("*.tmp*")) and not list(out.glob(".*.tmp*")), "the killed run's temp was left"
    m, r = (json.loads((d / "manifest.json").read_text()) for d in (out, ref))
    assert m["corpus"]["counts"] == r["corpus"]["counts"]
    assert m["steps"]["mine"]["batches"] == r["steps"]["mine"]["batches"]


BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("spacy", "ray", "duckdb"):
            raise ImportError("not on this machine: " + name)
sys.meta_path.insert(0, Block())
from ffkv.cli import main
main(sys.argv[1:])
"""


def test_mine_of_token_ids_needs_no_spacy_ray_or_duckdb(tmp_path, tiny_dirs):
    """The GPU image has none of the three: mining a pre-tokenized corpus must not import them."""
    from ffkv.corpus.tokens import write_parquet

    tok = _tok(tiny_dirs)
    rows = [tok(t)["input_ids"] for t in _all_texts(str(CORPUS), 40, seed=0)]
    path = write_parquet(tmp_path / "ids.parquet", rows, tok)
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-c", BLOCK, "mine", "--out", str(out), "--model", str(tiny_dirs["gpt2"]),
                          "--corpus", str(path), "--top-k", "3"], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    got = _sentences(out)
    order = np.random.default_rng(0).permutation(len(rows))
    assert got.column("token_ids").to_pylist() == [rows[d] for d in order if rows[d]]
    # the block is real: a text corpus needs the sentence splitter, and says so in one line
    res = subprocess.run([sys.executable, "-c", BLOCK, "mine", "--out", str(tmp_path / "text"), "--model",
                          str(tiny_dirs["gpt2"]), "--corpus", str(CORPUS), "--max-sentences", "5"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert res.returncode == 2 and "needs spaCy" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """Forty documents of WikiText-2 valid as a plain text file (blank lines between documents)."""
    from ffkv.corpus.sources import open_corpus

    docs = open_corpus(str(CORPUS))._documents()[:40]
    p = tmp_path_factory.mktemp("corpus") / "docs.txt"
    p.write_text("\n\n".join(docs))
    return str(p)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunk=st.integers(1, 300), per_task=st.integers(1, 50), cap=st.one_of(st.none(), st.integers(1, 400)),
       min_tokens=st.integers(1, 12), max_length=st.integers(4, 64), seed=st.integers(0, 3))
def test_any_chunking_gives_the_whole_corpus_rows(tiny_dirs, small_corpus, chunk, per_task, cap, min_tokens,
                                                   max_length, seed):
    tok = _tok(tiny_dirs)
    want = _expected(tok, small_corpus, cap, max_length, min_tokens=min_tokens, seed=seed)
    chunks, got, counts = _streamed(tok, small_corpus, cap, max_length, min_tokens=min_tokens, seed=seed,
                                    chunk=chunk, docs_per_task=per_task)
    assert got.cast(want.schema).equals(want)
    assert all(len(c) == chunk for c in chunks[:-1]) and [c.index for c in chunks] == list(range(len(chunks)))
    assert counts["sentences"] == want.num_rows


def test_default_workers_by_source_kind():
    """By default token ids are decoded in-process (workers only add pickling there), text gets
    `default_workers()`; a --workers the user typed wins for either."""
    from ffkv.corpus.stream import default_workers, resolve_workers

    assert resolve_workers(None, pretokenized=True) == 0
    assert resolve_workers(None, pretokenized=False) == default_workers()
    assert resolve_workers(3, pretokenized=True) == 3 and resolve_workers(0, pretokenized=False) == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50_000), max_size=12), min_size=1, max_size=20), st.integers(0, 9))
def test_pad_rows_equals_a_row_by_row_fill(rows, pad):
    """`pad_rows` (MemoryModel.batch and the mining batches both use it) equals filling a padded
    grid row by row, empty rows included."""
    from ffkv.model.memories import pad_rows

    lens = np.array([len(r) for r in rows])
    ids, mask = pad_rows(np.array([x for r in rows for x in r], np.int64), lens, pad, "cpu")
    T = max(map(len, rows))
    want_ids = [r + [pad] * (T - len(r)) for r in rows]
    want_mask = [[1] * len(r) + [0] * (T - len(r)) for r in rows]
    assert ids.tolist() == want_ids and mask.tolist() == want_mask
    assert ids.dtype == mask.dtype == torch.int64


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 300), chunk=st.integers(1, 120), group=st.integers(1, 90))
def test_file_chunks_cut_any_file_into_exact_chunks(tmp_path, n, chunk, group):
    """A whole `sentences` file read back chunk by chunk (a resumed pass; the Ray planner) gives
    the chunks of the table in memory, whatever the file's row groups."""
    from ffkv.corpus.stream import file_chunks

    t = pa.table({"sentence_id": np.arange(n, dtype=np.int64),
                  "token_ids": pa.array([list(range(i % 7)) for i in range(n)], pa.list_(pa.int32()))})
    f = tmp_path / f"t{n}_{chunk}_{group}.parquet"
    pq.write_table(t, f, row_group_size=group)
    got = list(file_chunks(f, chunk))
    assert [p.num_rows for p in got] == [min(chunk, n - a) for a in range(0, n, chunk)]
    for a, p in zip(range(0, n, chunk), got):
        assert p.equals(t.slice(a, chunk))
    only = list(file_chunks(f, chunk, ["sentence_id"]))
    assert all(p.column_names == ["sentence_id"] for p in only)
    with pytest.raises(ValueError):
        next(file_chunks(f, 0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(), max_size=30), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 30)),
       st.one_of(st.none(), st.integers(0, 30)))
def test_prefetched_is_the_source_in_order(items, depth, fail_at, leave_at):
    """Any depth gives the source's items in order; an error of the source is raised where its
    item would have come, after every item before it; a consumer that leaves early (or fails)
    stops the thread, which closes the source."""
    import threading

    from ffkv.corpus.stream import prefetched

    closed = []

    def source():
        try:
            for i, x in enumerate(items):
                if i == fail_at:
                    raise ValueError(f"bad item {i}")
                yield x
        finally:
            closed.append(threading.current_thread().name)

    got, err = [], None
    gen = prefetched(source(), depth)
    try:
        for x in gen:
            if leave_at is not None and len(got) == leave_at:
                break
            got.append(x)
    except ValueError as e:
        err = str(e)
    finally:
        gen.close()
    fails = fail_at is not None and fail_at < len(items)
    stop = min(len(items), fail_at if fails else len(items), leave_at if leave_at is not None else len(items))
    assert got == items[:stop]
    left = leave_at is not None and leave_at < (fail_at if fails else len(items))
    assert err == (None if left or not fails else f"bad item {fail_at}")
    if depth > 0:
        assert closed == ["ffkv-prefetch"] and not any(t.name == "ffkv-prefetch" for t in threading.enumerate())
    else:
        assert closed == [threading.current_thread().name]


def test_prefetched_raises_a_failing_close_instead_of_hanging():
    """A source whose close fails (a worker pool that cannot shut down) reaches the consumer as
    that error after the last item, not as a consumer waiting forever."""
    from ffkv.corpus.stream import prefetched

    class Source:
        def __init__(self):
            self.items = iter([1, 2, 3])

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

        def close(self):
            raise OSError("the pool would not shut down")

    got = []
    with pytest.raises(OSError, match="would not shut down"):
        for x in prefetched(Source(), 2):
            got.append(x)
    assert got == [1, 2, 3]


def test_a_shard_out_of_an_actors_reach_is_prepared_by_the_driver(tmp_path, tiny_dirs):
    """Ray's fallback for an actor that cannot see the corpus file or the run's folder: the driver
    writes that shard's part itself (`Prepared.prepare_here`) and sends the rows of its batches,
    read back from the part (`read_rows`): the whole stream's rows of those chunks."""
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import SentenceStream
    from ffkv.corpus.tokens import write_parquet
    from ffkv.steps.mine.distributed import Prepared, read_rows
    from ffkv.model.memories import open_model

    mm = open_model(str(tiny_dirs["gpt2"]), device="cpu")
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 500, size=int(n)).tolist() for n in rng.integers(0, 40, size=70)]
    path = write_parquet(tmp_path / "ids.parquet", rows, mm.tok)
    stream = lambda: SentenceStream(open_corpus(str(path)), mm.tok, mm.max_length, None, None, chunk=8)  # noqa: E731
    whole = pa.concat_tables([c.table() for c in stream()])
    planned = stream()
    planned.rows_plan()
    prep = Prepared({"spec": str(path), "kind": "parquet", "column": None, "context": 8192, "chunk": 8}, planned, [])
    prep.prepare_here(mm, 2, 5, tmp_path / "part.parquet")
    assert pq.read_table(tmp_path / "part.parquet").equals(whole.slice(16, 24))
    batches = [[0, 7, 3], [23], [12, 1]]  # the shard's own rows
    got = read_rows(tmp_path / "part.parquet", batches)
    for b, t in zip(batches, got):
        assert t.column("sentence_id").to_pylist() == [16 + i for i in b]
        assert t.column("token_ids").to_pylist() == whole.column("token_ids").take(pa.array([16 + i for i in b])).to_pylist()
