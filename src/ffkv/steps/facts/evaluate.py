"""The editing papers' metrics (ROME's CounterFact scores; EasyEdit's names beside them), for an
edited model and the unedited one.

Per fact, with NLL(o | p) the mean negative log-probability of object o's tokens after prompt p
(teacher-forced, as ROME compares multi-token objects):
- efficacy (EasyEdit: rewrite_acc): NLL(new | rewrite prompt) < NLL(true | rewrite prompt);
- generalization (rephrase_acc): the share of paraphrase prompts where the same holds;
- specificity (locality): the share of neighbour prompts (other subjects whose object is the true
  one) where NLL(true) < NLL(new) still holds;
- score: the harmonic mean of the three means over facts (ROME's S);
- fluency (ngram_entropy): greedy generations from the rewrite prompt, each text's bigram and
  trigram entropies (bits) weighted 2/3 and 4/3 and averaged, then averaged over texts, as ROME
  and EasyEdit compute it (words split by a regular expression here, by nltk there).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

NAMES = {"efficacy": "rewrite_acc", "generalization": "rephrase_acc", "specificity": "locality",
         "fluency": "ngram_entropy"}
GEN_TOKENS = 50  # tokens generated per fluency text (ROME: up to 100 with sampling)
_WORD = re.compile(r"\w+|[^\w\s]")


def ngram_entropy(text: str, ns=(2, 3), weights=(2 / 3, 4 / 3)) -> float:
    """One text's weighted mean of its n-gram entropies in bits (0 for a text too short)."""
    words = _WORD.findall(text)
    out = []
    for n, w in zip(ns, weights):
        grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        total = sum(grams.values())
        h = -sum(c / total * math.log2(c / total) for c in grams.values()) if total else 0.0
        out.append(w * h)
    return float(np.mean(out))


@torch.no_grad()
def target_nll(mm, texts: list[str], target: str, batch: int = 32) -> np.ndarray:
    """Per text, the mean NLL of `target`'s tokens following it (teacher-forced)."""
    from ffkv.steps.facts.data import prompt_ids, target_ids

    tgt = target_ids(mm.tok, target)
    out = []
    for a in range(0, len(texts), batch):
        seqs = [prompt_ids(mm.tok, t, mm.max_length) for t in texts[a:a + batch]]
        ids, mask = mm.batch([s + tgt for s in seqs])
        logp = torch.log_softmax(mm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits.float(), -1)
        for i, s in enumerate(seqs):
            pos = torch.arange(len(s) - 1, len(s) - 1 + len(tgt))
            out.append(float(-logp[i, pos, torch.tensor(tgt)].mean()))
    return np.array(out)


def greedy(mm, text: str, tokens: int = GEN_TOKENS) -> str:
    """The model's greedy continuation of `text` as text (`MemoryModel.greedy`)."""
    from ffkv.steps.facts.data import prompt_ids

    return mm.tok.decode(mm.greedy(prompt_ids(mm.tok, text, mm.max_length), tokens), skip_special_tokens=True)


@dataclass
class FactScores:
    efficacy: float
    generalization: float
    specificity: float
    fluency: float | None
    generation: str | None = None


def fact_scores(mm, fact, fluency: bool = True, tokens: int = GEN_TOKENS) -> FactScores:
    """One fact's scores on the model as it now is (edited or not)."""
    def wins(texts, first, second) -> float:
        if not texts:
            return float("nan")
        return float(np.mean(target_nll(mm, texts, first) < target_nll(mm, texts, second)))

    new, true = fact.target_new, fact.target_true
    gen = greedy(mm, fact.text, tokens) if fluency else None
    own = list(fact.neighbour_targets) or [true] * len(fact.neighbours)  # each neighbour's own object
    kept = [wins([p], o, new) for p, o in zip(fact.neighbours, own) if o != new]
    return FactScores(wins([fact.text], new, true), wins(list(fact.paraphrases), new, true),
                      float(np.mean(kept)) if kept else float("nan"),
                      ngram_entropy(gen) if gen is not None else None, gen)


def harmonic(*xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs or min(xs) <= 0:
        return 0.0
    return len(xs) / sum(1 / x for x in xs)


def aggregate(rows: list[FactScores]) -> dict:
    """Means over facts and the harmonic-mean score, under both names."""
    def mean(k):
        v = [getattr(r, k) for r in rows if getattr(r, k) is not None and not math.isnan(getattr(r, k))]
        return float(np.mean(v)) if v else None

    out = {k: mean(k) for k in ("efficacy", "generalization", "specificity", "fluency")}
    out["score"] = harmonic(out["efficacy"], out["generalization"], out["specificity"])
    out["facts"] = len(rows)
    out["easyedit"] = {NAMES[k]: out[k] for k in NAMES}
    return out
