"""What the paper reports for the `compose` step's figures (Figs 7-11, §5.2's cases), in our own
words (`ffkv.report.paper.Paper`)."""
from __future__ import annotations

from ffkv.report.paper import Paper

MOE = ("Mixture of experts: a token reaches {memories_per_token:,} of a layer's {d_m:,} memories (its "
       "routed experts'), so at most {active_share:.0%} of d_m can be active on it.")
GATED_FIG7 = ("Gated FFN: m = f(x·g)·(x·u) is signed through x·u, whose sign is symmetric, so about 50% "
              "of memories have m > 0 for any input, which is not the paper's 'key fired' count; the "
              "verdict uses the scale-free n90 instead.")
ACTIVATION = "Activation {act}: coefficients are rarely exactly zero."
GATED_FIG8 = ("Gated FFN: the verdict uses the signed form (a memory with m < 0 writes −v, so its "
              "prediction is top(−v)); the paper's form (m > 0 only) is also drawn.")


FIG7 = Paper(
    id="fig7", place=7,
    title="Fig 7 — how many memories are active per example",
    measure="share of the layer's memories with a positive coefficient (m > 0)",
    setup="4,000 random validation prefixes",
    result="Between roughly 10% and 50% of the 4,096 memories are active, i.e. a typical "
           "prediction involves hundreds of memories; the share dips towards layer 10.",
    tables=("compose_layers",),
    reference={"band": (10.0, 50.0), "label": "paper's range (10–50%)"},
    notes={"depth": None, "moe": MOE, "gated": GATED_FIG7, "activation": ACTIVATION},
)

FIG8 = Paper(
    id="fig8", place=8,
    title="Fig 8 — is the layer's prediction some single memory's prediction?",
    measure="share of examples where no active memory's value has the same top token as the "
            "layer output y",
    setup="4,000 validation prefixes",
    result="In every layer, in at least about 68% of the examples no single memory agrees with the "
           "layer's prediction; the layer output is a composition. Among the rest, 60% have a "
           "stop-word target and 43% a prefix of fewer than 5 tokens.",
    tables=("compose_layers",),
    reference={"line": 68.0, "label": "paper: ≥ 68% in every layer"},
    notes={"gated": GATED_FIG8, "lens": None},
)

FIG9 = Paper(
    id="fig9", place=9,
    title="Fig 9 — how often the residual already holds the model's final prediction",
    measure="share of examples with top(r_ℓ) equal to the model's final top token",
    setup="4,000 validation prefixes",
    result="About a third of the predictions are already fixed in the first few layers; the share "
           "climbs steeply from layer 10 and reaches the final prediction at the top.",
    tables=("compose_layers",),
    reference={"line": 100.0 / 3, "label": "paper: about a third in its first layers"},
    notes={"depth": None, "lens": None},
)

FIG10 = Paper(
    id="fig10", place=10,
    title="Fig 10 — the residual's confidence in the final prediction",
    measure="probability of the final top token under softmax(r_ℓ·E)",
    setup="4,000 validation prefixes",
    result="The probability grows through the layers: besides the choice of token, its confidence "
           "is refined layer by layer.",
    tables=("compose_layers",),
    notes={"lens": None},
)

FIG11 = Paper(
    id="fig11", place=11,
    title="Fig 11 — where the layer output comes from",
    measure="per example and layer: residual (top(o)=top(r)≠top(y)), ffn (top(o)=top(y)≠top(r)), "
            "agreement (all three equal), composition (top(o) equals neither)",
    setup="4,000 validation prefixes",
    result="Residual and agreement together make up the great majority: the FFN mostly leaves the "
           "residual's choice alone. When the choice changes, it is seldom to the FFN's own top "
           "token and mostly to a third token (composition).",
    tables=("compose_layers",),
    notes={"lens": None},
)

CASES = Paper(
    id="cases", place=11.5,
    title="§5.2 — last-layer cases where the FFN changes the prediction",
    measure="examples where top(r) ≠ top(o) in the last layer, read by hand",
    setup="100 random such cases",
    result="Read by hand, 66 of the 100 switch to a semantically unrelated word (e.g. \"people\" "
           "becomes \"same\") and 34 to a related one (e.g. \"later\" becomes \"earlier\").",
    tables=("compose_cases",),
)
