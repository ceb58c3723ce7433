"""Where the key statistics' time goes on a GPU, and the Triton histogram against torch's (issue 24).

    PYTHONPATH=src python3 benchmarks/bench_stats_gpu.py --corpus .dev/wt2_train_ids.parquet

On one real batch of a random-weight SmolLM2-135M-shaped model (`bench_gpu.build_shape`), sized as
`ffkv mine` sizes it: the captures of one tracker update (a group of layers), then
  1. the histogram of that update by both paths (`ffkv.mine.hist_cuda` and the index_add_ path of
     `ffkv.mine.stats`): equal counts, or the script says which differ;
  2. one KeyStats update, top-k update and histogram alone, each path, median of 5 (CUDA events);
  3. a torch.profiler table of one whole mining batch with statistics: the kernels by device time.
Without CUDA it runs on the CPU (the Triton path then only under TRITON_INTERPRET=1).
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


def main(a) -> None:
    from bench_gpu import build_shape, corpus_ids, stream

    from ffkv.corpus.batching import pack
    from ffkv.mine import hist_cuda, stats
    from ffkv.mine.engine import MineSettings, group_for, mine_batches, new_state
    from ffkv.mine.runner import resolve_batch_tokens
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
        f"Triton {'present' if importlib.util.find_spec('triton') and cuda else 'unavailable'}")

    def fresh():
        return stats.KeyStats(layers, None, mm.d_m, samples=5, device=mm.device, group=G)

    res = {}
    for name, flag in (("torch", "0"), ("triton", "1")):
        os.environ["FFKV_TRITON"] = flag
        if name == "triton" and not hist_cuda.available(dev):
            continue
        try:
            ks = fresh()
            ks.update(batch, cap)
            res[name] = ks.hist[tuple(layers)].clone()
            t_upd = timed(lambda: ks.update(batch, cap))  # the same state again: no allocation timed
        except Exception as e:  # noqa: BLE001  (say what broke, go on with the other figures)
            out(f"  {name:6s}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            continue
        out(f"  {name:6s}: one KeyStats update {t_upd * 1e3:8.2f} ms")
    if "triton" in res:
        same = torch.equal(res["torch"], res["triton"])
        out(f"  histograms equal (torch index_add_ vs Triton): {same}"
            + ("" if same else f"; {int((res['torch'] != res['triton']).sum())} cells differ"))
        lut = stats._raw_luts()[0].to(mm.device).to(torch.int32)
        lens = batch.lengths_on(mm.device)
        t_k = timed(lambda: hist_cuda.key_hist(m, lens, lut, stats.NB))
        out(f"  Triton histogram alone {t_k * 1e3:.2f} ms ({m.numel() * 4 / t_k / 1e9:,.0f} GB/s of float32 read)")
    os.environ["FFKV_TRITON"] = "1"
    from ffkv.mine.topk import TopKState

    def topk_once():
        TopKState(layers, None, mm.d_m, 50, device=mm.device, group=G).update(batch, LayerCapture(tuple(layers), m, batch))
    out(f"  top-k update alone {timed(topk_once) * 1e3:.2f} ms")
    sums = timed(lambda: (batch.weights() @ m.reshape(-1, m.shape[-1]), batch.weights() @ (m.reshape(-1, m.shape[-1]) ** 2)))
    out(f"  sums (two masked products) {sums * 1e3:.2f} ms; float32 cast of the group {timed(lambda: m.to(torch.bfloat16).float()) * 1e3:.2f} ms")
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
        out("profile of one mining batch with statistics (Triton on), by self device time:\n" + table)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--corpus", required=True, help="Parquet of token id lists")
    ap.add_argument("--tokens", type=int, default=400_000)
    ap.add_argument("--batch-tokens", default="auto")
    main(ap.parse_args())
