"""The one English stop-word list (NLTK's 127 words, `ffkv/data/stopwords.txt`)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

STOPWORDS_FILE = Path(__file__).resolve().parents[1] / "data" / "stopwords.txt"


@lru_cache(maxsize=1)
def stopwords() -> frozenset[str]:
    lines = STOPWORDS_FILE.read_text(encoding="utf-8").splitlines()
    return frozenset(l.strip().lower() for l in lines if l.strip() and not l.startswith("#"))
