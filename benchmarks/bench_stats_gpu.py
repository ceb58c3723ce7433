"""Where the trackers' time goes on a GPU, the fused kernels against the portable path (issue 24).

    PYTHONPATH=src python3 benchmarks/bench_stats_gpu.py --corpus .dev/wt2_train_ids.parquet

On one real batch of a random-weight SmolLM2-135M-shaped model (`bench_gpu.build_shape`), sized as
`ffkv mine` sizes it: the captures of one tracker update (a group of layers), then
  1. one KeyStats update and one top-k update by each path (`FFKV_TRITON=0`: torch;
     `FFKV_TRITON=1`: `ffkv.mine.fused_cuda`), median of 5 (CUDA events); the states must be
     equal (counts, maxima, positions, samples), or the script says which arrays differ;
  2. the fused capture kernel alone (bf16 and float32 captures) and the offer kernel alone, then
     the capture kernel under other tilings (`sweep`);
  3. a torch.profiler table of one whole mining batch with statistics and the fused kernels.
Without CUDA it runs on the CPU (the fused path then only under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics

from _common import out

import torch  # noqa: E402


def timed(fn, reps: int = 5) -> float:
    """Median seconds of fn() (CUDA events on a GPU)."""
    cuda = torch.cuda.is_available()
    fn()
    ts = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def sweep(fused_cuda, x, lens, lut) -> None:
    """The capture kernel (bf16, statistics, one sign) under other tilings: keys per program (BW),
    positions per tile (TT), warps, and rows per program (ROWS: each program adds its histogram
    to the whole with atomics, so more rows, fewer atomics, fewer programs). Registers, and so
    resident warps, depend on the first three (`python -m ffkv.mine.fused_aot` prints them for any
    GPU); only a GPU says which is fastest. Each tiling's histogram must equal the default's."""
    import numpy as np

    names = ("BW", "TT", "WARPS", "ROWS")
    keep = tuple(getattr(fused_cuda, n) for n in names)
    ref = fused_cuda.capture(x, lens, lut, (1,), True)
    if ref is None:
        out(f"  capture kernel tilings: skipped (the kernel failed: {fused_cuda._broken})")
        return
    ref = ref[1].cpu().numpy()
    row = []
    for tiling in ((16, 4, 1, 32), (32, 4, 2, 16), (64, 4, 4, 8), (16, 4, 1, 64), (16, 4, 1, 128), (8, 4, 1, 32),
                   (16, 8, 1, 32), (16, 2, 1, 32), (16, 4, 2, 32), (32, 4, 1, 32), (32, 2, 1, 32), (16, 2, 1, 64)):
        # (statically, sm_90: 16x4 issues 3.34 warp instructions a value at 27% occupancy; 16x2 3.22
        # at 38%; 32x4 2.77 at 19%; 32x2 3.00 at 22%: only a GPU weighs the two)
        for n, v in zip(names, tiling):
            setattr(fused_cuda, n, v)
        label = " ".join(f"{n}={v}" for n, v in zip(names, tiling))
        r = fused_cuda.capture(x, lens, lut, (1,), True)
        if r is None:  # did not compile: say so, and keep the path on for what follows
            row.append(f"{label}: failed ({fused_cuda._broken})")
            fused_cuda._broken = None
            continue
        same = np.array_equal(r[1].cpu().numpy(), ref)
        t = timed(lambda: fused_cuda.capture(x, lens, lut, (1,), True))
        row.append(f"{label}: {t * 1e3:.2f} ms{'' if same else ' (HISTOGRAM DIFFERS)'}")
    for n, v in zip(names, keep):
        setattr(fused_cuda, n, v)
    out("  capture kernel tilings (bf16, stats, one sign):\n    " + "\n    ".join(row))


def sweeps(fused_cuda, ks, g, score, pos, batch, m, lens, lut) -> None:
    """The fused kernels' knobs, each timed on one input: rows per offer chunk, the top-k's
    prefetch stages, the capture's tilings. Last in the run: a lease that ends here loses only these."""
    n_rows = len(batch.lengths)
    # on samples filled by eight batches' worth of sentence ids, where few rows still enter:
    # rows checked R at a time (`fused_cuda.OFFER_ROWS`), R = 1 being row by row
    for rep in range(1, 9):
        fused_cuda.offer(*ks.offer_args(g, 1, score, pos, batch.sids + rep * n_rows))
    keep, row = fused_cuda.OFFER_ROWS, []
    for r in (1, 4, 8, 16):
        fused_cuda.OFFER_ROWS = r
        t = timed(lambda: fused_cuda.offer(*ks.offer_args(g, 1, score, pos, batch.sids + 100 * n_rows)))
        row.append(f"{r} row(s) at a time {t * 1e3:.2f} ms")
    fused_cuda.OFFER_ROWS = keep
    out("  fused offer kernel alone, filled samples: " + "; ".join(row))
    # the top-k kernel on full lists that no row enters (the common case once they fill),
    # with its row loads prefetched and without
    key0 = torch.full((score.shape[1], 50), torch.iinfo(torch.long).max, dtype=torch.long, device=score.device)
    kp0 = torch.zeros(key0.shape, dtype=torch.int32, device=score.device)
    pos32, low = pos.to(torch.int32), score * 0.5
    fused_cuda.topk(score, pos32, batch.sids, key0, kp0)
    keep, row = fused_cuda.TOPK_STAGES, []
    for stg in (1, 2, 3, 4):
        fused_cuda.TOPK_STAGES = stg
        t = timed(lambda: fused_cuda.topk(low, pos32, batch.sids, key0, kp0))
        row.append(f"{stg} stage(s) {t * 1e3:.2f} ms")
    fused_cuda.TOPK_STAGES = keep
    out("  fused top-k kernel alone, no row entering: " + "; ".join(row))
    sweep(fused_cuda, m.to(torch.bfloat16), lens, lut)


def main(a) -> None:
    from bench_gpu import build_shape, corpus_ids, stream

    from ffkv.corpus.batching import pack
    from ffkv.mine import stats
    from ffkv.mine.engine import group_for, mine_batches, new_state
    from ffkv.steps.mine import MineSettings
    from ffkv.steps.mine.compute import resolve_batch_tokens
    from ffkv.mine.trackers import Batch, LayerCapture
    from ffkv.model.load import resolve_dtype

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    mm = build_shape(a.shape, dev, resolve_dtype("auto", dev))
    ids, _ = corpus_ids(a.corpus, mm, None)
    toks = stream(ids, a.tokens, 8192)
    s = MineSettings(top_k=50)
    bt = resolve_batch_tokens(mm, s) if a.batch_tokens == "auto" else int(a.batch_tokens)
    batches = pack([len(t) for t in toks], bt)
    idx = max(batches, key=len)
    seqs = [toks[i] for i in idx]
    tid, mask = mm.batch(seqs)
    tid, mask = tid.to(mm.device), mask.to(mm.device)
    G = group_for(mm, s)
    layers = list(range(G))
    caps = mm.capture(tid, mask, layers=layers, what=("m",))
    m = torch.cat([caps.layers[l]["m"] for l in layers], -1).float()
    del caps
    batch = Batch.from_lengths([len(x) for x in seqs], list(range(len(seqs))), mask)
    cap = LayerCapture(tuple(layers), m, batch)
    out(f"bench_stats_gpu: {a.shape}, batch of {len(seqs)} rows x {mask.shape[1]} positions ({batch.tokens:,} tokens, "
        f"budget {bt}); one update: {G} layers x {mm.d_m} keys = {m.shape[-1]:,} keys, {m.numel() / 1e9:.2f}G values; "
        f"Triton {'present' if importlib.util.find_spec('triton') else 'absent'}, CUDA {cuda}")

    def fresh():
        return stats.KeyStats(layers, None, mm.d_m, samples=5, device=mm.device, group=G)

    from ffkv.mine import fused_cuda
    from ffkv.mine.topk import TopKState

    res, tops, later = {}, {}, None
    for name, flag in (("torch", "0"), ("fused", "1")):
        os.environ["FFKV_TRITON"] = flag
        if name == "fused" and not fused_cuda.available(dev):
            out("  fused : skipped (no Triton, or no CUDA device)")
            continue
        try:
            def once():
                c = LayerCapture(tuple(layers), m, batch, (1,), True)  # what a mining update hands over
                ks.update(batch, c)
                return c
            ks = fresh()
            once()
            res[name] = {k: v.copy() for k, v in ks.arrays().items()}
            t_upd = timed(once)
            t_top = timed(lambda: TopKState(layers, None, mm.d_m, 50, device=mm.device, group=G).update(
                batch, LayerCapture(tuple(layers), m, batch, (1,), False)))
            # the lists after two batches (the second scaled and shuffled: some rows enter, most
            # not), to compare the paths: a hazard of the kernel's prefetching would show here
            tk = TopKState(layers, None, mm.d_m, 50, device=mm.device, group=G)
            tk.update(batch, LayerCapture(tuple(layers), m, batch, (1,), False))
            b2 = Batch.from_lengths(batch.lengths, [i + len(seqs) for i in range(len(seqs))], mask)
            tk.update(b2, LayerCapture(tuple(layers), m * 0.75 + m.roll(1, -1) * 0.5, b2, (1,), False))
            tops[name] = {k: v.copy() for k, v in tk.arrays().items()}
        except Exception as e:  # noqa: BLE001  (say what broke, go on with the other figures)
            out(f"  {name:6s}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            continue
        out(f"  {name:6s}: one KeyStats update {t_upd * 1e3:8.2f} ms (with the row bests it reads); one top-k "
            f"update {t_top * 1e3:8.2f} ms" + (f"; BROKEN: {fused_cuda._broken}" if fused_cuda._broken else ""))
    if "fused" in res:
        import numpy as np

        differ = [k for k in res["torch"] if "limbs" not in k
                  and not np.array_equal(res["torch"][k], res["fused"][k], equal_nan=True)]
        out(f"  states equal (counts, maxima, positions, samples; sums round apart): {not differ}"
            + (f"; differ: {differ[:8]}" if differ else ""))
        if "fused" in tops:
            differ = [k for k in tops["torch"] if not np.array_equal(tops["torch"][k], tops["fused"][k])]
            out(f"  top-k lists equal after two batches: {not differ}" + (f"; differ: {differ[:8]}" if differ else ""))
        lens, lut = batch.lengths_on(mm.device), fused_cuda.bin_lut(mm.device)
        for label, x in (("float32", m), ("bf16", m.to(torch.bfloat16))):
            t_k = timed(lambda: fused_cuda.capture(x, lens, lut, (1,), True))
            out(f"  fused capture kernel alone, {label} captures: {t_k * 1e3:.2f} ms "
                f"({x.numel() * x.element_size() / t_k / 1e9:,.0f} GB/s read)")
        ks = fresh()
        score, pos = LayerCapture(tuple(layers), m, batch).best(1)
        g = tuple(layers)
        t_o = timed(lambda: fused_cuda.offer(*ks.offer_args(g, 1, score, pos, batch.sids)))
        out(f"  fused offer kernel alone: {t_o * 1e3:.2f} ms")
        later = (ks, g, score, pos, lens, lut)  # the sweeps come last: the profile matters more
    os.environ["FFKV_TRITON"] = "0"
    sums = timed(lambda: (batch.weights() @ m.reshape(-1, m.shape[-1]), batch.weights() @ (m.reshape(-1, m.shape[-1]) ** 2)))
    out(f"  sums (two masked products) {sums * 1e3:.2f} ms; float32 cast of the group {timed(lambda: m.to(torch.bfloat16).float()) * 1e3:.2f} ms")
    os.environ["FFKV_TRITON"] = "1"
    with torch.no_grad():
        t_fwd = timed(lambda: mm.hf(input_ids=tid, attention_mask=mask, use_cache=False))
    out(f"  plain forward of the batch {t_fwd * 1e3:.2f} ms")
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        st = new_state(mm, s)
        sids = list(range(len(toks)))
        mine_batches(mm, st, toks, sids, [(0, idx)])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            mine_batches(mm, st, toks, sids, [(1, idx)])
            torch.cuda.synchronize()
        ka = p.key_averages()
        key = "self_device_time_total"
        try:
            table = ka.table(sort_by=key, row_limit=18, max_name_column_width=60)
        except Exception:  # noqa: BLE001  (older torch: the CUDA names)
            table = ka.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)
        out("profile of one mining batch with statistics (fused kernels on), by self device time:\n" + table)
    if later is not None:
        sweeps(fused_cuda, *later[:4], batch, m, *later[4:])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--corpus", required=True, help="Parquet of token id lists")
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--batch-tokens", default="auto")
    main(ap.parse_args())
