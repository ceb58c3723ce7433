"""`ffkv census`: what kind of memory each one is (issue 46, first piece), from the weights and
the mined pass's key statistics. No second pass over the corpus, no new tracker.

Definitions used here (v_i the value as ffkv reads it, `MemoryModel.values`: after a post-FFN
norm's gain (Gemma 2/3, OLMo 2) and Granite's residual multiplier; k_i the key row, for a gated
FFN g_i the gate row and u_i the input ("up") row, `MemoryModel.keys` / `up_keys`, fused gate_up
projections (Phi-3, the MoE experts) split by the family's adapter):

- Vocabulary moments (Gurnee et al. 2024, "Universal Neurons in GPT2"): per memory the vector
  c_i = cos(W_U[t], v_i) over every row t of the unembedding (the full vocabulary, padded rows
  included; a zero row, e.g. a padding token's in Gemma, counts as cosine 0). W_U: the unembedding as it is (`lens` naive) or its rows times the final norm's gain
  (`lens` norm, the default for a run whose lens is norm: the gain folded into W_U as
  TransformerLens's fold_ln does for Gurnee et al.; W_U is not centred). `skew` =
  `scipy.stats.skew(c_i)`, `kurtosis` = `scipy.stats.kurtosis(c_i)` (Fisher's: excess kurtosis, 0 for a
  normal), both with scipy's defaults (bias=True: population moments); `variance` = the population
  variance of c_i (`numpy.var`). Computed with scipy, not by hand (Gurnee et al.'s own kurtosis
  helper had an operator-precedence slip). The cosines are float32 products (torch), the moments
  scipy's over those float32 vectors.
  Classes: prediction when kurtosis > `kurtosis` and skew > 0; suppression when kurtosis >
  `kurtosis` and skew < 0; partition when variance · d > `partition`, d the model's width (a
  random direction's cosine with a near-isotropic vocabulary has variance ≈ 1/d, so the threshold
  reads "`partition` times a random direction's", the same across widths). A memory may be a
  prediction (or suppression) and a partition memory at once.
- Input-output classes (after Gerstner & Schütze 2025, arXiv 2505.17936; their paper's text was
  not at hand in this session, so the classes below are ffkv's own definitions under their
  names). With τ = `cos`, a cosine counts as positive above τ, negative below −τ, zero otherwise
  (t(c) ∈ {+1, 0, −1}).
  Ungated FFN (GPT-2, OPT, Pythia, …): cos_in_out = cos(k_i, v_i); enrichment when t = +1 (the
  memory adds to the direction it reads), depletion when t = −1, orthogonal_output otherwise.
  cos_gate_in and cos_gate_out are null.
  Gated FFN (m_i = f(x·g_i)·(x·u_i)): cos_gate_in = cos(g_i, u_i), cos_gate_out = cos(g_i, v_i),
  cos_in_out = cos(u_i, v_i), in this order:
  1. orthogonal_output: t(cos_gate_out) = 0 and t(cos_in_out) = 0 (writes away from both reads);
  2. proportional_change: t(cos_gate_in) = 0 (what opens the gate says nothing of the input's
     sign, so the output's sign follows the input's: the memory writes ±v in proportion);
  3. otherwise s = t(cos_gate_in) is the sign of m_i on an input along the gate (m_i writes s·v_i
     there); with e_g = t(s·cos_gate_out) (the written direction against the gate's) and
     e_u = t(cos_in_out) (against the input's):
     enrichment when e_g ≥ 0 and e_u ≥ 0, depletion when e_g ≤ 0 and e_u ≤ 0 (not both 0: that is
     1.), conditional_enrichment when e_g < 0 < e_u, conditional_depletion when e_u < 0 < e_g.
  The classes do not change under (u_i, v_i) -> (−u_i, −v_i), which leaves the FFN as it is.
  A zero weight vector's cosines are 0 (its class orthogonal_output, or proportional_change for a
  zero gate row); a zero value's moments are null.
- Dead and rare (Voita et al. 2024), from the mined pass's key histogram (`key_hist`, the signed
  log2 histogram of m over every mined token; `ffkv.mine.stats`): a memory is active on a token when
  |m| > eps. The histogram resolves |m| only at its bin edges (0, then 2^-10, 2^-9, …, 2^10), so eps
  is rounded up to the next edge, `eps_used` (recorded beside eps): active ⇔ |m| ≥ eps_used, and
  for eps_used = 0, |m| ≥ 2^-126 (the histogram's zero bin holds zeros and subnormal floats).
  `active` = the tokens on which the memory is active, `tokens` = the mined tokens (key_stats's
  count); dead ⇔ active = 0; rare ⇔ not dead and active < `rare` · tokens. Memories that were not
  mined (mine --layers/--dims) have null tokens, active, dead and rare.

Tables written (public contract; layers 0-based)
- `census`: one row per memory, by layer then dim. layer int16, dim int32, for a mixture of experts
  also expert int16, expert_dim int32 (`MemoryModel.expert_of`; the shared expert is expert E,
  after the E routed ones) and shared_expert bool (true on the shared expert's memories), then
  skew float32, kurtosis float32, variance float32, cos_gate_in float32, cos_gate_out float32,
  cos_in_out float32, tokens int64, active int64, dead bool, rare bool,
  prediction bool, suppression bool, partition bool, io_class string (one of `IO_CLASSES`).
- `census_layers`: one row per layer. layer int16, memories int32, mined int32 (memories with key
  statistics), tokens int64, then float64 shares: dead and rare (of the mined memories; null when
  none was mined), prediction, suppression, partition and one column per class of `IO_CLASSES` (of
  all memories), then kurtosis_median, skew_median, cos_in_out_mean float64.

`layer_census(mm, layer)` gives the weight columns and their classes for one layer (or some of
its memories) of any model, without a run.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ffkv.defs import canonical_dtype, check_lens
from ffkv.errors import FfkvError

IO_CLASSES = ("enrichment", "depletion", "conditional_enrichment", "conditional_depletion",
              "proportional_change", "orthogonal_output")
VOCAB_CLASSES = ("prediction", "suppression", "partition")
WEIGHT_COLUMNS = ("skew", "kurtosis", "variance", "cos_gate_in", "cos_gate_out", "cos_in_out")
DEFAULTS = {"kurtosis": 10.0, "partition": 2.0, "cos": 0.1}  # CensusSettings' defaults (a test holds them equal)


# ---- the weights ------------------------------------------------------------------------------------
def unembedding_rows(mm, lens: str):
    """W_U (V, d) float32 rows as the census compares values with them, each of unit norm (a zero row
    stays zero): E, or E's rows times the final norm's gain for the norm lens."""
    from ffkv.model.memories import lens_for

    ln = lens_for(mm, check_lens(lens))
    W = ln.E.detach().float()
    if lens == "norm":
        W = W * ln.gain.detach().float()
    return _unit(W)


def _unit(X):
    import torch

    X = X.detach().float()
    return X / X.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


WORKERS = 2  # threads running scipy's moments (numpy lets go of the GIL), beside torch's own
# rows per scipy call: its temporaries (a few × 16 × |V| float32, 3 MB each for SmolLM2) stay below glibc's mmap
# threshold, so they are reused, not mapped and faulted in each time (at 64 rows: 4x the page faults, +0.4 s of
# system time per SmolLM2 layer)
SCIPY_ROWS = 16


def _moments(C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scipy's skew and excess kurtosis, and the variance, of each row of C (n, V)."""
    from scipy import stats

    out = np.empty((3, len(C)), np.float32)
    for a in range(0, len(C), SCIPY_ROWS):
        c = C[a:a + SCIPY_ROWS]
        out[0, a:a + len(c)] = stats.skew(c, axis=1)
        out[1, a:a + len(c)] = stats.kurtosis(c, axis=1)
        out[2, a:a + len(c)] = c.var(axis=1)
    return out[0], out[1], out[2]


def weight_stats(mm, layer: int, W, chunk: int = 512, dims=None, advance=None) -> dict[str, np.ndarray]:
    """The weight columns of `layer` (all its memories, or `dims`): the vocabulary moments of
    cos(W, v_i) (W from `unembedding_rows`) and the key-value cosines. Chunks of values are
    compared with the vocabulary in turn, scipy's moments of one chunk running in a thread while
    torch multiplies the next (numpy lets go of the GIL)."""
    import torch

    with torch.no_grad():
        V = mm.values(layer)
        K, U = mm.keys(layer), mm.up_keys(layer)
        if dims is not None:
            idx = torch.as_tensor(np.asarray(dims, np.int64), device=V.device)
            V, K = V[idx], K[idx]
            U = U[idx] if U is not None else None
        Vn, Kn = _unit(V), _unit(K)
        n = len(Vn)
        out = {c: np.full(n, np.nan, np.float32) for c in WEIGHT_COLUMNS}
        if U is None:
            out["cos_in_out"] = (Kn * Vn).sum(1).cpu().numpy()
        else:
            Un = _unit(U)
            out["cos_gate_in"] = (Kn * Un).sum(1).cpu().numpy()
            out["cos_gate_out"] = (Kn * Vn).sum(1).cpu().numpy()
            out["cos_in_out"] = (Un * Vn).sum(1).cpu().numpy()
        W = W.to(Vn.device)
        chunk = max(1, min(chunk, n))
        # two (chunk, V) float32 buffers, taken in turn: scipy reads one while torch fills the other
        bufs = [torch.empty(chunk, W.shape[0], dtype=torch.float32, device=Vn.device) for _ in range(2 if n > chunk else 1)]
        pending = []
        with ThreadPoolExecutor(WORKERS) as pool:
            for k, a in enumerate(range(0, n, chunk)):
                rows = Vn[a:a + chunk]
                C = torch.matmul(rows, W.T, out=bufs[k % len(bufs)][:len(rows)]).cpu().numpy()
                half = -(-len(C) // WORKERS)
                pending.append((a, [pool.submit(_moments, C[b:b + half]) for b in range(0, len(C), half)]))
                if len(pending) > 1:  # the other buffer's chunk, done before that buffer is filled again
                    _collect(out, *pending.pop(0), advance)
            while pending:
                _collect(out, *pending.pop(0), advance)
    return out


def _collect(out: dict, a: int, futs, advance) -> None:
    parts = [f.result() for f in futs]
    for i, c in enumerate(("skew", "kurtosis", "variance")):
        v = np.concatenate([p[i] for p in parts])
        out[c][a:a + len(v)] = v
    if advance is not None:
        advance()


def _sign(c: np.ndarray, tau: float) -> np.ndarray:
    return np.where(c > tau, 1, np.where(c < -tau, -1, 0))


def io_classes(cos_gate_in, cos_gate_out, cos_in_out, tau: float, gated: bool) -> np.ndarray:
    """The input-output class of each memory (module docstring), as an array of `IO_CLASSES` names."""
    e_u = _sign(np.asarray(cos_in_out), tau)
    if not gated:
        return np.where(e_u > 0, "enrichment", np.where(e_u < 0, "depletion", "orthogonal_output")).astype(object)
    s = _sign(np.asarray(cos_gate_in), tau)
    e_g = _sign(s * np.asarray(cos_gate_out), tau)
    out = np.full(len(e_u), "", dtype=object)
    out[(e_g >= 0) & (e_u >= 0)] = "enrichment"
    out[(e_g <= 0) & (e_u <= 0)] = "depletion"
    out[(e_g < 0) & (e_u > 0)] = "conditional_enrichment"
    out[(e_u < 0) & (e_g > 0)] = "conditional_depletion"
    out[s == 0] = "proportional_change"
    out[(_sign(np.asarray(cos_gate_out), tau) == 0) & (e_u == 0)] = "orthogonal_output"
    return out


def vocab_classes(st: dict, d: int, kurtosis: float, partition: float) -> dict[str, np.ndarray]:
    """prediction, suppression, partition (module docstring) from the moments."""
    high = st["kurtosis"] > kurtosis
    return {"prediction": high & (st["skew"] > 0), "suppression": high & (st["skew"] < 0),
            "partition": st["variance"] * d > partition}


def layer_census(mm, layer: int, dims=None, *, lens: str | None = None, kurtosis: float = DEFAULTS["kurtosis"],
                 partition: float = DEFAULTS["partition"], cos: float = DEFAULTS["cos"], chunk: int = 512) -> pa.Table:
    """The census's weight columns and classes for one layer of `mm` (a `MemoryModel`), without a run:
    layer, dim, (expert, expert_dim,) the `WEIGHT_COLUMNS`, prediction, suppression, partition,
    io_class. `dims`: only these memories (e.g. one); `lens`: default the model's lens.
    E.g. `layer_census(open_model(), 20).to_pandas()`."""
    if not 0 <= int(layer) < mm.n_layers:
        raise FfkvError(f"layer {layer} out of range 0..{mm.n_layers - 1}")
    dims = np.arange(mm.d_m) if dims is None else np.asarray(dims, np.int64).reshape(-1)
    if len(dims) and (dims.min() < 0 or dims.max() >= mm.d_m):
        raise FfkvError(f"dims out of range 0..{mm.d_m - 1}")
    st = weight_stats(mm, int(layer), unembedding_rows(mm, lens or mm.lens.name), chunk, dims=dims)
    return _weight_table(mm, np.full(len(dims), int(layer)), dims, st, kurtosis, partition, cos)


def _expert_columns(mm, dims: np.ndarray) -> dict:
    if mm.expert_of(0) is None:
        return {}
    pairs = np.array([mm.expert_of(int(i)) for i in dims], np.int64).reshape(-1, 2)
    routed = int(mm.arch.n_experts(mm.blocks[0]))
    return {"expert": pa.array(pairs[:, 0].astype(np.int16)), "expert_dim": pa.array(pairs[:, 1].astype(np.int32)),
            "shared_expert": pa.array(pairs[:, 0] == routed)}


def _f32(x: np.ndarray) -> pa.Array:
    x = np.asarray(x, np.float32)
    return pa.array(x, mask=np.isnan(x))


def _weight_table(mm, layers, dims, st, kurtosis, partition, cos) -> pa.Table:
    cols = {"layer": pa.array(np.asarray(layers, np.int16)), "dim": pa.array(np.asarray(dims, np.int32)),
            **_expert_columns(mm, dims), **{c: _f32(st[c]) for c in WEIGHT_COLUMNS}}
    cols.update({k: pa.array(v) for k, v in vocab_classes(st, mm.d, kurtosis, partition).items()})
    cols["io_class"] = pa.array(io_classes(st["cos_gate_in"], st["cos_gate_out"], st["cos_in_out"], cos, mm.gated),
                                pa.string())
    return pa.table(cols)


# ---- the key statistics ------------------------------------------------------------------------------
def eps_edges(layout: dict) -> np.ndarray:
    """The |m| thresholds the key histogram resolves: 0, then each finite lower edge of a signed bin
    above the tiny one (2^-10 … 2^10)."""
    sign, lo = np.asarray(layout["sign"]), np.asarray(layout["lo"], np.float64)
    tiny = lo[(sign > 0)].min()
    return np.unique(np.concatenate([[0.0], lo[(sign != 0) & (lo > tiny)]]))


def eps_used(eps: float, layout: dict) -> float:
    """eps rounded up to the histogram's next edge (`eps_edges`)."""
    edges = eps_edges(layout)
    above = edges[edges >= eps]
    if not len(above):
        raise FfkvError(f"--eps {eps} is above the key histogram's last edge {edges[-1]:g}")
    return float(above[0])


def active_counts(run, eps_edge: float, L: int, d_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, active) (L, d_m) int64 from `key_stats` and `key_hist`: -1 where a memory was not mined.
    Active: tokens in the signed bins whose lower edge is ≥ eps_edge (for 0: every signed bin)."""
    from ffkv.store import query

    lay = query.stats_layout(run)
    sign, lo = np.asarray(lay["sign"]), np.asarray(lay["lo"], np.float64)
    on = (sign != 0) & (lo >= eps_edge) if eps_edge > 0 else sign != 0
    ks = query.table(run, "key_stats", columns=["layer", "dim", "sign", "count"])
    pos = ks.column("sign").to_numpy() == 1
    tokens = np.full((L, d_m), -1, np.int64)
    kl, kd = ks.column("layer").to_numpy()[pos].astype(np.int64), ks.column("dim").to_numpy()[pos].astype(np.int64)
    tokens[kl, kd] = ks.column("count").to_numpy()[pos]
    active = np.where(tokens >= 0, 0, -1).astype(np.int64)
    h = query.table(run, "key_hist", columns=["layer", "dim", "bin", "count"])
    b = h.column("bin").to_numpy().astype(np.int64)
    keep = on[b]
    np.add.at(active, (h.column("layer").to_numpy()[keep].astype(np.int64), h.column("dim").to_numpy()[keep].astype(np.int64)),
              h.column("count").to_numpy()[keep].astype(np.int64))
    return tokens, active


# ---- the step -----------------------------------------------------------------------------------------
def record(run, s) -> dict:
    """The manifest's record (what the results depend on; not chunk), after the checks that need the
    run, before any model loads: the run's key statistics (for dead and rare) must be there."""
    from ffkv.store import query

    lay = query.stats_layout(run)
    if lay is None:
        raise FfkvError(f"run {run.path} has no key statistics (`key_stats`, `key_hist`), which the census reads "
                        f"for dead and rare memories; mine it again without --no-stats")
    return {"eps": float(s.eps), "eps_used": eps_used(float(s.eps), lay), "rare": float(s.rare),
            "kurtosis": float(s.kurtosis), "partition": float(s.partition), "cos": float(s.cos),
            "lens": check_lens(s.lens or run.lens), "dtype": canonical_dtype(s.dtype),
            "mine_finished": run.step("mine").get("finished")}


def compute(ctx) -> dict:
    """Weight statistics of every layer, dead and rare from the key statistics, both tables written;
    the manifest keeps {"summary": ...}."""
    import torch

    from ffkv.model.onednn import fast_products

    mm = ctx.model()
    with torch.no_grad(), fast_products(getattr(mm, "device", None)):
        summary = _compute(ctx.run, mm, ctx.record, ctx.settings.chunk, ctx.show_progress)
    ctx.result = summary
    return {"summary": summary}


def _compute(run, mm, rec: dict, chunk: int, show_progress) -> dict:
    import math

    from ffkv.progress import progress

    t0 = time.time()
    L, d_m = mm.n_layers, mm.d_m
    W = unembedding_rows(mm, rec["lens"])
    per = []
    chunk = max(1, min(chunk, d_m))
    with progress(disable=None if show_progress is None else not show_progress) as bar:
        task = bar.add_task(f"census: values against the vocabulary ({rec['lens']} lens)",
                            total=L * math.ceil(d_m / chunk))
        for l in range(L):
            per.append(weight_stats(mm, l, W, chunk, advance=lambda: bar.advance(task)))
    st = {c: np.concatenate([p[c] for p in per]) for c in WEIGHT_COLUMNS}
    layers, dims = np.repeat(np.arange(L), d_m), np.tile(np.arange(d_m), L)
    t = _weight_table(mm, layers, dims, st, rec["kurtosis"], rec["partition"], rec["cos"])
    tokens, active = active_counts(run, rec["eps_used"], L, d_m)
    tok, act = tokens.reshape(-1), active.reshape(-1)
    mined = tok >= 0
    dead = mined & (act == 0)
    rare = mined & ~dead & (act < rec["rare"] * np.maximum(tok, 0))
    at = t.schema.get_field_index("prediction")
    for name, arr in (("rare", pa.array(rare, mask=~mined)), ("dead", pa.array(dead, mask=~mined)),
                      ("active", pa.array(act, pa.int64(), mask=~mined)),
                      ("tokens", pa.array(tok, pa.int64(), mask=~mined))):
        t = t.add_column(at, name, arr)
    lt = _layer_table(t, L)
    run.write_table("census", t)
    run.write_table("census_layers", lt)
    return _summary(rec, mm, t, lt, time.time() - t0)


def _layer_table(t: pa.Table, L: int) -> pa.Table:
    layer = t.column("layer").to_numpy()
    mined = t.column("tokens").is_valid().to_numpy(zero_copy_only=False)
    tokens = t.column("tokens").fill_null(0).to_numpy()
    flag = {c: t.column(c).fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
            for c in ("dead", "rare", *VOCAB_CLASSES)}
    io = t.column("io_class").to_numpy(zero_copy_only=False)
    num = {c: t.column(c).to_numpy(zero_copy_only=False).astype(np.float64) for c in ("kurtosis", "skew", "cos_in_out")}
    rows = []
    for l in range(L):
        at = layer == l
        n, m = int(at.sum()), at & mined
        nm = int(m.sum())
        row = {"layer": l, "memories": n, "mined": nm, "tokens": int(tokens[m].max()) if nm else None}
        row.update({c: float(flag[c][m].mean()) if nm else None for c in ("dead", "rare")})
        row.update({c: float(flag[c][at].mean()) if n else None for c in VOCAB_CLASSES})
        row.update({c: float((io[at] == c).mean()) if n else None for c in IO_CLASSES})
        for c, name in (("kurtosis", "kurtosis_median"), ("skew", "skew_median")):
            row[name] = float(np.nanmedian(num[c][at])) if n else None
        row["cos_in_out_mean"] = float(np.nanmean(num["cos_in_out"][at])) if n else None
        rows.append(row)
    schema = pa.schema([("layer", pa.int16()), ("memories", pa.int32()), ("mined", pa.int32()), ("tokens", pa.int64()),
                        *[(c, pa.float64()) for c in ("dead", "rare", *VOCAB_CLASSES, *IO_CLASSES,
                                                      "kurtosis_median", "skew_median", "cos_in_out_mean")]])
    return pa.Table.from_pylist(rows, schema=schema)


def _summary(rec: dict, mm, t: pa.Table, lt: pa.Table, seconds: float) -> dict:
    def count(c):
        return int(pc.sum(pc.cast(t.column(c).fill_null(False), pa.int64())).as_py() or 0)

    io = t.column("io_class").to_numpy(zero_copy_only=False)
    mined = t.column("tokens").null_count
    return {"layers": mm.n_layers, "d_m": mm.d_m, "memories": t.num_rows, "mined": t.num_rows - mined,
            "tokens": int(pc.max(t.column("tokens")).as_py() or 0), "lens": rec["lens"],
            "gated": bool(mm.gated), "eps": rec["eps"], "eps_used": rec["eps_used"],
            **{c: count(c) for c in ("dead", "rare", *VOCAB_CLASSES)},
            "io_classes": {c: int((io == c).sum()) for c in IO_CLASSES},
            "by_layer": {c: lt.column(c).to_pylist() for c in ("dead", "prediction", "suppression", "partition",
                                                               "enrichment", "depletion")},
            "seconds": round(seconds, 2)}


def compute_census(run, mm, settings=None, *, show_progress: bool | None = None, force: bool = False) -> dict:
    """The step through the lifecycle from Python (a run and its opened model); returns the summary."""
    from ffkv.steps.census import CensusSettings
    from ffkv.steps.lifecycle import execute

    s = settings if settings is not None else CensusSettings()
    out = execute(run, "census", s, mm=mm, force=force, show_progress=show_progress)
    return out.info["summary"]
