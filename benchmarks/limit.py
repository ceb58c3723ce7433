"""The arithmetic limit of a step: the FLOPs of its essential products, and a plain GEMM of them.

Every step's benchmark (values, compose, mutate, normalize, patterns, mine's forward) prints:
- `FLOPs`: the products the step must do, counted from the model it loaded (the shapes of its
  weights, its config's heads, its vocabulary) and the tokens, prefixes or values it scored;
- `GEMM`: the seconds `torch.matmul` takes on exactly those shapes, float32, on the torch
  threads in use, in the same process, timed right beside the step;
- `step / GEMM`: the ratio, comparable across machines (1.0 = the step runs at the speed of its
  products, nothing else costs anything);
- the machine's GEMM rate (GFLOP/s of one large float32 matmul), so that absolute times can be
  quoted with it.

A workload is a list of `Gemm(m, k, n, count, batch)`: `count` calls of a (batch ×) (m, k) @ (k, n)
product, 2·batch·m·k·n FLOPs each. Only products count: norms, activations, softmax, top-k and
bookkeeping are what the ratio measures the step against.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from typing import Callable, Iterable, NamedTuple

import torch


class Gemm(NamedTuple):
    m: int
    k: int
    n: int
    count: int = 1
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n * self.count


def flops(shapes: Iterable[Gemm]) -> int:
    return sum(g.flops for g in shapes)


def merge(shapes: Iterable[Gemm]) -> list[Gemm]:
    """The same workload with equal shapes folded into one entry (their counts summed)."""
    c: Counter = Counter()
    for g in shapes:
        if g.count and g.m and g.k and g.n and g.batch:
            c[(g.m, g.k, g.n, g.batch)] += g.count
    return [Gemm(m, k, n, cnt, b) for (m, k, n, b), cnt in sorted(c.items())]


# ---- the model's shapes, read from the weights and the config it loaded -------------------------
def _text_config(mm):
    cfg = mm.hf.config
    return getattr(cfg, "text_config", None) or cfg


def block_linears(mm, layer: int = 0) -> list[tuple[int, int]]:
    """(in_features, out_features) of every nn.Linear of one decoder block, as loaded."""
    return [(m.in_features, m.out_features) for m in mm.blocks[layer].modules()
            if isinstance(m, torch.nn.Linear)]


def attention_dims(mm) -> tuple[int, int]:
    """(heads, head_dim) of the model's attention, from its config."""
    cfg = _text_config(mm)
    h = int(cfg.num_attention_heads)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    return h, int(hd)


def block_shapes(mm, lengths: Iterable[int], layers: Iterable[int] | None = None,
                 batches: Iterable[Iterable[int]] | None = None) -> list[Gemm]:
    """The products of decoder blocks over sequences of these lengths (unpadded): every linear of
    the block on each batch's tokens (`batches`: lists of lengths; default one batch of all), and
    attention per sequence, head and layer: QKᵀ (T, hd) @ (hd, T) and AV (T, T) @ (T, hd), the full
    square (causal attention needs about half; at the sentence lengths of these steps attention is
    a few percent of a block's products either way)."""
    lengths = list(lengths)
    layers = list(range(mm.n_layers)) if layers is None else list(layers)
    batches = [lengths] if batches is None else [list(b) for b in batches]
    out = []
    for l in sorted(set(layers)):
        n_l = layers.count(l)
        lin = block_linears(mm, l)
        for b in batches:
            tok = sum(b)
            out += [Gemm(tok, i, o, n_l) for i, o in lin]
    h, hd = attention_dims(mm)
    for T, n_seq in Counter(lengths).items():
        # sequences of one length batched with the heads, as a batched attention kernel runs them
        out += [Gemm(T, hd, T, len(layers), h * n_seq), Gemm(T, T, hd, len(layers), h * n_seq)]
    return merge(out)


def forward_shapes(mm, lengths: Iterable[int], batches=None, head_rows: int = 0,
                   layers: Iterable[int] | None = None) -> list[Gemm]:
    """A forward pass's products: the blocks (`block_shapes`), and the head on `head_rows` rows."""
    out = block_shapes(mm, lengths, layers, batches)
    if head_rows:
        out.append(Gemm(head_rows, mm.d, mm.vocab_size))
    return merge(out)


def vocab_shapes(mm, rows: int, chunk: int, count: int = 1) -> list[Gemm]:
    """`rows` directions (d each) onto the vocabulary, in chunks of `chunk` rows, `count` times."""
    full, rest = divmod(rows, chunk)
    return merge([Gemm(chunk, mm.d, mm.vocab_size, full * count), Gemm(rest, mm.d, mm.vocab_size, count)])


# ---- the plain GEMM -----------------------------------------------------------------------------
def _timed(matmul, a, b, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        matmul(a, b)
    return (time.perf_counter() - t) / reps


def gemm_seconds(shapes: Iterable[Gemm], budget_s: float = 1.0, matmul: Callable = torch.matmul,
                 dtype=torch.float32) -> float:
    """Seconds `matmul` takes on the workload, float32, on the current torch threads. Each distinct
    shape runs once untimed, then up to `count` times within ~`budget_s`; the mean time per call,
    times `count`, is its share (so a shape called a million times costs ~budget_s to measure)."""
    total = 0.0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for s in merge(shapes):
            lead = (s.batch,) if s.batch > 1 else ()
            a = torch.randn(*lead, s.m, s.k, generator=g, dtype=dtype)
            b = torch.randn(*lead, s.k, s.n, generator=g, dtype=dtype)
            first = _timed(matmul, a, b, 1)  # warm-up, and a first estimate
            reps = max(1, min(s.count, int(budget_s / max(first, 1e-6))))
            total += _timed(matmul, a, b, reps) * s.count
    return total


def gemm_rate(n: int = 2048, reps: int = 3) -> float:
    """GFLOP/s of a float32 (n, n) @ (n, n) matmul on the current torch threads (best of `reps`)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.matmul(a, b)
    best = min(_timed(torch.matmul, a, b, 1) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


def machine_line() -> str:
    rate = gemm_rate()
    return (f"machine GEMM rate: {rate:,.1f} GFLOP/s (float32 2048³ matmul, {torch.get_num_threads()} torch "
            f"threads)")


def report(label: str, shapes: Iterable[Gemm], step_s: float, budget_s: float = 1.0,
           note: str = "", out: Callable[[str], None] | None = None) -> dict:
    """Print (and return) the step's FLOPs, the plain GEMM's seconds on its shapes and the ratio."""
    shapes = merge(shapes)
    f = flops(shapes)
    g = gemm_seconds(shapes, budget_s)
    rate = gemm_rate()
    res = {"label": label, "flops": f, "gemm_s": g, "step_s": step_s, "ratio": step_s / g if g else math.nan,
           "gemm_gflops": rate, "threads": torch.get_num_threads()}
    lines = [f"limit [{label}]: {f / 1e12:,.3f} TFLOP in {len(shapes)} shapes{' (' + note + ')' if note else ''}",
             f"  plain float32 torch.matmul of these shapes: {g:,.2f} s ({f / g / 1e9 if g else math.nan:,.1f} GFLOP/s); "
             f"step {step_s:,.2f} s -> step / GEMM = {res['ratio']:.2f}x",
             f"  machine GEMM rate: {rate:,.1f} GFLOP/s (float32 2048³, {res['threads']} torch threads): "
             f"the FLOPs at that rate take {f / rate / 1e9:,.2f} s"]
    for line in lines:
        (out or print)(line)
    return res
