"""The host side of mining (issue 24): a corpus streamed as `ffkv mine` streams it, in tok/s.

    python benchmarks/bench_host.py --corpus ids.parquet            # token id lists
    python benchmarks/bench_host.py --corpus stream.u16 --context 128
    PYTHONPATH=/other/checkout/src python benchmarks/bench_host.py --corpus ids.parquet   # another tree

On a GPU the forward of a small model outruns the host: with --workers 0 (the default for token
ids) the stream's decoding is mining's, in series, so its tok/s bounds `ffkv mine` end to end.
Several runs over the same corpus (the first one's imports and caches included in no figure);
prints each run's rate and the median. --corpus is any corpus spec `ffkv mine` takes; the
tokenizer is --tokenizer's folder or the embedded SmolLM2's. The rows' hash is printed too, so
two trees can be checked to stream the same chunks.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import time

from _common import out

from bench_gpu import default_tokenizer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="corpus spec: a text corpus, Parquet of token ids, .npy, .u16")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the embedded SmolLM2's)")
    ap.add_argument("--context", type=int, default=8192, help="the model's context: rows are cut to it")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)

    import ffkv
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import SentenceStream

    tok = default_tokenizer(a.tokenizer)
    rates, digest = [], None
    for _ in range(a.runs):
        st = SentenceStream(open_corpus(a.corpus), tok, a.context, workers=a.workers)
        h, n = hashlib.sha1(), 0
        t0 = time.perf_counter()
        for c in st:
            n += int(c.offsets[-1])
            for arr in (c.sentence_id, c.doc_id, c.values.astype("int64"), c.offsets.astype("int64")):
                h.update(arr.tobytes())
            h.update("\x00".join(c.text).encode())
        rates.append(n / (time.perf_counter() - t0))
        digest = h.hexdigest()[:12]
    out(f"bench_host: {a.corpus}, {n:,} tokens, workers {a.workers}, ffkv at {ffkv.__file__}")
    out("  runs: " + ", ".join(f"{r:,.0f}" for r in rates) + f" tok/s; median {statistics.median(rates):,.0f} "
        f"tok/s; rows {digest}")


if __name__ == "__main__":
    main()
