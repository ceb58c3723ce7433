"""`ffkv values`: read every value (and key) as a distribution over the vocabulary (paper §4).

p^ℓ_i = softmax(v^ℓ_i · E) through the run's lens (`Lens.direction_logits`: the paper's naive E,
or E after the final norm's gain). Values are processed in chunks of rows, so nothing of size
L × d_m × V is ever held: peak extra memory is a few (chunk × V) float32 buffers.

Definitions used here
- top-1 trigger of key (ℓ, i): the `triggers` row with rank == 1. With both lists present
  (sign +1 and sign −1) it is the one of the two rank-1 rows with the larger |coef|; a tie goes
  to sign +1. With only one list, that list's rank-1 row. Keys without any rank-1 row are
  excluded and counted (`n_no_trigger`); so are keys whose top-1 row has a null next_token (the
  prefix ends its sentence; counted in `n_sentence_end`). There is no fall-back to the other list.
- direction s_i: +1 when that trigger's coef ≥ 0 (the memory writes v_i; a zero coef keeps the
  paper's v_i), −1 when coef < 0 (it writes −v_i). The value distribution compared is that of
  s_i·v_i.
- agreement: top(s_i·v_i) == next_token of the top-1 trigger. top = argmax of the logits
  (`torch.topk`); rank = `rank_of` (number of logits strictly above the target), so rank 0 ⇔
  agreement except for exact float ties.
- shuffled-pairing baseline: per layer, R seeded permutations π of the values (key i paired
  with value π(i), same direction s_i and target); `shuffled` is the mean agreement over the R
  permutations, its interval the 2.5/97.5 percentiles over them, `shuffled_p` the permutation
  p-value (1 + #{perm ≥ observed}) / (1 + R). `shuffled_rank_median` uses permutation 0.
- random baseline: 1/|V| (a uniformly random top token).
- 95% intervals on agreement rates: Wilson score intervals.
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
The step's summary (the dict `compute_values` returns) is stored in the manifest under
steps.values.summary; `format_summary` prints it.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ffkv.errors import FfkvError

STEP = "values"
KINDS = ("value", "neg_value", "key")
TABLES = ("values", "values_agreement", "values_layers", "values_rank_hist", "values_fig6",
          "values_table2")
TRIGGER_COLUMNS = ("layer", "dim", "sign", "rank", "coef", "sentence_id", "position", "next_token")
Z95 = 1.959963984540054


# ---- small statistics ------------------------------------------------------------------------
def wilson(k, n, z: float = Z95):
    """Wilson score interval for k successes in n trials (arrays or scalars); NaN when n == 0."""
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = k / n
        den = 1 + z * z / n
        centre = (p + z * z / (2 * n)) / den
        half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
        lo, hi = np.clip(centre - half, 0, 1), np.clip(centre + half, 0, 1)
    lo = np.where(n > 0, lo, np.nan)
    hi = np.where(n > 0, hi, np.nan)
    return lo, hi


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


# ---- the vocabulary projection of one chunk ---------------------------------------------------
def summarize_logits(z, k: int, negative: bool = True, work=None) -> dict:
    """Top-k, probabilities, max probability and entropy of softmax(z) (and of softmax(−z)).

    z: (C, V) float32 logits. Returns {"pos": (...), "neg": (...)} where each is
    (top_tokens (C,k) int64, top_probs (C,k) f32, max_prob (C,) f32, entropy (C,) f32, lse (C,) f32).
    Two (C, V) work buffers are used for both signs: `work`, a pair of float32 tensors with at
    least C rows (reused across chunks to save page faults), or fresh ones.
    """
    import torch

    out = {}
    if work is None:
        buf, ebuf = torch.empty_like(z), torch.empty_like(z)
    else:
        buf, ebuf = work[0][: len(z)], work[1][: len(z)]
    for name in (("pos", "neg") if negative else ("pos",)):
        if name == "pos":
            tv, ti = z.topk(k, dim=-1)
            m = tv[:, :1]
            torch.sub(z, m, out=buf)             # z − max(z) ≤ 0
        else:
            bv, ti = z.topk(k, dim=-1, largest=False)
            tv = -bv                             # top-k of −z, descending
            m = tv[:, :1]
            torch.sub(-m, z, out=buf)            # −z − max(−z) ≤ 0
        # buf = shifted logits d ≤ 0: lse = m + log S, S = Σ e^d; H = log S − Σ e^d·d / S
        torch.exp(buf, out=ebuf)
        S = ebuf.sum(-1)
        T = buf.mul_(ebuf).sum(-1)               # Σ e^d·d (buf is scratch from here on)
        logS = torch.log(S)
        lse = m[:, 0] + logS
        ent = logS - T / S
        probs = torch.exp(tv - lse[:, None])
        out[name] = (ti, probs, probs[:, 0].clone(), ent, lse)
    return out


# ---- triggers ----------------------------------------------------------------------------------
def _trigger_path(run):
    return run.table_path("triggers")


def check_triggers(run) -> None:
    if not run.has_table("triggers"):
        raise FfkvError(f"run {run.path} has no `triggers` table; run `ffkv mine --out {run.path}` first")
    names = set(pq.read_schema(_trigger_path(run)).names)
    missing = [c for c in TRIGGER_COLUMNS if c not in names]
    if missing:
        raise FfkvError(f"the run's `triggers` table lacks column(s) {missing}; it was not made by "
                        f"this ffkv; rerun `ffkv mine --out {run.path}`")


def has_negative_lists(run) -> bool:
    """Whether the run was mined with negative lists (sign −1 rows; `ffkv mine --negative`)."""
    return pq.read_table(_trigger_path(run), columns=["sign"], filters=[("sign", "==", -1)]).num_rows > 0


def top1_triggers(run, L: int, d_m: int) -> dict:
    """Per memory (L, d_m): the top-1 trigger as defined in the module docstring."""
    t = pq.read_table(_trigger_path(run), columns=list(TRIGGER_COLUMNS), filters=[("rank", "==", 1)])
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


# ---- the step ------------------------------------------------------------------------------------
_DTYPES = {"auto": "float32", "float32": "float32", "fp32": "float32", "float16": "float16",
           "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
LENSES = ("naive", "norm")


def resolve_settings(run, lens: str | None = None, top_k: int = 10, chunk: int = 1024,
                     permutations: int = 100, seed: int = 0, bins: int = 10, table2_n: int = 100,
                     precision_k: int = 50, table2_kinds: str = "auto", *,
                     vocab_size: int | None = None, dtype: str = "auto") -> dict:
    """The step's settings as recorded in the manifest (what the results depend on; not chunk).

    vocab_size defaults to the run's recorded model. Raises FfkvError on bad values.
    """
    rec = run.manifest.get("model") or {}
    vocab_size = rec.get("vocab_size") if vocab_size is None else vocab_size
    lens = lens or run.manifest.get("lens") or "norm"
    if lens not in LENSES:
        raise FfkvError(f"unknown lens {lens!r}; choose naive or norm")
    if top_k < 1 or chunk < 1 or permutations < 0 or bins < 1 or table2_n < 0 or precision_k < 1:
        raise FfkvError("--top-k, --chunk, --bins and --precision-k must be ≥ 1; "
                        "--permutations and --table2 ≥ 0")
    if table2_kinds not in ("auto", "value", "both"):
        raise FfkvError(f"unknown --table2-kinds {table2_kinds!r}; choose auto, value or both")
    both = table2_kinds == "both" or (table2_kinds == "auto" and has_negative_lists(run))
    kinds2 = ("value", "neg_value") if both else ("value",)
    return {"lens": lens, "top_k": min(top_k, vocab_size) if vocab_size else top_k,
            "permutations": permutations, "seed": seed, "fig6_bins": bins, "table2_n": table2_n,
            "precision_k": precision_k, "table2_kinds": "+".join(kinds2),
            "dtype": _DTYPES.get(dtype, dtype), "mine_finished": run.step("mine").get("finished")}


def done_summary(run, settings: dict) -> dict | None:
    """The stored summary when the step is done with these settings and its tables exist."""
    if (run.step_done(STEP) and run.settings(STEP) == settings
            and all(run.has_table(t) for t in TABLES) and run.step(STEP).get("summary")):
        return {**run.step(STEP)["summary"], "skipped": True}
    return None


def _perms(d_m: int, R: int, seed: int, layer: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([seed, layer]))
    return np.stack([rng.permutation(d_m) for _ in range(R)]) if R else np.zeros((0, d_m), np.int64)


def _quant(x: np.ndarray, q: float) -> float:
    return float(np.quantile(x, q)) if len(x) else float("nan")


def compute_values(run, mm, lens: str | None = None, top_k: int = 10, chunk: int = 1024,
                   permutations: int = 100, seed: int = 0, bins: int = 10, table2_n: int = 100,
                   precision_k: int = 50, table2_kinds: str = "auto", show_progress: bool | None = None,
                   force: bool = False) -> dict:
    """Run the values step on `run` with the loaded model `mm`; returns the summary dict.

    Skips (returning the stored summary with "skipped": True) when the step is already done with
    the same settings and all its tables exist, unless `force`.
    """
    import torch

    run.require("mine", f"ffkv mine --out {run.path}")
    check_triggers(run)
    run.check_model(mm)
    settings = resolve_settings(run, lens, top_k, chunk, permutations, seed, bins, table2_n,
                                precision_k, table2_kinds, vocab_size=mm.vocab_size,
                                dtype=str(mm.dtype).replace("torch.", ""))
    if not force and (done := done_summary(run, settings)):
        return done
    with torch.no_grad():
        return _compute(run, mm, settings, chunk, show_progress)


def _compute(run, mm, settings: dict, chunk: int, show_progress) -> dict:
    import torch

    from ffkv.model.memories import Lens, rank_of
    from ffkv.progress import progress

    lens, top_k, permutations, seed = (settings[k] for k in ("lens", "top_k", "permutations", "seed"))
    bins, table2_n, precision_k = settings["fig6_bins"], settings["table2_n"], settings["precision_k"]
    kinds2 = tuple(settings["table2_kinds"].split("+"))
    Vsz, L, d_m = mm.vocab_size, mm.n_layers, mm.d_m
    t0 = time.time()
    run.start_step(STEP, settings)
    ln = mm.lens if mm.lens.mode == lens else Lens(mm, lens)
    trig = top1_triggers(run, L, d_m)
    chunk = max(1, min(chunk, d_m))

    # per-memory outputs (small: L × d_m × 3 × k)
    top_tok = np.zeros((L, d_m, 3, top_k), np.int32)
    top_p = np.zeros((L, d_m, 3, top_k), np.float32)
    maxp = np.zeros((L, d_m, 3), np.float32)
    ent = np.zeros((L, d_m, 3), np.float32)
    rank = np.full((L, d_m), -1, np.int64)
    tprob = np.full((L, d_m), np.nan, np.float32)
    sh_rank = np.full((L, d_m), -1, np.int64)
    perms = [_perms(d_m, permutations, seed, l) for l in range(L)]

    # three (chunk, V) float32 buffers reused for every chunk: logits and two work buffers
    work = (torch.empty(chunk, Vsz, device=mm.device), torch.empty(chunk, Vsz, device=mm.device))
    zbuf = torch.empty(chunk, Vsz, device=mm.device) if ln.E.dtype == torch.float32 else None

    def logits_of(W):  # (n, d) directions -> (n, V) float32 logits, through the lens
        if zbuf is None:
            return ln.direction_logits(W).float()
        return ln.direction_logits(W, out=zbuf[: len(W)])

    def ranks(z, tgt):  # rank_of over row blocks: its (rows, V) comparison stays small
        return torch.cat([rank_of(z[r:r + 128], tgt[r:r + 128]) for r in range(0, len(z), 128)])

    n_chunks = L * math.ceil(d_m / chunk)
    with progress(disable=None if show_progress is None else not show_progress) as bar:
        task = bar.add_task("values → vocabulary", total=n_chunks)
        for l in range(L):
            Vw, Kw = mm.values(l), mm.keys(l)
            direction = torch.as_tensor(trig["direction"][l], dtype=torch.long)
            target = torch.as_tensor(trig["next"][l], dtype=torch.long)
            valid = trig["valid"][l]
            # permutation 0: key i reads value p0[i]; inverse: value j is read by key inv0[j]
            inv0 = np.argsort(perms[l][0]) if permutations else None
            for a in range(0, d_m, chunk):
                b = min(a + chunk, d_m)
                z = logits_of(Vw[a:b])
                s = summarize_logits(z, top_k, work=work)
                for kk, name in ((0, "pos"), (1, "neg")):
                    ti, pr, mx, en, _ = s[name]
                    top_tok[l, a:b, kk] = ti.cpu().numpy()
                    top_p[l, a:b, kk] = pr.cpu().numpy()
                    maxp[l, a:b, kk] = mx.cpu().numpy()
                    ent[l, a:b, kk] = en.cpu().numpy()
                # the top-1 trigger's next token in the distribution of s_i·v_i. Rows are flipped
                # in place (×−1 is exact and undone after), so no chunk-sized copy is made.
                rows = np.nonzero(valid[a:b])[0]
                if len(rows):
                    sgn = torch.where(direction[a:b] < 0, -1.0, 1.0).to(z.device, z.dtype)
                    tgt = target[a:b].clamp(min=0).to(z.device)
                    z.mul_(sgn[:, None])
                    rk = ranks(z, tgt)
                    lse = torch.where(sgn > 0, s["pos"][4], s["neg"][4])
                    tp = torch.exp(z.gather(-1, tgt[:, None])[:, 0] - lse)
                    z.mul_(sgn[:, None])
                    rank[l, a + rows] = rk.cpu().numpy()[rows]
                    tprob[l, a + rows] = tp.cpu().numpy()[rows]
                # shuffled pairing (permutation 0): value j is read by key inv0[j], in its direction
                if permutations:
                    readers = inv0[a:b]
                    ok = np.nonzero(valid[readers])[0]
                    if len(ok):
                        rd = torch.as_tensor(readers, dtype=torch.long)
                        sgn = torch.where(direction[rd] < 0, -1.0, 1.0).to(z.device, z.dtype)
                        z.mul_(sgn[:, None])
                        rk = ranks(z, target[rd].clamp(min=0).to(z.device))
                        z.mul_(sgn[:, None])
                        sh_rank[l, readers[ok]] = rk.cpu().numpy()[ok]
                del z, s
                zk = logits_of(Kw[a:b])
                ti, pr, mx, en, _ = summarize_logits(zk, top_k, negative=False, work=work)["pos"]
                top_tok[l, a:b, 2], top_p[l, a:b, 2] = ti.cpu().numpy(), pr.cpu().numpy()
                maxp[l, a:b, 2], ent[l, a:b, 2] = mx.cpu().numpy(), en.cpu().numpy()
                del zk, ti, pr, mx, en
                bar.advance(task)

    # ---- agreement and baselines ---------------------------------------------------------------
    dir_idx = np.where(trig["direction"] < 0, 1, 0)  # 0: v, 1: −v
    value_top = np.take_along_axis(top_tok[..., 0], dir_idx[..., None], axis=2)[..., 0].astype(np.int64)
    used_maxp = np.take_along_axis(maxp, dir_idx[..., None], axis=2)[..., 0]
    valid = trig["valid"]
    agree = valid & (value_top == trig["next"])
    tops_both = top_tok[..., :2, 0].astype(np.int64)  # (L, d_m, 2)

    layer_rows = []
    hist_rows = []
    n_bins_rank = max(1, math.ceil(math.log2(max(Vsz, 2)))) + 1
    edges = np.array([0] + [2 ** j for j in range(n_bins_rank)], dtype=np.int64)
    edges = np.unique(np.minimum(edges, Vsz))
    if edges[-1] < Vsz:
        edges = np.append(edges, Vsz)
    for l in range(L):
        v = valid[l]
        n = int(v.sum())
        k_ag = int(agree[l].sum())
        lo, hi = wilson(k_ag, n)
        if permutations and n:
            idx = np.nonzero(v)[0]
            # key i reads value perms[r, i] in direction s_i
            sh_top = tops_both[l][perms[l][:, idx], dir_idx[l][idx][None, :]]  # (R, n)
            sh_rates = (sh_top == trig["next"][l][idx][None, :]).mean(1)
            sh = float(sh_rates.mean())
            sh_lo, sh_hi = (float(np.quantile(sh_rates, 0.025)), float(np.quantile(sh_rates, 0.975)))
            sh_pv = float((1 + (sh_rates >= k_ag / n).sum()) / (1 + permutations))
        else:
            sh = sh_lo = sh_hi = sh_pv = float("nan")
        rk = rank[l][v]
        srk = sh_rank[l][v] if permutations else np.zeros(0, np.int64)
        layer_rows.append({
            "layer": l, "n_memories": d_m, "n_no_trigger": int((~trig["has"][l]).sum()),
            "n_sentence_end": int((trig["has"][l] & ~v).sum()), "n": n,
            "n_neg": int((v & (trig["direction"][l] < 0)).sum()), "n_agree": k_ag,
            "agreement": k_ag / n if n else float("nan"), "ci_low": float(lo), "ci_high": float(hi),
            "shuffled": sh, "shuffled_ci_low": sh_lo, "shuffled_ci_high": sh_hi, "shuffled_p": sh_pv,
            "random_baseline": 1.0 / Vsz,
            "rank_mean": float(rk.mean()) if n else float("nan"),
            "rank_q10": _quant(rk, 0.10), "rank_q25": _quant(rk, 0.25), "rank_median": _quant(rk, 0.5),
            "rank_q75": _quant(rk, 0.75), "rank_q90": _quant(rk, 0.90),
            "shuffled_rank_median": _quant(srk, 0.5),
            "frac_rank_lt10": float((rk < 10).mean()) if n else float("nan"),
            "value_max_prob_mean": float(maxp[l, :, 0].mean()),
            "value_entropy_mean": float(ent[l, :, 0].mean()),
            "key_max_prob_mean": float(maxp[l, :, 2].mean()),
            "key_entropy_mean": float(ent[l, :, 2].mean()),
        })
        c = np.histogram(rk, bins=edges)[0] if n else np.zeros(len(edges) - 1, np.int64)
        cs = np.histogram(srk, bins=edges)[0] if len(srk) else np.zeros(len(edges) - 1, np.int64)
        for j in range(len(edges) - 1):
            hist_rows.append({"layer": l, "bin": j, "lo": int(edges[j]), "hi": int(edges[j + 1]),
                              "count": int(c[j]), "shuffled_count": int(cs[j])})

    # ---- Fig 6: agreement vs max probability of the compared direction --------------------------
    x = used_maxp[valid].astype(np.float64)
    y = agree[valid]
    fig6_rows = []
    if len(x):
        qe = np.unique(np.quantile(x, np.linspace(0, 1, bins + 1)))
        if len(qe) == 1:
            qe = np.array([qe[0], qe[0]])
        which = np.clip(np.searchsorted(qe, x, side="right") - 1, 0, len(qe) - 2)
        for j in range(len(qe) - 1):
            sel = which == j
            nn, kk = int(sel.sum()), int(y[sel].sum())
            lo, hi = wilson(kk, nn)
            fig6_rows.append({"bin": j, "lo": float(qe[j]), "hi": float(qe[j + 1]), "n": nn,
                              "n_agree": kk, "agreement": kk / nn if nn else float("nan"),
                              "ci_low": float(lo), "ci_high": float(hi),
                              "mean_max_prob": float(x[sel].mean()) if nn else float("nan")})

    # ---- Table 2 --------------------------------------------------------------------------------
    table2 = _table2(run, mm, maxp, top_tok, kinds2, table2_n, precision_k)

    # ---- write ------------------------------------------------------------------------------------
    _write_values_table(run, L, d_m, top_tok, top_p, maxp, ent)
    has = trig["has"]
    run.write_table("values_agreement", pa.table({
        "layer": pa.array(np.repeat(np.arange(L), d_m), pa.int16()),
        "dim": pa.array(np.tile(np.arange(d_m), L), pa.int32()),
        "trigger_sign": pa.array(trig["sign"].ravel(), pa.int8(), mask=~has.ravel()),
        "trigger_coef": pa.array(trig["coef"].ravel(), pa.float32(), mask=~has.ravel()),
        "sentence_id": pa.array(trig["sid"].ravel(), pa.int64(), mask=~has.ravel()),
        "position": pa.array(trig["pos"].ravel(), pa.int32(), mask=~has.ravel()),
        "next_token": pa.array(trig["next"].ravel(), pa.int32(), mask=~valid.ravel()),
        "direction": pa.array(trig["direction"].ravel(), pa.int8(), mask=~has.ravel()),
        "value_top": pa.array(value_top.ravel(), pa.int32(), mask=~has.ravel()),
        "max_prob": pa.array(used_maxp.ravel(), pa.float32(), mask=~has.ravel()),
        "target_prob": pa.array(tprob.ravel(), pa.float32(), mask=~valid.ravel()),
        "rank": pa.array(rank.ravel(), pa.int32(), mask=~valid.ravel()),
        "agree": pa.array(agree.ravel(), pa.bool_(), mask=~valid.ravel()),
    }), row_group_size=100_000)
    lt = pa.Table.from_pylist(layer_rows)
    run.write_table("values_layers", lt.set_column(0, "layer", lt["layer"].cast(pa.int16())))
    run.write_table("values_rank_hist", pa.table({
        "layer": pa.array([r["layer"] for r in hist_rows], pa.int16()),
        "bin": pa.array([r["bin"] for r in hist_rows], pa.int16()),
        "lo": pa.array([r["lo"] for r in hist_rows], pa.int32()),
        "hi": pa.array([r["hi"] for r in hist_rows], pa.int32()),
        "count": pa.array([r["count"] for r in hist_rows], pa.int64()),
        "shuffled_count": pa.array([r["shuffled_count"] for r in hist_rows], pa.int64())}))
    f6_schema = pa.schema([("bin", pa.int16()), ("lo", pa.float64()), ("hi", pa.float64()),
                           ("n", pa.int64()), ("n_agree", pa.int64()), ("agreement", pa.float64()),
                           ("ci_low", pa.float64()), ("ci_high", pa.float64()),
                           ("mean_max_prob", pa.float64())])
    run.write_table("values_fig6", pa.Table.from_pylist(fig6_rows, schema=f6_schema))
    run.write_table("values_table2", table2)

    # ---- summary ----------------------------------------------------------------------------------
    N = int(valid.sum())
    K = int(agree.sum())
    lo, hi = wilson(K, N)
    sh_all = [r["shuffled"] * r["n"] for r in layer_rows if r["n"] and not math.isnan(r["shuffled"])]
    t2_layers = table2["layer"].to_pylist()
    t2_agree = table2["n_agree"].to_pylist()
    summary = {
        "lens": lens, "vocab_size": Vsz, "layers": L, "d_m": d_m, "memories": L * d_m,
        "evaluated": N, "evaluated_neg": int((valid & (trig["direction"] < 0)).sum()),
        "no_trigger": int((~trig["has"]).sum()), "sentence_end": int((trig["has"] & ~valid).sum()),
        "agree": K, "agreement": K / N if N else None, "ci_low": float(lo), "ci_high": float(hi),
        "shuffled": (sum(sh_all) / N) if (N and sh_all) else None, "random_baseline": 1.0 / Vsz,
        "best_layer": max(layer_rows, key=lambda r: (-1 if math.isnan(r["agreement"]) else r["agreement"]))["layer"],
        "layer_agreement": [None if math.isnan(r["agreement"]) else r["agreement"] for r in layer_rows],
        "layer_rank_median": [None if math.isnan(r["rank_median"]) else r["rank_median"] for r in layer_rows],
        "fig6_low": fig6_rows[0]["agreement"] if fig6_rows else None,
        "fig6_high": fig6_rows[-1]["agreement"] if fig6_rows else None,
        "table2_n": len(t2_layers), "table2_kinds": list(kinds2), "precision_k": precision_k,
        "table2_with_agreeing": int(sum(1 for a in t2_agree if a and a > 0)),
        "table2_upper_half": int(sum(1 for l in t2_layers if l >= L / 2)),
        "seconds": round(time.time() - t0, 2),
    }
    summary = _no_nan(summary)
    run.finish_step(STEP, summary=summary)
    return summary


def _no_nan(x):
    """NaN → None, so the manifest stays standard JSON."""
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


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


def _decode(mm, ids) -> str | None:
    try:
        return mm.tok.decode([int(i) for i in ids])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot decode leaves the text empty
        return None


def _table2(run, mm, maxp, top_tok, kinds2, n_top, precision_k) -> pa.Table:
    L, d_m = maxp.shape[:2]
    kind_idx = [KINDS.index(k) for k in kinds2]
    cand = maxp[:, :, kind_idx].reshape(-1)  # order: layer, dim, kind
    n_top = min(n_top, len(cand))
    # highest max_prob first; ties by (layer, dim, kind) order
    order = np.lexsort((np.arange(len(cand)), -cand.astype(np.float64)))[:n_top]
    nk = len(kind_idx)
    lay, rem = np.divmod(order, d_m * nk)
    dim, kj = np.divmod(rem, nk)
    kinds = [kinds2[j] for j in kj]
    direction = np.array([1 if k == "value" else -1 for k in kinds], np.int64)
    tops = top_tok[lay, dim, [kind_idx[j] for j in kj], 0].astype(np.int64) if n_top else np.zeros(0, np.int64)

    rows_by_key: dict = {}
    if n_top:
        t = pq.read_table(_trigger_path(run), columns=list(TRIGGER_COLUMNS),
                          filters=[("rank", "<=", precision_k),
                                   ("layer", "in", sorted(set(int(x) for x in lay)))])
        want = set(zip(lay.tolist(), dim.tolist(), direction.tolist()))
        tl, td, ts = (t[c].to_numpy() for c in ("layer", "dim", "sign"))
        flat_key = (tl.astype(np.int64) * d_m + td) * 3 + (ts.astype(np.int64) + 1)
        want_flat = np.array([(a * d_m + b) * 3 + (s + 1) for a, b, s in want], np.int64)
        keep = np.nonzero(np.isin(flat_key, want_flat))[0]
        sub = t.take(pa.array(keep)).to_pydict()
        for i in range(len(keep)):
            key = (int(sub["layer"][i]), int(sub["dim"][i]), int(sub["sign"][i]))
            rows_by_key.setdefault(key, []).append({c: sub[c][i] for c in TRIGGER_COLUMNS})

    out = {c: [] for c in ("position", "layer", "dim", "kind", "direction", "max_prob", "top_token",
                           "top_token_text", "n_examples", "n_agree", "precision", "example_rank",
                           "example_sentence_id", "example_position", "example_coef", "example_text")}
    need_sent = {}
    for j in range(n_top):
        l, i, s, tok = int(lay[j]), int(dim[j]), int(direction[j]), int(tops[j])
        rows = sorted(rows_by_key.get((l, i, s), []), key=lambda r: r["rank"])
        n_ex, n_ag, best = precision_at_k([r["next_token"] for r in rows], [r["rank"] for r in rows],
                                          tok, precision_k)
        ex = next((r for r in rows if r["rank"] == best), None) if best is not None else None
        out["position"].append(j + 1)
        out["layer"].append(l)
        out["dim"].append(i)
        out["kind"].append(kinds[j])
        out["direction"].append(s)
        out["max_prob"].append(float(maxp[l, i, KINDS.index(kinds[j])]))
        out["top_token"].append(tok)
        out["top_token_text"].append(_decode(mm, [tok]))
        out["n_examples"].append(n_ex)
        out["n_agree"].append(n_ag)
        out["precision"].append(n_ag / n_ex if n_ex else None)
        out["example_rank"].append(best)
        out["example_sentence_id"].append(ex["sentence_id"] if ex else None)
        out["example_position"].append(ex["position"] if ex else None)
        out["example_coef"].append(ex["coef"] if ex else None)
        out["example_text"].append(None)
        if ex:
            need_sent[j] = (int(ex["sentence_id"]), int(ex["position"]))
    if need_sent and run.has_table("sentences"):
        ids = sorted({s for s, _ in need_sent.values()})
        st = pq.read_table(run.table_path("sentences"), columns=["sentence_id", "token_ids"],
                           filters=[("sentence_id", "in", ids)]).to_pydict()
        toks = dict(zip(st["sentence_id"], st["token_ids"]))
        for j, (sid, p) in need_sent.items():
            if sid in toks:
                out["example_text"][j] = _decode(mm, toks[sid][: p + 1])
    schema = pa.schema([("position", pa.int16()), ("layer", pa.int16()), ("dim", pa.int32()),
                        ("kind", pa.string()), ("direction", pa.int8()), ("max_prob", pa.float32()),
                        ("top_token", pa.int32()), ("top_token_text", pa.string()),
                        ("n_examples", pa.int32()), ("n_agree", pa.int32()),
                        ("precision", pa.float32()), ("example_rank", pa.int16()),
                        ("example_sentence_id", pa.int64()), ("example_position", pa.int32()),
                        ("example_coef", pa.float32()), ("example_text", pa.string())])
    return pa.Table.from_pydict(out, schema=schema)


# ---- text summary ----------------------------------------------------------------------------
def _pct(x, digits=2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{digits}f}%"


def format_summary(s: dict) -> str:
    L = s["layers"]
    la = [a for a in s["layer_agreement"]]
    thirds = [(0, L // 3), (L // 3, 2 * L // 3), (2 * L // 3, L)]

    def mean_of(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    lines = [
        f"values: {s['memories']:,} memories ({L} layers × {s['d_m']:,}), |V| = {s['vocab_size']:,}, "
        f"lens = {s['lens']}" + ("  [already done; pass --force to recompute]" if s.get("skipped") else ""),
        f"  evaluated {s['evaluated']:,} top-1 triggers ({s['evaluated_neg']:,} compared with −v); "
        f"excluded {s['no_trigger']:,} keys without triggers, {s['sentence_end']:,} at a sentence end",
        f"  agreement (Fig 4): {_pct(s['agreement'])} [{_pct(s['ci_low'])}, {_pct(s['ci_high'])}] "
        f"vs shuffled pairing {_pct(s['shuffled'], 3)} and random {_pct(s['random_baseline'], 4)}",
        "  by layer thirds: " + ", ".join(
            f"layers {a}–{b - 1}: {_pct(mean_of(la[a:b]))}" for a, b in thirds if b > a)
        + f"; best layer {s['best_layer']}: {_pct(la[s['best_layer']])}",
        "  median rank of the next token (Fig 5), by thirds: " + ", ".join(
            f"{mean_of(s['layer_rank_median'][a:b]):,.0f}" if mean_of(s['layer_rank_median'][a:b]) is not None
            else "n/a" for a, b in thirds if b > a),
        f"  agreement vs max probability (Fig 6): lowest bin {_pct(s['fig6_low'])}, "
        f"highest bin {_pct(s['fig6_high'])}",
        f"  Table 2: of the {s['table2_n']} highest-max-prob {'/'.join(s['table2_kinds'])}s, "
        f"{s['table2_with_agreeing']} have ≥1 agreeing trigger among their top {s['precision_k']} "
        f"(paper: 46/100); {s['table2_upper_half']} lie in the upper half of the layers",
        f"  tables: {', '.join(TABLES)}  ({s['seconds']:.1f} s)",
    ]
    return "\n".join(lines)
