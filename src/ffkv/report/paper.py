"""The paper's model, and the shape of what a step says about one of the paper's figures.

Embedded in the package so that `ffkv report` never reads anything outside the run. Each step that
reproduces a figure, table or case study declares it as a `Paper` entry beside its report
(`src/ffkv/steps/<name>/paper.py`) and shows it with `Builder.paper_section(entry, make)`.
Layer numbers in an entry's `result` are the paper's (1-based, 16 layers).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Paper:
    """One figure, table or case study of the paper, in our own words.

    `measure`: the quantity, as the run computes it; `setup`: the paper's sample; `result`: its
    finding, paraphrased; `tables`: the run tables it reads; `place`: its position among the
    paper's sections (its number in the paper). `reference`: the level the paper states in
    numbers, drawn on the run's figure (`ffkv.report.figures.reference`): a dashed line ("line", in
    the figure's y units) or a shaded band ("band": low, high), with its "label". `notes`: the ways
    this model may differ from the paper's that the section is read under (`MODEL_NOTES` keys), each
    with its own note (a format string over the manifest's model fields, `act`, `lens` and
    `active_share`), or None for the common one."""
    id: str
    title: str
    measure: str
    setup: str
    result: str
    tables: tuple[str, ...] = ()
    place: float = 100.0
    reference: dict | None = None
    notes: dict[str, str | None] = field(default_factory=dict)


# The differences from the paper's model that a section can be read under, in the order their notes
# are shown (`ffkv.report.build.model_differences` says which hold for a run).
MODEL_NOTES = ("depth", "moe", "gated", "activation", "subword", "lens")
