"""The `patterns` step as one unit: its settings (from which `ffkv patterns` is generated) and its
place in `reproduce`. Shallow and semantic patterns, key labels, Fig 2 and the tables' columns are
in `ffkv.steps.patterns.compute` (with `words`, `shallow`, `semantic`, `fig2`), the printed summary
in `.summary`; all are imported when the step runs."""
from __future__ import annotations

from dataclasses import dataclass

from ffkv.parse import parse_sign
from ffkv.steps.settings import Flag, a_seed, a_sign, at_least, between, setting
from ffkv.store.labels import TOP
from ffkv.steps.lifecycle import Step
from ffkv.steps import lazy

DEFAULT_SEMANTIC_KEYS = 10
MIN_COVER = 3
ALPHA = 1e-3
BACKGROUND = 2000
TABLES = ("patterns", "pattern_keys", "patterns_fig2")


def _alpha(v):
    return None if 0 < v <= 1 else f"must be in (0, 1] (got {v})"


@dataclass(frozen=True)
class PatternsSettings:
    """Settings of the `patterns` step (all but `device` are recorded in the manifest)."""
    keys_per_layer: int = setting(0, "Keys per layer for shallow patterns (seeded sample); 0 = every mined key.",
                                  check=at_least(0))
    semantic_keys_per_layer: int = setting(
        DEFAULT_SEMANTIC_KEYS, "Keys per layer that also get semantic patterns (the nested seeded sample that "
        "`ffkv annotate sample` gives annotators); 0 = all analysed keys. Embedding costs about 1/70 s per prefix "
        "on a CPU.", check=at_least(0),
        reproduce=Flag(default=10, presets={"full": 10}, min=0,
                       help="Keys per layer given semantic patterns (default 10, as the paper)."))
    top: int = setting(TOP, "Top prefixes per key (the paper: 25).", check=between(1, 32767))
    sign: int = setting(1, "Which triggers: + (top positive, the paper) or - (most negative).", parse=parse_sign,
                        shown="+", check=a_sign)
    seed: int = setting(0, "Seed of the key sample.", check=a_seed)
    min_cover: int = setting(MIN_COVER, "Prefixes a pattern must cover (the paper: 3).", check=at_least(1))
    alpha: float = setting(ALPHA, "Significance of a shallow pattern against random corpus prefixes; 1 = keep all.",
                           check=_alpha)
    background: int = setting(BACKGROUND, "Random corpus prefixes for the baselines.", check=at_least(50))
    semantic: bool = setting(True, "Semantic patterns too (--no-semantic: shallow patterns only).",
                             flag="--semantic/--no-semantic",
                             reproduce=Flag(help="Semantic patterns too (needs the sentence encoder package); "
                                                 "--no-semantic: shallow patterns only."))
    device: str = setting("auto", "Of the sentence encoder (the command's --device); results do not depend on it.",
                          recorded=False)
    workers: int | None = setting(None, "Processes that find the shallow patterns, runs of keys each (0: in this "
                                        "process; default: one per core up to 8). Results do not depend on it.",
                                  check=between(0, 256), recorded=False)


# by name (as the step's compute and summary): loaded when the step runs
record = lazy("ffkv.steps.patterns.compute:record")


STEP = Step(name="patterns", settings=PatternsSettings, requires=("mine",), tables=TABLES,
            compute=lazy("ffkv.steps.patterns.compute:compute"), record=record, cli=True,
            summary=lazy("ffkv.steps.patterns.summary:summary"), sections=lazy("ffkv.steps.patterns.report:sections"),
            differences=lazy("ffkv.steps.patterns.report:differences"),
            report_before_done=True,
            reproduce=lambda r, mm: PatternsSettings(semantic_keys_per_layer=r.semantic_keys_per_layer, seed=r.seed,
                                                     semantic=r.semantic, device=r.device),
            preflight=lambda r: r.semantic and lazy("ffkv.steps.patterns.semantic:require_encoder")(),
            help="Automatic patterns in each key's top-25 prefixes: shallow (shared last words, suffixes, n-grams) "
                 "and semantic (clusters of sentence embeddings); a label per key and Fig 2 for every key (tables "
                 "`patterns`, `pattern_keys`, `patterns_fig2`).")
