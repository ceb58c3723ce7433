"""Mining benchmarks (issue 3): throughput vs a plain forward pass, memory vs corpus size, scale.

    python benchmarks/bench_mine.py                 # all three, default sizes
    python benchmarks/bench_mine.py --only memory --memory-base 1000   # 1,000 vs 10,000 sentences
    python benchmarks/bench_mine.py --only memory --memory-base 1000 --memory-layers 0-1   # the host side
    python benchmarks/bench_mine.py --only regimes --sentences 200   # mine with and without --regimes

Throughput: the same length-packed batches go through (a) a plain transformers forward
with logits, (b) ffkv's mining pass without key statistics (captures of all 46,080
coefficients + streaming top-50, `--no-stats`) and (c) the default mining pass with key
statistics (histograms, sums, positions, quantile samples), interleaved batch by batch so all
see the same machine load. Memory: peak RSS of `ffkv mine` (with statistics) in a subprocess
on N and 10·N sentences. Scale: wall time per 1,000 sentences.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time

import limit
from _common import WT2, load_default, out, wikitext_token_lists

import torch  # noqa: E402  (after _common, which imports ffkv first)

PAPER_SECONDS_PER_1000 = 45 * 60  # the paper's code, RTX 3090 (its README)


def throughput(n: int, batch_tokens: int) -> dict:
    """Plain forward vs mining without and with key statistics, the same batches, interleaved."""
    from ffkv.corpus.batching import pack
    from ffkv.mine.engine import mine_batches, new_state
    from ffkv.steps.mine import MineSettings

    mm = load_default()
    toks = wikitext_token_lists(mm, n)
    batches = pack([len(t) for t in toks], batch_tokens)
    bare = new_state(mm, MineSettings(top_k=50, stats=False))
    full = new_state(mm, MineSettings(top_k=50))
    stats_mb = sum(t.numel() * t.element_size() for d in (full.stats.hist, full.stats.limbs, full.stats.max,
                                                          full.stats.pos, full.stats.sh, full.stats.sp,
                                                          full.stats.sc) for t in d.values()) / 2 ** 20
    sids = list(range(len(toks)))
    t_plain = t_bare = t_full = 0.0
    ntok = sum(map(len, toks))
    # every arm's products through oneDNN, as `ffkv mine` runs them (FFKV_ONEDNN=0: MKL for all)
    from ffkv.model.onednn import products_of

    stack = contextlib.ExitStack()
    stack.enter_context(products_of(mm))
    # warm-up on the first batch, untimed
    ids, mask = mm.batch([toks[i] for i in batches[0]])
    with torch.no_grad():
        mm.hf(input_ids=ids, attention_mask=mask, use_cache=False)
    for bi, idx in enumerate(batches):
        ids, mask = mm.batch([toks[i] for i in idx])
        arms = [("plain", None), ("bare", bare), ("full", full)]
        if bi % 2:  # alternate the order, so neither arm always follows the other
            arms = arms[::-1]
        for name, state in arms:
            t0 = time.perf_counter()
            if state is None:
                with torch.no_grad():
                    mm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum()
            else:
                mine_batches(mm, state, toks, sids, [(bi, idx)])
            dt = time.perf_counter() - t0
            if name == "plain":
                t_plain += dt
            elif name == "bare":
                t_bare += dt
            else:
                t_full += dt
    stack.close()
    res = {"sentences": len(toks), "tokens": ntok, "plain_tok_s": ntok / t_plain,
           "mine_tok_s": ntok / t_bare, "mine_stats_tok_s": ntok / t_full,
           "ratio": t_plain / t_bare, "ratio_stats": t_plain / t_full, "stats_state_mb": stats_mb}
    out(f"throughput: plain forward {res['plain_tok_s']:.0f} tok/s; mining {res['mine_tok_s']:.0f} tok/s "
        f"-> {res['ratio']:.2f}x without statistics (--no-stats; was 1.14x); "
        f"{res['mine_stats_tok_s']:.0f} tok/s -> {res['ratio_stats']:.2f}x with key statistics (goal >= 1.0x); "
        f"over {ntok} tokens, all 46,080 keys, t=50; statistics state {stats_mb:.0f} MB (goal <= 150 MB)")
    # the limit: every block's products over the batches' tokens (mining needs no head)
    lengths = [len(t) for t in toks]
    blocks = limit.forward_shapes(mm, lengths, [[lengths[i] for i in b] for b in batches])
    note = f"{mm.n_layers} blocks over {ntok:,} tokens in {len(batches)} batches"
    res["limit"] = limit.report("mine forward, no statistics", blocks, t_bare, note=note, out=out)
    res["limit_stats"] = limit.report("mine forward, key statistics", blocks, t_full, note=note, out=out)
    limit.report("plain forward with logits", blocks + [limit.Gemm(ntok, mm.d, mm.vocab_size)], t_plain,
                 note=note + " + the head on every token", out=out)
    return res


def regimes(n: int, batch_tokens: int, rounds: int = 2) -> dict:
    """`ffkv mine` as it runs by default (key statistics) with and without --regimes
    (`ffkv.mine.regimes`: the gate's pre-activations captured beside m, four masses and counts per
    memory), the same batches side by side, the order alternated batch by batch and round by
    round; the first batch of each arm once untimed (numba compiles). Issue 46's target: the
    added tracker costs <= 5% of mining time (ratio <= 1.05)."""
    from ffkv.corpus.batching import pack
    from ffkv.mine.engine import mine_batches, new_state
    from ffkv.model.onednn import products_of
    from ffkv.steps.mine import MineSettings

    from ffkv.mine.regimes import SignRegimes

    mm = load_default()
    toks = wikitext_token_lists(mm, n)
    batches = pack([len(t) for t in toks], batch_tokens)
    sids = list(range(len(toks)))
    ntok = sum(map(len, toks))
    # the tracker's own time inside the --regimes arm: a share of the same batches' time, so less at
    # the mercy of a loaded machine than the two arms' difference
    inner, update = [0.0], SignRegimes.update_layer

    def timed_update(self, *a):
        t0 = time.perf_counter()
        update(self, *a)
        inner[0] += time.perf_counter() - t0

    SignRegimes.update_layer = timed_update
    arms = {"mine": MineSettings(top_k=50), "mine --regimes": MineSettings(top_k=50, regimes=True)}
    states = {k: new_state(mm, s) for k, s in arms.items()}
    secs = {k: 0.0 for k in arms}
    pairs = []  # each batch's time with --regimes over its time without, in one round
    with products_of(mm):
        for k, st in states.items():  # warm-up, untimed
            mine_batches(mm, st, toks, sids, [(0, batches[0])])
        states = {k: new_state(mm, s) for k, s in arms.items()}
        inner[0] = 0.0
        for r in range(rounds):
            for bi, idx in enumerate(batches):
                order = list(arms) if (bi + r) % 2 == 0 else list(arms)[::-1]
                took = {}
                for k in order:
                    t0 = time.perf_counter()
                    mine_batches(mm, states[k], toks, sids, [(bi, idx)])
                    took[k] = time.perf_counter() - t0
                    secs[k] += took[k]
                pairs.append(took["mine --regimes"] / took["mine"])
    SignRegimes.update_layer = update
    ratio = secs["mine --regimes"] / secs["mine"]
    tracker = inner[0] / (secs["mine --regimes"] - inner[0])
    median = sorted(pairs)[len(pairs) // 2] if len(pairs) % 2 else sum(sorted(pairs)[len(pairs) // 2 - 1:][:2]) / 2
    res = {"sentences": len(toks), "tokens": ntok, "rounds": rounds, "batches": len(batches),
           "mine_s": secs["mine"], "regimes_s": secs["mine --regimes"], "ratio": ratio,
           "median_pair_ratio": median, "pair_ratios": pairs, "tracker_s": inner[0], "tracker_share": tracker,
           "mine_tok_s": rounds * ntok / secs["mine"], "regimes_tok_s": rounds * ntok / secs["mine --regimes"]}
    out(f"regimes: mine {res['mine_tok_s']:.0f} tok/s, mine --regimes {res['regimes_tok_s']:.0f} tok/s "
        f"-> {ratio:.3f}x the time ({100 * (ratio - 1):+.1f}%; goal <= 1.05x; median over batch pairs "
        f"{median:.3f}x, range {min(pairs):.3f}-{max(pairs):.3f}; the tracker's own time {100 * tracker:.1f}% "
        f"of the rest of its arm), {ntok} tokens x {rounds} rounds, "
        f"{len(batches)} batches of <= {batch_tokens} tokens, interleaved")
    return res


def _mine_subprocess(n: int, tmp: str, layers: str | None = None) -> tuple[float, float]:
    extra = ["--layers", layers] if layers else []
    code = (
        "import sys,time,json; sys.argv=['ffkv','mine','--out',%r,'--corpus',%r,'--max-sentences','%d',"
        "'--checkpoint-every','100000',*%r];"
        "t=time.time(); from ffkv.cli import main\n"
        "try: main()\nexcept SystemExit: pass\n"
        "rss=[l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1];"
        "print(json.dumps({'secs':time.time()-t,'rss_mb':int(rss)/1024}))"
    ) % (f"{tmp}/run{n}", str(WT2 / "wiki.train.tokens"), n, extra)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return d["secs"], d["rss_mb"]


def memory(n: int, layers: str | None = None) -> dict:
    """Peak RSS of `ffkv mine` at n and 10·n sentences. With `layers` (e.g. 0-1) the pass is short
    and the trackers' state small, so the host side's growth (corpus, sentences, token ids, batch
    plan) is the easiest to see: a stricter check than every layer. The mine step streams its
    corpus a chunk at a time and pins glibc's mmap threshold (`ffkv.steps.mine.compute`): 1.05x from
    1,000 to 10,000 sentences with --memory-layers 0-1, where splitting and tokenizing the whole
    corpus first gave 1.15x (2026-11-25, this 2-core CPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        s1, r1 = _mine_subprocess(n, tmp, layers)
        s10, r10 = _mine_subprocess(10 * n, tmp, layers)
    res = {"n": n, "rss_n_mb": r1, "rss_10n_mb": r10, "ratio": r10 / r1, "secs_n": s1, "secs_10n": s10}
    out(f"memory: peak RSS {r1:.0f} MB at {n} sentences, {r10:.0f} MB at {10 * n} "
        f"(layers {layers or 'all'}) -> {res['ratio']:.3f}x (goal <= 1.10x)")
    return res


def scale(n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        secs, _ = _mine_subprocess(n, tmp)
    per1000 = secs * 1000 / n
    out(f"scale: {n} WikiText-2 sentences, all 46,080 keys, t=50, in {secs:.1f} s end to end "
        f"({per1000:.0f} s per 1,000); the paper's code: ~{PAPER_SECONDS_PER_1000} s per 1,000 on a GPU "
        f"-> {PAPER_SECONDS_PER_1000 / per1000:.0f}x faster")
    return {"sentences": n, "seconds": secs, "seconds_per_1000": per1000}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["throughput", "memory", "scale", "regimes"])
    ap.add_argument("--sentences", type=int, default=1000, help="throughput sentences")
    ap.add_argument("--memory-base", type=int, default=100, help="N for the N vs 10N memory check")
    ap.add_argument("--memory-layers", default=None, help="layers mined in the memory check (e.g. 0-1; "
                                                          "default all)")
    ap.add_argument("--scale-sentences", type=int, default=1000)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--regimes-rounds", type=int, default=2, help="rounds over the batches for --only regimes")
    a = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if a.only in (None, "throughput"):
        throughput(a.sentences, a.batch_tokens)
    if a.only in (None, "memory"):
        memory(a.memory_base, a.memory_layers)
    if a.only in (None, "scale"):
        scale(a.scale_sentences)
    if a.only == "regimes":  # not among the defaults: its own run, side by side (issue 46)
        regimes(a.sentences, a.batch_tokens, a.regimes_rounds)
