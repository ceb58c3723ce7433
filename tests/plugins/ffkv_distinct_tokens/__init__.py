"""An example third-party step: how many distinct tokens end each key's top trigger prefixes.

It lives in this one package and is registered by one line, the entry point in the dist-info's
`entry_points.txt` beside it; no file of ffkv is edited. It then has a command (`ffkv
distinct-tokens RUN`) writing its table, an `ffkv reproduce` option (`--distinct-top`), a
paper-style report section with its own paper entry, verdict and figure (`report.py`), a panel on
each memory's browser page drawn by its own partial (`panel.html`), a later one (the other list's,
computed when the page asks for it) and a column in the browser's overview. tests/test_step_plugin.py checks all of it.

Table `distinct_tokens`: layer int16, dim int32, sign int8, triggers int32 (prefixes read),
distinct int32 (distinct last tokens among them), top_token int32 (the most frequent; ties: the
smallest id), top_count int32.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from ffkv.steps import Flag, Panel, Step, at_least, lazy, setting

NAME = "distinct_tokens"
SCHEMA = pa.schema([("layer", pa.int16()), ("dim", pa.int32()), ("sign", pa.int8()), ("triggers", pa.int32()),
                    ("distinct", pa.int32()), ("top_token", pa.int32()), ("top_count", pa.int32())])


@dataclass(frozen=True)
class DistinctSettings:
    top: int = setting(25, "Trigger ranks read per key.", check=at_least(1), short="-t",
                       reproduce=Flag("--distinct-top", help="Trigger ranks the example step reads per key "
                                                             "(default 25)."))
    sign: int = setting(1, "Which lists: 1 (top positive) or -1 (most negative).",
                        check=lambda v: None if v in (1, -1) else f"must be 1 or -1 (got {v})")


def compute(ctx) -> dict:
    from ffkv.store import query

    s = ctx.settings
    trig = query.read_triggers(ctx.run, s.sign, max_rank=s.top, columns=["layer", "dim", "sentence_id", "position"])
    sents = query.sentence_lookup(ctx.run, sorted(set(trig.column("sentence_id").to_pylist())))
    per: dict[tuple[int, int], Counter] = {}
    for l, d, sid, pos in zip(*(trig.column(c).to_pylist() for c in ("layer", "dim", "sentence_id", "position"))):
        per.setdefault((l, d), Counter())[sents[sid][pos]] += 1
    rows = []
    for (l, d), c in sorted(per.items()):
        tok, n = min(c.items(), key=lambda kv: (-kv[1], kv[0]))
        rows.append((l, d, s.sign, sum(c.values()), len(c), tok, n))
    cols = list(zip(*rows)) if rows else [[] for _ in SCHEMA]
    ctx.run.write_table(NAME, pa.table([pa.array(c, f.type) for c, f in zip(cols, SCHEMA)], schema=SCHEMA))
    return {"keys": len(rows)}


def panels(run, layer, dim):
    from ffkv.store import query

    t = query.table(run, NAME, filters=[("layer", "=", layer), ("dim", "=", dim)]).to_pylist()
    vocab = query.vocab_texts(run)
    return [Panel("Distinct trigger tokens", ("sign", "prefixes", "distinct", "most frequent", "count"),
                  tuple((r["sign"], r["triggers"], r["distinct"], vocab[r["top_token"]], r["top_count"]) for r in t),
                  note="From the example step in tests/plugins.")]


def later_panels(run, layer, dim):
    """The other list's count, read from the triggers when the page asks (`Step.later_panels`: here a
    stand-in for a panel that needs a model forward), drawn by the same partial."""
    from ffkv.store import query

    rec = run.manifest["settings"][NAME]
    sign = -int(rec["sign"])
    trig = query.table(run, "triggers", columns=["sentence_id", "position"],
                       filters=[("layer", "=", layer), ("dim", "=", dim), ("sign", "=", sign),
                                ("rank", "<=", int(rec["top"]))]).to_pylist()
    if not trig:
        return []
    sents = query.sentence_lookup(run, sorted({r["sentence_id"] for r in trig}))
    c = Counter(sents[r["sentence_id"]][r["position"]] for r in trig)
    tok, n = min(c.items(), key=lambda kv: (-kv[1], kv[0]))
    return [Panel("Distinct trigger tokens of the other list", ("sign", "prefixes", "distinct", "most frequent", "count"),
                  ((sign, sum(c.values()), len(c), query.vocab_texts(run)[tok], n),),
                  note="From the example step in tests/plugins, computed when asked.")]


def overview(run) -> dict:
    """One overview column: the mean number of distinct last tokens per key, by layer."""
    from ffkv.store import query

    t = query.table(run, NAME, columns=["layer", "distinct"])
    sums: dict[int, list[int]] = {}
    for l, n in zip(t.column("layer").to_pylist(), t.column("distinct").to_pylist()):
        sums.setdefault(l, []).append(n)
    return {"distinct last tokens": {l: sum(v) / len(v) for l, v in sums.items()}}


STEP = Step(NAME, DistinctSettings, requires=("mine",), tables=(NAME,), compute=compute,
            help="Count the distinct last tokens of each key's top trigger prefixes.", cli=True,
            reproduce=lambda r, mm: DistinctSettings(top=r.distinct_top), sections=lazy(f"{__name__}.report:sections"),
            panels=panels, later_panels=later_panels, later_label=lambda run, l, d: "the other list's distinct tokens",
            panel_template=f"{__name__}:panel.html", overview=overview)
