"""What the paper reports for the `mutate` step's figure (Fig 3), in our own words
(`ffkv.report.paper.Paper`)."""
from __future__ import annotations

from ffkv.report.paper import Paper

GATED = ("Gated FFN: coefficients are signed; the relative change is measured in the trigger's own "
         "direction (−0.5 = lost half of it; below −1 = changed sign).")


FIG3 = Paper(
    id="fig3", place=3,
    title="Fig 3 — how much a key's coefficient drops when a token is removed from its trigger",
    measure="relative change (new − old) / old of the memory coefficient after removing the first, "
            "the last or a random token of a trigger example",
    setup="100 random keys per layer (1,600), their top-50 trigger examples",
    result="Cutting the last token hurts the coefficient the most and cutting the first token the "
           "least: keys care about the end of the prefix. In the upper layers the last token "
           "matters less than in the lower ones.",
    tables=("mutations_layers", "mutations"),
    notes={"depth": None, "gated": GATED},
)
