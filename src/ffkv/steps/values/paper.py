"""What the paper reports for the `values` step's figures (Figs 4-6, Table 2), in our own words
(`ffkv.report.paper.Paper`)."""
from __future__ import annotations

from ffkv.report.paper import Paper

GATED = ("Gated FFN: each value is read in the direction its key's top trigger writes "
         "it (sign of the coefficient × v).")


FIG4 = Paper(
    id="fig4", place=4,
    title="Fig 4 — does a value predict the token that follows its key's best trigger?",
    measure="agreement rate: share of memories whose value's top token equals the next token of "
            "the key's top-1 trigger example",
    setup="all 65,536 memories",
    result="Practically zero in layers 1–10; from layer 11 on it climbs, to about 3.5% in the top "
           "layers. Chance level would be about 0.0004%.",
    tables=("values_layers",),
    reference={"line": 3.5, "label": "paper: about 3.5% in its top layers"},
    notes={"depth": None, "gated": GATED, "subword": None, "lens": None},
)

FIG5 = Paper(
    id="fig5", place=5,
    title="Fig 5 — rank of the trigger's next token in the value's distribution",
    measure="rank of that next token under softmax(v·E) (0 = top), per layer",
    setup="all memories",
    result="In the upper layers the next token ranks much higher (gets more probability) than in "
           "the lower layers.",
    tables=("values_layers", "values_rank_hist"),
    notes={"depth": None, "gated": GATED, "lens": None},
)

FIG6 = Paper(
    id="fig6", place=6,
    title="Fig 6 — agreement as a function of the value's confidence",
    measure="agreement rate in bins of the value distribution's maximum probability",
    setup="all memories",
    result="The more peaked a value's distribution (higher max probability), the more often its "
           "top token agrees with the key's trigger.",
    tables=("values_fig6",),
    notes={"gated": GATED, "lens": None},
)

TABLE2 = Paper(
    id="table2", place=6.5,
    title="Table 2 — the most confident values and their keys' triggers",
    measure="the 100 values with the highest max probability over all layers; precision@50 of "
            "each against its key's top-50 trigger examples",
    setup="all layers",
    result="Nearly all of them (97 of 100) sit in the upper layers (11–16), and 46 of the 100 have "
           "at least one agreeing trigger among their key's top 50.",
    tables=("values_table2",),
    notes={"depth": None, "gated": GATED, "subword": None},
)
