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

    python benchmarks/bench_host.py --corpus ids.parquet --overlap 368000

--overlap RATE stands a GPU in for mining: each batch of --batch-tokens launches --launches tiny
torch ops (each takes the GIL, as a kernel launch does) and then waits, GIL released, until the
batch has lasted tokens/RATE. It prints the pass's tok/s with the stream inline (`--prefetch 0`)
and made ahead by a thread (`ffkv.corpus.stream.prefetched`), side by side, run after run, against
RATE itself: whether the host's share hides behind the device, and what the launches lose to the
thread's GIL.
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
    ap.add_argument("--overlap", type=float, default=None, metavar="RATE",
                    help="a stand-in device mining RATE tok/s: the pass inline against prefetched")
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--launches", type=int, default=500, help="tiny ops a batch (kernel launches)")
    ap.add_argument("--depth", type=int, default=2, help="chunks prefetched")
    ap.add_argument("--ray-driver", action="store_true",
                    help="a --ray pass's driver before its actors start: the whole table written against the plan alone")
    a = ap.parse_args(argv)
    if a.overlap is not None:
        return overlap(a)
    if a.ray_driver:
        return ray_driver(a)

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


def ray_driver(a) -> None:
    import tempfile
    from pathlib import Path

    import pyarrow.parquet as pq

    import ffkv
    from ffkv.corpus.batching import pack
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import CHUNK, SCHEMA, SentenceStream

    tok = default_tokenizer(a.tokenizer)
    old, new = [], []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.runs):
            t0, n = time.perf_counter(), 0
            with pq.ParquetWriter(Path(d) / "sentences.parquet", SCHEMA, compression="zstd") as w:
                for c in SentenceStream(open_corpus(a.corpus), tok, a.context, workers=0):
                    w.write_table(c.table(), row_group_size=max(len(c), 1))
                    n += int(c.offsets[-1])
            old.append(n / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            lens = SentenceStream(open_corpus(a.corpus), tok, a.context, workers=0).rows_plan()
            if lens is None:
                raise SystemExit("--ray-driver needs a pre-tokenized corpus file")
            plan = [pack(lens[i:i + CHUNK], a.batch_tokens) for i in range(0, len(lens), CHUNK)]
            assert int(lens.sum()) == n and plan
            new.append(n / (time.perf_counter() - t0))
    out(f"bench_host --ray-driver: {a.corpus}, {n:,} tokens, ffkv at {ffkv.__file__}")
    out("  before (the driver streams the table): " + ", ".join(f"{r:,.0f}" for r in old) +
        f" tok/s; median {statistics.median(old):,.0f}")
    out("  now (the driver plans from offsets):    " + ", ".join(f"{r:,.0f}" for r in new) +
        f" tok/s; median {statistics.median(new):,.0f}")
    out(f"  the driver's share before the actors start: {statistics.median(new) / statistics.median(old):,.1f}x faster")


def overlap(a) -> None:
    import torch

    import ffkv
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import SentenceStream, prefetched

    torch.set_num_threads(1)
    tok = default_tokenizer(a.tokenizer)
    x = torch.zeros(16)

    def device(tokens: int) -> None:
        t_end = time.perf_counter() + tokens / a.overlap
        for _ in range(a.launches):
            torch.add(x, 1.0, out=x)
        left = t_end - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def one(depth: int) -> float:
        st = SentenceStream(open_corpus(a.corpus), tok, a.context, workers=a.workers)
        n = 0
        t0 = time.perf_counter()
        for c in prefetched(st, depth):
            toks = int(c.offsets[-1])
            n += toks
            for i in range(0, toks, a.batch_tokens):
                device(min(a.batch_tokens, toks - i))
        return n / (time.perf_counter() - t0)

    one(0)  # imports, caches
    got = {0: [], a.depth: []}
    for _ in range(a.runs):
        for d in got:
            got[d].append(one(d))
    inline, ahead = (statistics.median(got[d]) for d in got)
    out(f"bench_host --overlap: {a.corpus}, device {a.overlap:,.0f} tok/s, {a.launches} launches a "
        f"{a.batch_tokens:,}-token batch, ffkv at {ffkv.__file__}")
    out(f"  inline:     {inline:,.0f} tok/s ({inline / a.overlap:.2f}x the device)  runs "
        + ", ".join(f"{r:,.0f}" for r in got[0]))
    out(f"  prefetched: {ahead:,.0f} tok/s ({ahead / a.overlap:.2f}x the device)  runs "
        + ", ".join(f"{r:,.0f}" for r in got[a.depth]) + f"  ({ahead / inline:.2f}x inline)")


if __name__ == "__main__":
    main()
