"""Turn a corpus source into a `sentences` table of token ids, the input of every step."""
from __future__ import annotations

import pyarrow as pa

from ffkv.corpus.sources import open_corpus, tokenize
from ffkv.corpus.tokens import DEFAULT_CONTEXT


def prepare_sentences(run, mm, corpus: str | None, max_sentences: int | None, seed: int = 0,
                      field: str = "text", table: str = "sentences", min_tokens: int = 1,
                      context: int = DEFAULT_CONTEXT) -> pa.Table:
    """Split, tokenize and store sentences (a pre-tokenized source's rows: checked, not split or
    tokenized, `context` the window of a flat token stream); records the source, its kind, sha256
    and counts in the manifest."""
    src = open_corpus(corpus, field=field, seed=seed, context=context)
    sents = src.sentences(max_sentences=max_sentences)
    ids, n_trunc = tokenize(mm.tok, sents, mm.max_length, getattr(mm, "vocab_size", None))
    keep = [i for i, t in enumerate(ids) if len(t) >= min_tokens]
    tbl = pa.table({
        "sentence_id": pa.array([sents[i].sentence_id for i in keep], pa.int64()),
        "doc_id": pa.array([sents[i].doc_id for i in keep], pa.int64()),
        "text": pa.array([sents[i].text for i in keep], pa.string()),
        "token_ids": pa.array([ids[i] for i in keep], pa.list_(pa.int32())),
        "n_tokens": pa.array([len(ids[i]) for i in keep], pa.int32()),
    })
    run.write_table(table, tbl)
    counts = {**src.stats.as_dict(), "sentences": len(keep), "dropped_short": len(sents) - len(keep),
              "tokens": int(sum(len(ids[i]) for i in keep)), "truncated": n_trunc}
    run.manifest.setdefault("corpora", {})[table] = {
        "source": src.spec, "kind": src.kind, **src.details, "sha256": src.sha256, "seed": seed,
        "field": field, "max_sentences": max_sentences, "counts": counts}
    run.save()
    return tbl
