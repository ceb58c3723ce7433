"""An example third-party step: how many distinct tokens end each key's top trigger prefixes.

It lives in this one package and is registered by one line, the entry point in
`ffkv_distinct_tokens-0.1.dist-info/entry_points.txt`; no file of ffkv is edited. It then has
a command (`ffkv distinct-tokens RUN`), runs in `ffkv reproduce`, adds a report section and a
panel on each memory's browser page. tests/test_step_plugin.py checks all of it.

Table `distinct_tokens`: layer int16, dim int32, sign int8, triggers int32 (prefixes read),
distinct int32 (distinct last tokens among them), top_token int32 (the most frequent; ties: the
smallest id), top_count int32.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from ffkv.steps import Panel, ReportSection, Step, at_least, setting

SCHEMA = pa.schema([("layer", pa.int16()), ("dim", pa.int32()), ("sign", pa.int8()), ("triggers", pa.int32()),
                    ("distinct", pa.int32()), ("top_token", pa.int32()), ("top_count", pa.int32())])


@dataclass(frozen=True)
class DistinctSettings:
    top: int = setting(25, "Trigger ranks read per key.", check=at_least(1), short="-t")
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
    ctx.run.write_table("distinct_tokens", pa.table([pa.array(c, f.type) for c, f in zip(cols, SCHEMA)], schema=SCHEMA))
    return {"keys": len(rows)}


def sections(run, fig_dir):
    from ffkv.report.html import table

    t = run.read_table("distinct_tokens").to_pandas()
    by = t.groupby("layer")["distinct"].mean()
    rows = [[int(l), float(v)] for l, v in by.items()]
    return [ReportSection("distinct_tokens", "Distinct trigger tokens per key",
                          "<p>Mean number of distinct last tokens among a key's top trigger prefixes.</p>"
                          + table(["layer", "mean distinct"], rows, num={1}),
                          ({"id": "distinct_tokens", "title": "Distinct trigger tokens", "verdict": "not comparable",
                            "criterion": "beyond the paper", "measured": f"{t['distinct'].mean():.2f} on average"},))]


def panels(run, layer, dim):
    from ffkv.store import query

    t = query.table(run, "distinct_tokens", filters=[("layer", "=", layer), ("dim", "=", dim)]).to_pylist()
    vocab = query.vocab_texts(run)
    return [Panel("Distinct trigger tokens", ("sign", "prefixes", "distinct", "most frequent", "count"),
                  tuple((r["sign"], r["triggers"], r["distinct"], vocab[r["top_token"]], r["top_count"]) for r in t),
                  note="From the example step in tests/plugins.")]


STEP = Step("distinct_tokens", DistinctSettings, requires=("mine",), tables=("distinct_tokens",), compute=compute,
            help="Count the distinct last tokens of each key's top trigger prefixes.", cli=True,
            reproduce=lambda s, mm: DistinctSettings(), sections=sections, panels=panels)
