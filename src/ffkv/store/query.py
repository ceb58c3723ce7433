"""The read API over a run: every reader (the steps, report, annotations, web) asks here.

Nothing outside this module opens a Parquet path, so a table's location, its error messages and
its schema checks have one home. Tables come back as Arrow (`table`), or through DuckDB (`sql`,
`connect`) with one view per table, named as the table.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ffkv.errors import FfkvError
from ffkv.store.decode import Decoder

TRIGGER_COLUMNS = ("layer", "dim", "sign", "rank", "coef", "sentence_id", "position", "next_token")


# ---- tables ------------------------------------------------------------------------------------
def path(run, name: str) -> Path:
    return Path(run.path) / f"{name}.parquet"


def trusted(run, name: str) -> None:
    """Table `name` is the run's to read (`Run.table_problem`: recorded by the manifest, as
    written, by a step that is done), else FfkvError, one line: a file with a table's name that
    the manifest does not vouch for is never drawn."""
    p = path(run, name)
    if not p.exists():
        raise FfkvError(f"run {run.path} has no `{name}` table")
    problem = getattr(run, "table_problem", None)
    pr = problem(name) if problem is not None else None
    if pr is not None:
        raise FfkvError(f"the `{name}` table of {run.path} {pr}")


def table(run, name: str, columns=None, filters=None) -> pa.Table:
    """A whole table, or the columns and rows asked for (pyarrow filter syntax), once the run
    vouches for it (`trusted`)."""
    p = path(run, name)
    trusted(run, name)
    try:
        return pq.read_table(p, columns=list(columns) if columns is not None else None, filters=filters)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise FfkvError(f"the `{name}` table of {run.path} is unreadable ({first}); "
                        f"rerun the step that writes it") from None


def schema_names(run, name: str) -> list[str]:
    p = path(run, name)
    trusted(run, name)
    try:
        return list(pq.read_schema(p).names)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise FfkvError(f"the `{name}` table of {run.path} is unreadable ({str(e).splitlines()[0][:160]}); "
                        f"rerun the step that writes it") from None


def tables(run) -> list[str]:
    """Names of the run's tables: those present that it vouches for (`Run.has_table`)."""
    names = sorted(p.stem for p in Path(run.path).glob("*.parquet") if not p.name.startswith("."))
    has = getattr(run, "has_table", None)
    return [n for n in names if has is None or has(n)]


def connect(run):
    """A DuckDB connection with one view per table of the run (read-only over the Parquet files)."""
    import duckdb

    con = duckdb.connect()
    for name in tables(run):
        lit = str(path(run, name)).replace("'", "''")
        con.execute(f'CREATE VIEW "{name}" AS SELECT * FROM read_parquet(\'{lit}\')')
    return con


def sql(run, query: str, params=None) -> pa.Table:
    """Run SQL over the run's tables (each a view of its name) and return Arrow."""
    con = connect(run)
    try:
        return con.sql(query, params=params or None).to_arrow_table()
    finally:
        con.close()


# ---- triggers ----------------------------------------------------------------------------------
def check_triggers(run) -> None:
    """A readable `triggers` table with every column of the contract."""
    if not run.has_table("triggers"):
        raise FfkvError(f"run {run.path} has no `triggers` table; run `ffkv mine --out {run.path}` first")
    missing = [c for c in TRIGGER_COLUMNS if c not in set(schema_names(run, "triggers"))]
    if missing:
        raise FfkvError(f"the run's `triggers` table lacks column(s) {missing}; it was not made by "
                        f"this ffkv; rerun `ffkv mine --out {run.path}`")


def read_triggers(run, sign: int = 1, max_rank: int | None = None, columns=None) -> pa.Table:
    """The trigger rows of one sign (1: top positive, -1: most negative), up to `max_rank`."""
    if sign not in (1, -1):
        raise FfkvError(f"--sign must be + or - (1 or -1), not {sign}")
    if not run.has_table("triggers"):
        raise FfkvError(f"run {run.path} has no `triggers` table; run `ffkv mine --out {run.path}` first")
    filters = [("sign", "=", sign)]
    if max_rank is not None:
        filters.append(("rank", "<=", max_rank))
    t = table(run, "triggers", columns=columns, filters=filters)
    if t.num_rows == 0:
        raise FfkvError(f"run {run.path} has no triggers with sign {sign:+d}")
    return t


def top_triggers(run, columns=TRIGGER_COLUMNS) -> pa.Table:
    """The rank-1 rows of both signs."""
    return table(run, "triggers", columns=columns, filters=[("rank", "==", 1)])


def has_negative_lists(run) -> bool:
    """Whether the run was mined with negative lists (sign −1 rows; `ffkv mine --negative`)."""
    return table(run, "triggers", columns=["sign"], filters=[("sign", "==", -1)]).num_rows > 0


def mined_keys(trig: pa.Table) -> dict[int, np.ndarray]:
    """layer -> sorted dims that have at least one trigger in `trig`."""
    layer = trig.column("layer").to_numpy().astype(np.int64)
    dim = trig.column("dim").to_numpy().astype(np.int64)
    code = np.unique(layer * (1 << 32) + dim)
    lays = code >> 32
    return {int(l): code[lays == l] & 0xFFFFFFFF for l in np.unique(lays)}


def sample_keys(keys: dict[int, np.ndarray], per_layer: int | None, seed: int = 0) -> dict[int, np.ndarray]:
    """A seeded sample of `per_layer` keys per layer (None or 0: all of them), sorted by dim.

    Nested by design: each layer's keys are permuted by a generator seeded with (seed, layer)
    and the first `per_layer` are taken, so the 10-key sample is part of the 100-key sample
    (annotation, semantic patterns and mutations can share keys).
    """
    out = {}
    for l, dims in sorted(keys.items()):
        dims = np.sort(np.asarray(dims, dtype=np.int64))
        if per_layer and per_layer < len(dims):
            perm = np.random.default_rng([seed, l]).permutation(len(dims))
            dims = np.sort(dims[perm[:per_layer]])
        out[l] = dims
    return out


def key_sample(run, per_layer: int | None, seed: int = 0, sign: int = 1) -> dict[int, np.ndarray]:
    """The seeded, nested key sample of a run's mined keys (what mutate, patterns and annotate share)."""
    return sample_keys(mined_keys(read_triggers(run, sign, columns=["layer", "dim"])), per_layer, seed)


def sentences(run, sentence_ids=None, columns=("sentence_id", "token_ids")) -> pa.Table:
    """Rows of `sentences`, all or those with the given ids."""
    if sentence_ids is None:
        return table(run, "sentences", columns=columns)
    want = sorted({int(x) for x in np.asarray(sentence_ids, dtype=np.int64).ravel()})
    if not want:
        return table(run, "sentences", columns=columns).slice(0, 0)
    return table(run, "sentences", columns=columns, filters=[("sentence_id", "in", want)])


def sentence_lookup(run, sentence_ids) -> dict[int, list[int]]:
    """sentence_id -> token ids, for the given ids only."""
    sents = table(run, "sentences", columns=["sentence_id", "token_ids"])
    want = pa.array(np.unique(np.asarray(sentence_ids, dtype=np.int64)), pa.int64())
    sel = sents.filter(pc.is_in(sents.column("sentence_id"), value_set=want))
    got = dict(zip(sel.column("sentence_id").to_pylist(), sel.column("token_ids").to_pylist()))
    missing = len(want) - len(got)
    if missing:
        raise FfkvError(f"{missing} trigger sentence(s) are missing from the `sentences` table of "
                        f"{run.path}; the run is inconsistent (re-run `ffkv mine`)")
    return got


def vocab_texts(run) -> list[str]:
    """token id -> its decoded text, from the run's `vocab` table (no tokenizer needed)."""
    return table(run, "vocab", columns=["text"]).column("text").to_pylist()


def decoder(run) -> Decoder | None:
    """The run's decoder, from its `vocab` table (None without one)."""
    if not run.has_table("vocab"):
        return None
    names = schema_names(run, "vocab")
    t = table(run, "vocab", columns=[c for c in ("text", "token") if c in names])
    return Decoder(t.column("text").to_pylist(), t.column("token").to_pylist() if "token" in names else None)


def key_triggers(run, layer: int, dim: int, sign: int | None = None, top: int = 10) -> list[dict]:
    """A key's top trigger prefixes (both signs unless `sign`), with prefix text and next token."""
    filters = [("layer", "=", layer), ("dim", "=", dim)]
    if sign is not None:
        filters.append(("sign", "=", sign))
    trig = table(run, "triggers", filters=filters)
    if trig.num_rows == 0:
        m = run.manifest.get("model", {})
        mine = run.settings("mine") or {}
        raise FfkvError(f"no triggers for key {layer}/{dim} in {run.path} (the model has "
                        f"{m.get('layers')} layers × {m.get('d_m')} dims; mined: "
                        f"layers={mine.get('layers') or 'all'}, dims={mine.get('dims') or 'all'})")
    trig = trig.sort_by([("sign", "descending"), ("rank", "ascending")])
    rows = []
    counts: dict[int, int] = {}
    for r in trig.to_pylist():
        counts[r["sign"]] = counts.get(r["sign"], 0) + 1
        if counts[r["sign"]] <= top:
            rows.append(r)
    sent = sentences(run, [r["sentence_id"] for r in rows], columns=["sentence_id", "text", "token_ids"])
    by_sid = {r["sentence_id"]: r for r in sent.to_pylist()}
    dec = decoder(run)  # bytes joined before decoding: multi-byte characters stay whole
    out = []
    for r in rows:
        s = by_sid[r["sentence_id"]]
        toks = s["token_ids"][: r["position"] + 1]
        nt = r["next_token"]
        pieces = dec.pieces(toks)
        out.append({**r, "text": s["text"], "prefix_tokens": pieces,
                    "prefix": "".join(pieces), "trigger_token": pieces[-1] if pieces else "",
                    "next_token_text": dec.token_text(nt) if nt is not None else None})
    return out


# ---- what the other steps know about one key ---------------------------------------------------
def _key_rows(run, name: str, layer: int, dim: int, columns=None) -> list[dict]:
    if not run.has_table(name):
        return []
    return table(run, name, columns=columns, filters=[("layer", "=", layer), ("dim", "=", dim)]).to_pylist()


def _offsets(tok, texts: list[str], stored: list[list[int]]) -> list:
    """Per text, the tokenizer's character offsets when re-encoding gives the stored ids, else None."""
    out: list = [None] * len(texts)
    try:
        enc = tok(texts, add_special_tokens=True, return_offsets_mapping=True)
        for j, (e, o, ids) in enumerate(zip(enc["input_ids"], enc["offset_mapping"], stored)):
            if list(e[: len(ids)]) == list(ids):
                out[j] = o
    except Exception:  # noqa: BLE001 - slow tokenizers have no offsets: decode instead
        pass
    return out


def prefix_texts(run, tok, sentence_ids, positions) -> list[tuple[str, str]]:
    """(text, last token) of each prefix `token_ids[:position + 1]` of a sentence.

    The text is the sentence text up to the end of token `position` (from the tokenizer's
    offsets; decoded when offsets are unavailable or the prefix holds a special token); the last
    token is that token's surface text, stripped.
    """
    sids = np.asarray(sentence_ids, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    sel = sentences(run, sids, columns=["sentence_id", "text", "token_ids"])
    sid_list = sel.column("sentence_id").to_pylist()
    texts = sel.column("text").to_pylist()
    ids = sel.column("token_ids").to_pylist()
    missing = len(np.unique(sids)) - len(sid_list)
    if missing:
        raise FfkvError(f"{missing} trigger sentence(s) are missing from the `sentences` table of "
                        f"{run.path}; re-run `ffkv mine`")
    offsets = _offsets(tok, texts, ids)
    row = {s: j for j, s in enumerate(sid_list)}
    out = []
    for s, p in zip(sids.tolist(), pos.tolist()):
        j = row[s]
        o = offsets[j]
        if o is not None and p < len(o) and not (tuple(o[p]) == (0, 0) and p > 0):  # (0, 0) inside: a special token
            a, b = o[p]
            out.append((texts[j][:b], texts[j][a:b].strip()))
            continue
        t = ids[j][: p + 1]
        out.append((tok.decode(t, skip_special_tokens=True), tok.decode(t[-1:], skip_special_tokens=True).strip()))
    return out


# ---- key statistics (`ffkv mine` without --no-stats; `ffkv.mine.stats` documents the tables) ----------
KEY_STATS_TABLES = ("key_stats", "key_hist", "key_samples")


def stats_layout(run) -> dict | None:
    """The histogram bins the run's key statistics use (manifest), or None: a run mined before
    key statistics existed, or with --no-stats."""
    info = run.step("mine").get("stats")
    if not info or not all(run.has_table(t) for t in KEY_STATS_TABLES):
        return None
    return info


def has_key_stats(run) -> bool:
    return stats_layout(run) is not None


def key_stats(run, layer: int, dim: int) -> list[dict]:
    """A key's `key_stats` rows (one per mined sign, +1 first); empty when the run has none."""
    if not has_key_stats(run):
        return []
    rows = _key_rows(run, "key_stats", layer, dim)
    return sorted(rows, key=lambda r: -r["sign"])


def key_hist(run, layer: int, dim: int) -> dict | None:
    """A key's whole histogram: {"bin", "count", "sign", "lo", "hi"} lists over every bin (zeros
    filled in; hi None = unbounded), or None when the run has no key statistics."""
    lay = stats_layout(run)
    if lay is None:
        return None
    counts = [0] * int(lay["bins"])
    for r in _key_rows(run, "key_hist", layer, dim, columns=["layer", "dim", "bin", "count"]):
        counts[int(r["bin"])] = int(r["count"])
    return {"bin": list(range(int(lay["bins"]))), "count": counts, "sign": list(lay["sign"]),
            "lo": list(lay["lo"]), "hi": list(lay["hi"])}


def key_samples(run, layer: int, dim: int, sign: int | None = None) -> list[dict]:
    """A key's quantile samples, with prefix tokens: bins from the strongest down (per sign, +1
    first), within a bin by coefficient, strongest first. Empty when the run has none."""
    if not has_key_stats(run):
        return []
    rows = _key_rows(run, "key_samples", layer, dim)
    if sign is not None:
        rows = [r for r in rows if r["sign"] == sign]
    rows.sort(key=lambda r: (-r["sign"], -r["sign"] * r["bin"], -r["sign"] * r["coef"], r["sentence_id"]))
    if not rows:
        return []
    sent = sentences(run, [r["sentence_id"] for r in rows], columns=["sentence_id", "text", "token_ids"])
    by_sid = {r["sentence_id"]: r for r in sent.to_pylist()}
    vocab = vocab_texts(run)
    out = []
    for r in rows:
        s = by_sid.get(r["sentence_id"])
        toks = s["token_ids"][: r["position"] + 1] if s else []
        out.append({**r, "text": s["text"] if s else None, "prefix_tokens": [vocab[t] for t in toks]})
    return out


def covariance_layers(run) -> list[int]:
    """The layers whose keys' second moment the run keeps (`ffkv mine --covariance`), else []."""
    info = run.step("mine").get("covariance") or {}
    return list(info.get("layers", ())) if run.has_table("key_covariance") else []


def key_covariance(run, layer: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Layer `layer`'s (E[m] (d_m,), C = E[m mᵀ] (d_m, d_m) float64, tokens) from the mined pass;
    one line naming the command that makes it when the run has none for that layer."""
    have = covariance_layers(run)
    if layer not in have:
        kept = f" (it keeps layers {', '.join(map(str, have))})" if have else ""
        raise FfkvError(f"the run {run.path} has no key covariance of layer {layer}{kept}; it comes from "
                        f"`ffkv mine ... --covariance {layer}` (a run keeps its mine settings: into a new --out, "
                        f"or --overwrite this one)")
    t = table(run, "key_covariance", filters=[("layer", "=", layer)]).sort_by("dim")
    n = t.num_rows
    C = np.asarray(t.column("moment").combine_chunks().flatten().to_numpy(), np.float64).reshape(n, n)
    return t.column("mean").to_numpy().astype(np.float64), C, int(t.column("tokens")[0].as_py()) if n else 0


def sign_regimes(run, layer: int | None = None) -> pa.Table:
    """The `sign_regimes` table (`ffkv mine --regimes`; columns: `ffkv.mine.regimes`), of one layer
    or all, sorted by layer and dim; one line naming the command that makes it when the run has none."""
    if not run.has_table("sign_regimes"):
        raise FfkvError(f"the run {run.path} has no sign regimes; they come from `ffkv mine ... --regimes` "
                        "(a run keeps its mine settings: into a new --out, or --overwrite this one)")
    t = table(run, "sign_regimes", filters=None if layer is None else [("layer", "=", int(layer))])
    return t.sort_by([("layer", "ascending"), ("dim", "ascending")])


def key_stats_by_layer(run) -> pa.Table | None:
    """Per layer and sign over its keys: keys, the mean, quartiles and max of frac_active, the mean
    frac_strong, and the share of keys whose best sits on the first token in over half of the
    sentences. None when the run has no key statistics."""
    if not has_key_stats(run):
        return None
    t = table(run, "key_stats", columns=["layer", "sign", "frac_active", "frac_strong", "first_share"])
    lay, sg = t.column("layer").to_numpy(), t.column("sign").to_numpy()
    fa, fs, fst = (t.column(c).to_numpy().astype(np.float64) for c in ("frac_active", "frac_strong", "first_share"))
    rows = []
    for l in np.unique(lay):
        for s in (1, -1):
            m = (lay == l) & (sg == s)
            if not m.any():
                continue
            q25, q50, q75 = np.quantile(fa[m], [0.25, 0.5, 0.75])
            rows.append({"layer": int(l), "sign": s, "keys": int(m.sum()), "density_mean": float(fa[m].mean()),
                         "density_q25": float(q25), "density_median": float(q50), "density_q75": float(q75),
                         "density_max": float(fa[m].max()), "strong_mean": float(fs[m].mean()),
                         "first_token_keys": float((fst[m] > 0.5).mean())})
    return pa.Table.from_pylist(rows)
