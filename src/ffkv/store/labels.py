"""Key labels and prefix categories, shared by automatic patterns and human annotations.

A key's top `TOP` trigger prefixes (prefix i = its trigger of rank i + 1) carry patterns, each
shallow or semantic (`KINDS`) and covering some prefixes. From them:
- a key's label (`LABELS`): shallow | semantic | both (patterns of both kinds) | none;
- each prefix's category (`CATEGORIES`): shallow | semantic | both | not_covered, by the kinds of
  the patterns that cover it (the paper's Fig 2);
- per layer, the share of prefixes in each category, patterns per key and keys with a pattern.

`ffkv.steps.patterns.compute` (tables `pattern_keys`, `patterns_fig2`) and
`ffkv.store.annotations` (`AnnotationStore.stats`) both count with these functions.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

TOP = 25  # prefixes per key, as the paper's experts read them
KINDS = ("shallow", "semantic")
LABELS = ("shallow", "semantic", "both", "none")
CATEGORIES = ("shallow", "semantic", "both", "not_covered")


def label_of(shallow: bool, semantic: bool) -> str:
    """The key label from whether it has shallow and semantic patterns."""
    return "both" if shallow and semantic else "shallow" if shallow else "semantic" if semantic else "none"


def kind_sets(patterns: Iterable[tuple[str, Iterable[int]]]) -> tuple[set, set]:
    """(prefixes covered by a shallow pattern, by a semantic one) from (kind, covered) pairs."""
    sh, se = set(), set()
    for kind, covered in patterns:
        (sh if kind == "shallow" else se).update(covered)
    return sh, se


def _pairs(patterns: list[dict]):
    """(kind, covered) of pattern records: human ones list `prefixes`, automatic ones `covered`."""
    return ((p["kind"], p.get("prefixes", p.get("covered", []))) for p in patterns)


def categories(sh: set, se: set, n: int) -> list[str]:
    """Per prefix 0..n-1, its category given the shallow-covered and semantic-covered sets."""
    return ["both" if i in sh and i in se else "shallow" if i in sh else "semantic" if i in se
            else "not_covered" for i in range(n)]


def prefix_categories(patterns: list[dict], n: int) -> list[str]:
    """Per prefix 0..n-1: shallow / semantic / both / not_covered, from patterns with `kind` and
    `prefixes` (human records) or `covered`."""
    return categories(*kind_sets(_pairs(patterns)), n)


def key_label(patterns: list[dict]) -> str:
    """The label of a key from its pattern records (only their kinds matter)."""
    kinds = {p["kind"] for p in patterns}
    return label_of("shallow" in kinds, "semantic" in kinds)


def category_counts(cats: list[str]) -> list[int]:
    """How many prefixes fall in each of CATEGORIES."""
    return [cats.count(c) for c in CATEGORIES]


def layer_shares(layers, counts, n_patterns) -> list[dict]:
    """Fig 2 per layer from per-key (or per-annotation) rows.

    `layers` (K,), `counts` (K, 4) prefixes per CATEGORIES, `n_patterns` (K,). Returns per layer,
    ascending: layer, n (rows), prefixes, the four shares of prefixes (nan without prefixes),
    patterns_per_key (mean) and keys_with_pattern (share of rows with ≥ 1 pattern).
    """
    layers = np.asarray(layers)
    counts = np.asarray(counts).reshape(len(layers), len(CATEGORIES))
    n_patterns = np.asarray(n_patterns)
    out = []
    for l in np.unique(layers):
        s = layers == l
        c = counts[s].sum(0)
        tot = int(c.sum())
        npk = n_patterns[s]
        out.append({"layer": int(l), "n": int(s.sum()), "prefixes": tot,
                    **{k: (float(c[i]) / tot if tot else float("nan")) for i, k in enumerate(CATEGORIES)},
                    "patterns_per_key": float(npk.mean()), "keys_with_pattern": float((npk > 0).mean())})
    return out
