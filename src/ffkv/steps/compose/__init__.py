"""The `compose` step as one unit: its settings (from which `ffkv compose` is generated), what
the manifest records and its place in `reproduce`. The computation and the tables' columns are
in `ffkv.steps.compose.compute`, the printed summary in `.summary`, both imported only when the
step runs, so that `ffkv --help` does not load torch."""
from __future__ import annotations

from dataclasses import dataclass

from ffkv.defs import LENSES
from ffkv.steps.settings import Flag, a_seed, at_least, budget, setting
from ffkv.steps.lifecycle import Step
from ffkv.steps import lazy

DEFAULT_CORPUS = "wikipedia:valid"
DEFAULT_EPS = 0.1
TABLES = ("compose_sentences", "compose_prefixes", "value_tops", "compose_examples", "compose_layers",
          "compose_cases", "compose_lens_effect")


def _lens(v):
    return None if v in LENSES else f"must be naive or norm (got {v!r})"


_budget = budget(1)  # --batch-tokens: parse, check


@dataclass(frozen=True)
class ComposeSettings:
    """What `ffkv compose` is asked for. `batch_tokens` changes speed, `lens` and `cases` only the
    printed summary: none of the three is recorded."""
    corpus: str | None = setting(None, "Held-out corpus: wikipedia:valid (default), a .tokens/.jsonl/.txt file, "
                                       "hf:NAME[:SPLIT].",
                                 reproduce=Flag("--compose-corpus", help="Held-out corpus for compose and normalize "
                                                                         "(default wikipedia:valid)."))
    n_prefixes: int = setting(4000, "Prefixes to sample, one per sentence (the paper: 4,000).", check=at_least(1),
                              flag="--prefixes", short="-n",
                              reproduce=Flag("--prefixes", default=1000, presets={"full": 4000}, min=1,
                                             help="Held-out prefixes for compose (default 1,000; the paper: 4,000)."))
    seed: int = setting(0, "Seed of the document order, the sentence sample and the positions.", check=a_seed)
    eps: float = setting(DEFAULT_EPS, "Also count a memory active when |m_i| > eps (SiLU/GELU are rarely exactly 0).",
                         check=at_least(0))
    max_sentences: int | None = setting(None, "Read at most this many sentences of the corpus.", check=at_least(1))
    batch_tokens: int | str = setting("auto", "Token budget of one forward batch: auto (2048 on a CPU; sized from "
                                      "free memory on CUDA) or a number.", check=_budget[1], parse=_budget[0],
                                      recorded=False)
    per_sentence: int = setting(1, "When the corpus has fewer usable sentences than --prefixes, take up to this many "
                                   "distinct positions of a sentence (a second one only after every sentence gave "
                                   "one). 1 (default): one per sentence, fewer prefixes.", check=at_least(1),
                                reproduce=Flag("--prefixes-per-sentence", default=1, presets={"full": 2}, min=1,
                                               help="Compose's --per-sentence: up to this many prefixes of one "
                                                    "held-out sentence when sentences run short (default 1; full "
                                                    "preset 2)."))
    lens: str = setting("norm", "Lens shown first in the summary (both are always computed): naive or norm.",
                        check=_lens, recorded=False)
    cases: int = setting(5, "Last-layer cases to print (all are in compose_cases).", check=at_least(0), recorded=False)


def record(run, s: ComposeSettings) -> dict:
    """The manifest's settings (the fields' checks ran before). The model's identity is its
    unembedding digest (None until a fresh run records one)."""
    rec = {"corpus": s.corpus or DEFAULT_CORPUS, "prefixes": int(s.n_prefixes), "seed": int(s.seed),
           "eps": float(s.eps), "max_sentences": s.max_sentences, "lenses": list(LENSES),
           "model_unembed_sha256": (run.manifest.get("model") or {}).get("unembed_sha256")}
    if s.per_sentence != 1:  # left out at its default, so runs recorded before it still match
        rec["per_sentence"] = int(s.per_sentence)
    return rec


def reproduce(r, mm) -> ComposeSettings:
    """`ffkv reproduce`'s compose: its held-out corpus, prefix count and seed."""
    return ComposeSettings(corpus=r.compose_corpus or DEFAULT_CORPUS, n_prefixes=r.prefixes, seed=r.seed,
                           per_sentence=r.prefixes_per_sentence)


STEP = Step("compose", ComposeSettings, requires=(), tables=TABLES,
            compute=lazy("ffkv.steps.compose.compute:compute"), record=record,
            help="Figs 7-11: active memories, compositional layers, the residual's share of the decision, "
                 "confidence per layer, the residual/ffn/agreement/composition breakdown, last-layer cases.",
            cli=True, summary=lazy("ffkv.steps.compose.summary:summary"), reproduce=reproduce,
            sections=lazy("ffkv.steps.compose.report:sections"),
            differences=lazy("ffkv.steps.compose.report:differences"),
            report_before_done=True)
