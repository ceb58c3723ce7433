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
  variance of c_i (`numpy.var`). scipy's own float32 operations, shared by the three (`_moments`,
  tested equal to scipy bit for bit; Gurnee et al.'s own kurtosis helper had an operator-precedence
  slip). The cosines are float32 products (torch), the moments scipy's over those float32 vectors.
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

- Token and n-gram detectors (Voita et al. 2024), from the positive side's top triggers (`triggers`,
  sign +1; a trigger's last token is `sentences.token_ids[position]`, its bigram that token with the
  one before, the sentence's start counting as token −1). Voita's measure is the share of a
  neuron's activations on its top token type; without a second pass, the share of its top triggers
  stands in for it: `top_token` = the most common last token (ties: the smallest id), `token_share`
  = its share of the triggers, `ngram_share` = the most common bigram's share. token_detector when
  token_share ≥ `detector` and the memory has at least `MIN_TRIGGERS` triggers (`n_triggers`);
  ngram_detector likewise from ngram_share (an n-gram detector is also a token detector).
  Self-suppression (Voita: detectors suppress the token they detect): `self_rank` = the rank of
  top_token in the value's logits through the census's lens (`Lens.direction_logits`), counted from
  the low end (0 = the most suppressed; `rank_of` counting below), for token detectors only;
  self_suppressing when self_rank < `SELF_SUPPRESS` · |V| (|V| the logits' length).
- Positional (after Voita et al.): `key_stats.pos_hist` (sign +1: where each sentence's best
  coefficient sits, buckets 0, 1, 2-3, 4-7, …, `ffkv.mine.rules.pos_bucket`) against chance, the
  buckets of a uniformly random position of each sentence of `sentences` (the mean of each
  sentence's uniform bucket distribution, `position_baseline`). `pos_tv` = the total-variation
  distance between the memory's normalised pos_hist and chance; `pos_tv_chance` = the same for a
  multinomial draw of the memory's own sentence count from chance (shuffled positions;
  `numpy.random.default_rng(POS_SEED)`, memories in table order). positional when pos_tv ≥
  `positional` and pos_tv > 2 · pos_tv_chance, and not dead (a dead memory's ties put every
  sentence's best at position 0: a pos_tv near 1 that says nothing of position).

- Sign regimes (gated FFNs mined with `ffkv mine --regimes`; `ffkv.mine.regimes`): the share of a
  memory's activation mass Σ|m| in each (gate sign, input sign) combination, `regime_pp`,
  `regime_pn`, `regime_np`, `regime_nn` (copied from `sign_regimes`' shares), and `regime` the one
  with the most mass (pp, pn, np or nn; null without mass). Null for a run mined without --regimes.
- Chance baselines (what each share is read against in the report's verdicts):
  vocabulary moments: `CHANCE_DIRECTIONS` isotropic Gaussian directions of R^d (seeded
  `CHANCE_SEED`; a cosine does not depend on the norm, so "of the same norm" is implied), their
  cos(W_U, r) moments classed with the same thresholds: `prediction_chance`, `suppression_chance`,
  `partition_chance` (W_U is shared by the layers, so one draw serves every layer). Input-output
  classes: each layer's values shuffled among its memories (a seeded permutation per layer), the
  classes of (g_i, u_i, v_π(i)) (ungated: (k_i, v_π(i))): `enrichment_chance`, `depletion_chance` —
  stricter than independent random directions, since it keeps whatever direction the layer's keys
  and values share. Positional: `pos_tv_chance` (above).

Tables written (public contract; layers 0-based)
- `census`: one row per memory, by layer then dim. layer int16, dim int32, for a mixture of experts
  also expert int16, expert_dim int32 (`MemoryModel.expert_of`; the shared expert is expert E,
  after the E routed ones) and shared_expert bool (true on the shared expert's memories), then
  skew float32, kurtosis float32, variance float32, cos_gate_in float32, cos_gate_out float32,
  cos_in_out float32, tokens int64, active int64, dead bool, rare bool,
  prediction bool, suppression bool, partition bool, io_class string (one of `IO_CLASSES`),
  n_triggers int32, top_token int32, token_share float32, ngram_share float32, token_detector bool,
  ngram_detector bool, self_rank int32, self_suppressing bool (null unless a token detector), pos_tv
  float32, pos_tv_chance float32, positional bool (the detector columns null without positive
  triggers, the positional ones where not mined), regime_pp, regime_pn, regime_np, regime_nn float32
  and regime string (null unless mined with --regimes).
- `census_layers`: one row per layer. layer int16, memories int32, mined int32 (memories with key
  statistics), tokens int64, then float64 shares: dead and rare (of the mined memories; null when
  none was mined), prediction, suppression, partition and one column per class of `IO_CLASSES` (of
  all memories), then kurtosis_median, skew_median, cos_in_out_mean float64, then float64 shares:
  token_detector, ngram_detector (of the memories with triggers), self_suppressing (of the token
  detectors; null when none), positional (of the mined memories), then the chance baselines
  (float64 shares of all memories): prediction_chance, suppression_chance, partition_chance,
  enrichment_chance, depletion_chance, then the mean shares of the sign regimes over the layer's
  memories with mass, regime_pp, regime_pn, regime_np, regime_nn (null without --regimes).

`layer_census(mm, layer)` gives the weight columns and their classes for one layer (or some of
its memories) of any model, without a run.
"""
from __future__ import annotations

import math
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
DEFAULTS = {"kurtosis": 10.0, "partition": 2.0, "cos": 0.1, "detector": 0.5, "positional": 0.5}  # CensusSettings' defaults (a test holds them equal)


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


MIN_TRIGGERS = 5  # a detector needs at least this many positive triggers
SELF_SUPPRESS = 0.01  # self_suppressing: top token in the lowest 1% of the value's logits
POS_SEED = 0  # the shuffled-positions draw (pos_tv_chance)
CHANCE_SEED = 0  # the random directions and the shuffled pairings of the chance baselines
CHANCE_DIRECTIONS = 1024  # random directions whose vocabulary moments give the chance shares
REGIME_COLUMNS = ("regime_pp", "regime_pn", "regime_np", "regime_nn")
CHANCE_COLUMNS = ("prediction_chance", "suppression_chance", "partition_chance", "enrichment_chance",
                  "depletion_chance")
DETECTOR_COLUMNS = ("n_triggers", "top_token", "token_share", "ngram_share", "token_detector", "ngram_detector",
                    "self_rank", "self_suppressing", "pos_tv", "pos_tv_chance", "positional")

WORKERS = 2  # threads running the moments (numpy lets go of the GIL), beside torch's own
# rows at a time: the temporaries (a few × 16 × |V| float32, 3 MB each for SmolLM2) stay below glibc's mmap
# threshold, so they are reused, not mapped and faulted in each time (at 64 rows: 4x the page faults, +0.4 s of
# system time per SmolLM2 layer)
SCIPY_ROWS = 16


def _moments(C: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scipy's skew and excess kurtosis, and numpy's variance, of each row of C (n, V) float32: the
    same float32 operations as `scipy.stats.skew` / `kurtosis` (scipy 1.17's `_moment`: d = c − mean,
    m2 = mean(d²), m3 = mean(d²·d), m4 = mean((d²)²), NaN where m2 ≤ (eps·mean)²) and `ndarray.var`
    (= m2), done once instead of once per statistic: equal bit for bit (a test holds them equal to
    scipy's), 10x less time than the three calls, whose own overhead and repeated passes dominated."""
    out = np.empty((3, len(C)), np.float32)
    eps = np.finfo(np.float32).eps
    for a in range(0, len(C), SCIPY_ROWS):
        c = np.asarray(C[a:a + SCIPY_ROWS], np.float32)
        mean = c.mean(axis=1, keepdims=True)
        d = c - mean
        d2 = d ** 2
        m2 = d2.mean(axis=1)
        d *= d2
        m3 = d.mean(axis=1)
        d2 **= 2
        m4 = d2.mean(axis=1)
        with np.errstate(all="ignore"):
            zero = m2 <= (eps * mean[:, 0]) ** 2
            out[0, a:a + len(c)] = np.where(zero, np.nan, m3 / m2 ** 1.5)
            out[1, a:a + len(c)] = np.where(zero, np.nan, m4 / m2 ** 2.0) - 3
        out[2, a:a + len(c)] = m2
    return out[0], out[1], out[2]


def weight_stats(mm, layer: int, W, chunk: int = 512, dims=None, advance=None, bufs: list | None = None
                 ) -> dict[str, np.ndarray]:
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
        # `bufs`: a list kept by the caller across layers, so the buffers (200 MB for SmolLM2) are
        # allocated and faulted in once, not once per layer
        bufs = [] if bufs is None else bufs
        if (len(bufs) < (2 if n > chunk else 1) or bufs[0].shape != (chunk, W.shape[0])
                or bufs[0].device != Vn.device):
            bufs[:] = [torch.empty(chunk, W.shape[0], dtype=torch.float32, device=Vn.device)
                       for _ in range(2 if n > chunk else 1)]
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


def vocab_chance(mm, W, kurtosis: float, partition: float, n: int = CHANCE_DIRECTIONS,
                 seed: int = CHANCE_SEED) -> dict[str, float]:
    """The vocabulary classes' chance shares: those of `n` seeded isotropic random directions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    R = _unit(torch.randn(n, mm.d, generator=g)).to(W.device)
    sk, ku, va = (np.concatenate(x) for x in zip(*(_moments((R[a:a + 128] @ W.T).cpu().numpy())
                                                   for a in range(0, n, 128))))
    cl = vocab_classes({"skew": sk, "kurtosis": ku, "variance": va}, mm.d, kurtosis, partition)
    return {f"{c}_chance": float(v.mean()) for c, v in cl.items()}


def io_chance(mm, layer: int, tau: float, seed: int = CHANCE_SEED) -> dict[str, float]:
    """The enrichment and depletion shares of `layer` with its values shuffled among its memories."""
    import torch

    V, K, U = mm.values(layer), mm.keys(layer), mm.up_keys(layer)
    perm = torch.from_numpy(np.random.default_rng([seed, int(layer)]).permutation(len(V))).to(V.device)
    Vn, Kn = _unit(V[perm]), _unit(K)
    if U is None:
        io = io_classes(None, None, (Kn * Vn).sum(1).cpu().numpy(), tau, False)
    else:
        Un = _unit(U)
        io = io_classes((Kn * Un).sum(1).cpu().numpy(), (Kn * Vn).sum(1).cpu().numpy(),
                        (Un * Vn).sum(1).cpu().numpy(), tau, True)
    return {f"{c}_chance": float((io == c).mean()) for c in ("enrichment", "depletion")}


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


# ---- detectors and position (the triggers, the sentences, pos_hist) -------------------------------
def _sentence_tokens(run):
    """(sentence_ids sorted, their row order, flat token ids, row offsets, lengths) of `sentences`."""
    from ffkv.corpus.tokens import flat_lists
    from ffkv.store import query

    st = query.table(run, "sentences", columns=["sentence_id", "token_ids"])
    sid = st.column("sentence_id").to_numpy()
    flat, offs = flat_lists(st.column("token_ids"))
    order = np.argsort(sid, kind="stable")
    return sid[order], order, flat.astype(np.int64), offs, np.diff(offs)


def _modes(key: np.ndarray, *cols: np.ndarray):
    """Per distinct key: (key, total, the most common tuple's count, that tuple), ties to the smallest tuple.
    (key, *cols) packed into one int64 code where it fits: one sort, the rest linear (lexsort and
    the per-group sorts took 1.4 s of SmolLM2's census)."""
    lo = [int(x.min()) for x in cols] if len(key) else [0] * len(cols)
    span = [int(x.max()) - a + 1 for x, a in zip(cols, lo)] if len(key) else [1] * len(cols)
    inner = math.prod(span)
    if not len(key) or (int(key.max()) + 1) * inner >= 2 ** 62:
        return _modes_lexsort(key, *cols)
    code = key.astype(np.int64)
    for x, a, n in zip(cols, lo, span):
        code = code * n + (x.astype(np.int64) - a)
    code.sort()
    new = np.ones(len(code), bool)
    new[1:] = code[1:] != code[:-1]
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, len(code)))
    gk = code[starts] // inner  # ascending: the groups of one key are consecutive
    seg = np.flatnonzero(np.r_[True, gk[1:] != gk[:-1]])
    seg_len = np.diff(np.append(seg, len(gk)))
    top = np.maximum.reduceat(sizes, seg)
    cand = np.flatnonzero(sizes == np.repeat(top, seg_len))  # the largest groups, by tuple
    sid = np.repeat(np.arange(len(seg)), seg_len)[cand]
    best = cand[np.r_[True, sid[1:] != sid[:-1]]]  # the smallest tuple among them
    rest, tup = code[starts[best]] % inner, []
    for x, a, n in zip(reversed(cols), reversed(lo), reversed(span)):
        tup.append((rest % n + a).astype(x.dtype))
        rest = rest // n
    return gk[seg], np.add.reduceat(sizes, seg), top, tup[::-1]


def _modes_lexsort(key: np.ndarray, *cols: np.ndarray):
    """`_modes` by lexsort, for codes past int64."""
    order = np.lexsort((*reversed(cols), key))
    k, c = key[order], [x[order] for x in cols]
    n = len(k)
    new = np.ones(n, bool)
    new[1:] = k[1:] != k[:-1]
    for x in c:
        new[1:] |= x[1:] != x[:-1]
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, n))
    gk = k[starts]
    o = np.lexsort((starts, -sizes, gk))
    first = np.ones(len(o), bool)
    first[1:] = gk[o][1:] != gk[o][:-1]
    best = o[first]
    keys, total = np.unique(k, return_counts=True)
    return keys, total, sizes[best], [x[starts[best]] for x in c]


def detector_stats(run, L: int, d_m: int, sents=None) -> dict[str, np.ndarray]:
    """n_triggers, top_token, token_share, ngram_share (L·d_m,) from the positive side's triggers
    (module docstring); n_triggers 0 and the rest -1/NaN where a memory has none."""
    from ffkv.store import query

    ss, order, flat, offs, _ = sents if sents is not None else _sentence_tokens(run)
    tr = query.table(run, "triggers", columns=["layer", "dim", "sign", "sentence_id", "position"])
    pos_side = tr.column("sign").to_numpy() == 1
    key = tr.column("layer").to_numpy()[pos_side].astype(np.int64) * d_m + tr.column("dim").to_numpy()[pos_side]
    sid = tr.column("sentence_id").to_numpy()[pos_side]
    p = tr.column("position").to_numpy()[pos_side].astype(np.int64)
    at = np.searchsorted(ss, sid)
    if len(sid) and ((at >= len(ss)) | (ss[np.minimum(at, len(ss) - 1)] != sid)).any():
        raise FfkvError("the triggers name sentences the run's `sentences` table does not hold")
    start = offs[order[at]] if len(at) else np.zeros(0, np.int64)
    tok = flat[start + p]
    prev = np.where(p > 0, flat[np.maximum(start + p - 1, 0)], -1)
    out = {"n_triggers": np.zeros(L * d_m, np.int32), "top_token": np.full(L * d_m, -1, np.int64),
           "token_share": np.full(L * d_m, np.nan, np.float32), "ngram_share": np.full(L * d_m, np.nan, np.float32)}
    if not len(key):
        return out
    keys, total, top, (tt,) = _modes(key, tok)
    out["n_triggers"][keys] = total
    out["top_token"][keys] = tt
    out["token_share"][keys] = top / total
    keys2, total2, top2, _ = _modes(key, prev, tok)
    out["ngram_share"][keys2] = top2 / total2
    return out


def self_ranks(mm, lens: str, key: np.ndarray, token: np.ndarray, chunk: int = 512) -> tuple[np.ndarray, int]:
    """The rank of `token` in each memory's value logits (memory = layer·d_m + dim) from the low end,
    and the vocabulary's length; logits only for these memories."""
    import torch

    from ffkv.model.memories import lens_for, rank_of

    ln = lens_for(mm, check_lens(lens))
    out = np.zeros(len(key), np.int64)
    vocab = int(ln.E.shape[0])
    for l in np.unique(key // mm.d_m):
        idx = np.flatnonzero(key // mm.d_m == l)
        V = mm.values(int(l))
        for a in range(0, len(idx), chunk):
            i = idx[a:a + chunk]
            rows = V[torch.as_tensor(key[i] % mm.d_m, device=V.device)]
            lg = ln.direction_logits(rows)
            low = torch.ones(len(i), dtype=torch.bool, device=lg.device)  # rank from the low end
            out[i] = rank_of(lg, torch.as_tensor(token[i], device=lg.device), below=low).cpu().numpy()
    return out, vocab


def pos_edges(npos: int) -> tuple[np.ndarray, np.ndarray]:
    """Each position bucket's [lo, hi): 0, 1, 2-3, 4-7, …, the last one open (`ffkv.mine.rules.pos_bucket`)."""
    lo = np.array([0] + [1 << (b - 1) for b in range(1, npos)], np.int64)
    hi = np.append(lo[1:], np.iinfo(np.int64).max)
    return lo, hi


def position_baseline(lengths: np.ndarray, npos: int) -> np.ndarray:
    """(npos,) where a uniformly random position of each sentence falls, averaged over the sentences."""
    n = np.asarray(lengths, np.int64)
    n = n[n > 0]
    lo, hi = pos_edges(npos)
    counts = np.clip(n[:, None], lo, hi) - lo
    return (counts / n[:, None]).mean(0) if len(n) else np.full(npos, np.nan)


def _tv(h: np.ndarray, base: np.ndarray) -> np.ndarray:
    tot = h.sum(1, keepdims=True)
    return 0.5 * np.abs(h / np.where(tot > 0, tot, 1) - base).sum(1)


def position_stats(run, L: int, d_m: int, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pos_tv, pos_tv_chance) (L·d_m,) float32, NaN where not mined (module docstring)."""
    from ffkv.store import query

    ks = query.table(run, "key_stats", columns=["layer", "dim", "sign", "pos_hist"])
    plus = ks.column("sign").to_numpy() == 1
    ks = ks.filter(pa.array(plus))
    tv, chance = np.full(L * d_m, np.nan, np.float32), np.full(L * d_m, np.nan, np.float32)
    if not ks.num_rows:
        return tv, chance
    key = ks.column("layer").to_numpy().astype(np.int64) * d_m + ks.column("dim").to_numpy()
    from ffkv.corpus.tokens import flat_lists

    flat, _ = flat_lists(ks.column("pos_hist"))
    h = flat.astype(np.int64).reshape(ks.num_rows, -1)  # every row holds NPOS buckets
    base = position_baseline(lengths, h.shape[1])
    n = h.sum(1)
    ok = n > 0
    o = np.argsort(key, kind="stable")  # the draws in table order, whatever key_stats's order
    draw = np.zeros_like(h)
    draw[o[ok[o]]] = np.random.default_rng(POS_SEED).multinomial(n[o][ok[o]], base / base.sum())
    tv[key[ok]] = _tv(h[ok], base)
    chance[key[ok]] = _tv(draw[ok], base)
    return tv, chance


def detector_columns(run, mm, rec: dict, dead: np.ndarray) -> dict[str, pa.Array]:
    """The census's `DETECTOR_COLUMNS` for every memory, in table order; `dead` (L·d_m,) bool."""
    L, d_m = mm.n_layers, mm.d_m
    sents = _sentence_tokens(run)
    ds = detector_stats(run, L, d_m, sents)
    has = ds["n_triggers"] > 0
    enough = ds["n_triggers"] >= MIN_TRIGGERS
    tok_det = enough & (ds["token_share"] >= rec["detector"])
    ngram_det = enough & (ds["ngram_share"] >= rec["detector"])
    key = np.flatnonzero(tok_det)
    rank = np.full(L * d_m, -1, np.int64)
    vocab = 1
    if len(key):
        rank[key], vocab = self_ranks(mm, rec["lens"], key, ds["top_token"][key])
    tv, chance = position_stats(run, L, d_m, sents[4])
    mined = ~np.isnan(tv)
    return {"n_triggers": pa.array(ds["n_triggers"], pa.int32()),
            "top_token": pa.array(ds["top_token"], pa.int32(), mask=~has),
            "token_share": _f32(ds["token_share"]), "ngram_share": _f32(ds["ngram_share"]),
            "token_detector": pa.array(tok_det, mask=~has), "ngram_detector": pa.array(ngram_det, mask=~has),
            "self_rank": pa.array(rank, pa.int32(), mask=~tok_det),
            "self_suppressing": pa.array(rank < SELF_SUPPRESS * vocab, mask=~tok_det),
            "pos_tv": _f32(tv), "pos_tv_chance": _f32(chance),
            "positional": pa.array((tv >= rec["positional"]) & (tv > 2 * chance) & ~dead, mask=~mined)}


# ---- the step -----------------------------------------------------------------------------------------
def regime_columns(run, L: int, d_m: int) -> dict[str, pa.Array]:
    """The sign regimes' shares per memory (module docstring), null where the run has none."""
    shares = np.full((4, L * d_m), np.nan, np.float32)
    if run.has_table("sign_regimes"):
        from ffkv.store import query

        t = query.sign_regimes(run)
        at = t.column("layer").to_numpy().astype(np.int64) * d_m + t.column("dim").to_numpy().astype(np.int64)
        for r, c in enumerate(REGIME_COLUMNS):
            shares[r, at] = t.column(c.replace("regime", "share")).to_numpy(zero_copy_only=False).astype(np.float32)
    from ffkv.mine.regimes import REGIMES

    assert REGIME_COLUMNS == tuple(f"regime_{r}" for r in REGIMES)
    ok = ~np.isnan(shares).any(0)
    best = np.array(list(REGIMES), dtype=object)[np.argmax(np.where(ok, shares, 0), 0)]
    return {**{c: _f32(shares[r]) for r, c in enumerate(REGIME_COLUMNS)},
            "regime": pa.array(best, pa.string(), mask=~ok)}


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
            "detector": float(s.detector), "min_triggers": MIN_TRIGGERS, "self_suppress": SELF_SUPPRESS,
            "positional": float(s.positional), "pos_seed": POS_SEED, "chance_seed": CHANCE_SEED,
            "chance_directions": CHANCE_DIRECTIONS,
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
    from ffkv.progress import progress

    t0 = time.time()
    L, d_m = mm.n_layers, mm.d_m
    W = unembedding_rows(mm, rec["lens"])
    per, bufs = [], []
    chunk = max(1, min(chunk, d_m))
    with progress(disable=None if show_progress is None else not show_progress) as bar:
        task = bar.add_task(f"census: values against the vocabulary ({rec['lens']} lens)",
                            total=L * math.ceil(d_m / chunk))
        for l in range(L):
            per.append(weight_stats(mm, l, W, chunk, advance=lambda: bar.advance(task), bufs=bufs))
    vc = vocab_chance(mm, W, rec["kurtosis"], rec["partition"], rec.get("chance_directions", CHANCE_DIRECTIONS),
                      rec.get("chance_seed", CHANCE_SEED))
    chance = [{**vc, **io_chance(mm, l, rec["cos"], rec.get("chance_seed", CHANCE_SEED))} for l in range(L)]
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
    for name, arr in detector_columns(run, mm, rec, dead).items():
        t = t.append_column(name, arr)
    for name, arr in regime_columns(run, L, d_m).items():
        t = t.append_column(name, arr)
    lt = _layer_table(t, L, chance)
    run.write_table("census", t)
    run.write_table("census_layers", lt)
    return _summary(rec, mm, t, lt, time.time() - t0)


def _layer_table(t: pa.Table, L: int, chance: list[dict] | None = None) -> pa.Table:
    layer = t.column("layer").to_numpy()
    mined = t.column("tokens").is_valid().to_numpy(zero_copy_only=False)
    tokens = t.column("tokens").fill_null(0).to_numpy()
    flag = {c: t.column(c).fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
            for c in ("dead", "rare", *VOCAB_CLASSES)}
    io = t.column("io_class").to_numpy(zero_copy_only=False)
    num = {c: t.column(c).to_numpy(zero_copy_only=False).astype(np.float64) for c in ("kurtosis", "skew", "cos_in_out")}
    def valid(c):
        return t.column(c).is_valid().to_numpy(zero_copy_only=False)

    extra = {c: t.column(c).fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
             for c in ("token_detector", "ngram_detector", "self_suppressing", "positional")}
    has, det, pmined = valid("token_detector"), extra["token_detector"], valid("positional")
    reg = {c: t.column(c).to_numpy(zero_copy_only=False).astype(np.float64) for c in REGIME_COLUMNS
           if c in t.column_names}
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
        for c, base in (("token_detector", has[at]), ("ngram_detector", has[at]),
                        ("self_suppressing", det[at]), ("positional", pmined[at])):
            row[c] = float(extra[c][at][base].mean()) if base.any() else None
        row.update({c: (chance[l][c] if chance else None) for c in CHANCE_COLUMNS})
        for c in REGIME_COLUMNS:
            v = reg[c][at] if c in reg else np.array([])
            v = v[~np.isnan(v)]
            row[c] = float(v.mean()) if len(v) else None
        rows.append(row)
    schema = pa.schema([("layer", pa.int16()), ("memories", pa.int32()), ("mined", pa.int32()), ("tokens", pa.int64()),
                        *[(c, pa.float64()) for c in ("dead", "rare", *VOCAB_CLASSES, *IO_CLASSES,
                                                      "kurtosis_median", "skew_median", "cos_in_out_mean",
                                                      "token_detector", "ngram_detector", "self_suppressing",
                                                      "positional", *CHANCE_COLUMNS, *REGIME_COLUMNS)]])
    return pa.Table.from_pylist(rows, schema=schema)


def _summary(rec: dict, mm, t: pa.Table, lt: pa.Table, seconds: float) -> dict:
    def count(c):
        return int(pc.sum(pc.cast(t.column(c).fill_null(False), pa.int64())).as_py() or 0)

    io = t.column("io_class").to_numpy(zero_copy_only=False)
    mined = t.column("tokens").null_count
    return {"layers": mm.n_layers, "d_m": mm.d_m, "memories": t.num_rows, "mined": t.num_rows - mined,
            "tokens": int(pc.max(t.column("tokens")).as_py() or 0), "lens": rec["lens"],
            "gated": bool(mm.gated), "eps": rec["eps"], "eps_used": rec["eps_used"],
            **{c: count(c) for c in ("dead", "rare", *VOCAB_CLASSES, "token_detector", "ngram_detector",
                                     "self_suppressing", "positional")},
            "with_triggers": t.num_rows - t.column("token_detector").null_count,
            "detector": rec["detector"], "positional_tv": rec["positional"],
            "io_classes": {c: int((io == c).sum()) for c in IO_CLASSES},
            "by_layer": {c: lt.column(c).to_pylist() for c in ("dead", "prediction", "suppression", "partition",
                                                               "enrichment", "depletion", "token_detector",
                                                               "positional")},
            "seconds": round(seconds, 2)}


def compute_census(run, mm, settings=None, *, show_progress: bool | None = None, force: bool = False) -> dict:
    """The step through the lifecycle from Python (a run and its opened model); returns the summary."""
    from ffkv.steps.census import CensusSettings
    from ffkv.steps.lifecycle import execute

    s = settings if settings is not None else CensusSettings()
    out = execute(run, "census", s, mm=mm, force=force, show_progress=show_progress)
    return out.info["summary"]


# the classes a memory can be in, by the census's own names (flag columns, then `io_class`'s values)
CLASSES = ("dead", "rare", *VOCAB_CLASSES, *IO_CLASSES, "token_detector", "ngram_detector", "self_suppressing",
           "positional")


def in_class(t: pa.Table, name: str) -> np.ndarray:
    """THE members of census class `name` (one of `CLASSES`), a bool per row of a `census` table: its
    flag is true (null, e.g. not mined, is not in it), or for an input-output class `io_class` is it.
    Every filter and class count of the browser reads this, so a count and its list agree.
    KeyError for a name that is no class or a column the table lacks (a census from before it)."""
    if name in IO_CLASSES:
        return pc.equal(t.column("io_class"), name).fill_null(False).to_numpy(zero_copy_only=False)
    if name not in CLASSES:
        raise KeyError(name)
    return t.column(name).fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
