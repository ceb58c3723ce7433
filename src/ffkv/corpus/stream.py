"""Corpus -> sentences -> token ids as a stream of chunks, so that the host never holds every
sentence: the mine step writes each chunk as a row group of `sentences` and mines it, then lets
it go (issue 24).

Splitting and tokenizing run in `workers` processes (spawned: torch and the tokenizers' thread
pools do not survive a fork), a bounded number of tasks ahead of the consumer, which meanwhile
runs the forward pass; with workers=0 they run inline. Results come back in submission order and
sentence ids are numbered here, in the consumer, so the rows are the same for any number of
workers, any task size and any chunk size (tests/test_streaming.py). A chunk holds CHUNK kept rows
(the last one fewer): the unit the mining plan packs batches in, so its size is part of a
checkpoint's layout key.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from ffkv.errors import FfkvError

CHUNK = 4096  # kept rows per chunk, by default (`--chunk-sentences`)
DOCS_PER_TASK = 32  # documents one worker task splits and tokenizes
ROWS_PER_TASK = 2048  # pre-tokenized rows one task decodes

SCHEMA = pa.schema([("sentence_id", pa.int64()), ("doc_id", pa.int64()), ("text", pa.string()),
                    ("token_ids", pa.list_(pa.int32())), ("n_tokens", pa.int32())])


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_workers() -> int:
    """min(4, cores − 1), and 0 (inline) on two cores or fewer, where a worker would take a core
    from the forward pass."""
    n = cores()
    return 0 if n <= 2 else min(4, n - 1)


def resolve_workers(workers: int | None, pretokenized: bool) -> int:
    """--workers as given; by default `default_workers()` for text and 0 for token ids, whose rows
    only need decoding: on a 16-core GPU host, 1.7M tok/s in-process against 235k with 4 workers
    (pickling each task costs more than the decode; benchmarks/GPU.md)."""
    if workers is not None:
        return int(workers)
    return 0 if pretokenized else default_workers()


@dataclass
class Chunk:
    """Kept rows of the stream: ids flat (`values`, row i: values[offsets[i]:offsets[i+1]])."""
    index: int
    sentence_id: np.ndarray
    doc_id: np.ndarray
    text: list
    values: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.sentence_id)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def table(self) -> pa.Table:
        ids = pa.ListArray.from_arrays(pa.array(self.offsets.astype(np.int32)),
                                       pa.array(self.values.astype(np.int32, copy=False)))
        return pa.Table.from_arrays(
            [pa.array(self.sentence_id, pa.int64()), pa.array(self.doc_id, pa.int64()),
             pa.array(self.text, pa.string()), ids, pa.array(self.lengths.astype(np.int32))], schema=SCHEMA)


# ---- the work of one task (in a worker process, or inline) --------------------------------------
_TOK = None  # a worker's tokenizer and context, set once by `_init`
_MAXLEN = 0


def _init(tok, max_length: int) -> None:
    global _TOK, _MAXLEN
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _TOK, _MAXLEN = tok, max_length


def _flat(id_lists) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter((len(x) for x in id_lists), np.int64, len(id_lists))
    offs = np.concatenate([[0], np.cumsum(lens)])
    vals = np.fromiter((t for x in id_lists for t in x), np.int32, int(offs[-1]))
    return vals, offs


def split_task(doc_ids, docs) -> tuple:
    """Documents -> (doc id per sentence, texts, flat ids, offsets, which rows were cut to the
    context)."""
    from ffkv.corpus.sources import TOKENIZE_CHUNK, _sentencizer

    d_of, texts = [], []
    for d, doc in zip(doc_ids, _sentencizer().pipe(docs)):
        for s in doc.sents:
            t = s.text.strip()
            if t:
                d_of.append(int(d))
                texts.append(t)
    enc = []
    for i in range(0, len(texts), TOKENIZE_CHUNK):
        enc += _TOK(texts[i:i + TOKENIZE_CHUNK], add_special_tokens=True)["input_ids"]
    return (np.asarray(d_of, np.int64), texts, *_fit(enc))


def _fit(enc) -> tuple:
    """Ids cut to the context (`fit_sentences`), flat, and which rows were cut."""
    from ffkv.model.context import fit_sentences

    cut = np.fromiter((len(e) > _MAXLEN for e in enc), bool, len(enc))
    ids, _ = fit_sentences(enc, _MAXLEN)
    return (*_flat(ids), cut)


def decode_task(doc_ids, vals, offs) -> tuple:
    """Pre-tokenized rows -> the same tuple: ids as they are (cut to the context), text decoded.
    Where no row is cut, the flat ids are already the answer (`_fit` rebuilds them token by token)."""
    flat = vals.tolist()
    rows = [flat[a:b] for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())]
    texts = batch_decode(_TOK, rows)
    if len(rows) and int(np.diff(offs).max()) > _MAXLEN:
        return (np.asarray(doc_ids, np.int64), texts, *_fit(rows))
    return (np.asarray(doc_ids, np.int64), texts, np.asarray(vals, np.int32), np.asarray(offs, np.int64),
            np.zeros(len(rows), bool))


def chunks_of(tok, max_length: int, rows, vals, offs, first: int, size: int) -> Iterator[Chunk]:
    """Chunks first, first + 1, ... of a pre-tokenized source, from their sentences' source rows
    `rows` (sentence ids first·size on) and those rows' ids (flat `vals`, `offs`), decoded here:
    as the whole stream yields them."""
    _init(tok, max_length)
    for i, a in enumerate(range(0, len(rows), size)):
        b = min(a + size, len(rows))
        o = np.asarray(offs[a:b + 1], np.int64)
        d_of, texts, v, oo, _ = decode_task(np.asarray(rows[a:b]), vals[o[0]:o[-1]], o - o[0])
        start = (first + i) * size
        yield Chunk(first + i, np.arange(start, start + b - a, dtype=np.int64), d_of, texts,
                    np.asarray(v, np.int32), np.asarray(oo, np.int64))


def batch_decode(tok, rows: list[list[int]]) -> list[str]:
    """`tok.batch_decode(rows, skip_special_tokens=True)`, through the Rust tokenizer's own batch
    call where transformers would only loop over it row by row (a fast tokenizer whose class keeps
    transformers' decode and cleans up no spaces): 2.3x on SmolLM2's, the larger part of
    pre-tokenized rows' host time. No rows, no texts (transformers would say [''])."""
    if not rows:
        return []
    if _plain_fast_decode(type(tok)) and not getattr(tok, "clean_up_tokenization_spaces", True):
        return tok._tokenizer.decode_batch(rows, skip_special_tokens=True)
    return tok.batch_decode(rows, skip_special_tokens=True)


_PLAIN: dict = {}


def _plain_fast_decode(cls) -> bool:
    """Whether `cls` decodes as transformers' fast-tokenizer base does: its `_decode` from there
    (one `_tokenizer.decode` and the optional clean-up), `decode` and `batch_decode` from the base."""
    if cls not in _PLAIN:
        where = {n: next((c.__module__ for c in cls.__mro__ if n in c.__dict__), "")
                 for n in ("_decode", "decode", "batch_decode")}
        _PLAIN[cls] = (where["_decode"] in ("transformers.tokenization_utils_tokenizers",
                                            "transformers.tokenization_utils_fast")
                       and where["decode"] == where["batch_decode"] == "transformers.tokenization_utils_base")
    return _PLAIN[cls]


# ---- the stream ---------------------------------------------------------------------------------
class SentenceStream:
    """Iterate the chunks of a corpus source (`ffkv.corpus.sources.CorpusSource`) as the model's
    tokenizer reads it; `counts` (the manifest's) is whole once the stream is exhausted.

    Sentence ids number the split sentences (pre-tokenized: the non-empty rows) in the seeded
    document order, up to max_sentences; rows shorter than min_tokens are dropped, their ids
    left out: the rows of `CorpusSource.sentences` + `tokenize` (the whole corpus at once, which
    `ffkv corpus` still reads), as tests/test_streaming.py holds them."""

    def __init__(self, src, tok, max_length: int, vocab_size: int | None = None,
                 max_sentences: int | None = None, min_tokens: int = 1, chunk: int = CHUNK,
                 workers: int | None = 0, docs_per_task: int = DOCS_PER_TASK):
        self.src, self.tok, self.max_length, self.vocab_size = src, tok, max_length, vocab_size
        self.max_sentences, self.min_tokens, self.chunk = max_sentences, min_tokens, max(1, int(chunk))
        self.workers = None if workers is None else int(workers)  # None: `resolve_workers`
        self.docs_per_task = max(1, int(docs_per_task))
        self.sentences = self.kept = self.tokens = self.truncated = 0
        self.empty_rows = None  # a pre-tokenized source's rows with no token (skipped), once read
        self.documents = None  # known once the source is read (the first chunk asked for)

    @property
    def counts(self) -> dict:
        c = {**self.src.stats.as_dict(), "sentences": self.kept,
             "dropped_short": self.sentences - self.kept, "tokens": self.tokens, "truncated": self.truncated}
        return c if self.empty_rows is None else {**c, "empty_rows": self.empty_rows}

    def _order(self):
        """(documents, pre-tokenized rows or None, document order; for rows: only the non-empty
        ones, up to max_sentences, so that sentence id i is the row order[i])."""
        docs = self.src._documents()
        rows = self.src._tokens
        n_docs = rows.n_rows if rows is not None else len(docs)
        self.src.stats.documents = self.documents = n_docs
        order = np.random.default_rng(self.src.seed).permutation(n_docs)
        if rows is not None:
            rows.check(self.tok, self.vocab_size, self.max_length)  # before any forward pass
            lens = np.diff(rows.offsets)[order]
            self.empty_rows = int((lens == 0).sum())  # said in the manifest and mine's summary
            order = order[lens > 0]  # empty rows are no sentences
            if self.max_sentences:
                order = order[:self.max_sentences]
        return docs, rows, order

    @staticmethod
    def _rows_task(rows, d) -> tuple:
        """decode_task's arguments for the source rows d, in that order."""
        from ffkv.corpus.tokens import gather

        return (d, *gather(rows.values, rows.offsets, d))

    def rows_plan(self) -> np.ndarray | None:
        """A pre-tokenized source's sentence lengths as mined (cut to the context), known from its
        row offsets without decoding a row: what Ray's driver plans the batches from while the
        actors decode their own chunks (`chunks_of`). Sets `counts` as exhausting the stream
        would, and lets the ids go (a billion of them: 4 GB the driver need not hold). None for a
        text source, or where rows may be dropped as short (min_tokens > 1)."""
        if self.min_tokens > 1:
            return None
        _, rows, order = self._order()
        if rows is None:
            return None
        if len(order) == 0:
            raise FfkvError(f"corpus {self.src.spec!r} is empty: no sentences found")
        self.order = order  # the source row of each sentence id: a Ray actor's share to read
        full = np.diff(rows.offsets)[order]
        lens = np.minimum(full, self.max_length)
        self.sentences = self.kept = self.src.stats.sentences = len(order)
        self.tokens, self.truncated = int(lens.sum()), int((full > self.max_length).sum())
        rows.values = np.empty(0, rows.values.dtype)  # the ids are read again where they are decoded: the driver keeps none
        return lens

    def _tasks(self):
        """(function, args) per task, in document order."""
        docs, rows, order = self._order()
        n_docs = len(order) if rows is not None else len(docs)
        if rows is not None:
            for i in range(0, len(order), ROWS_PER_TASK):
                yield decode_task, self._rows_task(rows, order[i:i + ROWS_PER_TASK])
            return
        for i in range(0, n_docs, self.docs_per_task):
            d = order[i:i + self.docs_per_task]
            yield split_task, (d, [docs[j] for j in d])

    def _results(self) -> Iterator[tuple]:
        """Task results in order: inline, or from a spawned pool at most 2·workers tasks ahead
        (at most one worker per core: more only add processes that wait)."""
        tasks = self._tasks()
        first = next(tasks, None)  # the source is read: its kind is known
        tasks = itertools.chain([first] if first is not None else [], tasks)
        workers = min(resolve_workers(self.workers, self.src._tokens is not None), cores())
        if workers <= 0:
            _init(self.tok, self.max_length)
            for fn, args in tasks:
                yield fn(*args)
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init,
                                 initargs=(self.tok, self.max_length)) as pool:
            ahead: deque = deque()
            try:
                for fn, args in tasks:
                    ahead.append(pool.submit(fn, *args))
                    if len(ahead) >= 2 * workers:
                        yield ahead.popleft().result()
                while ahead:
                    yield ahead.popleft().result()
            finally:
                for f in ahead:
                    f.cancel()

    def __iter__(self) -> Iterator[Chunk]:
        cap = self.max_sentences or None
        buf: list[tuple] = []  # (sentence ids, doc ids, texts, values, offsets) pieces of kept rows
        held, index = 0, 0
        for d_of, texts, vals, offs, cut in self._results():
            n = len(texts)
            if cap is not None and self.sentences + n > cap:
                n = cap - self.sentences
                d_of, texts, offs = d_of[:n], texts[:n], offs[:n + 1]
                vals = vals[:offs[-1]]
            sid = np.arange(self.sentences, self.sentences + n, dtype=np.int64)
            self.sentences += n
            self.truncated += int(cut[:n].sum())
            lens = np.diff(offs)
            keep = np.flatnonzero(lens >= self.min_tokens)
            if len(keep) < n:
                vals = np.concatenate([vals[offs[i]:offs[i + 1]] for i in keep]) if len(keep) else vals[:0]
                offs = np.concatenate([[0], np.cumsum(lens[keep])])
                sid, d_of, texts = sid[keep], d_of[keep], [texts[i] for i in keep]
            start = 0
            while start < len(sid):  # cut at chunk boundaries
                take = min(self.chunk - held, len(sid) - start)
                a, b = offs[start], offs[start + take]
                buf.append((sid[start:start + take], d_of[start:start + take], texts[start:start + take],
                            vals[a:b], offs[start:start + take + 1] - a))
                held += take
                start += take
                if held == self.chunk:
                    yield self._chunk(index, buf)
                    buf, held, index = [], 0, index + 1
            if cap is not None and self.sentences >= cap:
                break
        if buf:
            yield self._chunk(index, buf)
        if self.sentences == 0:
            raise FfkvError(f"corpus {self.src.spec!r} is empty: no sentences found")
        self.src.stats.sentences = self.sentences

    def _chunk(self, index: int, buf: list) -> Chunk:
        vals = np.concatenate([p[3] for p in buf]).astype(np.int32, copy=False)
        lens = np.concatenate([np.diff(p[4]) for p in buf])
        offs = np.concatenate([[0], np.cumsum(lens)])
        self.kept += len(lens)
        self.tokens += int(offs[-1])
        return Chunk(index, np.concatenate([p[0] for p in buf]), np.concatenate([p[1] for p in buf]),
                     [t for p in buf for t in p[2]], vals, offs)


def prefetched(chunks: Iterable, depth: int) -> Iterator:
    """`chunks`, made up to `depth` ahead by a thread, so that the host's share of a chunk
    (decoding token ids, reading a table, waiting on worker processes: native code that lets go
    of the GIL) runs while the device mines the one before; depth 0: made as they are asked for.
    The producer's errors are raised here, where its chunk would have come; leaving early (an
    error, Ctrl-C) stops it and closes `chunks`."""
    if depth <= 0:
        yield from chunks
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        it = iter(chunks)
        last = (end, None)
        try:
            for c in it:
                if not put((c, None)):
                    return
        except BaseException as e:  # noqa: BLE001  (raised again in the consumer)
            last = (end, e)
        finally:
            try:
                close = getattr(it, "close", None)
                if close is not None:
                    close()  # a stream's worker pool, here, in the thread that ran it
            except BaseException as e:  # noqa: BLE001
                if last[1] is None:
                    last = (end, e)
        put(last)

    t = threading.Thread(target=produce, name="ffkv-prefetch", daemon=True)
    t.start()
    try:
        while True:
            try:
                c, err = q.get(timeout=1.0)
            except queue.Empty:
                if t.is_alive() or not q.empty():
                    continue
                raise RuntimeError("the corpus prefetch thread ended without its last item") from None
            if c is end:
                if err is not None:
                    raise err
                return
            yield c
    finally:
        stop.set()
        t.join(timeout=30)


def file_chunks(path, chunk: int = CHUNK, columns=None) -> Iterator[pa.Table]:
    """The rows of a Parquet file as tables of exactly `chunk` rows (the last one shorter), read
    a record batch at a time: the file is never held whole."""
    import pyarrow.parquet as pq

    if chunk < 1:
        raise ValueError("chunk must be at least 1")
    with pq.ParquetFile(path) as f:
        buf: list = []
        held = 0
        for rb in f.iter_batches(batch_size=min(chunk, 65536), columns=columns):
            buf.append(rb)
            held += rb.num_rows
            while held >= chunk:
                t = pa.Table.from_batches(buf)
                yield t.slice(0, chunk)
                rest = t.slice(chunk)
                buf, held = rest.to_batches(), rest.num_rows
        if held:
            yield pa.Table.from_batches(buf)


def table_chunks(table, chunk: int = CHUNK) -> Iterator[Chunk]:
    """A written `sentences` table (a pyarrow Table, or its Parquet file, read chunk by chunk) as
    the same chunks (a resumed pass whose table is whole)."""
    from ffkv.corpus.tokens import flat_lists

    parts = ((table.slice(start, chunk) for start in range(0, table.num_rows, chunk))
             if isinstance(table, pa.Table) else
             file_chunks(table, chunk, ["sentence_id", "doc_id", "text", "token_ids"]))
    for index, part in enumerate(parts):
        vals, offs = flat_lists(part.column("token_ids"))
        yield Chunk(index, part.column("sentence_id").to_numpy(), part.column("doc_id").to_numpy(),
                    part.column("text").to_pylist(), np.asarray(vals, np.int32), np.asarray(offs, np.int64))
