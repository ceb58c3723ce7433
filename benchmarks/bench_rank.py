"""Ranking a target by counting logits above it (`ffkv.model.memories.rank_of`), side by side with
the int64-accumulator count it replaced, on real SmolLM2 value logits.

    .venv/bin/python benchmarks/bench_rank.py [--layers 3] [--rounds 5]

The values step ranks each key's next token in its value's distribution (and in a shuffled
pairing's), under both lenses: 46,080 × 4 rows of 49,152 logits. Goal: rank_of ≥ 2× the old count,
same ranks. Both are timed in one process, interleaved round by round, on the same blocks.
"""
from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (imports ffkv before torch)
import torch

from ffkv.model.memories import rank_of


def rank_int64(logits, target):
    """The old count: the bool mask summed as uint8 into an int64 accumulator."""
    t = logits.gather(-1, target.unsqueeze(-1))
    return (logits > t).view(torch.uint8).sum(-1, dtype=torch.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=3, help="value matrices to rank over (first, middle, last)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    mm = _common.load_default()
    L = mm.n_layers
    layers = sorted({0, L // 2, L - 1} if a.layers >= 3 else {L - 1})[: a.layers]
    g = torch.Generator().manual_seed(0)
    blocks = []
    for l in layers:
        z = mm.lens.direction_logits(mm.values(l)).float()
        blocks += [(z[r:r + 128], torch.randint(0, z.shape[1], (len(z[r:r + 128]),), generator=g))
                   for r in range(0, len(z), 128)]
    t_new = t_old = 0.0
    for _ in range(a.rounds):
        for fn in (rank_of, rank_int64):
            t0 = time.perf_counter()
            got = [fn(z, t) for z, t in blocks]
            dt = time.perf_counter() - t0
            if fn is rank_of:
                t_new, new = t_new + dt, got
            else:
                t_old, old = t_old + dt, got
        assert all(torch.equal(x, y) for x, y in zip(new, old)), "ranks differ"
    rows = sum(len(z) for z, _ in blocks)
    print(f"rank_of: {rows:,} rows × {mm.vocab_size:,} logits, {a.rounds} rounds interleaved; ranks identical")
    print(f"  int64 accumulator {t_old / a.rounds:.3f} s/round, rank_of {t_new / a.rounds:.3f} s/round: "
          f"{t_old / t_new:.2f}× faster (goal ≥ 2×)")


if __name__ == "__main__":
    main()
