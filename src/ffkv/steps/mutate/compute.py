"""Fig 3 of the paper: how a key's coefficient changes when a trigger example is mutated.

For a seeded sample of keys per layer, each key's top trigger examples (default 50) get three
variants: the first token removed, the last token removed, a random token removed. The key's
coefficient is re-scored on every variant and compared with the original.

Conventions (documented because they are choices):
- A trigger example of key (ℓ, i) is the prefix `token_ids[:position + 1]` of its sentence; its
  coefficient is m_i at the prefix's last position (`MemoryModel.coefficients`, read by the
  capture at the value projection's input).
- "first" removes the first *real* token: when the tokenizer prepends special tokens (a BOS, as
  Llama-2 tokenizers do; SmolLM2 and GPT-2 prepend none) and the sentence starts with them, they
  are kept and the token after them is removed. "random" removes a token drawn uniformly from the
  real tokens of the prefix (it may be the first or the last one), with a generator seeded by
  (seed, layer). A prefix with fewer than 2 real tokens cannot be mutated (the variant would be
  empty or only specials): it is skipped and counted (`n_skipped` in `mutations_layers`).
- Relative change = (new − old) / old = new/old − 1, with old = the trigger's coefficient
  re-computed in the same pass as the variants (same device and dtype; the mined `coef` is kept as
  `trigger_coef` and the largest mismatch is recorded in the manifest). The formula is the same for
  gated FFNs, whose coefficients are signed: for positive triggers (sign +1, the default) and for
  negative ones (`sign=-1`) alike, −0.5 means the coefficient lost half of its value in the
  trigger's own direction, and a value below −1 means it changed sign. `rel_change` is NaN when
  old == 0 (left out of the summaries).
- A mixture of experts: the coefficient carries the router's weight, so a mutation that routes the
  token to other experts gives exactly 0 (rel_change −1): the key no longer fires. Nothing here
  is specific to it (tests/test_moe_steps.py holds every coefficient to a brute force).

Speed: the originals and variants of all keys and layers are re-scored at once by
`ffkv.memories.rescore`, which shares the work: a "last" variant is read from its original's
pass, a "random" one continues its original's cached keys and values (each variant's anchor is its
original), batches stop at their deepest layer.

Tables (public contract):
- `mutations`: layer int16, dim int32, sign int8, rank int16, sentence_id int64, position int32
  (the trigger prefix's last index in the sentence), mutation string (first | last | random),
  removed_position int32 (index in the sentence of the removed token), removed_token int32,
  n_tokens int32 (length of the mutated prefix), trigger_coef float32 (as mined), old_coef float32
  (re-computed), new_coef float32, rel_change float32. Sorted by layer, dim, rank, mutation.
- `mutations_layers`: layer int16, mutation string, n int64 (variants scored), n_skipped int64
  (examples too short to mutate), mean, q25, median, q75 (of rel_change, float64),
  share_lower float64 (share of variants with new < old in the trigger's direction, rel < 0).

The step: `ffkv.steps.mutate.STEP` (settings `MutateSettings`, manifest settings `settings_for`),
run through `ffkv.steps.lifecycle.execute(run, "mutate", MutateSettings(...))`; `mutate(run, mm, ...)`
is the computation alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ffkv.corpus.sources import leading_specials, n_special
from ffkv.errors import FfkvError
from ffkv.memories.rescore import MAX_ROWS, RescoreStats, rescore
from ffkv.store.query import mined_keys, read_triggers, sample_keys, sentence_lookup
from ffkv.steps.mutate import DEFAULT_EXAMPLES, DEFAULT_KEYS_PER_LAYER, MutateSettings

MUTATIONS = ("first", "last", "random")


# ---- the experiment ----------------------------------------------------------------------------
@dataclass
class MutateResult:
    mutations: pa.Table
    layers: pa.Table
    stats: dict = field(default_factory=dict)


def build_variants(trig: dict, sents: dict[int, list[int]], specials: list[int], seed: int):
    """Requests for originals and variants. `trig` has numpy columns layer, dim, rank, coef,
    sentence_id, position, sorted by layer, dim, rank. Returns (requests, rows, skipped) where
    requests = (seqs, layers, positions, dims, anchors) — a variant's anchor is its original,
    whose first tokens it shares — and rows describe each variant."""
    seqs, lays, poss, dims, anchors = [], [], [], [], []
    rows = {k: [] for k in ("t", "mutation", "removed_position", "removed_token", "n_tokens",
                            "old_req", "new_req")}
    skipped: dict[int, int] = {}
    rngs: dict[int, np.random.Generator] = {}

    def req(seq, layer, dim, anchor=-1):
        seqs.append(seq)
        lays.append(layer)
        poss.append(len(seq) - 1)
        dims.append(dim)
        anchors.append(anchor)
        return len(seqs) - 1

    for t in range(len(trig["layer"])):
        layer, dim = int(trig["layer"][t]), int(trig["dim"][t])
        sid, pos = int(trig["sentence_id"][t]), int(trig["position"][t])
        ids = sents[sid]
        if pos >= len(ids):
            raise FfkvError(f"trigger position {pos} lies outside sentence {sid} ({len(ids)} tokens); "
                            "the run is inconsistent")
        k = n_special(ids, specials)
        if pos + 1 - k < 2:
            skipped[layer] = skipped.get(layer, 0) + 1
            continue
        prefix = tuple(ids[: pos + 1])
        old = req(prefix, layer, dim)
        rng = rngs.setdefault(layer, np.random.default_rng([seed, 1, layer]))
        r = int(rng.integers(k, pos + 1))
        for mut, rm in (("first", k), ("last", pos), ("random", r)):
            v = prefix[:rm] + prefix[rm + 1:]
            rows["t"].append(t)
            rows["mutation"].append(mut)
            rows["removed_position"].append(rm)
            rows["removed_token"].append(prefix[rm])
            rows["n_tokens"].append(len(v))
            rows["old_req"].append(old)
            rows["new_req"].append(req(v, layer, dim, old))  # shares prefix[:rm] with the original
    return (seqs, lays, poss, dims, anchors), rows, skipped


def summarize(layer: np.ndarray, mutation: np.ndarray, rel: np.ndarray,
              skipped: dict[int, int], layers: list[int]) -> pa.Table:
    cols = {k: [] for k in ("layer", "mutation", "n", "n_skipped", "mean", "q25", "median", "q75",
                            "share_lower")}
    for l in layers:
        for mut in MUTATIONS:
            sel = (layer == l) & (mutation == mut)
            x = rel[sel]
            x = x[np.isfinite(x)].astype(np.float64)
            cols["layer"].append(l)
            cols["mutation"].append(mut)
            cols["n"].append(int(sel.sum()))
            cols["n_skipped"].append(int(skipped.get(l, 0)))
            if len(x):
                q25, med, q75 = np.percentile(x, [25, 50, 75])
                cols["mean"].append(float(x.mean()))
                cols["share_lower"].append(float((x < 0).mean()))
            else:
                q25 = med = q75 = float("nan")
                cols["mean"].append(float("nan"))
                cols["share_lower"].append(float("nan"))
            cols["q25"].append(float(q25))
            cols["median"].append(float(med))
            cols["q75"].append(float(q75))
    return pa.table({
        "layer": pa.array(cols["layer"], pa.int16()), "mutation": pa.array(cols["mutation"], pa.string()),
        "n": pa.array(cols["n"], pa.int64()), "n_skipped": pa.array(cols["n_skipped"], pa.int64()),
        **{k: pa.array(cols[k], pa.float64()) for k in ("mean", "q25", "median", "q75", "share_lower")}})


def check_settings(keys_per_layer: int | None, examples: int, sign: int = 1) -> None:
    """Settings a user can get wrong, checked before any table or model is read."""
    if examples < 1:
        raise FfkvError("--examples must be at least 1")
    if keys_per_layer is not None and keys_per_layer < 0:
        raise FfkvError("--keys-per-layer must be ≥ 0 (0 = all mined keys)")
    if sign not in (1, -1):
        raise FfkvError(f"--sign must be + or - (1 or -1), not {sign}")


def _require_layers(run, layers, mined) -> None:
    bad = sorted(set(layers) - set(int(l) for l in mined))
    if bad:
        raise FfkvError(f"layer(s) {bad} have no mined keys in {run.path}")


def select_triggers(run, sign: int, examples: int, keys_per_layer: int | None, seed: int,
                    layers=None) -> tuple[dict, dict[int, np.ndarray]]:
    """The top-`examples` triggers of a seeded sample of keys: (numpy columns layer, dim, rank,
    coef, sentence_id, position sorted by layer, dim, rank; the sample, layer -> dims)."""
    trig = read_triggers(run, sign, examples, columns=["layer", "dim", "rank", "coef", "sentence_id",
                                                       "position"])
    keys = mined_keys(trig)
    if layers is not None:
        _require_layers(run, layers, keys)
        keys = {l: keys[l] for l in layers}
    chosen = sample_keys(keys, keys_per_layer, seed)
    code = np.concatenate([l * (1 << 32) + d for l, d in chosen.items()])
    tl = trig.column("layer").to_numpy().astype(np.int64)
    td = trig.column("dim").to_numpy().astype(np.int64)
    sel = np.nonzero(np.isin(tl * (1 << 32) + td, code))[0]
    t = {c: trig.column(c).to_numpy()[sel] for c in trig.column_names}
    order = np.lexsort((t["rank"], t["dim"], t["layer"]))
    return {c: v[order] for c, v in t.items()}, chosen


def _rescore_with_bar(mm, requests: tuple, batch_tokens: int, show_progress: bool | None,
                      share_prefixes: bool, max_rows: int = MAX_ROWS) -> tuple[np.ndarray, RescoreStats]:
    """`rescore` the requests of `build_variants` under a progress bar."""
    from ffkv.progress import progress

    seqs, lays, poss, dims, anchors = requests
    stats = RescoreStats()
    with progress(show_progress is False if show_progress is not None else None) as pb:
        task = pb.add_task("mutate: re-scoring", total=None, tokens=0)

        def bar(n, tok, total=None):
            if total is not None:
                pb.update(task, total=total)
            pb.update(task, advance=n, tokens=pb.tasks[task].fields["tokens"] + tok)

        coef = rescore(mm, seqs, lays, poss, dims, batch_tokens=batch_tokens, bar=bar, stats=stats,
                       anchors=anchors if share_prefixes else None, max_rows=max_rows)
    return coef, stats


def mutations_table(t: dict, rows: dict, coef: np.ndarray, sign: int) -> pa.Table:
    """The `mutations` table: one row per variant, its trigger's columns and both coefficients."""
    ti = np.asarray(rows["t"], dtype=np.int64)
    old = coef[np.asarray(rows["old_req"], dtype=np.int64)] if len(ti) else np.zeros(0, np.float32)
    new = coef[np.asarray(rows["new_req"], dtype=np.int64)] if len(ti) else np.zeros(0, np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(old != 0, (new - old) / old, np.nan).astype(np.float32)
    return pa.table({
        "layer": pa.array(t["layer"][ti].astype(np.int16), pa.int16()),
        "dim": pa.array(t["dim"][ti].astype(np.int32), pa.int32()),
        "sign": pa.array(np.full(len(ti), sign, np.int8), pa.int8()),
        "rank": pa.array(t["rank"][ti].astype(np.int16), pa.int16()),
        "sentence_id": pa.array(t["sentence_id"][ti].astype(np.int64), pa.int64()),
        "position": pa.array(t["position"][ti].astype(np.int32), pa.int32()),
        "mutation": pa.array(list(np.asarray(rows["mutation"], dtype=object)), pa.string()),
        "removed_position": pa.array(np.asarray(rows["removed_position"], np.int32), pa.int32()),
        "removed_token": pa.array(np.asarray(rows["removed_token"], np.int32), pa.int32()),
        "n_tokens": pa.array(np.asarray(rows["n_tokens"], np.int32), pa.int32()),
        "trigger_coef": pa.array(t["coef"][ti].astype(np.float32), pa.float32()),
        "old_coef": pa.array(old, pa.float32()),
        "new_coef": pa.array(new, pa.float32()),
        "rel_change": pa.array(rel, pa.float32()),
    })


def max_rel_mismatch(table: pa.Table) -> float:
    """Largest |old − mined| / |mined| (denominator ≥ 1e-6): re-computed against mined coefficients."""
    if not table.num_rows:
        return 0.0
    trig_coef = table.column("trigger_coef").to_numpy().astype(np.float64)
    old = table.column("old_coef").to_numpy()
    return float(np.max(np.abs(old - trig_coef) / np.maximum(np.abs(trig_coef), 1e-6)))


def mutate(run, mm, keys_per_layer: int | None = DEFAULT_KEYS_PER_LAYER,
           examples: int = DEFAULT_EXAMPLES, sign: int = 1, seed: int = 0,
           batch_tokens: int | str = "auto", layers=None, show_progress: bool | None = None,
           write: bool = True, share_prefixes: bool = True) -> MutateResult:
    """Run the experiment and (with `write`) store `mutations` and `mutations_layers`.
    batch_tokens: a number, or auto (2048 on a CPU; on CUDA sized from free memory,
    `ffkv.corpus.batching.step_batch`)."""
    from ffkv.corpus.batching import resolve_step_batch

    check_settings(keys_per_layer, examples, sign)
    batch_tokens, max_rows = resolve_step_batch(mm, batch_tokens, 2048, MAX_ROWS)
    t0 = time.perf_counter()
    t, chosen = select_triggers(run, sign, examples, keys_per_layer, seed, layers)
    sents = sentence_lookup(run, t["sentence_id"])
    requests, rows, skipped = build_variants(t, sents, leading_specials(mm.tok), seed)
    coef, stats = _rescore_with_bar(mm, requests, batch_tokens, show_progress, share_prefixes, max_rows)
    table = mutations_table(t, rows, coef, sign)
    summary = summarize(table.column("layer").to_numpy().astype(np.int64),
                        np.asarray(rows["mutation"], dtype=object),
                        table.column("rel_change").to_numpy(), skipped, sorted(chosen))
    info = {
        "keys": int(sum(len(d) for d in chosen.values())),
        "layers": len(chosen),
        "examples_scored": int(table.num_rows // 3),
        "examples_skipped": int(sum(skipped.values())),
        "variants": int(table.num_rows),
        "max_rel_mismatch_vs_mined_coef": max_rel_mismatch(table),
        "rescore": {**stats.as_dict(), "batch_tokens": batch_tokens, "max_rows": max_rows},
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if write:
        run.write_table("mutations", table)
        run.write_table("mutations_layers", summary)
    return MutateResult(table, summary, info)


def settings_for(keys_per_layer, examples, sign, seed, layers, dtype: str = "auto") -> dict:
    """What the results depend on (not batch size or device, up to float rounding)."""
    return {"keys_per_layer": keys_per_layer or 0, "examples": examples, "sign": sign, "seed": seed,
            "layers": sorted(layers) if layers else None, "dtype": dtype}


# ---- the step ----------------------------------------------------------------------------------


def record(run, s: MutateSettings) -> dict:
    """The manifest's settings of the step (`settings_for`); the fields' own checks ran before
    (`ffkv.steps.mutate`); this refuses layers without mined triggers, before any model is loaded."""
    if s.layers:
        mined = read_triggers(run, s.sign, 1, columns=["layer"]).column("layer").to_numpy()
        _require_layers(run, s.layers, np.unique(mined))
    return settings_for(s.keys_per_layer, s.examples, s.sign, s.seed, s.layers, s.dtype)


def compute(ctx) -> dict:
    """Open the model (in the settings' dtype unless the caller gave one), run the experiment, and
    keep its numbers but the wall time (the manifest times the step itself)."""
    s = ctx.settings
    res = mutate(ctx.run, ctx.model(), keys_per_layer=s.keys_per_layer, examples=s.examples, sign=s.sign,
                 seed=s.seed, batch_tokens=s.batch_tokens, layers=list(s.layers) if s.layers else None,
                 show_progress=ctx.show_progress)
    ctx.result = res
    return {k: v for k, v in res.stats.items() if k != "seconds"}
