"""The two passes of the `normalize` step: fit (τ and scales, on the fit split) and evaluate (on the
held-out split: concentration, output error, variance, and the loss with each layer substituted)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ffkv.corpus.batching import pack, tight_ratio
from ffkv.steps.normalize.tail import Targets, intact, tail_delta, token_nll
from ffkv.steps.normalize.variants import (TAU_GRID, Sums, Variant, best_tau, coefficients,
                                                 concentration, grid_sums, random_slots, relu_coefficients,
                                                 top_slots)


@dataclass
class Plan:
    """What to measure: `layers` get the concentration, the substitution and the variance;
    `capacity_layers` the capacity sweep over `capacity_n` (n < d_m; d_m is the full variants)."""
    layers: list[int]
    capacity_layers: list[int]
    capacity_n: list[int]
    seed: int = 0

    @property
    def fit_layers(self) -> list[int]:
        return sorted(set(self.layers) | set(self.capacity_layers))

    def main(self, mm, layer: int) -> list[Variant]:
        return [Variant("softmax", layer, "all", mm.d_m), Variant("scaled_relu", layer, "all", mm.d_m)]

    def capacity(self, mm, layer: int) -> list[Variant]:
        """The sweep's jobs at `layer` (n < d_m) and, when `layer` has no main jobs, softmax at d_m."""
        out = [Variant(k, layer, sel, n) for n in self.capacity_n if n < mm.d_m
               for sel in ("random", "top") for k in ("softmax", "original")]
        return out + ([] if layer in self.layers else [Variant("softmax", layer, "all", mm.d_m)])


MAX_ROWS = 256  # rows of a batch on a CPU (`ffkv.corpus.batching.step_batch` on CUDA)


def batches_of(seqs: list[list[int]], batch_tokens: int, start: int = 0, stop: int | None = None,
               max_rows: int = MAX_ROWS, ratio: float | None = 1.5):
    """Length-packed batches (indices into seqs) of seqs[start:stop] (tight on a CPU:
    `ffkv.corpus.batching.tight_ratio`)."""
    stop = len(seqs) if stop is None else stop
    lengths = [len(s) for s in seqs[start:stop]]
    return [b + start for b in pack(lengths, batch_tokens, max_rows, ratio=ratio)] if lengths else []


def _per_layer(layers, what):
    """A capture callback that hands each layer's captures to `what(layer, parts)` once all arrived."""
    parts: dict[int, dict] = {}
    need = {"m", "y"} | ({"x"} if what.needs_x else set())
    layers = set(layers)

    def cb(layer, name, t):
        if layer not in layers:
            return
        p = parts.setdefault(layer, {})
        p[name] = t
        if need <= p.keys():
            what(layer, parts.pop(layer))
    return cb


def _captures(what):
    return ("x", "m", "y") if what.needs_x else ("m", "y")


# ---- fit -----------------------------------------------------------------------------------------
class _Rms:
    needs_x = True

    def __init__(self, mm, relu: dict):
        self.mm, self.relu, self.ss, self.n = mm, relu, {}, {}

    def __call__(self, layer, p):
        mm, valid = self.mm, self.valid
        m, x, y0 = p["m"][valid], p["x"][valid], _y0(mm, layer, p["y"][valid])
        self.ss[layer] = self.ss.get(layer, 0.0) + float((m.double() ** 2).sum())
        self.n[layer] = self.n.get(layer, 0) + m.numel()
        a = relu_coefficients(mm, layer, x) / math.sqrt(mm.d_m / 2)
        self.relu.setdefault(layer, Sums()).add(a @ mm.values(layer), y0)


class _Grid:
    needs_x = False

    def __init__(self, mm, plan: Plan, taus: dict, sums: dict):
        self.mm, self.plan, self.taus, self.sums = mm, plan, taus, sums

    def __call__(self, layer, p):
        mm, valid = self.mm, self.valid
        m, y0 = p["m"][valid], _y0(mm, layer, p["y"][valid])
        keys = [(Variant("softmax", layer, "all", mm.d_m), None)]  # (variant, kept slots)
        if layer in self.plan.capacity_layers:
            for n in (n for n in self.plan.capacity_n if n < mm.d_m):
                drawn = random_slots(mm.d_m, n, self.plan.seed, layer).to(m.device)
                keys += [(Variant("softmax", layer, "random", n), drawn),
                         (Variant("softmax", layer, "top", n), top_slots(m, n))]
        for v, keep in keys:
            sums = self.sums.setdefault(v.key, [Sums() for _ in self.taus[layer]])
            grid_sums(mm, layer, m, y0, self.taus[layer], sums, keep)
            if keep is not None:
                self.sums.setdefault(("original",) + v.key[1:], [Sums()])[0].add((m * keep) @ mm.values(layer), y0)


def _y0(mm, layer, y):
    """The FFN output without its bias: what the memories write."""
    b = mm.value_bias(layer)
    return y - b if b is not None else y


def _run(mm, seqs, batches, layers, what, bar=None, task=None):
    for idx in batches:
        ids, mask = mm.batch([seqs[i] for i in idx])
        what.valid = mask.bool()
        intact(mm, ids, mask, callback=_per_layer(layers, what), what=_captures(what))
        if bar is not None:
            bar.advance(task)


@torch.no_grad()
def fit(mm, seqs: list[list[int]], plan: Plan, batch_tokens: int, bar=None,
        max_rows: int = MAX_ROWS) -> dict[tuple, dict]:
    """Variant key (kind, layer, selection, n) -> {"variant" (fitted), "fit_rel_err", "tau_rel"}.

    Pass 1 measures RMS |m| per layer (the unit of the τ grid) and fits the scaled ReLU's γ;
    pass 2 scores every τ of the grid for every softmax variant."""
    batches = batches_of(seqs, batch_tokens, max_rows=max_rows, ratio=tight_ratio(mm.device))
    task = bar.add_task("normalize: fit", total=2 * len(batches)) if bar is not None else None
    relu: dict[int, Sums] = {}
    rms = _Rms(mm, relu)
    _run(mm, seqs, batches, plan.fit_layers, rms, bar, task)
    taus = {l: [math.sqrt(rms.ss[l] / rms.n[l]) * g for g in TAU_GRID] for l in plan.fit_layers}
    sums: dict = {}
    _run(mm, seqs, batches, plan.fit_layers, _Grid(mm, plan, taus, sums), bar, task)
    out = {}
    for l in plan.fit_layers:
        s = relu[l].norm_scale()
        v = Variant("scaled_relu", l, "all", mm.d_m)
        out[v.key] = {"variant": v.fitted(scale=s / math.sqrt(mm.d_m / 2), gamma=1 / s if s else math.inf),
                      "fit_rel_err": relu[l].rel_err(s), "tau_rel": float("nan")}
    for key, ss in sums.items():
        v = Variant(*key)
        if v.kind == "original":
            out[key] = {"variant": v, "fit_rel_err": ss[0].rel_err(1.0), "tau_rel": float("nan")}
            continue
        i, tau, s = best_tau(ss, taus[v.layer])
        out[key] = {"variant": v.fitted(tau=tau, scale=s), "fit_rel_err": ss[i].rel_err(s), "tau_rel": TAU_GRID[i]}
    return out


# ---- evaluate ------------------------------------------------------------------------------------
@dataclass
class Accum:
    """Per-sentence sums (float64 (J,)) by key, and the tokens behind them."""
    J: int
    sums: dict = field(default_factory=dict)

    def add(self, key, values: torch.Tensor, sent: np.ndarray, rows: torch.Tensor) -> None:
        """values (N,) of rows `rows` (batch row of each value); sent: batch row -> sentence index."""
        per_row = torch.bincount(rows, weights=values.double(), minlength=len(sent)).cpu().numpy()
        arr = self.sums.setdefault(key, np.zeros(self.J))
        arr[sent] += per_row

    def count(self, key, sent: np.ndarray, rows: torch.Tensor) -> None:
        """One per row of `rows`, on their device (a CPU tensor beside CUDA rows stops bincount)."""
        self.add(key, torch.ones(len(rows), device=rows.device), sent, rows)


class _Eval:
    """The held-out pass at one layer: concentration, output error, variance, and each job's y' − y."""
    needs_x = True

    def __init__(self, mm, plan: Plan, fitted: dict, acc: Accum, variance=None):
        self.mm, self.plan, self.fitted, self.acc, self.variance = mm, plan, fitted, acc, variance
        self.errs: dict[tuple, Sums] = {}

    def start(self, mask: torch.Tensor, sent: np.ndarray, jobs: dict, sweep: bool) -> None:
        self.valid, self.sent, self.jobs, self.sweep = mask.bool(), sent, jobs, sweep
        self.rows = self.valid.nonzero()[:, 0]
        self.deltas: dict[tuple, torch.Tensor] = {}

    def _stats(self, key, w: torch.Tensor) -> None:
        for name, t in concentration(w).items():
            self.acc.add(key + (name,), t, self.sent, self.rows)

    def __call__(self, layer, p):
        mm, valid = self.mm, self.valid
        x, m, y = p["x"], p["m"], p["y"]
        main = layer in self.plan.layers
        if main:
            mv = m[valid]
            self._stats(("m", layer), mv)
            if self.variance is not None and self.sweep:
                self.variance.add(layer, mv)
        for v in self.jobs.get(layer, ()):
            fv = self.fitted[v.key]["variant"]
            mp = coefficients(mm, fv, x, m, self.plan.seed)
            yhat = mm.ffn_from_memories(layer, mp)
            self.deltas[v.key] = yhat - y
            if main and v.selection == "all":
                self._stats(("w",) + v.key, mp[valid])
                self.errs.setdefault(v.key, Sums()).add(_y0(mm, layer, yhat[valid]), _y0(mm, layer, y[valid]))


def _jobs(mm, plan: Plan, sweep: bool) -> dict[int, list[Variant]]:
    jobs = {l: plan.main(mm, l) for l in plan.layers}
    if sweep:
        for l in plan.capacity_layers:
            jobs[l] = jobs.get(l, []) + plan.capacity(mm, l)
    return jobs


@torch.no_grad()
def evaluate(mm, seqs: list[list[int]], n_sweep: int, plan: Plan, fitted: dict, batch_tokens: int,
             variance=None, bar=None, max_rows: int = MAX_ROWS) -> tuple[Accum, dict]:
    """Per-sentence sums over the held-out split: ("nll", "intact"), ("nll",) + variant key,
    ("pred",) and ("tok",) token counts, ("m", layer, stat), ("w",) + key + (stat,); and the pooled
    output-error sums per main variant. Sentences [0, n_sweep) also get the capacity sweep and the
    variance on the model."""
    acc = Accum(len(seqs))
    ev = _Eval(mm, plan, fitted, acc, variance)
    ratio = tight_ratio(mm.device)
    batches = [(b, True) for b in batches_of(seqs, batch_tokens, 0, n_sweep, max_rows, ratio)]
    batches += [(b, False) for b in batches_of(seqs, batch_tokens, n_sweep, None, max_rows, ratio)]
    units = sum(1 + sum(map(len, _jobs(mm, plan, sw).values())) for _, sw in batches)
    task = bar.add_task("normalize: substitute", total=units, tokens=0) if bar is not None else None
    done_tokens = 0
    for idx, sweep in batches:
        ids, mask = mm.batch([seqs[i] for i in idx])
        ev.start(mask, idx, _jobs(mm, plan, sweep), sweep)
        cache = intact(mm, ids, mask, callback=_per_layer(plan.fit_layers, ev), what=("x", "m", "y"))
        tg = Targets.of(ids, mask)
        acc.add(("nll", "intact"), token_nll(mm, cache.final, tg), idx, tg.rows)
        acc.count(("pred",), idx, tg.rows)
        acc.count(("tok",), idx, ev.rows)
        done_tokens += int(mask.sum())
        if bar is not None:
            bar.update(task, advance=1, tokens=done_tokens)
        for key in sorted(ev.deltas, key=lambda k: (k[1], k)):
            h = tail_delta(mm, cache, key[1], ev.deltas.pop(key))
            acc.add(("nll",) + key, token_nll(mm, h, tg), idx, tg.rows)
            if bar is not None:
                bar.advance(task)
    return acc, ev.errs
