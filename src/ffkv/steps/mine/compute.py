"""The mining pass of the `mine` step: one forward pass per batch, every prefix's coefficients at
once, into the trackers (`ffkv.mine.trackers`, fed by `ffkv.mine.engine`), checkpointed,
resumable, optionally on Ray shards (`ffkv.steps.mine.distributed`).

The step itself (settings, record, which tables each tracker writes, the command) is
`ffkv.steps.mine`; its `compute` is `compute` here. `mine()` is the library's way in.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa

from ffkv.corpus.batching import Layout, auto_batch_tokens, device_memory, pack
from ffkv.mine.engine import (FlatTokens, checkpoint_batch_tokens, group_for, layout_key, load_checkpoint,
                              mine_batches, new_state, save_checkpoint, save_npz)
from ffkv.model import identity
from ffkv.steps.lifecycle import execute
from ffkv.steps.mine import COVARIANCE_TABLES, REGIMES_TABLES, STATS_TABLES, MineSettings, check_batch_tokens, fit

CKPT = ".mine_checkpoint.npz"


class _FinishContext:
    """What trackers' `finish` may read: the run's sentences batch by batch (what the host holds
    does not grow with the corpus)."""

    def __init__(self, run):
        self.run = run

    def sentence_batches(self, columns=("sentence_id", "token_ids"), rows: int = 65536):
        import pyarrow.parquet as pq

        with pq.ParquetFile(self.run.table_path("sentences")) as f:
            yield from f.iter_batches(batch_size=rows, columns=list(columns))


def vocab_table(tok, n: int) -> pa.Table:
    """Token id -> display string, so readers (show, report, web) need no tokenizer."""
    ids = list(range(n))
    size = len(tok)  # O(vocab) on a fast tokenizer: once, not once per id (a 262k vocabulary: 197 s)
    text = [tok.decode([i]) if i < size else "" for i in ids]
    raw = tok.convert_ids_to_tokens([i if i < size else 0 for i in ids])
    return pa.table({"token_id": pa.array(ids, pa.int32()), "text": text,
                     "token": [str(r) for r in raw]})


def mine(run, mm, s: MineSettings, checkpoint_every: float = 60.0, ray_address: str | None = None,
         shards: int | None = None, show_progress: bool | None = None, log=print, force: bool = False) -> dict:
    """Mine top-k triggers (and key statistics) into `run`; resumes a killed run with the same
    settings. `force`: mine again from scratch (the corpus split and the whole pass), replacing
    every table of the step."""
    s = replace(s, checkpoint_every=checkpoint_every, ray=ray_address, shards=shards)
    out = execute(run, "mine", s, mm=mm, log=log, show_progress=show_progress, force=force)
    if out.skipped:
        log(f"mine: {run.path} is already mined with these settings; nothing to do")
    return out.info


def _prepare(run, mm, s: MineSettings, force: bool = False) -> bool:
    """Record the model and the vocab (unless whole); True when the `sentences` table of these
    settings is already whole (a pass killed after writing it), so the pass reads it instead of
    streaming the corpus again."""
    identity.record_model(run, mm)
    run.manifest["lens"] = mm.lens.name
    run.save()
    if force or run.table_problem("vocab"):
        run.write_table("vocab", vocab_table(mm.tok, mm.vocab_size))
    return not force and run.table_problem("sentences") is None and \
        run.manifest.get("corpora", {}).get("sentences", {}).get("settings_key") == s.key()


def _stream(mm, s: MineSettings):
    """The corpus of these settings as a `ffkv.corpus.stream.SentenceStream`."""
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import SentenceStream

    src = open_corpus(s.corpus, field=s.field, seed=s.seed, context=s.context)
    return SentenceStream(src, mm.tok, mm.max_length, getattr(mm, "vocab_size", None), s.max_sentences,
                          chunk=s.chunk_sentences, workers=s.workers)


def prefetch_depth(s: MineSettings, mm) -> int:
    """--prefetch as given, else 2 on CUDA (the GPU outruns the host's decoding: on the H100,
    SmolLM2's shape mined 368k tok/s where the stream decoded 1.08M, so inline it cost a fifth
    of the pass) and 0 on a CPU (its cores run the forward)."""
    if s.prefetch is not None:
        return int(s.prefetch)
    import torch

    return 2 if torch.device(getattr(mm, "device", None) or "cpu").type == "cuda" else 0


def _record_corpus(run, s: MineSettings, stream) -> None:
    """The manifest's record of the corpus streamed into `sentences`, and of the settings it is for."""
    from ffkv.corpus.prepare import record_corpus

    rec = record_corpus(run, "sentences", stream, s.seed, s.field, s.max_sentences)
    rec["settings_key"] = s.key()
    run.manifest["corpus"] = rec
    run.manifest["counts"] = rec["counts"]
    run.save()


def _write_sentences(run, mm, s: MineSettings) -> None:
    """Stream the corpus into `sentences` without mining (Ray's shards read the table)."""
    from ffkv.corpus.stream import SCHEMA

    stream = _stream(mm, s)
    with run.table_writer("sentences", SCHEMA) as write:
        for chunk in stream:
            write(chunk.table())
    _record_corpus(run, s, stream)


def state_bytes(mm, s: MineSettings) -> int:
    """Device memory the trackers' state takes (`ffkv.mine.stats.KeyStats`' docstring: 408 bytes
    per key plus 132 + 220·k per key and sign; top-k: 12 bytes per slot and sign, 20 per prefix)."""
    layers = len(s.layers) if s.layers is not None else mm.n_layers
    keys = layers * (len(s.dims) if s.dims is not None else mm.d_m)
    signs = 2 if s.negative else 1
    per = signs * s.top_k * (20 if s.per_prefix else 12)
    if s.stats:
        per += 408 + signs * (132 + 220 * max(s.samples_per_bin, 1))
    return keys * per


def resolve_batch_tokens(mm, s: MineSettings, ckpt=None) -> int:
    """The token budget of this pass: --batch-tokens as given, or for auto the budget a
    checkpoint of these settings was mined under (a resume keeps its plan), else
    `ffkv.corpus.batching.auto_batch_tokens` from the device's free memory and the model's shape."""
    bt = check_batch_tokens(s.batch_tokens)
    if bt != "auto":
        return int(bt)
    prior = checkpoint_batch_tokens(ckpt) if ckpt is not None else None
    if prior is not None:
        with np.load(ckpt, allow_pickle=False) as z:
            if bytes(z["__key"]).decode() == layout_key(s, prior):
                return prior
    dev, free, elem = device_memory(mm)
    return auto_batch_tokens(dev, free, d=mm.d, d_m=mm.d_m, elem_bytes=elem,
                             keys=len(s.dims) if s.dims is not None else mm.d_m,
                             state_bytes=state_bytes(mm, s), group=group_for(mm, s))


def _mine_local(run, mm, s: MineSettings, state, whole: bool, checkpoint_every: float, show_progress,
                log, batch_tokens: int):
    """Stream the corpus chunk by chunk: write each chunk as a row group of `sentences` and mine
    its batches not yet in the checkpoint (a resumed run streams the chunks it had mined again,
    for the table, and skips their batches). With the table already whole, its rows are the
    chunks. Returns the state, the tokens mined now and the plan's layout."""
    from contextlib import closing, nullcontext

    from ffkv.corpus.stream import SCHEMA, prefetched, table_chunks
    from ffkv.mine.compiled import mining_forward
    from ffkv.mine.tune import tuner_for
    from ffkv.progress import progress

    ckpt = run.path / CKPT
    lkey = layout_key(s, batch_tokens)
    cursor = load_checkpoint(ckpt, state, lkey, log=log)
    if cursor:
        log(f"mine: resuming from checkpoint at batch {cursor}")
    elif ckpt.exists():
        state = new_state(mm, s)  # a checkpoint of other settings or trackers: maybe half loaded
    stream = None if whole else _stream(mm, s)
    chunks = table_chunks(run.table_path("sentences"), s.chunk_sentences) if whole else stream
    plan = Layout(batch_tokens)
    mined, last, done = 0, time.time(), 0  # done: batches of the plan so far, mined now or before
    tuner = tuner_for(mm, log)  # before the compiled blocks: its packing check runs the model eagerly
    _tune_malloc()
    with (nullcontext(None) if whole else run.table_writer("sentences", SCHEMA)) as write, \
            progress(None if show_progress is None else not show_progress) as bar, \
            mining_forward(mm, state.layers) as compiled, closing(tuner), \
            closing(prefetched(chunks, prefetch_depth(s, mm))) as chunks:  # closing: the tuner's blocks out, the thread stopped
        task = bar.add_task("mine", total=s.max_sentences, completed=0, tokens=0)
        rows = {}  # global batch index -> its rows, for the bar

        def on_batch(bi, ntok):
            nonlocal last, mined
            mined += ntok
            bar.update(task, advance=rows.pop(bi), tokens=bar.tasks[task].fields["tokens"] + ntok)
            if time.time() - last >= checkpoint_every:
                save_checkpoint(ckpt, state, bi + 1, lkey, batch_tokens)
                last = time.time()

        for chunk in chunks:
            if write is not None:
                write(chunk.table())
            lengths = chunk.lengths
            batches = pack(lengths, batch_tokens)  # no row cap: bounded by the budget alone
            todo = [(done + j, b) for j, b in enumerate(batches) if done + j >= cursor]
            rows.update((bi, len(b)) for bi, b in todo)
            bar.update(task, advance=len(chunk) - sum(len(b) for _, b in todo))  # mined before a resume
            mine_batches(mm, state, FlatTokens(values=chunk.values, offsets=chunk.offsets), chunk.sentence_id,
                         todo, on_batch, compiled=compiled, tuner=tuner, chunk=(done, len(batches)))
            done += len(batches)
            plan.add(lengths, batches)
            del chunk, batches, todo
            _trim_malloc()
    if stream is not None:
        _record_corpus(run, s, stream)
    return state, mined, plan, tuner


# glibc's malloc, tuned from Python (ctypes) because the pass's big buffers come and go:
# M_MMAP_THRESHOLD fixed at 32 MiB (glibc's own threshold moves with each large free, so which
# buffers land in the heap and fragment it drifts; RSS then grows with the corpus), and
# malloc_trim after each chunk returns the heap's free pages. Not lower: at 4 MiB every
# per-layer capture (2,048 tokens x 1,536 keys x 4 bytes = 12 MB) is a fresh mmap whose pages
# fault in again, and mining ran 1.27x slower (494 vs 627 tok/s, SmolLM2, 1,500 sentences), for
# peak RSS 1.043x instead of 1.057x from 1,000 to 10,000 sentences. No-ops off glibc.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20


def _libc():
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None
    except OSError:
        return None


def _tune_malloc() -> None:
    lib = _libc()
    if lib is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # the user's own setting wins
        lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _trim_malloc() -> None:
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


def compute(ctx) -> dict:
    """The pass (the step's `compute`): prepare the corpus, mine every batch not yet in the
    checkpoint (or on Ray shards), write the tables; returns the step's info."""
    with switched(ctx.settings):
        return _compute(ctx)


def switched(s: MineSettings):
    """--pack, --fused-kernels and --compile over their environment variables while the pass runs,
    in this thread (`ffkv.mine.switches`; Ray's actors get them in their environment). With
    --regimes the forward stays eager (the compiled blocks tap m only: `ffkv.mine.regimes`)."""
    from ffkv.mine import switches

    return switches.over({"FFKV_PACK": s.pack, "FFKV_TRITON": s.fused_kernels,
                          "FFKV_COMPILE": "0" if getattr(s, "regimes", False) else s.compile_blocks})


def _compute(ctx) -> dict:
    from ffkv.mine import fused_cuda, packing
    from ffkv.mine.compiled import enabled as compile_enabled
    from ffkv.mine.tune import how, how_of_shards

    run, s, mm = ctx.run, ctx.settings, ctx.model()
    packing.setting()  # a bad FFKV_PACK, FFKV_TRITON or FFKV_COMPILE is refused before any work
    fused_cuda.setting()
    compile_enabled()
    fit(s, mm)
    checkpoint_every, ray_address, shards = s.checkpoint_every, s.ray, s.shards
    if ctx.force:  # from scratch: no resume, neither a checkpoint's nor a killed Ray pass's shards
        import shutil

        (run.path / CKPT).unlink(missing_ok=True)
        shutil.rmtree(run.path / ".mine_shards", ignore_errors=True)
    whole = _prepare(run, mm, s, force=ctx.force)
    bt = resolve_batch_tokens(mm, s, run.path / CKPT)
    t0 = time.time()
    state = new_state(mm, s)
    if ray_address:  # the shards read their own rows of the whole table
        from ffkv.steps.mine.distributed import mine_ray

        prep = None if whole else _actors_prepare(run, mm, s, bt)
        if prep is None:
            if not whole:
                _write_sentences(run, mm, s)
            batches, plan, chunks = _ray_plan(run, s, bt)
        else:
            prep, batches, plan = prep
            chunks = prep.chunks
        _shards_of_this_plan(run, layout_key(s, bt) + ("/prepared" if prep is not None else ""))
        state, shards, hows = mine_ray(run, mm, s, batches, ray_address, shards, log=ctx.log, chunks=chunks,
                                       prep=prep)
        ran = how_of_shards(hows)
        mined_tokens = plan.tokens
    else:
        state, mined_tokens, plan, tuner = _mine_local(run, mm, s, state, whole, checkpoint_every,
                                                       ctx.show_progress, ctx.log, bt)
        ran = how(mm, tuner, state.layers)
    secs = time.time() - t0
    tables = state.finish(_FinishContext(run))
    trig = tables.pop("triggers")
    run.write_table("triggers", trig, row_group_size=100_000)
    for name, t in tables.items():  # key_stats, key_hist, key_samples: sorted by layer, dim
        run.write_table(name, t, row_group_size=100_000)
    (run.path / CKPT).unlink(missing_ok=True)
    info = {"rows": trig.num_rows, "padding_share": round(plan.padding_share(), 4),
            "tokens": plan.tokens,
            "tokens_per_s": round(mined_tokens / secs, 1) if secs > 0 else None,
            "mine_seconds": round(secs, 2), "shards": shards if ray_address else 1,
            "batch_tokens": bt, "batch_tokens_setting": s.batch_tokens,
            "dtype": str(getattr(mm, "dtype", "")).replace("torch.", ""),
            "device": str(getattr(mm, "device", "")), "batches": plan.record(), **ran}
    if state.stats is not None:
        from ffkv.mine.stats import layout

        info["stats"] = {**layout(), "tables": list(STATS_TABLES), "samples_per_bin": s.samples_per_bin}
    else:
        info["stats"] = None
    if "covariance" in state.trackers:
        info["covariance"] = {"layers": state.trackers["covariance"].cov, "tables": list(COVARIANCE_TABLES)}
    if "regimes" in state.trackers:
        from ffkv.mine.regimes import REGIMES

        info["regimes"] = {"regimes": dict(REGIMES), "tables": list(REGIMES_TABLES)}
    return info


def _actors_prepare(run, mm, s: MineSettings, bt: int):
    """Where Ray's actors can prepare their own rows (a pre-tokenized corpus file: its sentences
    and their lengths are known from its row offsets), (`Prepared`, the batch plan, its layout);
    else None, and the driver streams the corpus into `sentences` first."""
    from pathlib import Path

    from ffkv.corpus.tokens import kind_of
    from ffkv.steps.mine.distributed import Prepared

    if not (s.corpus and Path(s.corpus).is_file() and kind_of(Path(s.corpus), "")):
        return None  # text (read once, by the driver's stream), a dataset, or a file:COLUMN spec
    stream = _stream(mm, s)
    lens = stream.rows_plan()
    if lens is None:
        return None
    c = s.chunk_sentences
    batches, plan, chunks = _plan_of((lens[a:a + c] for a in range(0, len(lens), c)), bt)
    corpus = {"spec": s.corpus, "kind": stream.src.kind, "column": stream.src.details.get("column"),
              "context": s.context, "chunk": c}
    return Prepared(corpus, stream, chunks, joined=lambda: _record_corpus(run, s, stream)), batches, plan


def _ray_plan(run, s: MineSettings, bt: int):
    """The one-process pass's batch plan (packed within each chunk of `chunk_sentences` rows) as
    row indices of the whole table, read chunk by chunk: a shard's batches then span one
    stretch of rows, which it reads alone (`ffkv.steps.mine.distributed.read_rows`). With the
    chunks as (first batch, batch count): the actors' tuners take their strata from them."""
    from ffkv.corpus.stream import file_chunks

    return _plan_of((part.column("n_tokens").to_numpy() for part in
                     file_chunks(run.table_path("sentences"), s.chunk_sentences, ["n_tokens"])), bt)


def _plan_of(chunk_lengths, bt: int):
    """(batches as row indices of the whole table, the plan's `Layout`, (first batch, count) per
    chunk) from each chunk's sentence lengths."""
    batches, plan, start, chunks = [], Layout(bt), 0, []
    for lengths in chunk_lengths:
        local = pack(lengths, bt)
        chunks.append((len(batches), len(local)))
        batches += [b + start for b in local]
        plan.add(lengths, local)
        start += len(lengths)
    return batches, plan, chunks


def _shards_of_this_plan(run, lkey: str) -> None:
    """Ray shard files are named by the settings' key, and a shard is a slice of the batch plan:
    files left by a killed run under another plan (another budget) would be merged as if they
    were slices of this one. A marker names the plan; other plans' files are dropped."""
    d = run.path / ".mine_shards"
    marker = d / "plan.npz"  # .npz: mine_ray deletes every .npz there when it is done
    if d.exists():
        same = False
        if marker.exists():
            try:
                with np.load(marker, allow_pickle=False) as z:
                    same = bytes(z["key"]).decode() == lkey
            except Exception:  # noqa: BLE001
                same = False
        if not same:
            for f in d.glob("*.npz"):
                f.unlink()
    d.mkdir(exist_ok=True)
    save_npz(marker, {"key": np.frombuffer(lkey.encode(), np.uint8)})
