"""Shallow patterns of one key's prefixes: shared endings, last tokens, shapes and n-grams."""
from __future__ import annotations

import json
from collections import Counter

from ffkv.steps.patterns.words import ALPHA, MIN_COVER, STOP, Background, Pattern, Prefix, binom_tail

# on equal coverage and length, the more specific family wins
SPECIFICITY = {"end": 3, "tok": 2, "shape": 1, "has": 0}


def _describe(feat, surfaces: Counter) -> tuple[str, str]:
    forms = [f for f, _ in sorted(surfaces.items(), key=lambda kv: (-kv[1], kv[0]))][:4]
    quoted = "/".join(json.dumps(f, ensure_ascii=False) for f in forms)
    kind, val = feat
    if kind == "end":
        return ("last_word" if len(val) == 1 else "suffix"), f"ends with {quoted}"
    if kind == "tok":
        return "last_token", f"last token {quoted}"
    if kind == "shape":
        return "shape", f"ends with a {val} ({quoted})"
    return "ngram", f"contains {quoted}"


def _nested(a: tuple, b: tuple, suffix_only: bool) -> bool:
    """Is word tuple a a suffix (or, without suffix_only, a contiguous part) of b?"""
    if len(a) > len(b):
        return False
    if suffix_only:
        return b[len(b) - len(a):] == a
    return any(b[i:i + len(a)] == a for i in range(len(b) - len(a) + 1))


def _surface_ngram(ws: list[str], nw: list[str], g: tuple) -> str:
    for i in range(len(nw) - len(g) + 1):
        if tuple(nw[i:i + len(g)]) == g:
            return " ".join(ws[i:i + len(g)])
    return " ".join(g)


def _end_cover(prefixes: list[Prefix]) -> tuple[dict, dict]:
    """Ending features (end / tok / shape) -> prefixes having them, and their surface forms."""
    cover: dict = {}
    surf: dict = {}
    for i, p in enumerate(prefixes):
        for f, s in p.ends:  # distinct features per prefix (`end_features`)
            cover.setdefault(f, []).append(i)
            surf.setdefault(f, []).append(s)
    return cover, surf


def _has_cover(nws: list[list[str]], min_cover: int) -> dict:
    """("has", n-gram) -> prefixes containing it, for 1–3 word n-grams not made only of STOP words.

    Apriori: an n-gram covering ≥ min_cover prefixes is made of frequent words, so only n-grams of
    consecutive frequent words are formed (the n-grams of rarer words are never built)."""
    uni = Counter(w for nw in nws for w in set(nw))
    frequent = {w for w, c in uni.items() if c >= min_cover}
    has_cover: dict = {}
    for i, nw in enumerate(nws):
        feats: set = set()
        a = b = None  # the two words before w, when frequent and consecutive
        for w in nw:
            if w not in frequent:
                a = b = None
                continue
            feats.add((w,))
            if b is not None:
                feats.add((b, w))
                if a is not None:
                    feats.add((a, b, w))
            a, b = b, w
        for g in feats:
            if not STOP.issuperset(g):
                has_cover.setdefault(("has", g), set()).add(i)
    return has_cover


def _candidates(covers: list[tuple], words, nws, surf: dict, n: int, bg: Background, min_cover: int,
                alpha: float) -> list[Pattern]:
    """Every feature covering ≥ min_cover prefixes with a binomial tail below alpha."""
    cands = []
    for f, cov in covers:
        if len(cov) < min_cover:
            continue
        pv = binom_tail(n, len(cov), bg.df.get(f, 0), bg.n)
        if pv >= alpha:
            continue
        s = Counter(_surface_ngram(words[i], nws[i], f[1]) for i in cov) if f[0] == "has" else Counter(surf[f])
        sub, desc = _describe(f, s)
        ws = f[1] if f[0] in ("end", "has") else ((f[1],) if f[0] == "tok" else ())
        cands.append(Pattern("shallow", sub, desc, tuple(sorted(cov)), pv, bg.rate(f),
                             words=tuple(ws), family="has" if f[0] == "has" else f[0]))
    return cands


def _covered_by(p: Pattern, k: Pattern) -> bool:
    """Is p (covering a subset of k's prefixes) the same pattern as k in other words?"""
    if p.family == k.family == "end":
        return _nested(p.words, k.words, True) or _nested(k.words, p.words, True)
    if p.family == k.family == "has":
        return _nested(p.words, k.words, False) or _nested(k.words, p.words, False)
    if {p.family, k.family} == {"end", "tok"}:
        a, b = (p, k) if p.family == "tok" else (k, p)
        return "".join(ch for ch in a.words[0] if ch.isalnum()) in "".join(b.words)
    return False


def _explained_by_ending(p: Pattern, ends: list[Pattern], min_cover: int) -> bool:
    """A `contains` pattern whose prefixes an `ends with` pattern of the same words covers, all
    but fewer than min_cover of them."""
    cov = set(p.covered)
    return any(k.family == "end" and _nested(p.words, k.words, False) and set(k.covered) <= cov
               and len(cov - set(k.covered)) < min_cover for k in ends)


def _drop_redundant(cands: list[Pattern], min_cover: int) -> list[Pattern]:
    """Of nested patterns keep the one covering more prefixes (on a tie, the more specific)."""
    cands.sort(key=lambda p: (-len(p.covered), -len(p.words), -SPECIFICITY[p.family], p.description))
    all_ends = [c for c in cands if c.family == "end"]
    kept: list[Pattern] = []
    for p in cands:
        cov = set(p.covered)
        if any(cov <= set(k.covered) and _covered_by(p, k) for k in kept):
            continue
        if p.family == "has" and _explained_by_ending(p, kept + all_ends, min_cover):
            continue
        kept.append(p)
    return kept


def shallow_patterns(prefixes: list[Prefix], bg: Background, min_cover: int = MIN_COVER,
                     alpha: float = ALPHA, indices: list[int] | None = None) -> list[Pattern]:
    """Shallow patterns of one key's prefixes; `indices` are their prefix indices (default 0..n-1)."""
    n = len(prefixes)
    idx = list(range(n)) if indices is None else list(indices)
    if n < min_cover:
        return []
    words = [p.words for p in prefixes]
    nws = [p.norm_words for p in prefixes]
    cover, surf = _end_cover(prefixes)
    covers = list(cover.items()) + list(_has_cover(nws, min_cover).items())
    kept = _drop_redundant(_candidates(covers, words, nws, surf, n, bg, min_cover, alpha), min_cover)
    for p in kept:
        p.covered = tuple(idx[i] for i in p.covered)
    kept.sort(key=lambda p: (-len(p.covered), p.description))
    return kept
