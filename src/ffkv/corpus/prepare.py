"""Turn a corpus source into a `sentences` table of token ids, the input of every step."""
from __future__ import annotations

import pyarrow as pa

from ffkv.corpus.sources import open_corpus
from ffkv.corpus.stream import SCHEMA, SentenceStream
from ffkv.corpus.tokens import DEFAULT_CONTEXT


def prepare_sentences(run, mm, corpus: str | None, max_sentences: int | None, seed: int = 0,
                      field: str = "text", table: str = "sentences", min_tokens: int = 1,
                      context: int = DEFAULT_CONTEXT) -> pa.Table:
    """Split, tokenize and store sentences (a pre-tokenized source's rows: checked, not split or
    tokenized, `context` the window of a flat token stream), streamed chunk by chunk as the mine
    step streams them (`ffkv.corpus.stream`); records the source, its kind, sha256 and counts in
    the manifest, and returns the table."""
    src = open_corpus(corpus, field=field, seed=seed, context=context)
    stream = SentenceStream(src, mm.tok, mm.max_length, getattr(mm, "vocab_size", None), max_sentences,
                            min_tokens=min_tokens)
    with run.table_writer(table, SCHEMA) as write:
        for chunk in stream:
            write(chunk.table())
    record_corpus(run, table, stream, seed, field, max_sentences)
    run.save()
    return run.read_table(table)


def record_corpus(run, table: str, stream: SentenceStream, seed: int, field: str,
                  max_sentences: int | None) -> dict:
    """The manifest's `corpora.<table>`: the source, its kind, sha256 and the stream's counts."""
    src = stream.src
    rec = {"source": src.spec, "kind": src.kind, **src.details, "sha256": src.sha256, "seed": seed,
           "field": field, "max_sentences": max_sentences, "counts": stream.counts}
    run.manifest.setdefault("corpora", {})[table] = rec
    return rec
