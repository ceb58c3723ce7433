from ffkv.corpus.sources import CorpusSource, open_corpus, Sentence
from ffkv.corpus.wikitext import detokenize

__all__ = ["CorpusSource", "open_corpus", "Sentence", "detokenize"]
