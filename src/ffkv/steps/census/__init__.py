"""The `census` step as one unit: its settings (from which `ffkv census RUN` is generated) and its
place in the registry. What kind of memory each one is, from the weights and the mined pass's key
statistics (issue 46, first piece): the definitions, the computation and the tables' columns are in
`ffkv.steps.census.compute` (also `layer_census`, the weight statistics of one layer without a
run), the printed summary in `.summary`, the report's census by depth in `.report` (with the memory
page's panels, drawn by the browser's `census_panel.html`: the census panel at once, the sign
regimes' after the page, `later_panels`), a gated memory's examples per sign regime
in `.regimes`."""
from __future__ import annotations

from dataclasses import dataclass

from ffkv.defs import LENSES
from ffkv.steps import lazy
from ffkv.steps.lifecycle import Step
from ffkv.steps.settings import at_least, between, setting

TABLES = ("census", "census_layers")
EPS_MAX = 2.0 ** 10  # the key histogram's last finite edge (`ffkv.mine.rules.E_HI`)


def _lens(v):
    return None if v is None or v in LENSES else f"must be naive or norm (got {v!r})"


@dataclass(frozen=True)
class CensusSettings:
    """What `ffkv census` is asked for. Every threshold is recorded in the manifest (and the eps the
    key histogram's bins allow, `eps_used`). `chunk` (values at a time) changes memory, not results."""
    eps: float = setting(0.0, "Activity threshold: a memory is active on a token when |m| > eps (read at the "
                              "key histogram's bin edges: 0 or a power of 2 from 2^-10 to 2^10, rounded up).",
                         check=between(0.0, EPS_MAX))
    rare: float = setting(1e-4, "Rare: active on fewer than this share of the mined tokens (Voita et al.: 1e-4).",
                          check=between(0.0, 1.0))
    kurtosis: float = setting(10.0, "Prediction/suppression: excess kurtosis of cos(W_U, v) over the vocabulary "
                                    "above this (with skew > 0 / < 0; Gurnee et al.).", check=at_least(0.0))
    partition: float = setting(2.0, "Partition: variance of cos(W_U, v) over the vocabulary above this many times "
                                    "1/d (a random direction's).", check=at_least(0.0))
    cos: float = setting(0.1, "Input-output classes: a cosine counts as positive above this, negative below its "
                              "negative, else as zero (Gerstner & Schütze).", check=between(0.0, 1.0))
    detector: float = setting(0.5, "Token (n-gram) detector: at least this share of its positive top triggers end in "
                                   "its most common token (bigram), with at least 5 triggers (after Voita et al.).",
                              check=between(0.0, 1.0))
    positional: float = setting(0.5, "Positional: total-variation distance of pos_hist from chance positions at least "
                                     "this, and above twice a shuffled draw's.", check=between(0.0, 1.0))
    lens: str | None = setting(None, "naive: W_U as it is; norm: W_U's rows times the final norm's gain (as "
                                     "folded in by Gurnee et al.). Default: the run's lens.", check=_lens)
    chunk: int = setting(512, "Values compared with the vocabulary at a time (memory ≈ chunk × |V| × 4 B × 2).",
                         check=at_least(1), recorded=False)
    dtype: str = setting("auto", "The model's dtype (the command's --dtype).")


def reproduce(r, mm) -> CensusSettings:
    """`ffkv reproduce` runs the census with its defaults (about 40 s on SmolLM2 on this CPU): its
    verdicts against the later papers join the report's."""
    return CensusSettings(dtype=r.dtype)


STEP = Step("census", CensusSettings, requires=("mine",), tables=TABLES,
            compute=lazy("ffkv.steps.census.compute:compute"), record=lazy("ffkv.steps.census.compute:record"),
            cli=True, summary=lazy("ffkv.steps.census.summary:summary"), reproduce=reproduce,
            sections=lazy("ffkv.steps.census.report:sections"), panels=lazy("ffkv.steps.census.report:panels"),
            later_panels=lazy("ffkv.steps.census.report:later_panels"),
            later_label=lazy("ffkv.steps.census.report:later_label"),
            panel_template="census_panel.html",
            overview=lazy("ffkv.steps.census.report:overview"),
            help="A census of the memories: dead and rare (from the mined key statistics), prediction, "
                 "suppression and partition (vocabulary moments of the values), enrichment and depletion "
                 "(cosines of keys with values), token and n-gram detectors and their self-suppression (from the "
                 "top triggers), positional memories (from the key statistics' positions).")
