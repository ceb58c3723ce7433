"""Mining at device scale (issue 24): plain forward vs mining vs mining with key statistics.

    python benchmarks/bench_gpu.py --shape smollm2-135m --tokens 20000           # random weights
    python benchmarks/bench_gpu.py --shape llama-8b --tokens 20000000 --corpus ids.parquet
    python benchmarks/bench_gpu.py --model HuggingFaceTB/SmolLM2-135M --corpus wikitext-2:valid
    PYTHONPATH=src python3 benchmarks/bench_gpu.py --shape llama-1b --corpus ids.parquet   # a bare GPU box

--model takes an HF id, a folder or a GGUF file (default: the embedded SmolLM2 GGUF); --shape
builds a random-weight model of that shape from a config instead (weights do not change the
cost). --corpus is a text corpus spec (`ffkv corpus --help`; default WikiText-2 valid when it is
there) or a Parquet file whose first list-of-integers column holds token ids (no tokenizer, no
sentence splitter: what a machine without spaCy runs). --tokens N streams N tokens, cycling the
corpus when it is shorter. On the same length-packed batches (budget: --batch-tokens, default
auto as `ffkv mine` sizes it), interleaved batch by batch: a plain forward with logits, the
forward as mining runs it with nothing captured (its ceiling), mining (top-50 of every key, --no-stats), mining with key statistics, and both again with the fused
kernels (`FFKV_TRITON=1`, where Triton and CUDA are), and with --pack C the ceiling and mining
with statistics in packed rows of C tokens (`FFKV_PACK`, `ffkv.mine.packing`), and with --compile
through compiled blocks (`FFKV_COMPILE`, `ffkv.mine.compiled`); --arms keeps only some. It prints tok/s and ratios, host
preparation tok/s (corpus -> token ids; and streamed as `ffkv mine` streams it, with each
--workers count), peak GPU memory (CUDA), the trackers' aten ops per
layer and batch (torch.profiler, the CPU proxy of kernel launches) and the projected wall time
of 100M tokens. Without CUDA it measures the CPU figures and says the GPU ones were skipped.
Imports neither spaCy, Ray nor DuckDB (a text corpus other than WikiText may need spaCy).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from _common import WT2, out

import torch  # noqa: E402  (after _common, which imports ffkv first)

SHAPES = {  # LlamaConfig fields: hidden, intermediate, layers, heads, kv heads, vocabulary
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152),
    "llama-1b": (2048, 8192, 16, 32, 8, 128256),
    "llama-8b": (4096, 14336, 32, 32, 8, 128256),
}


class _Ids:
    """The tokenizer a random-weight model needs in ffkv: a pad id and a vocabulary size."""
    pad_token_id = 0

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n


def build_shape(name: str, device: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ffkv.model.memories import MemoryModel

    d, dm, L, h, kv, V = SHAPES[name]
    cfg = LlamaConfig(hidden_size=d, intermediate_size=dm, num_hidden_layers=L, num_attention_heads=h,
                      num_key_value_heads=kv, vocab_size=V, max_position_embeddings=8192,
                      tie_word_embeddings=name == "smollm2-135m")
    torch.manual_seed(0)
    was = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy held by the CUDA cache (8B: 32 GB)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(was)
    return MemoryModel(hf, _Ids(V))


def corpus_ids(spec: str | None, mm, tok_of) -> tuple[list[list[int]], float]:
    """Token id lists of the corpus, and the host's preparation rate in tokens/s."""
    t0 = time.perf_counter()
    if spec and spec.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        t = pq.read_table(spec)
        col = next((c for c, f in zip(t.columns, t.schema) if pa.types.is_list(f.type)
                    and pa.types.is_integer(f.type.value_type)), None)
        if col is None:
            raise SystemExit(f"bench_gpu: {spec} has no list-of-integers column")
        ids = [x for x in col.to_pylist() if x]
    else:
        from ffkv.corpus.sources import open_corpus, tokenize

        spec = spec or str(WT2 / "wiki.valid.tokens")
        sents = open_corpus(spec).sentences(None)
        ids, _ = tokenize(tok_of(), sents, mm.max_length)
    secs = time.perf_counter() - t0
    return ids, sum(map(len, ids)) / secs if secs > 0 else float("inf")


def default_tokenizer(folder: str | None = None):
    """--tokenizer's folder, else the embedded SmolLM2's (a GGUF: needs gguf, absent on a bare box)."""
    from transformers import AutoTokenizer

    if folder:
        return AutoTokenizer.from_pretrained(folder)
    from ffkv.model.load import resolve_default_model

    p = resolve_default_model()
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


def host_rates(spec: str | None, tok, max_length: int, workers: list[int], limit: int) -> dict:
    """Host preparation as `ffkv mine` streams it (`ffkv.corpus.stream.SentenceStream`: split,
    tokenize; pre-tokenized rows: check, decode), with each worker count: {workers: (tok/s after
    the first chunk, seconds to the first chunk)} over about `limit` tokens. A CPU figure: what
    the host can feed the device, overlapped with the forward pass."""
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import SentenceStream

    res = {}
    for w in workers:
        st = SentenceStream(open_corpus(spec or str(WT2 / "wiki.valid.tokens")), tok, max_length,
                            chunk=1024, workers=w)
        t0 = time.perf_counter()
        first, ntok = None, 0
        it = iter(st)
        for c in it:
            if first is None:
                first = time.perf_counter()
            else:
                ntok += int(c.offsets[-1])
            if ntok >= limit:
                it.close()
                break
        secs = time.perf_counter() - (first or t0)
        res[w] = (ntok / secs if secs > 0 and ntok else float("nan"), (first or t0) - t0)
    return res


def stream(ids: list[list[int]], n: int, limit: int) -> list[list[int]]:
    """N tokens (at least), cycling the corpus; sequences cut at the model's context."""
    outl, total, i = [], 0, 0
    while total < n:
        s = ids[i % len(ids)][:limit]
        outl.append(s)
        total += len(s)
        i += 1
    return outl


def tracker_ops(mm, toks, batch_idx, settings, fused: bool = False) -> float:
    """Aten ops (and, fused, Triton launches) per layer and batch of the trackers
    (`ffkv.mine.trackers.tracker_ops_per_layer`) on one real batch's captures of the first group
    of layers, after one untimed update."""
    from dataclasses import replace

    from ffkv.mine.engine import group_for, new_state
    from ffkv.mine.trackers import Batch, tracker_ops_per_layer

    layers = list(range(group_for(mm, settings)))  # one update's layers: an 8B's all would not fit twice
    settings = replace(settings, layers=layers)
    seqs = [toks[i] for i in batch_idx]
    ids, mask = mm.batch(seqs)
    ids, mask = ids.to(mm.device), mask.to(mm.device)
    caps = mm.capture(ids, mask, layers=layers, what=("m",))
    ms = [caps.layers[l]["m"] for l in layers]
    del caps
    state = new_state(mm, settings)
    # the portable path, which a GPU runs: on a CPU the statistics' numba kernels count no aten op
    old, os.environ["FFKV_NUMBA"] = os.environ.get("FFKV_NUMBA"), "0"
    flag, os.environ["FFKV_TRITON"] = os.environ.get("FFKV_TRITON", "0"), "1" if fused else "0"
    try:
        tracker_ops_per_layer(state, ms, Batch.from_lengths([len(s) for s in seqs], list(range(len(seqs))), mask))
        b2 = Batch.from_lengths([len(s) for s in seqs], list(range(len(seqs), 2 * len(seqs))), mask)
        return tracker_ops_per_layer(state, [-m for m in ms], b2)
    finally:
        os.environ["FFKV_TRITON"] = flag
        if old is None:
            os.environ.pop("FFKV_NUMBA")
        else:
            os.environ["FFKV_NUMBA"] = old


def main(a) -> dict:
    from ffkv.corpus.batching import layout, pack
    from ffkv.mine.engine import group_for, mine_batches, new_state
    from ffkv.steps.mine import MineSettings
    from ffkv.steps.mine.compute import resolve_batch_tokens

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    from ffkv.model.load import resolve_dtype

    dtype = resolve_dtype(a.dtype, device)
    if a.shape:
        mm = build_shape(a.shape, device, dtype)
        what = f"random-weight {a.shape} shape"
        tok_of = lambda: default_tokenizer(a.tokenizer)  # noqa: E731
    else:
        from ffkv.model.memories import open_model

        mm = open_model(a.model, device=device, dtype=str(dtype).replace("torch.", ""))
        what = a.model or "the default SmolLM2 GGUF"
        tok_of = lambda: mm.tok  # noqa: E731
    ids, host_tok_s = corpus_ids(a.corpus, mm, tok_of)
    if max(max(s) for s in ids) >= mm.vocab_size:
        raise SystemExit(f"bench_gpu: the corpus holds token ids >= the model's vocabulary ({mm.vocab_size})")
    toks = stream(ids, a.tokens, mm.max_length or 8192)
    lengths = [len(t) for t in toks]
    bare_s, full_s = MineSettings(top_k=50, stats=False), MineSettings(top_k=50, batch_tokens=a.batch_tokens)
    bt = resolve_batch_tokens(mm, full_s)
    batches = pack(lengths, bt)
    lay = layout(lengths, batches, bt)
    ntok = sum(lengths)
    out(f"bench_gpu: {what}, {mm.n_layers} layers x {mm.d_m} keys, {str(dtype).replace('torch.', '')} on "
        f"{torch.cuda.get_device_name(0) if cuda else 'CPU (' + str(torch.get_num_threads()) + ' threads)'}; "
        f"{ntok:,} tokens in {len(toks):,} sequences; batch_tokens {bt} ({a.batch_tokens}): {lay['batches']} "
        f"batches, {lay['mean_tokens']:.0f} tokens and up to {lay['max_rows']} rows each, fill {lay['fill']:.0%}, "
        f"padding {lay['padding_share']:.1%}")
    ops_bare = tracker_ops(mm, toks, batches[0], bare_s)
    ops_full = tracker_ops(mm, toks, batches[0], full_s)
    from ffkv.mine import fused_cuda

    flag = os.environ.get("FFKV_TRITON", "0")
    os.environ["FFKV_TRITON"] = "1"
    fused = fused_cuda.available(device)  # the fused kernels' arms too, on the same batches
    os.environ["FFKV_TRITON"] = flag
    line = (f"tracker aten ops per layer and batch (torch.profiler, leaf ops; {group_for(mm, full_s)} layers per "
            f"update): {ops_bare:.1f} top-k only, {ops_full:.1f} with key statistics (goal <= 20)")
    if fused:
        fb, ff = (tracker_ops(mm, toks, batches[0], x, fused=True) for x in (bare_s, full_s))
        line += f"; fused kernels (a launch counts one): {fb:.1f} top-k only, {ff:.1f} with key statistics"
    out(line)
    arms = ["plain", "floor", "bare", "stats"] + (["bare_fused", "stats_fused"] if fused else [])
    packed = None
    if a.pack:
        from ffkv.mine.packing import Packed, refusal

        why = refusal(mm)
        if why:
            out(f"packed rows (FFKV_PACK={a.pack}): skipped, {why}")
        else:
            packed = a.pack
            arms += ["floor_packed", "stats_packed"] + (["stats_fused_packed"] if fused else [])
    if a.compile:
        arms += (["stats_compiled"] + (["stats_fused_compiled"] if fused else [])
                 + (["stats_fused_packed_compiled"] if fused and packed else []))
    if a.arms:
        arms = ["plain"] + [x for x in arms if x in a.arms and x != "plain"]
    states = {arm: new_state(mm, bare_s if arm.startswith("bare") else full_s) for arm in arms
              if not arm.startswith(("plain", "floor"))}
    sids = list(range(len(toks)))
    secs = {arm: 0.0 for arm in arms}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():  # warm-up, untimed
        i0, m0 = mm.batch([toks[i] for i in batches[0]])
        mm.hf(input_ids=i0.to(mm.device), attention_mask=m0.to(mm.device), use_cache=False)
    if a.compile:  # the compile happens here, untimed (`ffkv.mine.compiled`: one graph for all shapes)
        t0 = time.perf_counter()
        os.environ["FFKV_COMPILE"] = "1"
        for arm in [x for x in arms if "_compiled" in x]:
            os.environ["FFKV_TRITON"] = "1" if "_fused" in arm else "0"
            os.environ["FFKV_PACK"] = str(packed) if "_packed" in arm else "0"
            mine_batches(mm, new_state(mm, full_s), toks, sids, [(0, batches[0])])
        os.environ["FFKV_COMPILE"] = "0"
        sync()
        out(f"compiled blocks (FFKV_COMPILE=1): warm-up {time.perf_counter() - t0:.1f} s")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    for bi, idx in enumerate(batches):
        ids_b, mask = mm.batch([toks[i] for i in idx])
        ids_b, mask = ids_b.to(mm.device), mask.to(mm.device)
        for arm in (arms if bi % 2 == 0 else arms[::-1]):
            os.environ["FFKV_TRITON"] = "1" if "_fused" in arm else "0"
            os.environ["FFKV_PACK"] = str(packed) if "_packed" in arm else "0"
            os.environ["FFKV_COMPILE"] = "1" if "_compiled" in arm else "0"
            sync()
            t0 = time.perf_counter()
            if arm == "plain":
                with torch.no_grad():
                    mm.hf(input_ids=ids_b, attention_mask=mask, use_cache=False).logits.sum()
            elif arm == "floor":  # what mining's forward costs with nothing captured: its ceiling
                with torch.no_grad():
                    mm.capture(ids_b, None, what=())
            elif arm == "floor_packed":  # the same in packed rows (`ffkv.mine.packing`)
                from ffkv.mine.engine import flat_rows

                p = Packed(*flat_rows(toks, idx), mm.pad_id(), packed, mm.device)
                with torch.no_grad():
                    mm.capture(p.ids, None, what=(), position_ids=p.position_ids)
            else:
                mine_batches(mm, states[arm], toks, sids, [(bi, idx)])
            sync()
            secs[arm] += time.perf_counter() - t0
    os.environ["FFKV_TRITON"] = flag
    for k in ("FFKV_PACK", "FFKV_COMPILE"):
        os.environ.pop(k, None)
    rate = {k: ntok / v for k, v in secs.items()}
    what = {"plain": "plain forward (with logits)",
            "floor": "mining's ceiling (the forward to the last layer, no mask, nothing captured)",
            "bare": "mining without statistics", "stats": "mining with key statistics"}
    tags = {"fused": "fused kernels (FFKV_TRITON=1)", "packed": f"packed rows of {packed} tokens (FFKV_PACK)",
            "compiled": "compiled blocks (FFKV_COMPILE=1)"}
    out("throughput on the same batches, interleaved (tok/s, and x the plain forward):")
    for arm in arms:
        base, *tg = arm.split("_")
        out(f"  {what[base]}{', ' + ', '.join(tags[t] for t in tg) if tg else ''}: {rate[arm]:,.0f} tok/s "
            f"({secs['plain'] / secs[arm]:.2f}x)")
    if fused and fused_cuda._broken:
        out(f"  BROKEN fused kernels, the portable path ran: {fused_cuda._broken}")
    if not fused:
        out("throughput, fused kernels: skipped (no Triton, or no CUDA device)")
    out(f"host preparation (corpus -> token ids, one process): {host_tok_s:,.0f} tok/s")
    streamed = None
    try:
        tok = tok_of()
    except Exception as e:  # noqa: BLE001  (a bare GPU box: no tokenizer for --shape)
        out(f"host preparation, streamed: skipped (no tokenizer: {str(e).splitlines()[0][:100]})")
    else:
        streamed = host_rates(a.corpus, tok, mm.max_length or 8192, a.workers, a.host_tokens)
        out("host preparation, streamed as `ffkv mine` streams it (ffkv.corpus.stream, chunks of 1,024): " + "; ".join(
            f"{r:,.0f} tok/s {'in-process' if w == 0 else f'with {w} worker process(es)'} (first chunk after {t0:.1f} s)"
            for w, (r, t0) in streamed.items()) + f"; {torch.get_num_threads()} torch threads, "
            f"{len(os.sched_getaffinity(0))} cores")
    best_stats = max((v for k, v in rate.items() if k.startswith("stats")), default=float("nan"))
    hours = 1e8 / best_stats / 3600
    serial = 1e8 / best_stats + 1e8 / host_tok_s
    line = (f"projected 100M tokens: {hours * 60:,.1f} min mining with statistics; {serial / 60:,.1f} min with host "
            f"preparation in series")
    if streamed:
        w, (best, _) = max(streamed.items(), key=lambda kv: kv[1][0])
        line += (f"; {1e8 / min(best_stats, best) / 60:,.1f} min with it overlapped "
                 f"({w} workers: the slower of the two sets the pace)")
    out(line)
    res = {"tokens": ntok, "batch_tokens": bt, **lay, **{f"{k}_tok_s": v for k, v in rate.items()},
           "host_tok_s": host_tok_s, "ops_topk": ops_bare, "ops_stats": ops_full,
           "host_streamed_tok_s": {w: r for w, (r, _) in (streamed or {}).items()}}
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        out(f"peak GPU memory: {peak:.1f} GiB")
        res["peak_gib"] = peak
    else:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        out(f"GPU figures skipped (peak GPU memory, GPU tok/s): no CUDA device (torch {torch.__version__}, {build})")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, help="HF id, folder or GGUF file (default: the embedded SmolLM2)")
    g.add_argument("--shape", choices=sorted(SHAPES), help="random-weight model of this shape")
    ap.add_argument("--corpus", default=None, help="text corpus spec or a Parquet file of token id lists")
    ap.add_argument("--tokenizer", default=None,
                    help="with --shape: a tokenizer folder for the streamed host figure (default: the embedded "
                         "SmolLM2's, from its GGUF)")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--batch-tokens", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--workers", default=None,
                    help="worker counts for the streamed host figure, e.g. 0,4 (default: 0 and the mine step's default, "
                         "at least 1)")
    ap.add_argument("--host-tokens", type=int, default=300_000, help="tokens streamed per worker count")
    ap.add_argument("--pack", type=int, default=0,
                    help="also time mining's forward in packed rows of this many tokens (FFKV_PACK; 0: not)")
    ap.add_argument("--compile", action="store_true",
                    help="also time mining through compiled blocks (FFKV_COMPILE=1; compiled before the timing)")
    ap.add_argument("--arms", default=None,
                    help="keep only these arms beside the plain forward, comma-separated (e.g. stats,stats_compiled)")
    args = ap.parse_args()
    from ffkv.corpus.stream import default_workers

    try:
        args.workers = ([0, max(1, default_workers())] if args.workers is None else
                        [int(x) for x in str(args.workers).split(",")])
    except ValueError:
        print(f"bench_gpu: --workers takes whole numbers, e.g. 0,4 (got {args.workers!r})", file=sys.stderr)
        sys.exit(2)
    args.arms = [x for x in args.arms.split(",") if x] if args.arms else None
    if args.tokens < 1 or args.pack < 0:
        print("bench_gpu: --tokens must be at least 1, and --pack at least 0", file=sys.stderr)
        sys.exit(2)
    main(args)
