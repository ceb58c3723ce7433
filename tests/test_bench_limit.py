"""benchmarks/limit.py: the FLOP counter against a hand count, and the plain GEMM runs the shapes given.
No timings are asserted."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

_spec = importlib.util.spec_from_file_location(
    "bench_limit", Path(__file__).resolve().parents[1] / "benchmarks" / "limit.py")
limit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(limit)


class _Block(torch.nn.Module):
    """A Llama-shaped block: q, k, v, o (d → d) and a gated MLP (d → d_m → d)."""

    def __init__(self, d: int, dm: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(d, dm, bias=False), torch.nn.Linear(d, dm, bias=False)
        self.down = torch.nn.Linear(dm, d, bias=False)


def _tiny(L=2, d=8, dm=16, V=32, heads=2):
    cfg = SimpleNamespace(num_attention_heads=heads, hidden_size=d)
    return SimpleNamespace(blocks=[_Block(d, dm) for _ in range(L)], hf=SimpleNamespace(config=cfg),
                           n_layers=L, d=d, d_m=dm, vocab_size=V)


def test_forward_flops_by_hand():
    mm = _tiny()
    # sequences of 3 and 5 tokens, one batch of 8 tokens; d = 8, d_m = 16, 2 heads of 4, 2 layers
    lin = 2 * 8 * (4 * 8 * 8 + 2 * 8 * 16 + 16 * 8)  # per layer: 10,240
    att = 2 * 2 * 4 * (3 * 3 + 5 * 5) * 2  # per layer: 2 products × heads × hd × ΣT²  × 2 FLOP = 1,088
    assert limit.flops(limit.forward_shapes(mm, [3, 5])) == 2 * (lin + att) == 22_656
    # the head on 2 rows: 2·2·d·V
    assert limit.flops(limit.forward_shapes(mm, [3, 5], head_rows=2)) == 22_656 + 2 * 2 * 8 * 32
    # two batches: the linears' FLOPs are the same, the shapes differ
    two = limit.forward_shapes(mm, [3, 5], batches=[[3], [5]])
    assert limit.flops(two) == 22_656 and {(g.m, g.k, g.n) for g in two} >= {(3, 8, 16), (5, 16, 8)}
    # only layer 1, twice (a tail run twice): half the model, twice
    assert limit.flops(limit.block_shapes(mm, [3, 5], layers=[1, 1])) == 2 * (lin + att)


def test_vocab_flops_by_hand():
    mm = _tiny()
    # 10 directions in chunks of 4 (4, 4, 2), both of 2 passes: 2·10·d·V·2
    shapes = limit.vocab_shapes(mm, 10, 4, count=2)
    assert limit.flops(shapes) == 2 * 10 * 8 * 32 * 2
    assert sorted((g.m, g.count) for g in shapes) == [(2, 2), (4, 4)]
    assert limit.flops([limit.Gemm(2, 3, 4, count=5, batch=6)]) == 2 * 2 * 3 * 4 * 5 * 6
    assert limit.merge([limit.Gemm(2, 3, 4, 1), limit.Gemm(2, 3, 4, 2), limit.Gemm(0, 3, 4, 9)]) == [limit.Gemm(2, 3, 4, 3)]


def test_gemm_runs_the_shapes_given():
    calls = []

    def matmul(a, b):
        calls.append((tuple(a.shape), tuple(b.shape), a.dtype))
        return torch.matmul(a, b)

    shapes = [limit.Gemm(3, 4, 5, count=2), limit.Gemm(6, 7, 8, count=1, batch=3)]
    s = limit.gemm_seconds(shapes, budget_s=1e9, matmul=matmul)
    assert s >= 0
    # each shape once to warm up, then `count` times (the budget allows all)
    assert calls.count(((3, 4), (4, 5), torch.float32)) == 3
    assert calls.count(((3, 6, 7), (3, 7, 8), torch.float32)) == 2
    assert len(calls) == 5
    # a small budget still runs every shape at least twice (warm-up + one timed call)
    calls.clear()
    limit.gemm_seconds([limit.Gemm(3, 4, 5, count=1000)], budget_s=0.0, matmul=matmul)
    assert calls == [((3, 4), (4, 5), torch.float32)] * 2


def test_report_returns_the_ratio():
    lines = []
    r = limit.report("tiny", [limit.Gemm(16, 16, 16, 4)], step_s=1.0, budget_s=0.01, out=lines.append)
    assert r["flops"] == 2 * 16 ** 3 * 4 and r["gemm_s"] > 0 and r["ratio"] == 1.0 / r["gemm_s"]
    assert r["gemm_gflops"] > 0 and any("step / GEMM" in x for x in lines)
