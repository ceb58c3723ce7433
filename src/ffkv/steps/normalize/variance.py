"""C3 and C4: the variance of an unnormalized memory's output against its number of slots.

Synthetic: y = Σ_{i≤n} ReLU(x_i)·v_i with x_i, v_i ~ N(0, 1) independent has Var y = n/2 (each
term has mean 0 and variance E[ReLU(x)²]·E[v²] = 1/2); scaled by 1/(γ·√(n/2)) it has 1/γ².
The standard error of a sample variance s² over S draws is √((m₄ − m₂²·(S−3)/(S−1)) / S), with
m₂, m₄ the sample's central moments.

On the model: for each layer and size k, `repeats` fixed random subsets S of the memories
(seeded by (seed, layer, k, repeat)); y_S = Σ_{i∈S} m_i·v_i per token; its variance across tokens
per output coordinate, averaged over the d coordinates. The reported variance is the mean over
the subsets, its SE their spread (std/√repeats); with k = d_m there is one subset and no SE.
"""
from __future__ import annotations

import math

import numpy as np
import torch

SYNTHETIC_N = tuple(2 ** k for k in range(4, 15))  # 16 … 16,384


def variance_se(y: np.ndarray) -> tuple[float, float]:
    """(s², SE of s²) of a sample."""
    S = len(y)
    c = y - y.mean()
    m2, m4 = float((c ** 2).mean()), float((c ** 4).mean())
    return float(c @ c / (S - 1)), math.sqrt(max(m4 - m2 * m2 * (S - 3) / (S - 1), 0.0) / S)


def synthetic(ns=SYNTHETIC_N, draws: int = 2000, gamma: float = 1.0, seed: int = 0,
              chunk_values: int = 4_000_000) -> list[dict]:
    """Rows of `normalize_variance` for the synthetic memory (source "synthetic")."""
    rows = []
    for n in ns:
        rng = np.random.default_rng([seed, 7, n])
        y = np.empty(draws)
        step = max(1, chunk_values // n)
        for s in range(0, draws, step):
            c = min(step, draws - s)
            x, v = rng.standard_normal((c, n)), rng.standard_normal((c, n))
            y[s:s + c] = (np.maximum(x, 0.0) * v).sum(1)
        var, se = variance_se(y)
        div = gamma * gamma * n / 2
        base = {"source": "synthetic", "layer": None, "n": n, "draws": draws, "repeats": 1, "gamma": gamma}
        rows.append({**base, "kind": "raw", "variance": var, "se": se, "expected": n / 2})
        rows.append({**base, "kind": "scaled", "variance": var / div, "se": se / div, "expected": 1 / (gamma * gamma)})
    return rows


def subset_sizes(d_m: int) -> list[int]:
    """16, 64, 256, … below d_m, then d_m."""
    out, k = [], 16
    while k < d_m:
        out.append(k)
        k *= 4
    return out + [d_m]


class ModelVariance:
    """Streaming per-coordinate sums of y_S for every (layer, size, subset)."""

    def __init__(self, mm, layers, repeats: int = 4, seed: int = 0, gamma: float = 1.0):
        self.mm, self.gamma, self.d_m = mm, gamma, mm.d_m
        self.sizes = subset_sizes(mm.d_m)
        self.subsets = {}
        for l in layers:
            for k in self.sizes:
                reps = 1 if k >= mm.d_m else repeats
                self.subsets[(l, k)] = [torch.from_numpy(np.sort(np.random.default_rng([seed, l, k, r]).choice(
                    mm.d_m, k, replace=False))) for r in range(reps)]
        self.s1 = {key: [0.0] * len(v) for key, v in self.subsets.items()}
        self.s2 = {key: [0.0] * len(v) for key, v in self.subsets.items()}
        self.count = {l: 0 for l in layers}
        self.repeats = repeats

    @torch.no_grad()
    def add(self, layer: int, m: torch.Tensor) -> None:
        """m (N, d_m): the coefficients of N tokens of `layer`."""
        if layer not in self.count:
            return
        V = self.mm.values(layer)
        for k in self.sizes:
            for r, idx in enumerate(self.subsets[(layer, k)]):
                idx = idx.to(m.device)
                y = (m[:, idx] @ V[idx]).double()
                self.s1[(layer, k)][r] = self.s1[(layer, k)][r] + y.sum(0)
                self.s2[(layer, k)][r] = self.s2[(layer, k)][r] + (y * y).sum(0)
        self.count[layer] += m.shape[0]

    def rows(self) -> list[dict]:
        out = []
        for (l, k), subs in self.subsets.items():
            N = self.count[l]
            if N < 2:
                continue
            per = np.array([float((s2 / N - (s1 / N) ** 2).mean())
                            for s1, s2 in zip(self.s1[(l, k)], self.s2[(l, k)])])
            var = float(per.mean())
            se = float(per.std(ddof=1) / math.sqrt(len(per))) if len(per) > 1 else float("nan")
            div = self.gamma * self.gamma * k / 2
            base = {"source": "model", "layer": l, "n": k, "draws": N * len(per), "repeats": len(per),
                    "gamma": self.gamma, "expected": None}
            out.append({**base, "kind": "raw", "variance": var, "se": se})
            out.append({**base, "kind": "scaled", "variance": var / div, "se": se / div})
        return out
