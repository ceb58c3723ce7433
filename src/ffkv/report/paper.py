"""What Geva et al. (2021) report, one entry per figure, table or case study, in our own words.

Embedded in the package so that `ffkv report` never reads anything outside the run. Each entry:
- `title`: what the figure shows.
- `measure`: the quantity, as the run computes it.
- `setup`: the paper's sample.
- `result`: the paper's finding, paraphrased.
- `step`: the ffkv command whose tables the figure needs (for the "how to create it" hint).
- `tables`: the run tables it reads.
Layer numbers in `result` are the paper's (1-based, 16 layers). Which step shows an entry, and where
in the report, is that step's (`src/ffkv/steps/<name>/report.py`: `Builder.paper_section(make, place)`).
"""
from __future__ import annotations

PAPER_MODEL = {
    "name": "Baevski & Auli (2019) adaptive-input transformer LM",
    "training_data": "WikiText-103",
    "architecture": "decoder-only transformer, pre-norm, adaptive input embeddings",
    "layers": 16,
    "d": 1024,
    "d_m": 4096,
    "memories": 65_536,
    "activation": "relu",
    "gated": False,
    "parameters": "247M",
    "vocabulary": "word-level, 267,744 types (adaptive softmax/input)",
    "weights": "full precision",
    "lens": "naive (h·E, no final norm)",
}

PAPER: dict[str, dict] = {
    "fig2": {
        "title": "Fig 2 — what kind of pattern the trigger prefixes share, per layer",
        "measure": "share of each key's top-25 trigger prefixes that are covered by a shallow pattern, "
                   "a semantic pattern, both, or none",
        "setup": "10 random keys per layer (160 keys), top-25 prefixes each, one expert annotator per key",
        "result": "Experts found a pattern for every key (3.6 per key on average) and 65–80% of the prefixes "
                  "fall under some pattern. The lower layers (1–9) are mostly shallow patterns such as a "
                  "shared last word; from layer 10 up, semantic patterns (a shared topic) take over.",
        "step": "patterns",
        "tables": ["patterns_fig2"],
    },
    "fig2_human": {
        "title": "Fig 2 (human labels) — pattern kinds from the run's own annotations",
        "measure": "as Fig 2, from annotations.sqlite",
        "setup": "as Fig 2",
        "result": "As for Fig 2: shallow patterns dominate layers 1–9, semantic ones layers 10–16; "
                  "65–80% of prefixes are covered.",
        "step": "annotate",
        "tables": ["annotations.sqlite"],
    },
    "fig3": {
        "title": "Fig 3 — how much a key's coefficient drops when a token is removed from its trigger",
        "measure": "relative change (new − old) / old of the memory coefficient after removing the first, "
                   "the last or a random token of a trigger example",
        "setup": "100 random keys per layer (1,600), their top-50 trigger examples",
        "result": "Cutting the last token hurts the coefficient the most and cutting the first token the "
                  "least: keys care about the end of the prefix. In the upper layers the last token "
                  "matters less than in the lower ones.",
        "step": "mutate",
        "tables": ["mutations_layers", "mutations"],
    },
    "fig4": {
        "title": "Fig 4 — does a value predict the token that follows its key's best trigger?",
        "measure": "agreement rate: share of memories whose value's top token equals the next token of "
                   "the key's top-1 trigger example",
        "setup": "all 65,536 memories",
        "result": "Practically zero in layers 1–10; from layer 11 on it climbs, to about 3.5% in the top "
                  "layers. Chance level would be about 0.0004%.",
        "step": "values",
        "tables": ["values_layers"],
    },
    "fig5": {
        "title": "Fig 5 — rank of the trigger's next token in the value's distribution",
        "measure": "rank of that next token under softmax(v·E) (0 = top), per layer",
        "setup": "all memories",
        "result": "In the upper layers the next token ranks much higher (gets more probability) than in "
                  "the lower layers.",
        "step": "values",
        "tables": ["values_layers", "values_rank_hist"],
    },
    "fig6": {
        "title": "Fig 6 — agreement as a function of the value's confidence",
        "measure": "agreement rate in bins of the value distribution's maximum probability",
        "setup": "all memories",
        "result": "The more peaked a value's distribution (higher max probability), the more often its "
                  "top token agrees with the key's trigger.",
        "step": "values",
        "tables": ["values_fig6"],
    },
    "table2": {
        "title": "Table 2 — the most confident values and their keys' triggers",
        "measure": "the 100 values with the highest max probability over all layers; precision@50 of "
                   "each against its key's top-50 trigger examples",
        "setup": "all layers",
        "result": "Nearly all of them (97 of 100) sit in the upper layers (11–16), and 46 of the 100 have "
                  "at least one agreeing trigger among their key's top 50.",
        "step": "values",
        "tables": ["values_table2"],
    },
    "fig7": {
        "title": "Fig 7 — how many memories are active per example",
        "measure": "share of the layer's memories with a positive coefficient (m > 0)",
        "setup": "4,000 random validation prefixes",
        "result": "Between roughly 10% and 50% of the 4,096 memories are active, i.e. a typical "
                  "prediction involves hundreds of memories; the share dips towards layer 10.",
        "step": "compose",
        "tables": ["compose_layers"],
    },
    "fig8": {
        "title": "Fig 8 — is the layer's prediction some single memory's prediction?",
        "measure": "share of examples where no active memory's value has the same top token as the "
                   "layer output y",
        "setup": "4,000 validation prefixes",
        "result": "In every layer, in at least about 68% of the examples no single memory agrees with the "
                  "layer's prediction; the layer output is a composition. Among the rest, 60% have a "
                  "stop-word target and 43% a prefix of fewer than 5 tokens.",
        "step": "compose",
        "tables": ["compose_layers"],
    },
    "fig9": {
        "title": "Fig 9 — how often the residual already holds the model's final prediction",
        "measure": "share of examples with top(r_ℓ) equal to the model's final top token",
        "setup": "4,000 validation prefixes",
        "result": "About a third of the predictions are already fixed in the first few layers; the share "
                  "climbs steeply from layer 10 and reaches the final prediction at the top.",
        "step": "compose",
        "tables": ["compose_layers"],
    },
    "fig10": {
        "title": "Fig 10 — the residual's confidence in the final prediction",
        "measure": "probability of the final top token under softmax(r_ℓ·E)",
        "setup": "4,000 validation prefixes",
        "result": "The probability grows through the layers: besides the choice of token, its confidence "
                  "is refined layer by layer.",
        "step": "compose",
        "tables": ["compose_layers"],
    },
    "fig11": {
        "title": "Fig 11 — where the layer output comes from",
        "measure": "per example and layer: residual (top(o)=top(r)≠top(y)), ffn (top(o)=top(y)≠top(r)), "
                   "agreement (all three equal), composition (top(o) equals neither)",
        "setup": "4,000 validation prefixes",
        "result": "Residual and agreement together make up the great majority: the FFN mostly leaves the "
                  "residual's choice alone. When the choice changes, it is seldom to the FFN's own top "
                  "token and mostly to a third token (composition).",
        "step": "compose",
        "tables": ["compose_layers"],
    },
    "cases": {
        "title": "§5.2 — last-layer cases where the FFN changes the prediction",
        "measure": "examples where top(r) ≠ top(o) in the last layer, read by hand",
        "setup": "100 random such cases",
        "result": "Read by hand, 66 of the 100 switch to a semantically unrelated word (e.g. \"people\" "
                  "becomes \"same\") and 34 to a related one (e.g. \"later\" becomes \"earlier\").",
        "step": "compose",
        "tables": ["compose_cases"],
    },
    "table1": {
        "title": "Table 1 — example keys, their patterns and trigger prefixes",
        "measure": "keys with the pattern an annotator (here: `ffkv patterns`) found, and their top "
                   "trigger prefixes",
        "setup": "hand-picked examples",
        "result": "Examples range from a shallow pattern in layer 1 (prefixes ending in \"substitutes\") "
                  "through mixed ones in layer 6 (military texts ending in \"base\"/\"bases\") to semantic "
                  "ones in the top layers (a \"part of\" relation, TV shows).",
        "step": "patterns",
        "tables": ["pattern_keys", "patterns", "triggers", "sentences", "vocab"],
    },
}

# The levels the paper states in numbers, drawn on the run's figure (`ffkv.report.figures.reference`):
# a dashed line ("line", in the figure's y units) or a shaded band ("band": low, high). Only what the
# paper reports (see each entry's `result` above); figures without a stated level have none.
REFERENCE: dict[str, dict] = {
    "fig2": {"band": (65.0, 80.0), "label": "paper: 65–80% of prefixes covered by a pattern"},
    "fig4": {"line": 3.5, "label": "paper: about 3.5% in its top layers"},
    "fig7": {"band": (10.0, 50.0), "label": "paper's range (10–50%)"},
    "fig8": {"line": 68.0, "label": "paper: ≥ 68% in every layer"},
    "fig9": {"line": 100.0 / 3, "label": "paper: about a third in its first layers"},
}
