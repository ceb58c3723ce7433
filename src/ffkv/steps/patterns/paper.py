"""What the paper reports for the `patterns` step's figures (Fig 2, from automatic and from human
labels, and Table 1), in our own words (`ffkv.report.paper.Paper`)."""
from __future__ import annotations

from ffkv.report.paper import Paper


FIG2 = Paper(
    id="fig2", place=2,
    title="Fig 2 — what kind of pattern the trigger prefixes share, per layer",
    measure="share of each key's top-25 trigger prefixes that are covered by a shallow pattern, "
            "a semantic pattern, both, or none",
    setup="10 random keys per layer (160 keys), top-25 prefixes each, one expert annotator per key",
    result="Experts found a pattern for every key (3.6 per key on average) and 65–80% of the prefixes "
           "fall under some pattern. The lower layers (1–9) are mostly shallow patterns such as a "
           "shared last word; from layer 10 up, semantic patterns (a shared topic) take over.",
    tables=("patterns_fig2",),
    reference={"band": (65.0, 80.0), "label": "paper: 65–80% of prefixes covered by a pattern"},
    notes={"depth": None},
)

FIG2_HUMAN = Paper(
    id="fig2_human", place=2.1,
    title="Fig 2 (human labels) — pattern kinds from the run's own annotations",
    measure="as Fig 2, from annotations.sqlite",
    setup="as Fig 2",
    result="As for Fig 2: shallow patterns dominate layers 1–9, semantic ones layers 10–16; "
           "65–80% of prefixes are covered.",
    tables=("annotations.sqlite",),
    notes={"depth": None},
)

TABLE1 = Paper(
    id="table1", place=2.2,
    title="Table 1 — example keys, their patterns and trigger prefixes",
    measure="keys with the pattern an annotator (here: `ffkv patterns`) found, and their top "
            "trigger prefixes",
    setup="hand-picked examples",
    result="Examples range from a shallow pattern in layer 1 (prefixes ending in \"substitutes\") "
           "through mixed ones in layer 6 (military texts ending in \"base\"/\"bases\") to semantic "
           "ones in the top layers (a \"part of\" relation, TV shows).",
    tables=("pattern_keys", "patterns", "triggers", "sentences", "vocab"),
    notes={"subword": None},
)
