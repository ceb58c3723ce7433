"""Benchmark `ffkv normalize` on SmolLM2 over held-out Wikipedia (wikipedia:valid).

    .venv/bin/python benchmarks/bench_normalize.py                    # the goal: all layers × 2 variants, 10,000 tokens, ≤ 15 min
    .venv/bin/python benchmarks/bench_normalize.py --only reproduce   # the sizing `reproduce` uses: ≤ 2 min
    .venv/bin/python benchmarks/bench_normalize.py --only default     # `ffkv normalize RUN` as is (sweep and variance too)
    .venv/bin/python benchmarks/bench_normalize.py --tokens 2000 --fit-tokens 400   # the goal's ratios, 5x smaller
    .venv/bin/python benchmarks/bench_normalize.py --model gemma3 --tokens 1000 --fit-tokens 200   # 262,144 tokens

"goal" substitutes every layer's FFN by each of the two variants (no capacity sweep, no variance
on the model) and prints the wall time of each part, and the ratio to a plain transformers forward
pass with logits over exactly the same evaluation batches, measured in the same process right
before and right after (their mean is the baseline, so load from other processes hits both sides
alike). Running each substitution as a full forward pass would cost 2·L plain passes; the ratio
says how much of that the cached residual stream saves.
"""
from __future__ import annotations

import argparse
import os
import time

import limit
from _common import load_default, out, peak_rss_mb  # noqa: F401  (imports ffkv first)

GOAL_MIN, REPRODUCE_MIN = 15.0, 2.0
QUIET_TOK_S = 450  # a plain fp32 forward of SmolLM2 on this 2-core CPU with nothing else running


def plain_forward(mm, seqs, batch_tokens: int) -> float:
    """Seconds for hf(...).logits over the batches the step packs."""
    import torch

    from ffkv.steps.normalize.passes import batches_of

    t = time.perf_counter()
    with torch.no_grad():
        for idx in batches_of(seqs, batch_tokens):
            ids, mask = mm.batch([seqs[i] for i in idx])
            mm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum()
    return time.perf_counter() - t


def times(shapes, k: int):
    return [g._replace(count=g.count * k) for g in shapes]


def normalize_shapes(mm, ev, fi, info) -> list:
    """The products of the main measures (every layer × softmax and scaled ReLU), unpadded, batched
    as the step packs: fit, two passes over the fit tokens (all blocks), per layer the ReLU's
    coefficients from x (x·K, and x·U when gated), a·V, and a·V for each τ of the grid; evaluate, one
    pass over the evaluation tokens, per layer the ReLU's coefficients and each variant's m'·V, for
    each layer and variant the blocks above it, and the head on every predicted position, once
    intact and once per substitution. The capacity sweep and the variance are not counted."""
    from ffkv.corpus.batching import tight_ratio
    from ffkv.steps.normalize.passes import batches_of
    from ffkv.steps.normalize.variants import TAU_GRID

    L, d, dm, V = mm.n_layers, mm.d, mm.d_m, mm.vocab_size
    n_k = 1 + (mm.up_keys(0) is not None)
    layers = list(range(L))
    shapes = []
    for seqs, fit in ((fi, True), (ev, False)):
        idx = batches_of(seqs, info["batch_tokens"], max_rows=info["max_rows"], ratio=tight_ratio(mm.device))
        bl = [[len(seqs[i]) for i in b] for b in idx]
        lengths = [n for b in bl for n in b]
        shapes += times(limit.forward_shapes(mm, lengths, bl), 2 if fit else 1)
        for b in bl:
            tok = sum(b)
            if fit:
                shapes += [limit.Gemm(tok, d, dm, n_k * L), limit.Gemm(tok, dm, d, (1 + len(TAU_GRID)) * L)]
            else:
                shapes += [limit.Gemm(tok, d, dm, n_k * L), limit.Gemm(tok, dm, d, 2 * L)]
                shapes += [limit.Gemm(sum(n - 1 for n in b), d, V, 1 + 2 * L)]
        if not fit:  # the blocks above each substituted layer, for both variants
            tails = [k for l in layers for k in range(l + 1, L)] * 2
            shapes += limit.block_shapes(mm, lengths, tails, bl)
    return limit.merge(shapes)


def measure(mm, name: str, s, goal_min: float | None, baseline: bool, smollm2: bool = True) -> None:
    from ffkv.steps.normalize.compute import normalize, split

    ev, fi = split(mm, s, warn=lambda m: out(f"note: {m}"))[:2]
    n_tok = sum(map(len, ev))
    base1 = plain_forward(mm, ev, s.batch_tokens) if baseline else None
    if baseline:
        out(f"[{name}] plain forward with logits (before): {base1:.1f} s, {n_tok / base1:,.0f} tok/s")
    t0 = time.perf_counter()
    res = normalize(mm, s, warn=lambda m: out(f"note: {m}"), show_progress=None)
    wall = time.perf_counter() - t0
    info = res["info"]
    out(f"[{name}] {info['eval_tokens']:,} evaluation tokens, {info['fit_tokens']:,} fit tokens, "
        f"{info['layers']} layers, capacity layers {info['capacity_layers']}: prepare {info['seconds_prepare']} s, "
        f"fit {info['seconds_fit']} s, substitution pass {info['seconds_substitute']} s, tables "
        f"{info['seconds_tables']} s; total {wall:.1f} s = {wall / 60:.2f} min"
        + (f" (goal ≤ {goal_min:g} min: {'met' if wall / 60 <= goal_min else 'NOT met'})" if goal_min else ""))
    if baseline:
        base2 = plain_forward(mm, ev, s.batch_tokens)
        base = (base1 + base2) / 2
        L = mm.n_layers
        jobs = info["substitutions"]
        sweep = f" and {info['capacity_substitutions']} capacity ones on the sweep's sentences" \
            if info["capacity_substitutions"] else ""
        out(f"[{name}] plain forward (after): {base2:.1f} s; mean {base:.1f} s. Substitution pass = "
            f"{info['seconds_substitute'] / base:.1f} plain passes for {jobs} substitutions{sweep} (L = {L}); "
            f"fit {info['seconds_fit'] / base:.1f}; whole step {wall / base:.1f} plain passes"
            + ("" if sweep else f"; one full pass per substitution would be {jobs}: "
               f"{jobs * base / info['seconds_substitute']:.1f}x saved"))
        if smollm2:  # the quiet rate is SmolLM2's
            out(f"[{name}] at the {QUIET_TOK_S} tok/s of a plain pass on a quiet machine (../shared/NOTES.md) the "
                f"step would take {wall / base * n_tok / QUIET_TOK_S / 60:.2f} min")
    if info["layers"] == mm.n_layers:
        limit.report(f"normalize {name}", normalize_shapes(mm, ev, fi, info), wall,
                     note=f"{info['fit_tokens']:,} fit and {info['eval_tokens']:,} evaluation tokens, {mm.n_layers} "
                          f"layers × 2 variants" + ("; the capacity sweep and the variance not counted"
                                                    if info["capacity_substitutions"] else ""), out=out)
    lay = res["tables"]["normalize_layers"].to_pandas()
    for v in ("softmax", "scaled_relu"):
        d = lay[lay["variant"] == v]
        out(f"[{name}] {v}: Δloss median {d['delta_loss'].median():+.3f} nats (min {d['delta_loss'].min():+.3f}, "
            f"max {d['delta_loss'].max():+.3f}); intact loss {lay['loss_intact'].iloc[0]:.3f}")
    out(f"[{name}] peak RSS so far {peak_rss_mb():,.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("goal", "reproduce", "default"), default="goal")
    ap.add_argument("--tokens", type=int, default=None, help="Evaluation tokens (default: the mode's own).")
    ap.add_argument("--fit-tokens", type=int, default=None, help="Fit tokens (default: the mode's own).")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--no-baseline", action="store_true", help="Skip the plain forward passes.")
    ap.add_argument("--model", default=None,
                    help="another model (`ffkv info` names them: gemma3, a folder, ...); default SmolLM2. The "
                         "limit line compares the step with a plain GEMM of its own products on this model "
                         "(issue 50: Gemma 3's 262,144-token head)")
    args = ap.parse_args()

    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from dataclasses import replace

    from ffkv.steps.normalize import NormalizeSettings, reproduce_settings

    t0 = time.perf_counter()
    if args.model:
        from ffkv.model.memories import open_model

        mm = open_model(args.model, device="cpu")
    else:
        mm = load_default()
    out(f"{args.model or 'SmolLM2-135M'}: {mm.n_layers} layers, d_m={mm.d_m}; torch threads {torch.get_num_threads()}; load "
        f"{time.perf_counter() - t0:.1f} s; machine load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if args.only == "goal":
        s = NormalizeSettings(sweep_tokens=0, capacity_layers=(), batch_tokens=args.batch_tokens)
        goal = GOAL_MIN
    elif args.only == "reproduce":
        s, goal = replace(reproduce_settings(mm.n_layers), batch_tokens=args.batch_tokens), REPRODUCE_MIN
    else:
        s, goal = NormalizeSettings(batch_tokens=args.batch_tokens), None
    if args.tokens:
        s = replace(s, tokens=args.tokens)
    if args.fit_tokens:
        s = replace(s, fit_tokens=args.fit_tokens)
    measure(mm, args.only, s, goal, baseline=not args.no_baseline, smollm2=not args.model)
    out(f"machine load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
