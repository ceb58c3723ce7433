"""`ffkv worth`: what each memory is worth to the model, over the run's own mined sentences.

A memory's worth is the rise of the model's mean next-token loss (nats per predicted token) when
it is removed: m_i = 0 at every token of every sentence. Removing each of 46,080 memories for real
would take 46,080 passes; attribution patching (Nanda 2023; Syed et al. 2023) estimates all of
them from one forward and one backward pass a batch, to first order:

    worth_i ≈ (1/N) Σ_t −m_{i,t} · ∂L/∂m_{i,t}

with L the summed loss over the batch's N predicted tokens and m where ffkv's interventions edit it
(`MemoryModel.editing`: after a post-FFN norm, the token's norm scale kept). Exact when the loss is
linear in m_i; a memory whose removal moves the loss far from linear (a large coefficient, a
steep softmax) is misjudged, which the check measures: `check` memories (half the largest
|estimates|, half drawn at random, seeded) are removed for real over the first `check_tokens`
tokens' sentences, and the Spearman correlation of their estimates over those same tokens with
the real rises is recorded (`summary.check.spearman`). A mixture of experts is refused (an edit
reaches only the dims its router picked, so the gradient is not the removal's).

Sentences: the run's `sentences` in sentence_id order, whole, until `tokens` predicted tokens (the
last one cut there); the check's are the first whole sentences reaching `check_tokens`.

Table written (public contract; layers 0-based)
- `memory_worth`: one row per memory, by layer then dim. layer int16, dim int32, tokens int64 (the
  predicted tokens), worth float64 (the estimate, nats per token; > 0: the model is worse without
  it), rank int32 (1 = the largest worth of its layer), estimate_check float64 and ablated float64
  (the estimate over the check's tokens and the real rise there; null unless checked).
"""
from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa

from ffkv.defs import canonical_dtype
from ffkv.errors import FfkvError

CPU_TOKENS, CPU_ROWS = 512, 64  # a CPU batch: gradients for every layer's m are kept until the backward


def record(run, s) -> dict:
    """The manifest's record (not batch_tokens)."""
    return {"tokens": int(s.tokens), "check": int(s.check), "check_tokens": int(s.check_tokens),
            "seed": int(s.seed), "dtype": canonical_dtype(s.dtype), "mine_finished": run.step("mine").get("finished")}


def sentence_rows(run, tokens: int) -> list[np.ndarray]:
    """The run's sentences in sentence_id order, whole, until `tokens` predicted tokens (the last cut)."""
    from ffkv.corpus.tokens import flat_lists
    from ffkv.store import query

    st = query.table(run, "sentences", columns=["sentence_id", "token_ids"])
    flat, offs = flat_lists(st.column("token_ids"))
    rows, got = [], 0
    for i in np.argsort(st.column("sentence_id").to_numpy(), kind="stable"):
        r = np.asarray(flat[offs[i]:offs[i + 1]], np.int64)
        if len(r) < 2:
            continue
        r = r[:tokens - got + 1]
        rows.append(r)
        got += len(r) - 1
        if got >= tokens:
            break
    if not rows:
        raise FfkvError(f"run {run.path} has no sentence of two tokens or more to measure a loss on")
    return rows


def _batches(rows, batch_tokens: int, max_rows: int) -> list[list[int]]:
    from ffkv.corpus.batching import pack

    return [list(map(int, b)) for b in pack([len(r) for r in rows], batch_tokens, max_rows)]


def _loss_sum(mm, ids, mask):
    """The batch's summed next-token loss over its real tokens, and how many it predicted."""
    import torch

    logits = mm.hf(input_ids=ids, use_cache=False).logits[:, :-1].float()
    tgt, ok = ids[:, 1:], (mask[:, 1:] > 0)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    return (nll.view_as(tgt) * ok).sum(), int(ok.sum())


def _inputs(mm, rows, idx):
    from ffkv.model.memories import pad_rows

    sel = [rows[i] for i in idx]
    return pad_rows(np.concatenate(sel), np.array([len(r) for r in sel]), mm.pad_id(), mm.device)


def _refuse_moe(mm) -> None:
    if mm.arch.moe_info(mm.blocks[0]):
        raise FfkvError("worth: a mixture of experts edits only the dims its router picked, so the gradient is "
                        "not a removal's; not supported")


def estimate(mm, rows, batch_tokens: int = CPU_TOKENS, max_rows: int = CPU_ROWS, *,
             advance=None) -> tuple[np.ndarray, int]:
    """Every memory's first-order worth (L, d_m) float64 over `rows`, and the predicted tokens."""
    import torch

    _refuse_moe(mm)
    L = mm.n_layers
    sums = np.zeros((L, mm.d_m))
    n = 0
    for idx in _batches(rows, batch_tokens, max_rows):
        ids, mask = _inputs(mm, rows, idx)
        B, T = ids.shape
        delta = {l: torch.zeros(B, T, mm.d_m, device=mm.device, dtype=mm.dtype, requires_grad=True) for l in range(L)}
        seen: dict = {}

        def make(l):
            def fn(m):
                seen[l] = m.detach()
                return m + delta[l]
            return fn

        with torch.enable_grad(), mm.editing({l: make(l) for l in range(L)}):
            loss, k = _loss_sum(mm, ids, mask)
            grads = torch.autograd.grad(loss, [delta[l] for l in range(L)])  # not the weights' gradients
        for l, g in enumerate(grads):
            sums[l] -= (seen[l].double() * g.double()).sum((0, 1)).cpu().numpy()
        n += k
        if advance is not None:
            advance(k)
    return sums / max(n, 1), n


def mean_loss(mm, rows, removed=None, batch_tokens: int = CPU_TOKENS, max_rows: int = CPU_ROWS) -> float:
    """The mean next-token loss over `rows`, with the memories `removed` [(layer, dim)] set to m = 0."""
    import torch

    fns = {}
    for l, i in removed or ():
        fns.setdefault(int(l), []).append(int(i))

    def make(dims):
        def fn(m):
            out = m.clone()
            out[..., dims] = 0
            return out
        return fn

    tot, n = 0.0, 0
    with torch.no_grad(), mm.editing({l: make(d) for l, d in fns.items()}):
        for idx in _batches(rows, batch_tokens, max_rows):
            s, k = _loss_sum(mm, *_inputs(mm, rows, idx))
            tot, n = tot + float(s), n + k
    return tot / max(n, 1)


def check_rows(rows, check_tokens: int) -> int:
    """How many of the first rows (whole) reach `check_tokens` predicted tokens."""
    got = 0
    for j, r in enumerate(rows):
        got += len(r) - 1
        if got >= check_tokens:
            return j + 1
    return len(rows)


def pick(est: np.ndarray, k: int, seed: int) -> list[tuple[int, int]]:
    """k memories: the k//2 largest |est|, then random others (seeded)."""
    flat = np.abs(est).ravel()
    top = list(np.argsort(-flat, kind="stable")[:k // 2])
    rest = np.setdiff1d(np.arange(flat.size), top)
    rnd = np.random.default_rng(seed).choice(rest, size=min(k - len(top), len(rest)), replace=False)
    d_m = est.shape[1]
    return [(int(i // d_m), int(i % d_m)) for i in [*top, *sorted(rnd)]]


def compute(ctx) -> dict:
    from ffkv.corpus.batching import resolve_step_batch
    from ffkv.progress import progress

    t0 = time.time()
    s, rec, run = ctx.settings, ctx.record, ctx.run
    mm = ctx.model()
    _refuse_moe(mm)
    bt, rows_cap = resolve_step_batch(mm, s.batch_tokens, CPU_TOKENS, CPU_ROWS)
    rows = sentence_rows(run, rec["tokens"])
    nc = check_rows(rows, rec["check_tokens"]) if rec["check"] else 0
    # the check's sentences are batched first, on their own: their estimate is the check's
    snap = {}
    with progress(disable=None if ctx.show_progress is None else not ctx.show_progress) as bar:
        task = bar.add_task("worth: forward and backward passes", total=sum(len(r) - 1 for r in rows))
        adv = lambda k: bar.advance(task, k)  # noqa: E731
        if nc:
            est_c, n_c = estimate(mm, rows[:nc], bt, rows_cap, advance=adv)
            snap = {"est": est_c, "n": n_c}
            rest, n_r = estimate(mm, rows[nc:], bt, rows_cap, advance=adv) if nc < len(rows) else (0.0, 0)
            n = n_c + n_r
            worth = (est_c * n_c + rest * n_r) / max(n, 1)
        else:
            worth, n = estimate(mm, rows, bt, rows_cap, advance=adv)
        check = None
        if nc:
            mems = pick(snap["est"], rec["check"], rec["seed"])
            ctask = bar.add_task("worth: the check's removals", total=len(mems) + 1)
            base = mean_loss(mm, rows[:nc], None, bt, rows_cap)
            bar.advance(ctask)
            real = []
            for l, i in mems:
                real.append(mean_loss(mm, rows[:nc], [(l, i)], bt, rows_cap) - base)
                bar.advance(ctask)
            check = {"memories": mems, "real": real, "estimate": [float(snap["est"][l, i]) for l, i in mems],
                     "tokens": snap["n"], "loss": base}
    t = _table(worth, n, check)
    run.write_table("memory_worth", t)
    summ = _summary(worth, n, check, time.time() - t0)
    ctx.result = summ
    return {"summary": summ}


def _table(worth: np.ndarray, n: int, check: dict | None) -> pa.Table:
    L, d_m = worth.shape
    rank = np.empty((L, d_m), np.int32)
    for l in range(L):
        rank[l, np.argsort(-worth[l], kind="stable")] = np.arange(1, d_m + 1)
    est_c = np.full((L, d_m), np.nan)
    abl = np.full((L, d_m), np.nan)
    for (l, i), e, r in zip(check["memories"], check["estimate"], check["real"]) if check else ():
        est_c[l, i], abl[l, i] = e, r
    f = lambda x: pa.array(x.ravel(), mask=np.isnan(x.ravel()))  # noqa: E731
    return pa.table({"layer": pa.array(np.repeat(np.arange(L), d_m).astype(np.int16)),
                     "dim": pa.array(np.tile(np.arange(d_m), L).astype(np.int32)),
                     "tokens": pa.array(np.full(L * d_m, n, np.int64)), "worth": pa.array(worth.ravel()),
                     "rank": pa.array(rank.ravel()), "estimate_check": f(est_c), "ablated": f(abl)})


def _summary(worth: np.ndarray, n: int, check: dict | None, seconds: float) -> dict:
    from scipy.stats import spearmanr

    d_m = worth.shape[1]
    top = np.argsort(-worth.ravel(), kind="stable")[:10]
    out = {"layers": int(worth.shape[0]), "d_m": int(d_m), "tokens": int(n),
           "by_layer": [float(x) for x in worth.sum(1)],
           "top": [[int(i // d_m), int(i % d_m), float(worth.ravel()[i])] for i in top],
           "positive": int((worth > 0).sum()), "seconds": round(seconds, 2)}
    if check:
        rho = spearmanr(check["estimate"], check["real"]).statistic if len(check["real"]) > 1 else float("nan")
        out["check"] = {**check, "spearman": None if rho != rho else float(rho)}
    return out


def summary(run, out, s=None, as_json: bool = False) -> None:
    summ = {**out.info["summary"], **({"skipped": True} if out.skipped else {})}
    if as_json:
        print(json.dumps(summ, indent=2))
        return
    lines = [f"worth: {summ['layers'] * summ['d_m']:,} memories over {summ['tokens']:,} predicted tokens "
             f"({summ['seconds']:.0f} s); removing one raises the loss for {summ['positive']:,} of them"]
    lines.append("  the most valuable (layer:dim, nats per token): "
                 + ", ".join(f"{l}:{d} {w:+.3g}" for l, d, w in summ["top"][:5]))
    c = summ.get("check")
    if c:
        rho = c["spearman"]
        lines.append(f"  checked by real removal of {len(c['memories'])} memories over {c['tokens']:,} tokens: Spearman "
                     f"{'n/a' if rho is None else f'{rho:.2f}'} between the estimates and the real rises")
    lines.append("  table: memory_worth")
    print("\n".join(lines))
