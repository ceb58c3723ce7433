"""`ffkv values`: read every value (and key) as a distribution over the vocabulary (paper §4).

p^ℓ_i = softmax(v^ℓ_i · E) through the run's lens (`Lens.direction_logits`: the paper's naive E,
or E after the final norm's gain). Values are processed in chunks of rows, so nothing of size
L × d_m × V is ever held: peak extra memory is one (chunk × V) float32 buffer (at most
`MAX_LOGIT_BYTES`) and two (128 × V) ones.

Definitions used here
- top-1 trigger of key (ℓ, i): the `triggers` row with rank == 1. With both lists present
  (sign +1 and sign −1) it is the one of the two rank-1 rows with the larger |coef|; a tie goes
  to sign +1. With only one list, that list's rank-1 row. Keys without any rank-1 row are
  excluded and counted (`n_no_trigger`); so are keys whose top-1 row has a null next_token (the
  prefix ends its sentence; counted in `n_sentence_end`). There is no fall-back to the other list.
- direction s_i: +1 when that trigger's coef ≥ 0 (the memory writes v_i; a zero coef keeps the
  paper's v_i), −1 when coef < 0 (it writes −v_i). The value distribution compared is that of
  s_i·v_i.
- agreement: top(s_i·v_i) == next_token of the top-1 trigger. top = the largest logit (ties:
  the lower token id; `ffkv.steps.values.rows.tails`); rank = `rank_of` (number of logits
  strictly above the target), so rank 0 ⇔ agreement except for exact float ties.
- shuffled-pairing baseline: per layer, R seeded permutations π of the values (key i paired
  with value π(i), same direction s_i and target); `shuffled` is the mean agreement over the R
  permutations, its interval the 2.5/97.5 percentiles over them, `shuffled_p` the permutation
  p-value (1 + #{perm ≥ observed}) / (1 + R). `shuffled_rank_median` uses permutation 0.
- random baseline: 1/|V| (a uniformly random top token).
- 95% intervals on agreement rates: Wilson score intervals
  (`scipy.stats.binomtest(k, n).proportion_ci(method="wilson")`).
- entropy: nats, −Σ p log p of softmax(logits) in float32, from the shifted log-sum-exp.
- Table 2: the `table2_n` highest max-probability written directions over all layers. Kinds:
  `value` only (the paper), or `value` and `neg_value` (auto: when the run has negative trigger
  lists, i.e. was mined with `--negative`, as suits gated models whose coefficients are
  signed). precision@k = (# of the key's rank ≤ k triggers of the matching sign — +1 for v_i,
  −1 for −v_i — whose next_token equals the direction's top token) / (# of those triggers
  present, ≤ k; a null next_token counts as not matching). The example is the
  best-ranked matching trigger.

Tables written (public contract; layers 0-based)
- `values`: layer int16, dim int32, kind string ∈ {value, neg_value, key}, top_tokens
  list<int32> (top-k by probability), top_probs list<float32>, max_prob float32, entropy float32.
  `key` is the (gate) key k_i read through the same lens (Dar et al.). Sorted by layer, dim, kind
  in that order.
- `values_agreement`: one row per memory. layer int16, dim int32, trigger_sign int8,
  trigger_coef float32, sentence_id int64, position int32, next_token int32, direction int8,
  value_top int32 (top of s_i·v_i), max_prob float32 (of s_i·v_i), target_prob float32,
  rank int32, agree bool. Trigger columns null when the key has no trigger; direction,
  value_top and max_prob null then too; target_prob, rank and agree null when the memory is
  excluded (no trigger or null next_token).
- `values_layers`: per layer. layer int16, n_memories, n_no_trigger, n_sentence_end, n (evaluated),
  n_neg (compared with −v_i), n_agree, agreement, ci_low, ci_high, shuffled, shuffled_ci_low,
  shuffled_ci_high, shuffled_p, random_baseline, rank_mean, rank_q10, rank_q25, rank_median,
  rank_q75, rank_q90, shuffled_rank_median, frac_rank_lt10, value_max_prob_mean,
  value_entropy_mean, key_max_prob_mean, key_entropy_mean.
- `values_rank_hist` (Fig 5): layer int16, bin int16, lo int32, hi int32 (rank in [lo, hi)),
  count int64, shuffled_count int64 (permutation 0). Bins: [0,1), [1,2), [2,4), [4,8), … up to |V|.
- `values_fig6` (Fig 6): bin int16, lo, hi (max_prob edges; quantile bins over the evaluated
  memories, pooled over layers; a value falls in [lo, hi), the last bin includes hi), n, n_agree,
  agreement, ci_low, ci_high, mean_max_prob.
- `values_table2`: position int16 (1 = highest max_prob), layer int16, dim int32, kind, direction
  int8, max_prob float32, top_token int32, top_token_text, n_examples int32, n_agree int32,
  precision float32 (precision@k), example_rank int16, example_sentence_id int64,
  example_position int32, example_coef float32, example_text (the decoded prefix; null without
  a `sentences` table or without a match).
- Both lenses (issue 14): with `both_lenses` (the default) the values are projected a second time
  through the other lens (the paper's naive v·E when the run's lens is norm; keys are not
  re-projected). `values_lenses` = `values_layers` with a leading `lens` column, one block per lens
  (the run's lens first, equal to `values_layers`); `values_fig6_lenses` and `values_table2_lenses`
  likewise for `values_fig6` and `values_table2` (`example_text` null for the other lens).
  The other lens's key columns (key_max_prob_mean, key_entropy_mean) are null.
- `value_index`: the token → memories inverse index of `ffkv.memories.value_index` (k = 20),
  fed from the same projections (no extra pass), for every lens projected.
- `frac_rank_lt100` (in `values_layers`): the share of evaluated memories with rank < 100.
The step is `ffkv.steps.values.STEP` (settings `ValuesSettings`), run through
`ffkv.steps.lifecycle.execute`; its summary (the dict `compute_values` returns) is stored in the
manifest under steps.values.summary; `ffkv.steps.values.summary.format_summary` prints it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ffkv.defs import canonical_dtype, check_lens, other_lens, wilson
from ffkv.errors import FfkvError
from ffkv.store import query
from ffkv.store.query import TRIGGER_COLUMNS, check_triggers, has_negative_lists
from ffkv.steps.values import ValuesSettings
from ffkv.steps.lifecycle import execute

KINDS = ("value", "neg_value", "key")


# ---- small statistics ------------------------------------------------------------------------
def precision_at_k(next_tokens, ranks, top_token: int, k: int = 50):
    """(n_examples, n_agree, best matching rank or None) over the rows with rank ≤ k.

    next_tokens: ints, with None or a negative number for a null next token.
    """
    nt = np.asarray([(-1 if t is None else int(t)) for t in next_tokens], dtype=np.int64)
    rk = np.asarray(ranks, dtype=np.int64)
    keep = rk <= k
    nt, rk = nt[keep], rk[keep]
    hit = nt == int(top_token)
    return int(keep.sum()), int(hit.sum()), (int(rk[hit].min()) if hit.any() else None)


def _perms(d_m: int, R: int, seed: int, layer: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([seed, layer]))
    return np.stack([rng.permutation(d_m) for _ in range(R)]) if R else np.zeros((0, d_m), np.int64)


def _quant(x: np.ndarray, q: float) -> float:
    return float(np.quantile(x, q)) if len(x) else float("nan")


def _no_nan(x):
    """NaN → None, so the manifest stays standard JSON."""
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


# ---- the vocabulary projection of one chunk ---------------------------------------------------
WORK_ROWS = 128  # rows of softmax work at a time: (128 × |V|) float32 buffers, whatever the chunk
# A chunk's logits are held at most this big: --chunk 1024 stays 1024 on SmolLM2 (49,152 tokens) and
# becomes 512 on Gemma 3 (262,144). The logits, and so every result, do not depend on the chunk
# (Gemma 3's are bit-identical at 128, 512 and 1024 rows; `test_chunk_and_seed_invariance`).
MAX_LOGIT_BYTES = 512 * 2 ** 20


def summarize_logits(z, k: int, negative: bool = True, work=None, tail: int = 0) -> dict:
    """Top-k, probabilities, max probability and entropy of softmax(z) (and of softmax(−z)).

    z: (C, V) float32 logits. Returns {"pos": (...), "neg": (...)} where each is
    (top_tokens (C,k) int64, top_probs (C,k) f32, max_prob (C,) f32, entropy (C,) f32, lse (C,) f32,
    (logits, tokens) (C, max(k, tail)) of that side's top, descending: what the value index reuses).
    Rows are independent, so the softmax work runs over blocks of rows in two (rows, V) float32
    buffers: `work`, a pair of tensors reused across chunks (to save page faults) whose row count
    is the block size, or fresh ones of `WORK_ROWS` rows. Why blocks: with Gemma 3's 262,144
    tokens, two chunk-sized buffers were 2 GB of the step's memory.
    """
    import torch

    if work is None:
        n = min(len(z), WORK_ROWS)
        work = (torch.empty(n, z.shape[1], dtype=z.dtype, device=z.device),
                torch.empty(n, z.shape[1], dtype=z.dtype, device=z.device))
    step = max(1, len(work[0]))
    parts = [_summarize_rows(z[a:a + step], k, negative, work, tail) for a in range(0, len(z), step)]
    if len(parts) == 1:
        return parts[0]
    return {name: (*(torch.cat([p[name][j] for p in parts]) for j in range(5)),
                   tuple(torch.cat([p[name][5][j] for p in parts]) for j in range(2))) for name in parts[0]}


def _summarize_rows(z, k: int, negative: bool, work, tail: int = 0) -> dict:
    """`summarize_logits` of at most len(work[0]) rows."""
    import torch

    from ffkv.steps.values.rows import tails

    out = {}
    buf, ebuf = work[0][: len(z)], work[1][: len(z)]
    n = min(max(k, tail), z.shape[1])
    top, bottom = tails(z, n, both=negative)  # both tails in one visit of each row
    for name in (("pos", "neg") if negative else ("pos",)):
        if name == "pos":
            tv_all, ti_all = top
        else:
            tv_all, ti_all = -bottom[0], bottom[1]  # top of −z, descending
        tv, ti = tv_all[:, :k], ti_all[:, :k]
        m = tv[:, :1]
        if name == "pos":
            torch.sub(z, m, out=buf)             # z − max(z) ≤ 0
        else:
            torch.sub(-m, z, out=buf)            # −z − max(−z) ≤ 0
        # buf = shifted logits d ≤ 0: lse = m + log S, S = Σ e^d; H = log S − Σ e^d·d / S
        torch.exp(buf, out=ebuf)
        S = ebuf.sum(-1)
        T = buf.mul_(ebuf).sum(-1)               # Σ e^d·d (buf is scratch from here on)
        logS = torch.log(S)
        lse = m[:, 0] + logS
        ent = logS - T / S
        probs = torch.exp(tv - lse[:, None])
        out[name] = (ti, probs, probs[:, 0].clone(), ent, lse, (tv_all, ti_all))
    return out


class _Projector:
    """(n, d) directions -> (n, V) float32 logits through the lens. One (chunk, V) float32 buffer
    holds the logits of every chunk, and `work`, the two (WORK_ROWS, V) ones of `summarize_logits`."""

    def __init__(self, mm, lens, chunk: int):
        import torch

        self.lens = lens
        rows = min(chunk, WORK_ROWS)
        self.work = (torch.empty(rows, mm.vocab_size, device=mm.device),
                     torch.empty(rows, mm.vocab_size, device=mm.device))
        self.zbuf = torch.empty(chunk, mm.vocab_size, device=mm.device)

    def logits(self, W):
        return self.lens.direction_logits(W, out=self.zbuf[: len(W)])


# ---- triggers ----------------------------------------------------------------------------------
def top1_triggers(run, L: int, d_m: int) -> dict:
    """Per memory (L, d_m): the top-1 trigger as defined in the module docstring."""
    t = query.top_triggers(run)
    lay = t["layer"].to_numpy().astype(np.int64)
    dim = t["dim"].to_numpy().astype(np.int64)
    if len(lay) and (lay.min() < 0 or lay.max() >= L or dim.min() < 0 or dim.max() >= d_m):
        raise FfkvError(f"the run's `triggers` table has layer/dim outside the model's {L} × {d_m}; "
                        f"is this the run's model?")
    sign = t["sign"].to_numpy().astype(np.int64)
    coef = t["coef"].to_numpy().astype(np.float32)
    sid = t["sentence_id"].to_numpy().astype(np.int64)
    pos = t["position"].to_numpy().astype(np.int64)
    nxt = t["next_token"].fill_null(-1).to_numpy().astype(np.int64)
    flat = lay * d_m + dim
    N = L * d_m
    have = {s: np.zeros(N, bool) for s in (1, -1)}
    cols = {s: {"coef": np.zeros(N, np.float32), "sid": np.full(N, -1, np.int64),
                "pos": np.full(N, -1, np.int64), "next": np.full(N, -1, np.int64)} for s in (1, -1)}
    for s in (1, -1):
        sel = np.nonzero(sign == s)[0][::-1]  # reversed: on duplicates the first row wins
        f = flat[sel]
        have[s][f] = True
        cols[s]["coef"][f], cols[s]["sid"][f] = coef[sel], sid[sel]
        cols[s]["pos"][f], cols[s]["next"][f] = pos[sel], nxt[sel]
    use_pos = have[1] & (~have[-1] | (np.abs(cols[1]["coef"]) >= np.abs(cols[-1]["coef"])))
    use_neg = have[-1] & ~use_pos
    res = {"has": use_pos | use_neg,
           "sign": np.where(use_pos, 1, np.where(use_neg, -1, 0)).astype(np.int8)}
    for c in ("coef", "sid", "pos", "next"):
        res[c] = np.where(use_pos, cols[1][c], cols[-1][c])
    res["direction"] = np.where(res["has"], np.where(res["coef"] >= 0, 1, -1), 0).astype(np.int8)
    res["valid"] = res["has"] & (res["next"] >= 0)
    return {k: v.reshape(L, d_m) for k, v in res.items()}


# ---- the step: settings ------------------------------------------------------------------------
# ValuesSettings and STEP: `ffkv.steps.values` (the step as one unit).


def record(run, s: ValuesSettings, vocab_size: int | None = None) -> dict:
    """The step's settings as recorded in the manifest (what the results depend on; not chunk).

    vocab_size defaults to the run's recorded model. The fields' own checks ran before
    (`ffkv.steps.values`); this adds the ones that need the run, before any model is loaded.
    """
    check_triggers(run)
    rec = run.manifest.get("model") or {}
    vocab_size = rec.get("vocab_size") if vocab_size is None else vocab_size
    lens = check_lens(s.lens or run.lens)
    _check_fits(s)
    both = s.table2_kinds == "both" or (s.table2_kinds == "auto" and has_negative_lists(run))
    kinds2 = ("value", "neg_value") if both else ("value",)
    return {"lens": lens, "top_k": min(s.top_k, vocab_size) if vocab_size else s.top_k,
            "permutations": s.permutations, "seed": s.seed, "fig6_bins": s.bins, "table2_n": s.table2_n,
            "precision_k": s.precision_k, "table2_kinds": "+".join(kinds2),
            "dtype": canonical_dtype(s.dtype), "mine_finished": run.step("mine").get("finished"),
            "lenses": [lens] + ([other_lens(lens)] if s.both_lenses else []), "value_index_k": INDEX_K}


def _check_fits(s: ValuesSettings) -> None:
    """--bins and --table2 against the integer columns that hold them (Fig 6's `bin` 0..bins-1,
    Table 2's `position` 1..n): a bigger value is refused here, before any work, not by Arrow."""
    for opt, n, top, schema, col in (("--bins", s.bins, s.bins - 1, FIG6_SCHEMA, "bin"),
                                     ("--table2", s.table2_n, s.table2_n, TABLE2_SCHEMA, "position")):
        most = int(np.iinfo(schema.field(col).type.to_pandas_dtype()).max)
        if top > most:
            raise FfkvError(f"{opt} {n:,} is too large: at most {most + (n - top):,} "
                            f"(the {col} column is {schema.field(col).type})")


INDEX_K = 20


# ---- the step: compute -------------------------------------------------------------------------
def compute(ctx) -> dict:
    """The step's work: project, compare, write the tables; the manifest keeps {"summary": ...}."""
    import torch

    mm = ctx.model()
    with torch.no_grad():
        summary = _compute(ctx.run, mm, ctx.record, ctx.settings.chunk, ctx.show_progress)
    ctx.result = summary
    return {"summary": summary}


def _compute(run, mm, rec: dict, chunk: int, show_progress) -> dict:
    from ffkv.model.onednn import fast_products

    with fast_products(getattr(mm, "device", None)):
        return _compute_all(run, mm, rec, chunk, show_progress)


def _compute_all(run, mm, rec: dict, chunk: int, show_progress) -> dict:
    t0 = time.time()
    L, d_m = mm.n_layers, mm.d_m
    kinds2 = tuple(rec["table2_kinds"].split("+"))
    trig = top1_triggers(run, L, d_m)
    perms = [_perms(d_m, rec["permutations"], rec["seed"], l) for l in range(L)]
    from ffkv.memories.value_index import IndexBuilder, write_index

    index = IndexBuilder(rec.get("value_index_k", INDEX_K))
    proj = _project(mm, rec["lens"], rec["top_k"], trig, perms, chunk, show_progress, index=index)
    projections = {rec["lens"]: proj}
    ag = _agreement(trig, proj)
    layer_rows, hist_rows = _layer_tables(trig, proj, ag, perms, mm.vocab_size)
    fig6_rows = _fig6_rows(ag["used_maxp"][ag["valid"]], ag["agree"][ag["valid"]], rec["fig6_bins"])
    table2 = _table2(run, mm, proj.maxp, proj.top_tok, kinds2, rec["table2_n"], rec["precision_k"])
    _write_values_table(run, L, d_m, proj.top_tok, proj.top_p, proj.maxp, proj.ent)
    _write_agreement_table(run, trig, proj, ag)
    _write_layer_tables(run, layer_rows, hist_rows, fig6_rows)
    run.write_table("values_table2", table2)
    per_lens = {rec["lens"]: (layer_rows, fig6_rows, table2)}
    other = {}
    for ln in rec.get("lenses", [rec["lens"]])[1:]:
        p2 = projections[ln] = _project(mm, ln, rec["top_k"], trig, perms, chunk, show_progress, index=index,
                                        keys=False)
        ag2 = _agreement(trig, p2)
        rows2, _ = _layer_tables(trig, p2, ag2, perms, mm.vocab_size)
        for r in rows2:
            r["key_max_prob_mean"] = r["key_entropy_mean"] = None
        f6 = _fig6_rows(ag2["used_maxp"][ag2["valid"]], ag2["agree"][ag2["valid"]], rec["fig6_bins"])
        t2 = _table2(run, mm, p2.maxp, p2.top_tok, kinds2, rec["table2_n"], rec["precision_k"], texts=False)
        per_lens[ln] = (rows2, f6, t2)
        other[ln] = _other_summary(rows2, f6)
    _write_lens_tables(run, per_lens)
    write_index(run, index.table())
    from ffkv.memories import value_tops

    value_tops.store(run, mm, {ln: (p.vtop[..., 0], p.vtop[..., 1]) for ln, p in projections.items()})
    summary = _summary(rec, mm, trig, ag, layer_rows, fig6_rows, table2, kinds2)
    summary["other_lenses"] = other
    summary["seconds"] = round(time.time() - t0, 2)
    return _no_nan(summary)


# ---- projecting every value and key ---------------------------------------------------------------
@dataclass
class Projections:
    """Per-memory results (small: L × d_m × 3 × k). Kind axis in KINDS order (v, −v, key)."""
    top_tok: np.ndarray  # (L, d_m, 3, k) int32
    top_p: np.ndarray  # (L, d_m, 3, k) float32
    maxp: np.ndarray  # (L, d_m, 3) float32
    ent: np.ndarray  # (L, d_m, 3) float32
    rank: np.ndarray  # (L, d_m) rank of the top-1 trigger's next token in s_i·v_i; −1 if excluded
    tprob: np.ndarray  # (L, d_m) its probability; NaN if excluded
    sh_rank: np.ndarray  # (L, d_m) rank under shuffled pairing (permutation 0)
    vtop: np.ndarray  # (L, d_m, 2) argmax and argmin of the value's logits (the `value_tops` cache)

    @classmethod
    def empty(cls, L: int, d_m: int, k: int) -> "Projections":
        return cls(np.zeros((L, d_m, 3, k), np.int32), np.zeros((L, d_m, 3, k), np.float32),
                   np.zeros((L, d_m, 3), np.float32), np.zeros((L, d_m, 3), np.float32),
                   np.full((L, d_m), -1, np.int64), np.full((L, d_m), np.nan, np.float32),
                   np.full((L, d_m), -1, np.int64), np.zeros((L, d_m, 2), np.int64))

    def put(self, l: int, a: int, b: int, kind: int, summary) -> None:
        """Store one `summarize_logits` result for rows a:b of layer l."""
        ti, pr, mx, en = summary[:4]
        self.top_tok[l, a:b, kind] = ti.cpu().numpy()
        self.top_p[l, a:b, kind] = pr.cpu().numpy()
        self.maxp[l, a:b, kind] = mx.cpu().numpy()
        self.ent[l, a:b, kind] = en.cpu().numpy()


def _project(mm, lens: str, top_k: int, trig: dict, perms: list, chunk: int, show_progress,
             index=None, keys: bool = True) -> Projections:
    """Every value (both signs) and key (unless not `keys`) through the lens, chunk by chunk,
    layer by layer; each chunk's logits also feed `index` (an `IndexBuilder`) when given."""
    from ffkv.model.memories import lens_for
    from ffkv.progress import progress

    L, d_m = mm.n_layers, mm.d_m
    ln = lens_for(mm, lens)
    chunk = max(1, min(chunk, d_m, max(WORK_ROWS, MAX_LOGIT_BYTES // (4 * mm.vocab_size))))
    out = Projections.empty(L, d_m, top_k)
    proj = _Projector(mm, ln, chunk)
    with progress(disable=None if show_progress is None else not show_progress) as bar:
        task = bar.add_task(f"values → vocabulary ({lens} lens)", total=L * math.ceil(d_m / chunk))
        for l in range(L):
            _project_layer(mm, l, proj, out, trig, perms[l], chunk, top_k, lambda: bar.advance(task),
                           index=index, lens=lens, keys=keys)
    return out


def _project_layer(mm, l: int, proj: _Projector, out: Projections, trig: dict, perm: np.ndarray,
                   chunk: int, top_k: int, advance, index=None, lens: str = "", keys: bool = True) -> None:
    import torch

    Vw, Kw = mm.values(l), mm.keys(l)
    direction = torch.as_tensor(trig["direction"][l], dtype=torch.long)
    target = torch.as_tensor(trig["next"][l], dtype=torch.long)
    valid = trig["valid"][l]
    # permutation 0: key i reads value p0[i]; inverse: value j is read by key inv0[j]
    inv0 = np.argsort(perm[0]) if len(perm) else None
    for a in range(0, mm.d_m, chunk):
        b = min(a + chunk, mm.d_m)
        z = proj.logits(Vw[a:b])
        s = summarize_logits(z, top_k, work=proj.work, tail=index.k + 1 if index is not None else 0)
        if index is not None:
            index.add(lens, l, a, z, lse=(s["pos"][4], s["neg"][4]), tops=(s["pos"][5], s["neg"][5]))
        out.vtop[l, a:b] = _extremes(z, s)
        out.put(l, a, b, 0, s["pos"])
        out.put(l, a, b, 1, s["neg"])
        _ranks_of_targets(z, s, a, direction, target, valid, inv0, out.rank[l], out.tprob[l], out.sh_rank[l])
        del z, s
        if keys:
            out.put(l, a, b, 2, summarize_logits(proj.logits(Kw[a:b]), top_k, negative=False, work=proj.work)["pos"])
        advance()


def _extremes(z, s: dict) -> np.ndarray:
    """(C, 2) argmax and argmin of each row of z, first index on ties: the first of each tail
    (`ffkv.steps.values.rows.tails` puts ties in token order), no pass of their own."""
    import torch

    return torch.stack([s["pos"][0][:, 0], s["neg"][0][:, 0]], 1).cpu().numpy()


def _ranks_of_targets(z, s: dict, a: int, direction, target, valid, inv0, rank, tprob, sh_rank) -> None:
    """The ranks of a chunk (values a..a+C-1 of a layer) in one visit of its logits: into `rank` and
    `tprob`, the top-1 trigger's next token in s_i·v_i for the valid rows; into `sh_rank`, under
    the shuffled pairing (permutation 0: value j read by key inv0[j], in that key's direction), the
    reading key's target (`ffkv.steps.values.rows.signed_ranks`)."""
    import torch

    from ffkv.steps.values.rows import signed_ranks

    C = len(z)
    own = np.arange(a, a + C)
    readers = [own] + ([inv0[a:a + C]] if inv0 is not None else [])
    tgt = torch.stack([target[torch.as_tensor(r)].clamp(min=0) for r in readers], 1)
    sgn = torch.stack([torch.where(direction[torch.as_tensor(r)] < 0, -1, 1) for r in readers], 1)
    rk = signed_ranks(z, tgt, sgn).cpu().numpy()
    rows = np.nonzero(valid[own])[0]
    if len(rows):
        pos = sgn[:, 0] > 0
        zt = z.gather(1, tgt[:, :1].to(z.device))[:, 0]
        lse = torch.where(pos.to(z.device), s["pos"][4], s["neg"][4])
        p = torch.exp(torch.where(pos.to(z.device), zt, -zt) - lse).cpu().numpy()
        rank[a + rows] = rk[rows, 0]
        tprob[a + rows] = p[rows]
    if inv0 is not None:
        ok = np.nonzero(valid[readers[1]])[0]
        sh_rank[readers[1][ok]] = rk[ok, 1]


# ---- agreement and baselines ---------------------------------------------------------------
def _agreement(trig: dict, proj: Projections) -> dict:
    """Per memory: the compared direction (0: v, 1: −v), its top token and max probability, and
    whether that top token is the top-1 trigger's next token."""
    dir_idx = np.where(trig["direction"] < 0, 1, 0)
    value_top = np.take_along_axis(proj.top_tok[..., 0], dir_idx[..., None], axis=2)[..., 0].astype(np.int64)
    used_maxp = np.take_along_axis(proj.maxp, dir_idx[..., None], axis=2)[..., 0]
    valid = trig["valid"]
    return {"dir_idx": dir_idx, "value_top": value_top, "used_maxp": used_maxp, "valid": valid,
            "agree": valid & (value_top == trig["next"])}


def rank_edges(V: int) -> np.ndarray:
    """Fig 5's rank bins: [0,1), [1,2), [2,4), [4,8), … up to |V|."""
    n_bins = max(1, math.ceil(math.log2(max(V, 2)))) + 1
    edges = np.unique(np.minimum(np.array([0] + [2 ** j for j in range(n_bins)], dtype=np.int64), V))
    return np.append(edges, V) if edges[-1] < V else edges


def _shuffled_agreement(sh_top: np.ndarray, target: np.ndarray, observed: float) -> tuple:
    """(mean, 2.5%, 97.5%, p-value) of one layer's agreement over its R shuffled pairings.

    sh_top (R, n): the top token each evaluated key reads under each permutation; target (n,)."""
    rates = (sh_top == target[None, :]).mean(1)
    return (float(rates.mean()), float(np.quantile(rates, 0.025)), float(np.quantile(rates, 0.975)),
            float((1 + (rates >= observed).sum()) / (1 + len(rates))))


def _layer_tables(trig: dict, proj: Projections, ag: dict, perms: list, V: int) -> tuple[list, list]:
    """Rows of `values_layers` and `values_rank_hist`."""
    tops_both = proj.top_tok[..., :2, 0].astype(np.int64)  # (L, d_m, 2)
    edges = rank_edges(V)
    layer_rows, hist_rows = [], []
    for l, perm in enumerate(perms):
        v = ag["valid"][l]
        rk = proj.rank[l][v]
        srk = proj.sh_rank[l][v] if len(perm) else np.zeros(0, np.int64)
        layer_rows.append(_layer_row(l, trig, proj, ag, perm, tops_both[l], rk, srk, V))
        hist_rows += _hist_rows(l, rk, srk, edges)
    return layer_rows, hist_rows


def _layer_row(l: int, trig: dict, proj: Projections, ag: dict, perm: np.ndarray, tops_both: np.ndarray,
               rk: np.ndarray, srk: np.ndarray, V: int) -> dict:
    v = ag["valid"][l]
    d_m, n, k_ag = len(v), int(v.sum()), int(ag["agree"][l].sum())
    lo, hi = wilson(k_ag, n)
    sh = sh_lo = sh_hi = sh_pv = float("nan")
    if len(perm) and n:
        idx = np.nonzero(v)[0]
        # key i reads value perm[r, i] in direction s_i
        sh_top = tops_both[perm[:, idx], ag["dir_idx"][l][idx][None, :]]  # (R, n)
        sh, sh_lo, sh_hi, sh_pv = _shuffled_agreement(sh_top, trig["next"][l][idx], k_ag / n)
    return {
        "layer": l, "n_memories": d_m, "n_no_trigger": int((~trig["has"][l]).sum()),
        "n_sentence_end": int((trig["has"][l] & ~v).sum()), "n": n,
        "n_neg": int((v & (trig["direction"][l] < 0)).sum()), "n_agree": k_ag,
        "agreement": k_ag / n if n else float("nan"), "ci_low": float(lo), "ci_high": float(hi),
        "shuffled": sh, "shuffled_ci_low": sh_lo, "shuffled_ci_high": sh_hi, "shuffled_p": sh_pv,
        "random_baseline": 1.0 / V,
        "rank_mean": float(rk.mean()) if n else float("nan"),
        "rank_q10": _quant(rk, 0.10), "rank_q25": _quant(rk, 0.25), "rank_median": _quant(rk, 0.5),
        "rank_q75": _quant(rk, 0.75), "rank_q90": _quant(rk, 0.90),
        "shuffled_rank_median": _quant(srk, 0.5),
        "frac_rank_lt10": float((rk < 10).mean()) if n else float("nan"),
        "frac_rank_lt100": float((rk < 100).mean()) if n else float("nan"),
        "value_max_prob_mean": float(proj.maxp[l, :, 0].mean()),
        "value_entropy_mean": float(proj.ent[l, :, 0].mean()),
        "key_max_prob_mean": float(proj.maxp[l, :, 2].mean()),
        "key_entropy_mean": float(proj.ent[l, :, 2].mean()),
    }


def _hist_rows(l: int, rk: np.ndarray, srk: np.ndarray, edges: np.ndarray) -> list[dict]:
    c = np.histogram(rk, bins=edges)[0] if len(rk) else np.zeros(len(edges) - 1, np.int64)
    cs = np.histogram(srk, bins=edges)[0] if len(srk) else np.zeros(len(edges) - 1, np.int64)
    return [{"layer": l, "bin": j, "lo": int(edges[j]), "hi": int(edges[j + 1]),
             "count": int(c[j]), "shuffled_count": int(cs[j])} for j in range(len(edges) - 1)]


def _fig6_rows(maxp: np.ndarray, agree: np.ndarray, bins: int) -> list[dict]:
    """Fig 6: agreement vs max probability of the compared direction, in quantile bins."""
    x = maxp.astype(np.float64)
    rows = []
    if len(x):
        qe = np.unique(np.quantile(x, np.linspace(0, 1, bins + 1)))
        if len(qe) == 1:
            qe = np.array([qe[0], qe[0]])
        which = np.clip(np.searchsorted(qe, x, side="right") - 1, 0, len(qe) - 2)
        for j in range(len(qe) - 1):
            sel = which == j
            nn, kk = int(sel.sum()), int(agree[sel].sum())
            lo, hi = wilson(kk, nn)
            rows.append({"bin": j, "lo": float(qe[j]), "hi": float(qe[j + 1]), "n": nn,
                         "n_agree": kk, "agreement": kk / nn if nn else float("nan"),
                         "ci_low": float(lo), "ci_high": float(hi),
                         "mean_max_prob": float(x[sel].mean()) if nn else float("nan")})
    return rows


def _summary(rec: dict, mm, trig: dict, ag: dict, layer_rows: list, fig6_rows: list, table2: pa.Table,
             kinds2: tuple) -> dict:
    """The step's summary (manifest steps.values.summary; `format_summary` prints it), but seconds."""
    L, d_m, V = mm.n_layers, mm.d_m, mm.vocab_size
    valid = ag["valid"]
    N, K = int(valid.sum()), int(ag["agree"].sum())
    lo, hi = wilson(K, N)
    sh_all = [r["shuffled"] * r["n"] for r in layer_rows if r["n"] and not math.isnan(r["shuffled"])]
    t2_layers = table2["layer"].to_pylist()
    t2_agree = table2["n_agree"].to_pylist()
    return {
        "lens": rec["lens"], "vocab_size": V, "layers": L, "d_m": d_m, "memories": L * d_m,
        "evaluated": N, "evaluated_neg": int((valid & (trig["direction"] < 0)).sum()),
        "no_trigger": int((~trig["has"]).sum()), "sentence_end": int((trig["has"] & ~valid).sum()),
        "agree": K, "agreement": K / N if N else None, "ci_low": float(lo), "ci_high": float(hi),
        "shuffled": (sum(sh_all) / N) if (N and sh_all) else None, "random_baseline": 1.0 / V,
        "best_layer": max(layer_rows, key=lambda r: (-1 if math.isnan(r["agreement"]) else r["agreement"]))["layer"],
        "layer_agreement": [None if math.isnan(r["agreement"]) else r["agreement"] for r in layer_rows],
        "layer_rank_median": [None if math.isnan(r["rank_median"]) else r["rank_median"] for r in layer_rows],
        "fig6_low": fig6_rows[0]["agreement"] if fig6_rows else None,
        "fig6_high": fig6_rows[-1]["agreement"] if fig6_rows else None,
        "table2_n": len(t2_layers), "table2_kinds": list(kinds2), "precision_k": rec["precision_k"],
        "table2_with_agreeing": int(sum(1 for a in t2_agree if a and a > 0)),
        "table2_upper_half": int(sum(1 for l in t2_layers if l >= L / 2)),
    }


# ---- writing the tables ---------------------------------------------------------------------------
def _write_values_table(run, L, d_m, top_tok, top_p, maxp, ent) -> None:
    k = top_tok.shape[-1]
    n = L * d_m * 3
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * k, pa.int32())
    kind = pa.DictionaryArray.from_arrays(pa.array(np.tile(np.arange(3, dtype=np.int8), L * d_m)),
                                          pa.array(list(KINDS)))
    run.write_table("values", pa.table({
        "layer": pa.array(np.repeat(np.arange(L), d_m * 3), pa.int16()),
        "dim": pa.array(np.tile(np.repeat(np.arange(d_m), 3), L), pa.int32()),
        "kind": kind.cast(pa.string()),
        "top_tokens": pa.ListArray.from_arrays(offsets, pa.array(top_tok.reshape(-1), pa.int32())),
        "top_probs": pa.ListArray.from_arrays(offsets, pa.array(top_p.reshape(-1), pa.float32())),
        "max_prob": pa.array(maxp.reshape(-1), pa.float32()),
        "entropy": pa.array(ent.reshape(-1), pa.float32()),
    }), row_group_size=100_000)


def _write_agreement_table(run, trig: dict, proj: Projections, ag: dict) -> None:
    L, d_m = trig["has"].shape
    no_trig, excluded = ~trig["has"].ravel(), ~ag["valid"].ravel()
    run.write_table("values_agreement", pa.table({
        "layer": pa.array(np.repeat(np.arange(L), d_m), pa.int16()),
        "dim": pa.array(np.tile(np.arange(d_m), L), pa.int32()),
        "trigger_sign": pa.array(trig["sign"].ravel(), pa.int8(), mask=no_trig),
        "trigger_coef": pa.array(trig["coef"].ravel(), pa.float32(), mask=no_trig),
        "sentence_id": pa.array(trig["sid"].ravel(), pa.int64(), mask=no_trig),
        "position": pa.array(trig["pos"].ravel(), pa.int32(), mask=no_trig),
        "next_token": pa.array(trig["next"].ravel(), pa.int32(), mask=excluded),
        "direction": pa.array(trig["direction"].ravel(), pa.int8(), mask=no_trig),
        "value_top": pa.array(ag["value_top"].ravel(), pa.int32(), mask=no_trig),
        "max_prob": pa.array(ag["used_maxp"].ravel(), pa.float32(), mask=no_trig),
        "target_prob": pa.array(proj.tprob.ravel(), pa.float32(), mask=excluded),
        "rank": pa.array(proj.rank.ravel(), pa.int32(), mask=excluded),
        "agree": pa.array(ag["agree"].ravel(), pa.bool_(), mask=excluded),
    }), row_group_size=100_000)


FIG6_SCHEMA = pa.schema([("bin", pa.int16()), ("lo", pa.float64()), ("hi", pa.float64()),
                         ("n", pa.int64()), ("n_agree", pa.int64()), ("agreement", pa.float64()),
                         ("ci_low", pa.float64()), ("ci_high", pa.float64()),
                         ("mean_max_prob", pa.float64())])


def _write_layer_tables(run, layer_rows: list, hist_rows: list, fig6_rows: list) -> None:
    lt = pa.Table.from_pylist(layer_rows)
    run.write_table("values_layers", lt.set_column(0, "layer", lt["layer"].cast(pa.int16())))
    types = {"layer": pa.int16(), "bin": pa.int16(), "lo": pa.int32(), "hi": pa.int32(),
             "count": pa.int64(), "shuffled_count": pa.int64()}
    run.write_table("values_rank_hist", pa.table({c: pa.array([r[c] for r in hist_rows], t)
                                                  for c, t in types.items()}))
    run.write_table("values_fig6", pa.Table.from_pylist(fig6_rows, schema=FIG6_SCHEMA))


# ---- Table 2 ---------------------------------------------------------------------------------------
TABLE2_SCHEMA = pa.schema([("position", pa.int16()), ("layer", pa.int16()), ("dim", pa.int32()),
                           ("kind", pa.string()), ("direction", pa.int8()), ("max_prob", pa.float32()),
                           ("top_token", pa.int32()), ("top_token_text", pa.string()),
                           ("n_examples", pa.int32()), ("n_agree", pa.int32()),
                           ("precision", pa.float32()), ("example_rank", pa.int16()),
                           ("example_sentence_id", pa.int64()), ("example_position", pa.int32()),
                           ("example_coef", pa.float32()), ("example_text", pa.string())])


def _decode(mm, ids) -> str | None:
    try:
        return mm.tok.decode([int(i) for i in ids])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot decode leaves the text empty
        return None


def _table2_candidates(maxp, top_tok, kinds2, n_top: int) -> dict:
    """The n_top highest max_prob directions of the given kinds: arrays lay, dim, direction, top
    and the list kind. Ties by (layer, dim, kind) order."""
    d_m = maxp.shape[1]
    kind_idx = [KINDS.index(k) for k in kinds2]
    cand = maxp[:, :, kind_idx].reshape(-1)  # order: layer, dim, kind
    n_top = min(n_top, len(cand))
    order = np.lexsort((np.arange(len(cand)), -cand.astype(np.float64)))[:n_top]
    nk = len(kind_idx)
    lay, rem = np.divmod(order, d_m * nk)
    dim, kj = np.divmod(rem, nk)
    kinds = [kinds2[j] for j in kj]
    return {"lay": lay, "dim": dim, "kind": kinds,
            "direction": np.array([1 if k == "value" else -1 for k in kinds], np.int64),
            "top": (top_tok[lay, dim, [kind_idx[j] for j in kj], 0].astype(np.int64) if n_top
                    else np.zeros(0, np.int64))}


def _triggers_by_key(run, c: dict, precision_k: int, d_m: int) -> dict:
    """(layer, dim, sign) -> the key's trigger rows of rank ≤ precision_k, for the candidates."""
    if not len(c["lay"]):
        return {}
    t = run.read_table("triggers", columns=list(TRIGGER_COLUMNS),
                       filters=[("rank", "<=", precision_k), ("layer", "in", sorted(set(int(x) for x in c["lay"])))])
    want = set(zip(c["lay"].tolist(), c["dim"].tolist(), c["direction"].tolist()))
    tl, td, ts = (t[col].to_numpy() for col in ("layer", "dim", "sign"))
    flat_key = (tl.astype(np.int64) * d_m + td) * 3 + (ts.astype(np.int64) + 1)
    want_flat = np.array([(a * d_m + b) * 3 + (s + 1) for a, b, s in want], np.int64)
    keep = np.nonzero(np.isin(flat_key, want_flat))[0]
    sub = t.take(pa.array(keep)).to_pydict()
    rows_by_key: dict = {}
    for i in range(len(keep)):
        key = (int(sub["layer"][i]), int(sub["dim"][i]), int(sub["sign"][i]))
        rows_by_key.setdefault(key, []).append({col: sub[col][i] for col in TRIGGER_COLUMNS})
    return rows_by_key


def _table2(run, mm, maxp, top_tok, kinds2, n_top, precision_k, texts: bool = True) -> pa.Table:
    c = _table2_candidates(maxp, top_tok, kinds2, n_top)
    rows_by_key = _triggers_by_key(run, c, precision_k, maxp.shape[1])
    out = {name: [] for name in TABLE2_SCHEMA.names}
    examples = {}  # row j -> (sentence_id, position) of its example trigger
    for j in range(len(c["lay"])):
        l, i, s, tok = int(c["lay"][j]), int(c["dim"][j]), int(c["direction"][j]), int(c["top"][j])
        rows = sorted(rows_by_key.get((l, i, s), []), key=lambda r: r["rank"])
        n_ex, n_ag, best = precision_at_k([r["next_token"] for r in rows], [r["rank"] for r in rows],
                                          tok, precision_k)
        ex = next((r for r in rows if r["rank"] == best), None) if best is not None else None
        row = {"position": j + 1, "layer": l, "dim": i, "kind": c["kind"][j], "direction": s,
               "max_prob": float(maxp[l, i, KINDS.index(c["kind"][j])]), "top_token": tok,
               "top_token_text": _decode(mm, [tok]), "n_examples": n_ex, "n_agree": n_ag,
               "precision": n_ag / n_ex if n_ex else None, "example_rank": best,
               "example_sentence_id": ex["sentence_id"] if ex else None,
               "example_position": ex["position"] if ex else None,
               "example_coef": ex["coef"] if ex else None, "example_text": None}
        for name, v in row.items():
            out[name].append(v)
        if ex:
            examples[j] = (int(ex["sentence_id"]), int(ex["position"]))
    if texts:
        _example_texts(run, mm, examples, out["example_text"])
    return pa.Table.from_pydict(out, schema=TABLE2_SCHEMA)


def _other_summary(rows: list, fig6: list) -> dict:
    """The summary of another lens: agreement and median rank per layer, Fig 6's end bins."""
    return {"layer_agreement": [None if math.isnan(r["agreement"]) else r["agreement"] for r in rows],
            "layer_rank_median": [None if math.isnan(r["rank_median"]) else r["rank_median"] for r in rows],
            "fig6_low": fig6[0]["agreement"] if fig6 else None, "fig6_high": fig6[-1]["agreement"] if fig6 else None}


def _write_lens_tables(run, per_lens: dict) -> None:
    """`values_lenses`, `values_fig6_lenses`, `values_table2_lenses`: a `lens` column, then the
    per-lens tables' columns, one block per lens (the run's lens first)."""
    def with_lens(ln, t):
        return t.add_column(0, "lens", pa.array([ln] * t.num_rows, pa.string()))

    lay, f6, t2 = [], [], []
    for ln, (rows, fig6, table2) in per_lens.items():
        lt = pa.Table.from_pylist(rows)
        lt = lt.set_column(0, "layer", lt["layer"].cast(pa.int16()))
        for c in ("key_max_prob_mean", "key_entropy_mean"):
            lt = lt.set_column(lt.schema.get_field_index(c), c, lt[c].cast(pa.float64()))
        lay.append(with_lens(ln, lt))
        f6.append(with_lens(ln, pa.Table.from_pylist(fig6, schema=FIG6_SCHEMA)))
        t2.append(with_lens(ln, table2))
    run.write_table("values_lenses", pa.concat_tables(lay))
    run.write_table("values_fig6_lenses", pa.concat_tables(f6))
    run.write_table("values_table2_lenses", pa.concat_tables(t2))


def _example_texts(run, mm, examples: dict, texts: list) -> None:
    """Fill texts[j] with the decoded prefix of each example (left null without `sentences`)."""
    if not examples or not run.has_table("sentences"):
        return
    st = query.sentences(run, [s for s, _ in examples.values()],
                         columns=["sentence_id", "token_ids"]).to_pydict()
    toks = dict(zip(st["sentence_id"], st["token_ids"]))
    for j, (sid, p) in examples.items():
        if sid in toks:
            texts[j] = _decode(mm, toks[sid][: p + 1])


# ---- the step ------------------------------------------------------------------------------------
def compute_values(run, mm, settings: ValuesSettings | None = None, *, show_progress: bool | None = None,
                   force: bool = False, **fields) -> dict:
    """Run the values step on `run` with the loaded model `mm` and `settings` (or
    ValuesSettings(**fields)); returns the summary dict.

    Skips (returning the stored summary with "skipped": True) when the step is already done with
    the same settings and all its tables exist, unless `force`.
    """
    s = settings if settings is not None else ValuesSettings(**{"dtype": str(mm.dtype).replace("torch.", ""),
                                                                **fields})
    out = execute(run, "values", s, mm=mm, force=force, show_progress=show_progress)
    return {**out.info["summary"], "skipped": True} if out.skipped else out.result
