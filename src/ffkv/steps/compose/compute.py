"""`ffkv compose`: how memories compose into a layer's prediction, and layers into the model's.

The paper's §5 (Figs 7-11 and the last-layer cases), on N prefixes sampled from a held-out
corpus split: one sentence per prefix, one seeded random position per sentence (up to
`--per-sentence` K distinct positions of a sentence when the split has fewer sentences). One forward
pass per batch of prefixes captures r, m, y, o at every layer (only at each prefix's last
position); the vocabulary projections are batched per layer and reduced at once to argmaxes
and the probability of the final prediction, so nothing of size N × L × V is ever held.

Both lenses of `ffkv.model.memories.Lens` are evaluated on the same captures: "naive" (h·E, the
paper's projection) and "norm" (through the final norm; at the last layer it gives the model's
own logits). Every lens-dependent table has a `lens` column.

Notation, per example and layer ℓ (0-based): r the residual entering the FFN, m the memory
coefficients, y the FFN output, o = r + y; w = top(o_{L-1}), the final prediction under the lens.
top(h) = argmax of `Lens.logits(h)` (ties: lowest token id, torch's argmax). Below the last layer,
top(o) is read from r's and y's logits (`Lens.sum_top`: o = r + y in the lens's linear space), and o
is projected only for the rows whose derived top is within a float error bound of a rival; so it
equals the direct argmax (tests/test_sum_top.py), for a third fewer vocabulary products.

Definitions and choices
- Active memory: `is_active(m)` (m_i > 0, the paper's) and `is_active(m, eps)` (|m_i| > eps).
  On a mixture of experts d_m counts every expert's memories and m is 0 on experts a token is
  not routed to, so the active share is of all of them, at most memories_per_token / d_m (the
  report says so beside Fig 7).
- Mass: c_i = |m_i|·‖v_i‖₂. mass_top{1,10,50} = share of Σ c_i carried by the k largest c_i with
  k = ceil(p·d_m) for p = 1%, 10%, 50%.
- Value tops: top(v_i) = argmax `Lens.direction_logits(v_i)`; top(-v_i) = argmin of the same
  logits (negation is exact). Cached in the run as `value_tops`.
- Fig 8, paper's form (`y_matches_memory`): some memory with m_i > 0 has top(v_i) = top(y).
  Signed form (`y_matches_memory_eps`): some memory with |m_i| > eps has top(sign(m_i)·v_i) =
  top(y), since a negative coefficient (gated FFNs, GELU) writes -v_i. With eps = 0 the two agree.
- Fig 8, three variants side by side (issue 14), each with a shuffled baseline:
  `signed` (every memory with m_i ≠ 0: top(sign(m_i)·v_i) = top(y)); `code`, the paper's released
  code, which compares top(m_i·v_i) with top(o_ℓ) (the layer *output*, not the FFN output y its
  text names): every m_i ≠ 0, top(sign(m_i)·v_i) = top(o); `rel`, the signed form with an ε
  relative to the coefficients' scale: |m_i| > EPS_REL·max_j |m_j| (same example and layer), so
  the threshold follows the coefficients' growth with depth. Shuffled baseline of a variant: the
  same memories against the target of another example of the same batch (the batch's targets
  rolled by one; batches of one example have none, NaN). The pairing is one random draw: it
  depends on the length packing, so `batch_tokens` moves the baseline within its sampling error.
- Hub tokens: the ⌈HUB_SHARE·|V|⌉ tokens with the largest e_t·ē/‖ē‖ (ē the mean unembedding row),
  i.e. high norm and aligned with the mean; `fig8_hub_share` = share of the `rel` matches whose
  top(y) is a hub, `fig8_no_match_rel_nohub` = the `rel` no-match share over the examples whose
  top(y) is not a hub (the sensitivity check).
- Fig 7, scale-free: `n90` = the fewest memories whose c_i = |m_i|·‖v_i‖ carry 90% of Σ c_i.
- Fig 8 follow-up: among examples where some active memory matches (paper's form), the share
  whose target (the next token of the sentence) is a stop word (`src/ffkv/data/stopwords.txt`:
  decoded token, stripped, lower-cased, on the list) and the share whose prefix has fewer than
  5 tokens (`prefix_tokens` counts the tokens fed to the model, including a BOS if the
  tokenizer adds one).
- Fig 9: `r_matches_final` = top(r_ℓ) = w. The curve's end point is `o_matches_final` at the last
  layer (top(o_{L-1}) = w), which is 1 by construction; under the norm lens w is also exactly
  the model's own argmax. top(r_{L-1}) = w is *not* 1: it fails exactly on the last-layer cases.
- Fig 10: p_final_in_r = softmax(Lens.logits(r_ℓ))[w]; rank_final_in_r = `rank_of` (0 = top).
- Fig 11: category per (example, layer): residual top(o)=top(r)≠top(y); ffn top(o)=top(y)≠top(r);
  agreement all three equal; composition top(o) equals neither. These partition the examples.
  The paper's "by construction impossible" case top(r)=top(y)≠top(o) falls into composition and
  is counted separately as `r_eq_y_ne_o` (it can happen through the norm or an output bias).

Tables written to the run (public contract):
- `compose_sentences`: the `sentences` schema (see DEVELOPING.md) for the held-out corpus.
- `compose_prefixes`: example_id int32, sentence_id int64, text string (sentence), prefix string
  (decoded prefix), token_ids list<int32> (the prefix = sentence token_ids[:position + 1]),
  position int32, prefix_tokens int32, target int32 (token after the prefix), target_token string,
  target_is_stop bool.
- `value_tops`: the cache of `ffkv.memories.value_tops` (columns there); written here when the
  values step has not filled it already.
- `compose_examples`: one row per lens × layer × example, sorted so: lens string, layer int16,
  example_id int32, n_active int32 (m > 0), n_active_eps int32 (|m| > eps), mass_top1, mass_top10,
  mass_top50 float32, top_r, top_y, top_o, top_final int32, p_final_in_r float32,
  rank_final_in_r int32, category string, y_matches_memory bool, y_matches_memory_eps bool,
  n_agreeing int32 (active memories, paper's form, whose value top equals top(y)).
- `compose_layers`: per lens × layer: lens, layer, n_examples, d_m, eps, active_mean, active_p25,
  active_median, active_p75, active_min, active_max (fractions of d_m, m > 0), active_eps_mean,
  active_eps_median, mass_top1, mass_top10, mass_top50 (means), fig8_no_single_memory,
  fig8_no_single_memory_eps (fractions), fig8_matched, fig8_matched_stop, fig8_matched_short
  (counts), fig8_matched_stop_share, fig8_matched_short_share, r_matches_final, o_matches_final,
  p_final_mean, p_final_q25, p_final_median, p_final_q75, residual, ffn, agreement, composition,
  r_eq_y_ne_o (fractions); added by issue 14 (absent in older runs): n90_mean, n90_median,
  n90_p25, n90_p75 (counts of memories), fig8_no_match_signed, fig8_no_match_code,
  fig8_no_match_rel, fig8_shuffled_paper, fig8_shuffled_signed, fig8_shuffled_code,
  fig8_shuffled_rel (no-match shares under the shuffled pairing), fig8_shuffled_n (examples with a
  shuffled partner), fig8_hub_share, fig8_no_match_rel_nohub, fig8_n_nohub, n_hubs.
- `compose_cases`: last-layer cases, top(r_{L-1}) ≠ top(o_{L-1}): lens, sample_order int32 (a
  seeded random order; the first 100 are the paper's random sample), example_id, sentence_id,
  prefix, top_r, top_r_token, top_o, top_o_token, top_y, top_y_token, category (ffn or
  composition), target, target_token, p_final_in_r.
- `compose_lens_effect`: how much the lens changes each per-layer curve: quantity, naive, norm
  (means over layers), mean_abs_diff, max_abs_diff, layer_of_max; plus rows `w_differs` and
  `category_differs` (shares of examples / example-layers that differ; naive, norm null).

The step is `ffkv.steps.compose.STEP` (settings `ComposeSettings`), run through
`ffkv.steps.lifecycle.execute`; it needs no other step (a fresh run records the model it is given).
`ffkv.steps.compose.summary.print_summary` reads the tables back.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pyarrow as pa
import torch

from ffkv.corpus.stopwords import stopwords
from ffkv.defs import LENSES
from ffkv.errors import FfkvError
from ffkv.model.memories import is_active, lens_for, rank_of
from ffkv.steps.compose import DEFAULT_CORPUS, DEFAULT_EPS, ComposeSettings
from ffkv.steps.lifecycle import execute
from ffkv.memories.value_tops import value_tops  # the run's cache, shared with values
from ffkv.model import identity

CATEGORIES = ("residual", "ffn", "agreement", "composition")
FIG8_VARIANTS = ("signed", "code", "rel")
MASS_SHARES = (0.01, 0.10, 0.50)
SHORT_PREFIX = 5  # the paper's "prefix shorter than 5 tokens"
EPS_REL = 0.1  # Fig 8 relative form: |m_i| > EPS_REL · max_j |m_j| of the same example and layer
HUB_SHARE = 0.001  # hub tokens: the top 0.1% of the vocabulary by e_t · ē/‖ē‖ (norm × alignment with the mean)
SHARE_90 = 0.9  # Fig 7 scale-free: the fewest memories carrying 90% of Σ|m_i|·‖v_i‖
CURVES = ("fig8_no_single_memory", "r_matches_final", "p_final_mean", "residual", "ffn",
          "agreement", "composition")


# ---- stop words ----------------------------------------------------------------------------
def token_is_stop(tok, ids) -> np.ndarray:
    """Per token id: is its decoded text (stripped, lower-cased) a stop word."""
    ids = np.asarray(ids, dtype=np.int64)
    sw = stopwords()
    uniq = np.unique(ids)
    table = {int(u): tok.decode([int(u)]).strip().lower() in sw for u in uniq}
    return np.array([table[int(i)] for i in ids], dtype=bool)


def categorize(top_r, top_y, top_o) -> np.ndarray:
    """Fig 11 category index into CATEGORIES for each element (a partition)."""
    top_r, top_y, top_o = map(np.asarray, (top_r, top_y, top_o))
    r, y = top_o == top_r, top_o == top_y
    return np.select([r & ~y, y & ~r, r & y], [0, 1, 2], default=3).astype(np.int8)


# ---- prefixes ----------------------------------------------------------------------------
def spread_positions(lo: np.ndarray, hi: np.ndarray, n: int, per_sentence: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n distinct (sentence, position) pairs with lo[s] <= position < hi[s], when the sentences are
    too few for one each: a sentence gives a k-th prefix only once every sentence with room has
    given k - 1, and none gives more than `per_sentence`; fewer pairs when those run out.

    Returns (sentence index, position) sorted by sentence then position."""
    room = np.minimum(np.maximum(hi - lo, 0), per_sentence)
    take = np.zeros_like(room)
    for k in range(1, per_sentence + 1):  # round k: one more from each sentence with room for it
        can = np.flatnonzero(room >= k)
        left = n - int(take.sum())
        if left <= 0 or len(can) == 0:
            break
        take[can if len(can) <= left else rng.choice(can, size=left, replace=False)] += 1
    sent, pos = [], []
    for i in np.flatnonzero(take):
        sent.append(np.full(take[i], i))
        pos.append(np.sort(lo[i] + rng.choice(int(hi[i] - lo[i]), size=int(take[i]), replace=False)))
    if not sent:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(sent).astype(np.int64), np.concatenate(pos).astype(np.int64)


def sample_prefixes(run, mm, corpus: str | None, n: int, seed: int = 0,
                    max_sentences: int | None = None, warn=print, per_sentence: int = 1) -> pa.Table:
    """Sentences of the held-out split → `compose_sentences`; one seeded position per sampled
    sentence → `compose_prefixes`. A sentence is usable when it has a token after at least one
    real (non-special) token. With fewer usable sentences than `n`, up to `per_sentence`
    positions of a sentence (`spread_positions`); prefixes of one sentence are not independent,
    so that is a choice the user makes (`--per-sentence`)."""
    from ffkv.corpus.prepare import prepare_sentences

    if n < 1:
        raise FfkvError(f"--prefixes must be at least 1 (got {n})")
    spec = corpus or DEFAULT_CORPUS
    sents = prepare_sentences(run, mm, spec, max_sentences, seed=seed, table="compose_sentences")
    token_ids = sents.column("token_ids").to_pylist()
    special = set(getattr(mm.tok, "all_special_ids", []) or [])
    first = np.array([1 if t and t[0] in special else 0 for t in token_ids], dtype=np.int64)
    n_tok = np.array([len(t) for t in token_ids], dtype=np.int64)
    usable = np.flatnonzero(n_tok - first >= 2)
    if len(usable) == 0:
        raise FfkvError(f"corpus {spec!r} has no sentence of 2 or more tokens to make a prefix from")
    rng = np.random.default_rng(seed)
    if len(usable) >= n:
        chosen = np.sort(rng.choice(usable, size=n, replace=False))
        # one position per sentence: the prefix ends at `position`, the target follows it
        pos = rng.integers(first[chosen], n_tok[chosen] - 1)  # high exclusive: position ≤ n - 2
    elif per_sentence <= 1:
        warn(f"corpus {spec!r} has only {len(usable)} usable sentences (2+ tokens) for "
             f"{n} requested prefixes; using all {len(usable)} (--per-sentence K takes up to K from each)")
        chosen = usable
        pos = rng.integers(first[chosen], n_tok[chosen] - 1)
    else:
        at, pos = spread_positions(first[usable], n_tok[usable] - 1, n, per_sentence, rng)
        chosen = usable[at]
        per = np.bincount(at)
        several, most = int((per > 1).sum()), int(per.max())
        warn(f"corpus {spec!r} has {len(usable)} usable sentences (2+ tokens) for {n} requested prefixes; "
             f"{several} of them give {'2' if most == 2 else f'2 to {most}'} prefixes each, "
             f"{len(chosen)} prefixes in all")
    prefixes = [token_ids[s][: p + 1] for s, p in zip(chosen, pos)]
    targets = np.array([token_ids[s][p + 1] for s, p in zip(chosen, pos)], dtype=np.int64)
    texts = sents.column("text").to_pylist()
    tbl = pa.table({
        "example_id": pa.array(np.arange(len(chosen)), pa.int32()),
        "sentence_id": pa.array(sents.column("sentence_id").to_numpy()[chosen], pa.int64()),
        "text": pa.array([texts[s] for s in chosen], pa.string()),
        "prefix": pa.array(mm.tok.batch_decode(prefixes, skip_special_tokens=True), pa.string()),
        "token_ids": pa.array(prefixes, pa.list_(pa.int32())),
        "position": pa.array(pos, pa.int32()),
        "prefix_tokens": pa.array(pos + 1, pa.int32()),
        "target": pa.array(targets, pa.int32()),
        "target_token": pa.array([mm.tok.decode([int(t)]) for t in targets], pa.string()),
        "target_is_stop": pa.array(token_is_stop(mm.tok, targets), pa.bool_()),
    })
    run.write_table("compose_prefixes", tbl)
    return tbl


# ---- the pass ------------------------------------------------------------------------------
@torch.no_grad()
def analyze(mm, prefixes: list[list[int]], eps: float = DEFAULT_EPS, vtops=None,
            batch_tokens: int = 2048, max_batch: int = 128, rows: int = 384,
            bar=None) -> dict:
    """One forward pass per length-packed batch; per-example, per-layer arrays.

    Returns {"common": {name: (N, L) array}, "naive"/"norm": {name: (N, L) array, "w": (N,)},
    "tokens": int}. `rows` bounds the rows of one vocabulary projection (rows × V floats).
    """
    from ffkv.corpus.batching import pack
    from ffkv.model.onednn import fast_products

    with fast_products(getattr(mm, "device", None)):
        return _analyze(mm, prefixes, eps, vtops, batch_tokens, max_batch, rows, bar, pack)


def _analyze(mm, prefixes, eps, vtops, batch_tokens, max_batch, rows, bar, pack) -> dict:
    if vtops is None:
        vtops = value_tops(None, mm)
    N, L = len(prefixes), mm.n_layers
    lenses = {ln: lens_for(mm, ln) for ln in vtops}
    vnorm = torch.stack([mm.values(l).detach().float().norm(dim=-1) for l in range(L)]).to(mm.device)  # (L, d_m)
    common, per = _result_arrays(N, L, lenses)
    vt_dev = {ln: (p.to(mm.device), n.to(mm.device)) for ln, (p, n) in vtops.items()}
    lengths = [len(p) for p in prefixes]
    task = bar.add_task("compose", total=N, tokens=0) if bar is not None else None
    n_tokens = 0
    # r, y, o of one layer sit together as (3B, d) rows, one projection each; B ≤ rows / 3
    for idx in pack(lengths, batch_tokens, max(1, min(max_batch, rows // 3))):
        ryo, M = _capture(mm, [prefixes[i] for i in idx])
        _store(common, idx, _activity_and_mass(M, vnorm, eps))
        for ln, lens in lenses.items():
            _store(per[ln], idx, _lens_pass(lens, ryo, M, *vt_dev[ln], eps))
        n_tokens += int(sum(lengths[i] for i in idx))
        if task is not None:
            bar.update(task, advance=len(idx), tokens=n_tokens)
    return {"common": common, **per, "tokens": n_tokens}


def _result_arrays(N: int, L: int, lenses) -> tuple[dict, dict]:
    """The per-example, per-layer arrays `analyze` fills: common ones and one set per lens."""
    common = {k: np.zeros((N, L), np.int32) for k in ("n_active", "n_active_eps", "n90")}
    common.update({f"mass_top{round(p * 100)}": np.zeros((N, L), np.float32) for p in MASS_SHARES})
    per = {ln: {**{k: np.zeros((N, L), np.int32) for k in
                   ("top_r", "top_y", "top_o", "rank_final_in_r", "n_agreeing")},
                "p_final_in_r": np.zeros((N, L), np.float32),
                "y_matches_memory": np.zeros((N, L), bool),
                "y_matches_memory_eps": np.zeros((N, L), bool),
                **{f"fig8_{v}": np.zeros((N, L), bool) for v in FIG8_VARIANTS},
                **{f"fig8_shuf_{v}": np.zeros((N, L), np.int8) for v in ("paper",) + FIG8_VARIANTS},
                "w": np.zeros(N, np.int64)} for ln in lenses}
    return common, per


def _store(dst: dict, idx, src: dict) -> None:
    """Rows idx (the batch's examples) of each array in dst from the batch's arrays in src."""
    for k, v in src.items():
        dst[k][idx] = v


def _capture(mm, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass: r, y, o (L, 3, B, d) and m (L, B, d_m) at each prefix's last token."""
    L, B = mm.n_layers, len(batch)
    ids, mask = mm.batch(batch)
    last = torch.as_tensor([len(p) - 1 for p in batch], device=mm.device)
    ar = torch.arange(B, device=mm.device)
    ryo = torch.empty(L, 3, B, mm.d, device=mm.device)
    M = torch.empty(L, B, mm.d_m, device=mm.device)
    slot = {"r": 0, "y": 1, "o": 2}

    def keep(layer, name, t):
        (M[layer] if name == "m" else ryo[layer, slot[name]])[:] = t[ar, last]

    mm.capture(ids, mask, what=("r", "m", "y", "o"), callback=keep)
    return ryo, M


def _activity_and_mass(M: torch.Tensor, vnorm: torch.Tensor, eps: float) -> dict:
    """Fig 7 per (example, layer): active memories, and the share of Σ|m|·‖v‖ the top ones carry."""
    ks = [max(1, math.ceil(p * M.shape[-1])) for p in MASS_SHARES]
    out = {"n_active": is_active(M).sum(-1).T.cpu().numpy(),
           "n_active_eps": is_active(M, eps).sum(-1).T.cpu().numpy()}
    c = M.abs() * vnorm[:, None, :]  # (L, B, d_m)
    tot = c.sum(-1)
    csort = c.sort(dim=-1, descending=True).values.cumsum(-1)
    out["n90"] = ((csort < SHARE_90 * tot[..., None]).sum(-1) + 1).clamp(max=M.shape[-1]).T.cpu().numpy()
    cs = c.topk(max(ks), dim=-1).values.cumsum(-1)
    for p, k in zip(MASS_SHARES, ks):
        share = torch.where(tot > 0, cs[..., k - 1] / tot, torch.full_like(tot, float("nan")))
        out[f"mass_top{round(p * 100)}"] = share.T.cpu().numpy()
    return out


def _lens_pass(lens, ryo: torch.Tensor, M: torch.Tensor, vpos, vneg, eps: float) -> dict:
    """Under one lens, per (example, layer): top(r), top(y), top(o), the final prediction w and
    its probability and rank under r (Figs 9-11), and Fig 8's single-memory matches."""
    tops, w, pw, rk = _tops_and_final(lens, ryo)
    ty = tops[1]  # (L, B)
    hit = is_active(M) & (vpos[:, None, :] == ty[:, :, None])  # (L, B, d_m)
    stop = torch.where(M > 0, vpos[:, None, :], vneg[:, None, :])  # top(sign(m_i)·v_i)
    hit_eps = is_active(M, eps) & (stop == ty[:, :, None])
    return {"top_r": tops[0].T.cpu().numpy(), "top_y": tops[1].T.cpu().numpy(),
            "top_o": tops[2].T.cpu().numpy(), "w": w.cpu().numpy(),
            "p_final_in_r": pw.T.cpu().numpy(), "rank_final_in_r": rk.T.cpu().numpy(),
            "n_agreeing": hit.sum(-1).T.cpu().numpy(), "y_matches_memory": hit.any(-1).T.cpu().numpy(),
            "y_matches_memory_eps": hit_eps.any(-1).T.cpu().numpy(),
            **fig8_variants(M, vpos, stop, ty, tops[2])}


def fig8_variants(M: torch.Tensor, vpos, stop, ty, to) -> dict:
    """Fig 8's variants (module docstring) and their shuffled baselines, per (example, layer).

    M (L, B, d_m); vpos (L, d_m) top(v_i); stop (L, B, d_m) top(sign(m_i)·v_i); ty, to (L, B).
    Returns fig8_<variant> (B, L) bool (some memory matches) and fig8_shuf_<variant> (B, L) int8
    (1 match, 0 none, −1 no partner: a batch of one)."""
    B = M.shape[1]
    nz = M != 0
    rel = M.abs() > EPS_REL * M.abs().amax(-1, keepdim=True)
    sets = {"paper": (M > 0, vpos[:, None, :].expand_as(M), ty), "signed": (nz, stop, ty),
            "code": (nz, stop, to), "rel": (rel & nz, stop, ty)}
    out = {}
    for name, (act, tok, tgt) in sets.items():
        if name != "paper":
            out[f"fig8_{name}"] = (act & (tok == tgt[:, :, None])).any(-1).T.cpu().numpy()
        if B > 1:
            sh = (act & (tok == tgt.roll(1, dims=1)[:, :, None])).any(-1).T.cpu().numpy().astype(np.int8)
        else:
            sh = np.full((B, M.shape[0]), -1, np.int8)
        out[f"fig8_shuf_{name}"] = sh
    return out


def hub_tokens(mm, share: float = HUB_SHARE) -> np.ndarray:
    """Token ids of the hubs: the ⌈share·|V|⌉ largest e_t·ē/‖ē‖ over the unembedding rows e_t."""
    E = mm.lens.E.detach().float()  # the unembedding, the same under either lens
    mean = E.mean(0)
    score = E @ (mean / mean.norm().clamp(min=1e-12))
    k = max(1, math.ceil(share * E.shape[0]))
    return np.sort(score.topk(k).indices.cpu().numpy())


def _tops_and_final(lens, ryo: torch.Tensor):
    """(tops (3, L, B): top of r, y, o; w (B,): top(o) of the last layer; p(w | r) (L, B);
    rank of w under r (L, B)). The last layer is projected first: it defines w."""
    L, _, B, d = ryo.shape
    dev = ryo.device
    tops = torch.empty(3, L, B, dtype=torch.long, device=dev)
    pw = torch.empty(L, B, device=dev)
    rk = torch.zeros(L, B, dtype=torch.long, device=dev)
    w = None
    sums = lens.sums_exactly()
    for l in [L - 1] + list(range(L - 1)):
        # below the last layer, top(o) comes from the r and y rows' logits (o = r + y, `Lens.sum_top`),
        # so o is projected only where r's and y's sum leaves a near tie: a third fewer products
        derive = w is not None and sums
        z = lens.logits(ryo[l, :2 if derive else 3].reshape(-1, d))  # (3B or 2B, V): r, y (, o) rows
        t = z.max(-1).indices  # = argmax (the first maximum); a little faster on CPU
        if derive:
            to, ok = lens.sum_top([ryo[l, 0], ryo[l, 1]], [z[:B], z[B:]], ryo[l, 2])
            if not bool(ok.all()):
                off = (~ok).nonzero()[:, 0]
                to[off] = lens.logits(ryo[l, 2][off]).max(-1).indices
            t = torch.cat([t, to])
        tops[:, l] = t.view(3, B)
        if w is None:
            w = t[2 * B:]  # top(o) at the last layer
        zr = z[:B].float()
        pw[l] = torch.log_softmax(zr, -1).gather(-1, w[:, None])[:, 0].exp()
        # rank 0 where w is the argmax (ties: only logits strictly above count)
        off = (t[:B] != w).nonzero()[:, 0]
        if len(off):
            rk[l, off] = rank_of(zr[off], w[off])
    return tops, w, pw, rk


# ---- tables ------------------------------------------------------------------------------
def _q(x, q):
    x = np.asarray(x, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(np.quantile(x, q)) if len(x) else float("nan")


def _by_layer(a) -> np.ndarray:
    """(N, L) -> flat, ordered by layer, then example."""
    return np.ascontiguousarray(np.asarray(a).T).reshape(-1)


def build_tables(mm, res: dict, prefixes: pa.Table, eps: float, seed: int = 0) -> dict[str, pa.Table]:
    L, dm = mm.n_layers, mm.d_m
    lenses = [ln for ln in LENSES if ln in res]
    com = res["common"]
    is_stop = prefixes.column("target_is_stop").to_numpy(zero_copy_only=False).astype(bool)
    short = prefixes.column("prefix_tokens").to_numpy() < SHORT_PREFIX
    cats = {ln: categorize(res[ln]["top_r"], res[ln]["top_y"], res[ln]["top_o"]) for ln in lenses}  # (N, L)
    hubs = res.get("hubs")
    if hubs is None:
        hubs = hub_tokens(mm)
    layers_tbl = pa.Table.from_pylist([_layer_row(ln, l, res[ln], com, cats[ln], dm, eps, is_stop, short, hubs)
                                       for ln in lenses for l in range(L)])
    layers_tbl = layers_tbl.set_column(1, "layer", layers_tbl.column("layer").cast(pa.int16()))
    tables = {"compose_examples": pa.concat_tables([_examples_table(ln, res[ln], com, cats[ln]) for ln in lenses]),
              "compose_layers": layers_tbl,
              "compose_cases": pa.concat_tables([_cases_table(mm, ln, res[ln], cats[ln], prefixes, seed)
                                                 for ln in lenses])}
    if set(LENSES) <= set(lenses):
        tables["compose_lens_effect"] = lens_effect(layers_tbl, res, cats)
    return tables


def _examples_table(ln: str, r: dict, com: dict, cat: np.ndarray) -> pa.Table:
    """`compose_examples` rows of one lens."""
    N, L = cat.shape
    return pa.table({
        "lens": pa.array([ln] * (N * L), pa.string()),
        "layer": pa.array(_by_layer(np.tile(np.arange(L), (N, 1))), pa.int16()),
        "example_id": pa.array(_by_layer(np.tile(np.arange(N)[:, None], (1, L))), pa.int32()),
        "n_active": pa.array(_by_layer(com["n_active"]), pa.int32()),
        "n_active_eps": pa.array(_by_layer(com["n_active_eps"]), pa.int32()),
        **{f"mass_top{round(p * 100)}": pa.array(_by_layer(com[f"mass_top{round(p * 100)}"]), pa.float32())
           for p in MASS_SHARES},
        "top_r": pa.array(_by_layer(r["top_r"]), pa.int32()),
        "top_y": pa.array(_by_layer(r["top_y"]), pa.int32()),
        "top_o": pa.array(_by_layer(r["top_o"]), pa.int32()),
        "top_final": pa.array(_by_layer(np.repeat(r["w"][:, None], L, 1)), pa.int32()),
        "p_final_in_r": pa.array(_by_layer(r["p_final_in_r"]), pa.float32()),
        "rank_final_in_r": pa.array(_by_layer(r["rank_final_in_r"]), pa.int32()),
        "category": pa.DictionaryArray.from_arrays(pa.array(_by_layer(cat), pa.int8()),
                                                   pa.array(CATEGORIES)).cast(pa.string()),
        "y_matches_memory": pa.array(_by_layer(r["y_matches_memory"]), pa.bool_()),
        "y_matches_memory_eps": pa.array(_by_layer(r["y_matches_memory_eps"]), pa.bool_()),
        "n_agreeing": pa.array(_by_layer(r["n_agreeing"]), pa.int32()),
    })


def _layer_row(ln: str, l: int, r: dict, com: dict, cat: np.ndarray, dm: int, eps: float,
               is_stop: np.ndarray, short: np.ndarray, hubs: np.ndarray | None = None) -> dict:
    """The `compose_layers` row of one lens and layer."""
    N = cat.shape[0]
    act = com["n_active"][:, l] / dm
    act_e = com["n_active_eps"][:, l] / dm
    matched = r["y_matches_memory"][:, l]
    p = r["p_final_in_r"][:, l]
    tr, ty, to = r["top_r"][:, l], r["top_y"][:, l], r["top_o"][:, l]
    w = r["w"]
    share = lambda sel: float(sel.sum() / matched.sum()) if matched.any() else float("nan")  # noqa: E731
    return {
        "lens": ln, "layer": l, "n_examples": N, "d_m": dm, "eps": float(eps),
        "active_mean": float(act.mean()), "active_p25": _q(act, .25), "active_median": _q(act, .5),
        "active_p75": _q(act, .75), "active_min": float(act.min()), "active_max": float(act.max()),
        "active_eps_mean": float(act_e.mean()), "active_eps_median": _q(act_e, .5),
        **{f"mass_top{round(q * 100)}": float(np.nanmean(com[f"mass_top{round(q * 100)}"][:, l]))
           for q in MASS_SHARES},
        "fig8_no_single_memory": float((~matched).mean()),
        "fig8_no_single_memory_eps": float((~r["y_matches_memory_eps"][:, l]).mean()),
        "fig8_matched": int(matched.sum()),
        "fig8_matched_stop": int((matched & is_stop).sum()),
        "fig8_matched_short": int((matched & short).sum()),
        "fig8_matched_stop_share": share(matched & is_stop),
        "fig8_matched_short_share": share(matched & short),
        "r_matches_final": float((tr == w).mean()),
        "o_matches_final": float((to == w).mean()),
        "p_final_mean": float(p.mean()), "p_final_q25": _q(p, .25),
        "p_final_median": _q(p, .5), "p_final_q75": _q(p, .75),
        **{c: float((cat[:, l] == i).mean()) for i, c in enumerate(CATEGORIES)},
        "r_eq_y_ne_o": float(((tr == ty) & (to != tr)).mean()),
        **_scale_free_and_fig8(l, r, com, hubs),
    }


def _scale_free_and_fig8(l: int, r: dict, com: dict, hubs: np.ndarray | None) -> dict:
    """The issue-14 columns of a `compose_layers` row (module docstring)."""
    out = {}
    if "n90" in com:
        n90 = com["n90"][:, l].astype(np.float64)
        out.update(n90_mean=float(n90.mean()), n90_median=_q(n90, .5), n90_p25=_q(n90, .25), n90_p75=_q(n90, .75))
    if "fig8_rel" not in r:
        return out
    for v in FIG8_VARIANTS:
        out[f"fig8_no_match_{v}"] = float((~r[f"fig8_{v}"][:, l]).mean())
    for v in ("paper",) + FIG8_VARIANTS:
        sh = r[f"fig8_shuf_{v}"][:, l]
        ok = sh >= 0
        out[f"fig8_shuffled_{v}"] = float((sh[ok] == 0).mean()) if ok.any() else float("nan")
        out["fig8_shuffled_n"] = int(ok.sum())
    if hubs is not None:
        is_hub = np.isin(r["top_y"][:, l], hubs)
        m = r["fig8_rel"][:, l]
        out["fig8_hub_share"] = float((m & is_hub).sum() / m.sum()) if m.any() else float("nan")
        out["fig8_no_match_rel_nohub"] = float((~m[~is_hub]).mean()) if (~is_hub).any() else float("nan")
        out["fig8_n_nohub"] = int((~is_hub).sum())
        out["n_hubs"] = int(len(hubs))
    return out


def _cases_table(mm, ln: str, r: dict, cat: np.ndarray, prefixes: pa.Table, seed: int) -> pa.Table:
    """`compose_cases` of one lens: top(r) ≠ top(o) at the last layer, in a seeded random order."""
    ll = cat.shape[1] - 1
    sel = np.flatnonzero(r["top_r"][:, ll] != r["top_o"][:, ll])
    order = np.empty(len(sel), np.int64)
    order[np.random.default_rng(seed + 1).permutation(len(sel))] = np.arange(len(sel))
    dec = lambda ids: [mm.tok.decode([int(i)]) for i in ids]  # noqa: E731
    tr, to, ty = r["top_r"][sel, ll], r["top_o"][sel, ll], r["top_y"][sel, ll]
    take = pa.array(sel)
    case = pa.table({
        "lens": pa.array([ln] * len(sel), pa.string()),
        "sample_order": pa.array(order, pa.int32()),
        "example_id": pa.array(sel, pa.int32()),
        "sentence_id": prefixes.column("sentence_id").take(take),
        "prefix": prefixes.column("prefix").take(take),
        "top_r": pa.array(tr, pa.int32()), "top_r_token": pa.array(dec(tr), pa.string()),
        "top_o": pa.array(to, pa.int32()), "top_o_token": pa.array(dec(to), pa.string()),
        "top_y": pa.array(ty, pa.int32()), "top_y_token": pa.array(dec(ty), pa.string()),
        "category": pa.array([CATEGORIES[c] for c in cat[sel, ll]], pa.string()),
        "target": prefixes.column("target").take(take),
        "target_token": prefixes.column("target_token").take(take),
        "p_final_in_r": pa.array(r["p_final_in_r"][sel, ll], pa.float32()),
    })
    return case.sort_by([("sample_order", "ascending")])


def lens_effect(layers_tbl: pa.Table, res: dict, cats: dict) -> pa.Table:
    d = layers_tbl.to_pydict()
    lens = np.asarray(d["lens"])
    rows = []
    for q in CURVES:
        a = np.asarray(d[q], dtype=np.float64)
        nv, nm = a[lens == "naive"], a[lens == "norm"]
        diff = np.abs(nv - nm)
        rows.append({"quantity": q, "naive": float(nv.mean()), "norm": float(nm.mean()),
                     "mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max()),
                     "layer_of_max": int(diff.argmax())})
    rows.append({"quantity": "w_differs", "naive": None, "norm": None,
                 "mean_abs_diff": float((res["naive"]["w"] != res["norm"]["w"]).mean()),
                 "max_abs_diff": None, "layer_of_max": None})
    cd = cats["naive"] != cats["norm"]
    rows.append({"quantity": "category_differs", "naive": None, "norm": None,
                 "mean_abs_diff": float(cd.mean()), "max_abs_diff": float(cd.mean(0).max()),
                 "layer_of_max": int(cd.mean(0).argmax())})
    return pa.Table.from_pylist(rows, schema=pa.schema([
        ("quantity", pa.string()), ("naive", pa.float64()), ("norm", pa.float64()),
        ("mean_abs_diff", pa.float64()), ("max_abs_diff", pa.float64()), ("layer_of_max", pa.int32())]))


# ---- the step ------------------------------------------------------------------------------


def compute(ctx) -> dict:
    """Sample the prefixes, one pass over them, write the tables; returns the manifest's info."""
    from ffkv.corpus.batching import resolve_step_batch
    from ffkv.progress import progress

    run, s, mm = ctx.run, ctx.settings, ctx.model()
    if not run.manifest.get("model"):  # a fresh run: its model is the one loaded here
        identity.record_model(run, mm)
        ctx.record["model_unembed_sha256"] = run.manifest["model"]["unembed_sha256"]
        run.manifest["settings"]["compose"] = ctx.record
        run.save()
    t0 = time.time()
    prefixes = sample_prefixes(run, mm, s.corpus, s.n_prefixes, s.seed, s.max_sentences,
                               warn=ctx.warn, per_sentence=s.per_sentence)
    ids = prefixes.column("token_ids").to_pylist()
    with progress(None if ctx.show_progress is None else not ctx.show_progress) as bar:
        t1 = time.time()
        vt = value_tops(run, mm, LENSES, bar=bar)
        t2 = time.time()
        # r, y, o of a layer: 3 rows of the vocabulary projection per example
        bt, rows = resolve_step_batch(mm, s.batch_tokens, 2048, 128, row_bytes=3 * 4 * mm.vocab_size)
        res = analyze(mm, ids, eps=s.eps, vtops=vt, batch_tokens=bt, max_batch=rows, rows=3 * rows, bar=bar)
    t3 = time.time()
    tables = build_tables(mm, res, prefixes, s.eps, s.seed)
    for name, t in tables.items():
        run.write_table(name, t)
    return {"prefixes": len(ids), "prefixes_requested": s.n_prefixes, "batch_tokens": bt, "max_rows": rows,
            "prefix_sentences": len(set(prefixes.column("sentence_id").to_pylist())), "tokens": res["tokens"],
            "seconds_prepare": round(t1 - t0, 2), "seconds_value_tops": round(t2 - t1, 2),
            "seconds_pass": round(t3 - t2, 2),
            "tokens_per_second": round(res["tokens"] / max(t3 - t2, 1e-9), 1),
            "fig8_pooled": _fig8_pooled(tables["compose_layers"]),
            "last_layer_cases": {ln: int(sum(1 for x in tables["compose_cases"].column("lens").to_pylist() if x == ln))
                                 for ln in LENSES}}


def _fig8_pooled(layers: pa.Table) -> dict:
    """Per lens, Fig 8's follow-up pooled over layers: matched example-layers, and the shares of
    them with a stop-word target and with a short prefix."""
    lay = layers.to_pydict()
    pooled = {}
    for ln in LENSES:
        s = [i for i, x in enumerate(lay["lens"]) if x == ln]
        m = sum(lay["fig8_matched"][i] for i in s)
        pooled[ln] = {"fig8_matched": m,
                      "fig8_matched_stop_share": sum(lay["fig8_matched_stop"][i] for i in s) / m if m else None,
                      "fig8_matched_short_share": sum(lay["fig8_matched_short"][i] for i in s) / m if m else None}
    return pooled


def compose(run, mm, settings: ComposeSettings | None = None, *, force: bool = False,
            show_progress: bool | None = None, warn=print, **fields) -> dict:
    """Run the compose step into `run` with `settings` (or ComposeSettings(**fields)); returns
    {"skipped": bool, "info": manifest step info}."""
    s = settings if settings is not None else ComposeSettings(**fields)
    out = execute(run, "compose", s, mm=mm, force=force, show_progress=show_progress, warn=warn)
    return {"skipped": out.skipped, "info": out.info}
