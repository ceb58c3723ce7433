"""The `normalize` step's tables, from the per-sentence sums of the passes (columns: the package
docstring). Intervals are sentence-clustered: a sentence's tokens share a context, so the unit of
the standard error is the sentence, not the token."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from ffkv.steps.normalize.variants import TOPS

STATS = ("entropy",) + tuple(f"top{k}" for k in TOPS)


def ratio_mean_se(s: np.ndarray, n: np.ndarray) -> tuple[float, float]:
    """Mean Σs/Σn of per-sentence sums s over per-sentence counts n, and its clustered SE."""
    use = n > 0
    s, n = s[use], n[use]
    N, J = n.sum(), len(n)
    if N <= 0:
        return float("nan"), float("nan")
    mean = float(s.sum() / N)
    se = math.sqrt(J / (J - 1) * float(((s - mean * n) ** 2).sum())) / N if J > 1 else float("nan")
    return mean, se


def layers_table(mm, plan, fitted: dict, acc, errs: dict) -> pa.Table:
    S, pred, tok = acc.sums, acc.sums[("pred",)], acc.sums[("tok",)]
    base = S[("nll", "intact")]
    intact, _ = ratio_mean_se(base, pred)
    rows = []
    for l in plan.layers:
        for v in plan.main(mm, l):
            f = fitted[v.key]
            fv = f["variant"]
            loss, _ = ratio_mean_se(S[("nll",) + v.key], pred)
            delta, delta_se = ratio_mean_se(S[("nll",) + v.key] - base, pred)
            row = {"layer": l, "variant": v.kind, "d_m": mm.d_m, "gated": mm.gated,
                   "tau": fv.tau if v.kind == "softmax" else None,
                   "tau_rel": f["tau_rel"] if v.kind == "softmax" else None,
                   "scale": fv.scale, "gamma": fv.gamma if v.kind == "scaled_relu" else None,
                   "fit_rel_err": f["fit_rel_err"], "eval_rel_err": errs[v.key].rel_err(1.0),
                   "loss": loss, "loss_intact": intact, "delta_loss": delta, "delta_loss_se": delta_se,
                   "ppl": math.exp(loss), "ppl_intact": math.exp(intact),
                   "tokens": int(pred.sum()), "sentences": int((pred > 0).sum())}
            for st in STATS:
                m_st, _ = ratio_mean_se(S[("m", l, st)], tok)
                w_st, _ = ratio_mean_se(S[("w",) + v.key + (st,)], tok)
                _, d_se = ratio_mean_se(S[("w",) + v.key + (st,)] - S[("m", l, st)], tok)
                row.update({f"{st}_m": m_st, f"{st}_w": w_st, f"{st}_diff_se": d_se})
            row["entropy_uniform"] = math.log(mm.d_m)
            rows.append(row)
    return _typed(pa.Table.from_pylist(rows), int16=("layer",), int32=("d_m", "sentences"))


def _loss_keys(mm, layer: int, sel: str, n: int):
    """(softmax key, original key) of the capacity sweep; at n = d_m the full variants."""
    if n >= mm.d_m:
        return ("softmax", layer, "all", mm.d_m), "intact"
    return ("softmax", layer, sel, n), ("original", layer, sel, n)


def capacity_table(mm, plan, fitted: dict, acc, n_sweep: int) -> pa.Table:
    S = acc.sums
    pred = S[("pred",)].copy()
    pred[n_sweep:] = 0  # the sweep's sentences only
    base = S[("nll", "intact")]
    intact, _ = ratio_mean_se(base, pred)
    ns = sorted(set(plan.capacity_n) | {mm.d_m})
    rows = []
    for l in plan.capacity_layers:
        for sel in ("random", "top"):
            sk0, ok0 = _loss_keys(mm, l, sel, ns[0])
            gap0 = S[("nll",) + sk0] - (base if ok0 == "intact" else S[("nll",) + ok0])
            for n in ns:
                sk, ok = _loss_keys(mm, l, sel, n)
                sm = S[("nll",) + sk]
                orig = base if ok == "intact" else S[("nll",) + ok]
                gap, gap_se = ratio_mean_se(sm - orig, pred)
                change, change_se = ratio_mean_se((sm - orig) - gap0, pred)
                f = fitted[sk]
                rows.append({"layer": l, "selection": sel, "n": n, "tau": f["variant"].tau,
                             "tau_rel": f["tau_rel"], "scale": f["variant"].scale,
                             "loss_softmax": ratio_mean_se(sm, pred)[0],
                             "loss_original": ratio_mean_se(orig, pred)[0], "loss_intact": intact,
                             "gap": gap, "gap_se": gap_se, "gap_change": change, "gap_change_se": change_se,
                             "fit_rel_err_softmax": f["fit_rel_err"],
                             "fit_rel_err_original": 0.0 if ok == "intact" else fitted[ok]["fit_rel_err"],
                             "tokens": int(pred.sum()), "sentences": int((pred > 0).sum())})
    return _typed(pa.Table.from_pylist(rows), int16=("layer",), int32=("n", "sentences")) if rows \
        else _empty_capacity()


def _empty_capacity() -> pa.Table:
    f64 = pa.float64()
    return pa.schema([("layer", pa.int16()), ("selection", pa.string()), ("n", pa.int32()), ("tau", f64),
                      ("tau_rel", f64), ("scale", f64), ("loss_softmax", f64), ("loss_original", f64),
                      ("loss_intact", f64), ("gap", f64), ("gap_se", f64), ("gap_change", f64),
                      ("gap_change_se", f64), ("fit_rel_err_softmax", f64), ("fit_rel_err_original", f64),
                      ("tokens", pa.int64()), ("sentences", pa.int32())]).empty_table()


VARIANCE_SCHEMA = pa.schema([("source", pa.string()), ("layer", pa.int16()), ("n", pa.int32()),
                             ("kind", pa.string()), ("variance", pa.float64()), ("se", pa.float64()),
                             ("expected", pa.float64()), ("draws", pa.int64()), ("repeats", pa.int32()),
                             ("gamma", pa.float64())])


def variance_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=VARIANCE_SCHEMA)


def _typed(t: pa.Table, int16=(), int32=()) -> pa.Table:
    for names, typ in ((int16, pa.int16()), (int32, pa.int32())):
        for c in names:
            if c in t.column_names:
                t = t.set_column(t.column_names.index(c), c, t.column(c).cast(typ))
    return t
