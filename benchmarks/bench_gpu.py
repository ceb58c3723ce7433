"""Mining on a GPU (issue 13): tokens/s of the whole mining pass against a plain forward.

    python benchmarks/bench_gpu.py                    # 1,000 WikiText-2 sentences on cuda:0
    python benchmarks/bench_gpu.py --sentences 5000 --dtype bfloat16

The model, the captures and every tracker (top-50 triggers and key statistics) stay on the
GPU; only the final arrays leave it. The same length-packed batches go through a plain forward
with logits, mining without statistics and mining with them, interleaved batch by batch, timed
with CUDA synchronisation. Without CUDA it says why it skipped and exits 0.
"""
from __future__ import annotations

import argparse
import time

from _common import load_default, out, wikitext_token_lists  # noqa: F401

import torch  # noqa: E402  (after _common, which imports ffkv first)


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device (torch {torch.__version__}, {build})"
    return None


def run(n: int, batch_tokens: int, dtype: str) -> dict:
    from ffkv.corpus.batching import pack
    from ffkv.mine.engine import MineSettings, mine_batches, new_state
    from ffkv.model.memories import open_model

    mm = open_model(None, device="cuda", dtype=dtype)
    toks = wikitext_token_lists(mm, n)
    batches = pack([len(t) for t in toks], batch_tokens)
    states = {"bare": new_state(mm, MineSettings(top_k=50, stats=False)), "stats": new_state(mm, MineSettings(top_k=50))}
    sids = list(range(len(toks)))
    secs = {"plain": 0.0, "bare": 0.0, "stats": 0.0}
    ntok = sum(map(len, toks))
    ids, mask = mm.batch([toks[i] for i in batches[0]])
    with torch.no_grad():
        mm.hf(input_ids=ids, attention_mask=mask, use_cache=False)
    torch.cuda.synchronize()
    for bi, idx in enumerate(batches):
        ids, mask = mm.batch([toks[i] for i in idx])
        order = ["plain", "bare", "stats"] if bi % 2 == 0 else ["stats", "bare", "plain"]
        for arm in order:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if arm == "plain":
                with torch.no_grad():
                    mm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum()
            else:
                mine_batches(mm, states[arm], toks, sids, [(bi, idx)])
            torch.cuda.synchronize()
            secs[arm] += time.perf_counter() - t0
    t0 = time.perf_counter()
    tables = states["stats"].stats.finish()
    fin = time.perf_counter() - t0
    res = {k: ntok / v for k, v in secs.items()}
    out(f"gpu ({torch.cuda.get_device_name(0)}, {dtype}): plain forward {res['plain']:.0f} tok/s; mining "
        f"{res['bare']:.0f} tok/s ({secs['plain'] / secs['bare']:.2f}x) without statistics, {res['stats']:.0f} tok/s "
        f"({secs['plain'] / secs['stats']:.2f}x) with key statistics; over {ntok} tokens, all keys, t=50; "
        f"tables from the GPU state in {fin:.1f} s ({sum(t.num_rows for t in tables.values()):,} rows)")
    return {"tokens": ntok, **{f"{k}_tok_s": v for k, v in res.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args()
    why = skip_reason()
    if why:
        out(f"bench_gpu: skipped: {why}")
    else:
        run(a.sentences, a.batch_tokens, a.dtype)
