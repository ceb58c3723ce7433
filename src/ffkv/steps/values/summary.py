"""What `ffkv values` prints: the step's summary (the manifest's steps.values.summary) as text or JSON."""
from __future__ import annotations

import json

from ffkv.defs import lens_name, pct
from ffkv.steps.values import TABLES


def summary(run, out, s=None, as_json: bool = False) -> None:
    summ = {**out.info["summary"], **({"skipped": True} if out.skipped else {})}
    print(json.dumps(summ, indent=2) if as_json else format_summary(summ))


def _pct(x, digits: int = 2) -> str:
    """`defs.pct`, with the summary's "n/a" for a missing value."""
    return "n/a" if x is None or x != x else pct(x, digits)


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
    for ln, o in (s.get("other_lenses") or {}).items():
        lines.insert(-1, f"  {lens_name(ln)}: agreement by thirds "
                     + ", ".join(_pct(mean_of(o["layer_agreement"][a:b])) for a, b in thirds if b > a)
                     + "; median rank by thirds " + ", ".join(
                         f"{mean_of(o['layer_rank_median'][a:b]):,.0f}" if mean_of(o['layer_rank_median'][a:b]) is not None
                         else "n/a" for a, b in thirds if b > a)
                     + f"; Fig 6 lowest bin {_pct(o['fig6_low'])}, highest {_pct(o['fig6_high'])}")
    return "\n".join(lines)
