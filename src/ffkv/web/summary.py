"""One line per memory, written from what the run has measured (no language model writes it).

`summary_line(parts)` is THE function that writes the line; `Summaries(browser)` gathers its
parts for every memory once (lazily, on first use) from the run's tables:

- every part is of the memory's dominant side s (`ffkv.web.measures.dominant_signs`: the side with
  more activation mass), so a memory whose − side dominates is described by −v and its most
  negative prefixes, and its line says so ("− side:");
- a first-position memory (`ffkv.web.measures.first_position`: its side peaks at a sentence's
  first token in most sentences) is said to be one first, with that share; its pattern is left
  out, since a one-token prefix at position 0 makes any pattern describe the sentence's opening
  word, not what the key detects (issue 48: 11/1229, m ≈ 3,500 at position 0 only, read as a
  "shallow pattern ends with j");
- the strongest automatic pattern of side s's list (`patterns`): the one covering the most of
  the key's top prefixes, then the smallest p-value;
- the top trigger tokens: the tokens its top `TRIGGER_TOP` trigger prefixes of side s end in,
  the most frequent first (shown with their count when a token recurs);
- the top tokens of s·v (`values`, kind `value` or `neg_value`, the run's lens) and its max probability;
- the human annotations (`annotations.sqlite`): the first pattern's description, else the
  note, read when the line is asked for (annotations change while the server runs).

It is a summary of measurements, not an explanation of the memory.
"""
from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from ffkv.display import show_token

TRIGGER_TOP = 25      # prefixes read for the trigger tokens (the paper's top 25)
TOKENS_SHOWN = 3      # trigger tokens and value tokens in a line
MAX_DESCRIPTION = 60  # characters of a pattern description or a note in a line


def _clip(s: str, n: int = MAX_DESCRIPTION) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 1] + "…"


def summary_line(pattern: dict | None = None, triggers: list[tuple[str, int]] | None = None, n_triggers: int = 0,
                 value: dict | None = None, annotation: dict | None = None, sign: int = 1,
                 first_share: float | None = None) -> str:
    """The one-line summary of a memory, from its parts (each may be missing), all of side `sign`:
    pattern {kind, description, n_covered, n}; triggers [(token text, count)] of n_triggers
    prefixes; value {tokens: [text], max_prob}; annotation {annotator, text}; first_share, set
    only for a first-position memory: the share of sentences that peak at position 0."""
    out = []
    if first_share is not None:
        out.append(f"first-position memory (peaks at a sentence's first token in {100 * first_share:.0f}% "
                   "of sentences)")
        pattern = None
    if pattern:
        out.append(f"{pattern['kind']} pattern “{_clip(pattern['description'])}” "
                   f"({pattern['n_covered']}/{pattern['n']} prefixes)")
    if triggers:
        toks = ", ".join(show_token(t) + (f" ×{c}" if c > 1 else "") for t, c in triggers)
        out.append(f"top triggers end in {toks}" + (f" (of {n_triggers})" if n_triggers else ""))
    if value and value.get("tokens"):
        p = value.get("max_prob")
        out.append("value promotes " + ", ".join(show_token(t) for t in value["tokens"])
                   + (f" (top p {p:.2g})" if p is not None and p == p else ""))
    if annotation:
        out.append(f"annotated by {_clip(annotation['annotator'], 30)}: “{_clip(annotation['text'])}”")
    if not out:
        return "nothing measured yet"
    return ("− side: " if sign == -1 else "") + " · ".join(out)


class Summaries:
    """The parts of every memory's line, gathered once from the browser's tables."""

    def __init__(self, b):
        from ffkv.web.measures import dominant_signs, first_position, first_shares

        self.b = b
        N = b.L * b.d_m
        self.sign = dominant_signs(b)
        self.first, self.first_share = first_position(b), first_shares(b)
        self.triggers: dict[int, tuple[list[tuple[str, int]], int]] = {}
        self.value: dict[int, dict] = {}
        self.pattern: dict[int, dict] = {}
        # top trigger tokens: counts of (memory, token) among the top prefixes of its dominant side
        sel = np.nonzero((b.trig_sign == self.sign[b.trig.code]) & (b.trig_rank <= TRIGGER_TOP))[0]
        if len(sel):
            code = b.trig.code[sel].astype(np.int64)
            tok = b.trig_token[sel].astype(np.int64)
            n_per = np.bincount(code, minlength=N)
            pair, count = np.unique(code * max(b.V, 1) + tok, return_counts=True)
            pc_, pt = pair // max(b.V, 1), pair % max(b.V, 1)
            order = np.lexsort((pt, -count, pc_))  # per memory: most frequent first, then token id
            pc_, pt, count = pc_[order], pt[order], count[order]
            starts = np.searchsorted(pc_, np.unique(pc_))
            ends = np.append(starts[1:], len(pc_))
            for a, e in zip(starts.tolist(), ends.tolist()):
                c = int(pc_[a])
                e = min(e, a + TOKENS_SHOWN)
                self.triggers[c] = ([(b.tok(int(t)), int(k)) for t, k in zip(pt[a:e], count[a:e])], int(n_per[c]))
        if b.values is not None:
            vt = b.values.table
            for kind, s in (("value", 1), ("neg_value", -1)):
                sub = vt.filter(pc.equal(vt.column("kind"), kind))
                codes = (sub.column("layer").to_numpy().astype(np.int64) * b.d_m + sub.column("dim").to_numpy())
                for c, toks, mp in zip(codes.tolist(), sub.column("top_tokens").to_pylist(),
                                       sub.column("max_prob").to_pylist()):
                    if self.sign[c] == s:
                        self.value[c] = {"tokens": [b.tok(t) for t in (toks or [])[:TOKENS_SHOWN]], "max_prob": mp}
        if b.patterns is not None:
            pt_ = b.patterns.table
            n_of = {}
            if b.pattern_keys is not None:
                pk = b.pattern_keys.table
                for l, d, s, n in zip(*(pk.column(c).to_pylist() for c in ("layer", "dim", "sign", "n_prefixes"))):
                    n_of[(l * b.d_m + d, s)] = n
            best: dict[int, tuple] = {}
            cols = [pt_.column(c).to_pylist() for c in ("layer", "dim", "sign", "kind", "description",
                                                          "n_covered", "p_value")]
            for l, d, s, kind, desc, nc, pv in zip(*cols):
                c = l * b.d_m + d
                if s != self.sign[c]:  # a pattern of the other side's prefixes describes the weak side
                    continue
                key = (-(nc or 0), pv if pv is not None else 1.0)  # coverage, then p-value
                if c not in best or key < best[c][0]:
                    best[c] = (key, {"kind": kind, "description": desc, "n_covered": nc,
                                     "n": n_of.get((c, s), TRIGGER_TOP), "sign": s})
            self.pattern = {c: v for c, (_, v) in best.items()}

    def parts(self, code: int, annotation: dict | None = None) -> dict:
        trig, n = self.triggers.get(code, ([], 0))
        return {"pattern": self.pattern.get(code), "triggers": trig, "n_triggers": n,
                "value": self.value.get(code), "annotation": annotation, "sign": int(self.sign[code]),
                "first_share": float(self.first_share[code]) if self.first[code] else None}

    def line(self, code: int, annotation: dict | None = None) -> str:
        return summary_line(**self.parts(code, annotation))


def annotation_part(records: list[dict]) -> dict | None:
    """The annotation shown in a line: the latest record's first pattern description, else its note."""
    for r in sorted(records, key=lambda r: -(r.get("updated") or 0)):
        pats = [p for p in r.get("patterns") or [] if str(p.get("description") or "").strip()]
        text = pats[0]["description"] if pats else str(r.get("note") or "").strip()
        if text:
            return {"annotator": r["annotator"], "text": text}
    return None
