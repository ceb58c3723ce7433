"""Benchmark `ffkv mutate` (Fig 3) on SmolLM2: 10 keys per layer × 50 examples × 3 mutations.

    .venv/bin/python benchmarks/bench_mutate.py                 # builds a run once, then times
    .venv/bin/python benchmarks/bench_mutate.py --run RUN       # a real run made by `ffkv mine`

Without --run, a run is built once in --workdir (default /tmp/ffkv-bench-mutate): WikiText-2
valid sentences, and real top-50 triggers (one prefix per sentence, its best position) of a
seeded sample of keys per layer, found by brute force in one forward pass over the sentences.
Only those keys are mined, so `mutate --keys-per-layer 10` re-scores exactly them.

Printed, side by side in one process:
- wall time of `mutate` (the library call the CLI makes; model loading excluded), variants/s;
- the naive baseline: one forward pass per variant through all layers (the paper's released
  code re-runs each mutated example), timed on a seeded sample of variants and extrapolated;
- the ratio, and the engine's bookkeeping (sequences actually run, layer-tokens computed);
- the throughput of a plain forward pass right before and after, to tell the machine's load
  (other jobs share its 2 cores) from the code's speed, with the time scaled to a quiet machine.
The target of issue 6 is ≤ 10 minutes for 45,000 variants on this 2-core CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ffkv  # noqa: E402,F401  (sets MKL_CBWR before torch loads MKL)
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from ffkv.model import identity

sys.path.insert(0, str(Path(__file__).resolve().parent))
import limit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FFKV_SHARED", ROOT.parent / "shared"))
WT2_VALID = SHARED / "corpora" / "wikitext-2" / "wiki.valid.tokens"


@torch.no_grad()
def build_run(path: Path, mm, n_sentences: int, keys_per_layer: int, k: int, seed: int,
              batch_tokens: int = 2048):
    from ffkv.corpus.batching import pack
    from ffkv.corpus.prepare import prepare_sentences
    from ffkv.store.query import sample_keys
    from ffkv.store.run import Run

    run = Run(path, create=True)
    identity.record_model(run, mm)
    run.start_step("mine", {"benchmark": "brute-force triggers of sampled keys",
                            "keys_per_layer": keys_per_layer, "k": k, "seed": seed})
    tbl = prepare_sentences(run, mm, str(WT2_VALID), n_sentences, seed=seed, min_tokens=2)
    ids = tbl.column("token_ids").to_pylist()
    sids = np.asarray(tbl.column("sentence_id").to_pylist())
    keys = sample_keys({l: np.arange(mm.d_m) for l in range(mm.n_layers)}, keys_per_layer, seed)
    dims = {l: torch.as_tensor(d) for l, d in keys.items()}
    S = len(ids)
    best = {(l, s): torch.full((S, len(dims[l])), float("nan")) for l in keys for s in (1, -1)}
    bpos = {(l, s): torch.zeros((S, len(dims[l])), dtype=torch.long) for l in keys for s in (1, -1)}
    lens = np.array([len(x) for x in ids])
    t0 = time.perf_counter()
    for n, b in enumerate(pack(lens, batch_tokens)):
        inp, mask = mm.batch([ids[i] for i in b])
        bt = torch.as_tensor(b)

        def cb(layer, name, m):
            m = m[:, :, dims[layer]].float()  # (B, T, k)
            pad = (mask == 0).unsqueeze(-1)
            for s in (1, -1):
                v = (s * m).masked_fill(pad, float("-inf"))
                mx, am = v.max(1)
                best[(layer, s)][bt] = s * mx
                bpos[(layer, s)][bt] = am

        mm.capture(inp, mask, what=("m",), callback=cb)
        if n % 10 == 0:
            print(f"  mining batch {n}, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    cols = {c: [] for c in ("layer", "dim", "sign", "rank", "coef", "sentence_id", "position", "next_token")}
    for (l, s), v in sorted(best.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        for j, d in enumerate(keys[l]):
            order = np.lexsort((np.arange(S), -(s * v[:, j].numpy())))[:k]
            for r, i in enumerate(order):
                p = int(bpos[(l, s)][i, j])
                cols["layer"].append(l)
                cols["dim"].append(int(d))
                cols["sign"].append(s)
                cols["rank"].append(r + 1)
                cols["coef"].append(float(v[i, j]))
                cols["sentence_id"].append(int(sids[i]))
                cols["position"].append(p)
                cols["next_token"].append(ids[i][p + 1] if p + 1 < len(ids[i]) else None)
    run.write_table("triggers", pa.table({
        "layer": pa.array(cols["layer"], pa.int16()), "dim": pa.array(cols["dim"], pa.int32()),
        "sign": pa.array(cols["sign"], pa.int8()), "rank": pa.array(cols["rank"], pa.int16()),
        "coef": pa.array(cols["coef"], pa.float32()), "sentence_id": pa.array(cols["sentence_id"], pa.int64()),
        "position": pa.array(cols["position"], pa.int32()), "next_token": pa.array(cols["next_token"], pa.int32())}))
    run.finish_step("mine", sentences=S)
    return run


@torch.no_grad()
def naive_seconds(mm, run, table: pa.Table, n: int, seed: int) -> tuple[float, float]:
    """Seconds per variant of one full forward pass per variant (all layers), on `n` variants."""
    from ffkv.store.query import sentence_lookup

    rng = np.random.default_rng(seed)
    idx = rng.choice(table.num_rows, size=min(n, table.num_rows), replace=False)
    rows = table.take(pa.array(idx)).to_pylist()
    sents = sentence_lookup(run, [r["sentence_id"] for r in rows])
    err = 0.0
    spent = 0.0
    for r in rows:
        ids = sents[r["sentence_id"]][: r["position"] + 1]
        v = ids[: r["removed_position"]] + ids[r["removed_position"] + 1:]
        inp, mask = mm.batch([v])
        got = {}
        h = mm._mod(r["layer"], mm.arch.value).register_forward_pre_hook(
            lambda mod, a: got.__setitem__("m", a[0].detach()))
        t0 = time.perf_counter()
        try:
            mm.hf(input_ids=inp, attention_mask=mask, use_cache=False)  # the whole model, as naive code does
        finally:
            spent += time.perf_counter() - t0
            h.remove()
        c = got["m"].reshape(1, len(v), -1)[0, -1, r["dim"]]  # checks the engine's number
        err = max(err, abs(float(c) - r["new_coef"]) / max(abs(r["new_coef"]), 1e-3))
    return spent / len(rows), err


@torch.no_grad()
def plain_throughput(mm, seconds: float = 20.0) -> float:
    """Tokens/s of a plain full forward pass at batch 32 × 32 now (NOTES.md: ≈ 450 on a quiet machine)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, mm.vocab_size - 1, (32, 32), generator=g)
    mask = torch.ones_like(ids)
    mm.hf(input_ids=ids, attention_mask=mask, use_cache=False)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        mm.hf(input_ids=ids, attention_mask=mask, use_cache=False)
        n += 1
    return n * ids.numel() / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, help="an existing run with ≥50 triggers per key")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ffkv-bench-mutate"))
    ap.add_argument("--sentences", type=int, default=1000, help="sentences mined when building a run")
    ap.add_argument("--keys-per-layer", type=int, default=10)
    ap.add_argument("--examples", type=int, default=50)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--naive-sample", type=int, default=150, help="variants timed for the baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-only", action="store_true", help="only build the benchmark run")
    ap.add_argument("--no-share", action="store_true", help="no prefix sharing of random variants")
    a = ap.parse_args()

    from ffkv.steps.mutate.compute import mutate
    from ffkv.model.memories import open_model
    from ffkv.store.run import Run

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    t = time.perf_counter()
    mm = open_model(None, device="cpu")
    print(f"model loaded in {time.perf_counter() - t:.1f} s")
    if a.run:
        run = Run(a.run)
    elif (a.workdir / "triggers.parquet").exists():
        run = Run(a.workdir)
        print(f"reusing the benchmark run in {a.workdir}")
    else:
        t = time.perf_counter()
        run = build_run(a.workdir, mm, a.sentences, a.keys_per_layer, a.examples, a.seed)
        print(f"built a benchmark run in {a.workdir} in {time.perf_counter() - t:.0f} s")
    identity.check_model(run, mm)
    if a.build_only:
        return

    before = plain_throughput(mm)
    t, cpu = time.perf_counter(), time.process_time()
    res = mutate(run, mm, keys_per_layer=a.keys_per_layer, examples=a.examples, seed=a.seed,
                 batch_tokens=a.batch_tokens, write=False, share_prefixes=not a.no_share)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    after = plain_throughput(mm)
    V = res.stats["variants"]
    st = res.stats["rescore"]
    print(f"\nmutate: {res.stats['keys']} keys, {V:,} variants "
          f"({res.stats['examples_skipped']} one-token examples skipped) in {wall:.1f} s "
          f"= {wall / 60:.2f} min, {V / wall:,.0f} variants/s")
    print(f"  requests {st['requests']:,} (originals + variants) -> {st['unique_sequences']:,} unique "
          f"sequences -> {st['sequences_run']:,} run ({st['tokens_run']:,} tokens), {st['batches']} batches")
    print(f"  layer-tokens computed {st['layer_tokens']:,} (padded {st['padded_layer_tokens']:,}); "
          f"CPU time {cpu:.0f} s on {torch.get_num_threads()} threads")
    tput = (before + after) / 2
    print(f"  plain forward pass now: {before:.0f} tok/s before, {after:.0f} tok/s after "
          f"(NOTES.md: ≈ 450 tok/s on a quiet machine): mutate at 450 tok/s would take about "
          f"{wall * tput / 450:.0f} s")
    lens = res.mutations.column("n_tokens").to_numpy()
    full = int(lens.sum()) * mm.n_layers
    print(f"  naive work would be {full:,} layer-tokens: {full / st['layer_tokens']:.1f}× more")

    # the limit: every block's linears on the layer-tokens the engine runs (unpadded; prefix sharing
    # and the stop at the deepest layer a batch needs included), at the engine's mean batch rows
    rows = max(1, round(st["tokens_run"] / max(st["batches"], 1)))
    calls = max(1, round(st["layer_tokens"] / rows))
    shapes = [limit.Gemm(rows, i, o, calls) for i, o in limit.block_linears(mm)]
    limit.report("mutate", shapes, wall,
                 note=f"{st['layer_tokens']:,} layer-tokens × the block's linears "
                      f"(2·{sum(i * o for i, o in limit.block_linears(mm)):,} FLOP each), {calls:,} calls of "
                      f"{rows} rows; attention not counted (short prefixes)")

    per, err = naive_seconds(mm, run, res.mutations, a.naive_sample, a.seed)
    naive = per * V
    print(f"\nnaive baseline: {per * 1000:.1f} ms per variant (one full pass each, {a.naive_sample} "
          f"timed) -> {naive:,.0f} s = {naive / 60:.1f} min for {V:,} variants (extrapolated)")
    print(f"  engine vs direct coefficient: max relative difference {err:.1e}")
    print(f"\nspeed-up over naive: {naive / wall:.1f}×; target ≤ 600 s: "
          f"{'met' if wall <= 600 else 'NOT met'} ({wall:.0f} s)")
    for m in ("first", "last", "random"):
        rows = [r for r in res.layers.to_pylist() if r["mutation"] == m]
        med = [f"{r['median']:+.2f}" for r in rows]
        print(f"  median rel. change, {m:>6}, layers 0..{len(rows) - 1}: {' '.join(med)}")


if __name__ == "__main__":
    main()
