"""Words, prefixes, the background of random corpus prefixes and the Pattern record (see the
package docstring)."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import pyarrow as pa

from ffkv.corpus.stopwords import stopwords
from ffkv.errors import FfkvError
from ffkv.corpus.sources import leading_specials, n_special
from ffkv.store import query
from ffkv.steps.patterns import ALPHA, BACKGROUND, MIN_COVER  # noqa: F401  (the settings' defaults)
from ffkv.store.labels import TOP  # noqa: F401  (re-exported)

WORD = re.compile(r"<[a-z]+>|[^\W_]+(?:['’][^\W_]+)*|[^\w\s]")
# "contains" patterns made only of stop words or FILLER are not reported (every prefix long
# enough has them; trigger prefixes are not of the same length as random ones); "ends with"
# patterns may be. FILLER adds to the stop-word list what fills any long Wikipedia prefix:
# modals, a few more function words, punctuation and WikiText's <unk>.
FILLER = ("""also among could it's may might must one onto shall since upon us whose without would
yet s , . ; : ! ? ' " ( ) [ ] - – — ‘ ’ “ ” <unk>""".split())
YEAR = re.compile(r"^(1[0-9]{3}|20[0-9]{2})$")


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
    """A prefix's text and last token. Its words, normalized words and ending features are
    computed once per object: `prefix_texts` gives one object per distinct prefix, and a prefix
    is the trigger of many keys (read-only lists: callers must not change them)."""
    text: str
    last_token: str  # its surface text, stripped

    @cached_property
    def words(self) -> list[str]:
        return words_of(self.text)

    @cached_property
    def norm_words(self) -> list[str]:
        return [norm_word(w) for w in self.words]

    @cached_property
    def ends(self) -> list:
        """`end_features` of the prefix."""
        return end_features(self.words, self.last_token)


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
            nw = p.norm_words
            feats = {f for f, _ in p.ends} | has_features(nw)
            df.update(feats)
            wdf.update(set(nw))
        return cls(len(prefixes), df, [p.text for p in prefixes], wdf)


@lru_cache(maxsize=100_000)
def binom_tail(n: int, c: int, df: int, B: int) -> float:
    """P(X ≥ c) for X ~ Binomial(n, (df + 0.5)/(B + 1)): scipy's binomial survival function at c − 1.

    Cached: keys share (n, c, df, B) often. Inside the support (0 ≤ c − 1 < n) `binom.sf` evaluates
    scipy's `_binom_sf` ufunc, so that is called directly: the same number without binom.sf's
    argument handling, which cost ~0.5 ms a call (`_binom_sf`, with binom.sf where a scipy lacks it)."""
    if c <= 0:
        return 1.0
    if c > n:
        return 0.0
    return _binom_sf(c - 1, n, (df + 0.5) / (B + 1))


def _binom_sf(k: int, n: int, p: float) -> float:
    try:
        from scipy.special._ufuncs import _binom_sf as kernel
    except ImportError:  # another scipy: the public function
        from scipy.stats import binom

        return float(binom.sf(k, n, p))
    return float(kernel(float(k), float(n), p))


# ---- prefixes from a run ----------------------------------------------------------------------------
def prefix_texts(run, tok, sentence_ids, positions) -> list[Prefix]:
    """The text of each prefix (sentence text up to the end of token `position`) and its last token.
    Equal (sentence, position) pairs share one Prefix: read and split once (a run's keys share
    their triggers: 46,080 keys × 50 triggers of SmolLM2 hold about 40,000 distinct prefixes)."""
    sids = np.asarray(sentence_ids, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    if len(sids) == 0:
        return []
    pairs, inv = np.unique(np.stack([sids, pos], 1), axis=0, return_inverse=True)
    distinct = [Prefix(t, lt) for t, lt in query.prefix_texts(run, tok, pairs[:, 0], pairs[:, 1])]
    return [distinct[i] for i in inv.reshape(-1).tolist()]


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
