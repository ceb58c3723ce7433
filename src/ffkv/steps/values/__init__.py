"""The `values` step as one unit: its settings (from which `ffkv values` is generated) and its place
in `reproduce`. The projection, the agreement measures, what the manifest records and the
tables' columns are in `ffkv.steps.values.compute`, the printed summary in `.summary`; both are
imported when the step runs."""
from __future__ import annotations

from dataclasses import dataclass

from ffkv.defs import LENSES
from ffkv.steps.settings import a_seed, at_least, between, setting
from ffkv.steps.lifecycle import Step
from ffkv.steps import lazy

TABLES = ("values", "values_agreement", "values_layers", "values_rank_hist", "values_fig6",
          "values_table2", "values_lenses", "values_fig6_lenses", "values_table2_lenses", "value_index")


def _lens(v):
    return None if v is None or v in LENSES else f"must be naive or norm (got {v!r})"


def _kinds(v):
    return None if v in ("auto", "value", "both") else f"must be auto, value or both (got {v!r})"


@dataclass(frozen=True)
class ValuesSettings:
    """What `ffkv values` is asked for. `lens` None: the run's lens. `chunk` (values projected at
    a time) changes memory, not results, so it is not recorded. `dtype` is the model's, recorded."""
    lens: str | None = setting(None, "naive: v·E as in the paper; norm: with the final norm's gain. Default: "
                                     "the run's lens.", check=_lens)
    top_k: int = setting(10, "Tokens stored per value/key distribution.", check=at_least(1))
    chunk: int = setting(1024, "Values projected at a time (memory ≈ chunk × |V| × 4 B, at most 512 MB, + 2 × 128 × |V| × 4 B).", check=at_least(1),
                         recorded=False)
    permutations: int = setting(100, "Shuffled pairings per layer for the baseline.", check=between(0, 100_000))
    seed: int = setting(0, "Seed of the shuffled pairings.", check=a_seed)
    bins: int = setting(10, "Max-probability bins (quantiles) for Fig 6.", check=at_least(1))
    table2_n: int = setting(100, "Values in Table 2 (highest max probability).", check=at_least(0), flag="--table2")
    precision_k: int = setting(50, "Trigger examples per key for precision@k.", check=at_least(1))
    table2_kinds: str = setting("auto", "value (the paper), both (v and −v), or auto: both when the run has "
                                        "negative trigger lists (mine --negative).", check=_kinds)
    dtype: str = setting("auto", "The model's dtype (the command's --dtype).")
    both_lenses: bool = setting(True, "Also read the values through the other lens (the paper's naive one when "
                                      "the run's is norm).", flag="--both-lenses/--one-lens")


# by name (as the step's compute and summary): loaded when the step runs
record = lazy("ffkv.steps.values.compute:record")


def _has_summary(run, info: dict) -> bool:
    return bool(info.get("summary"))


STEP = Step("values", ValuesSettings, requires=("mine",), tables=TABLES,
            compute=lazy("ffkv.steps.values.compute:compute"), record=record, done_info=_has_summary, cli=True,
            summary=lazy("ffkv.steps.values.summary:summary"), sections=lazy("ffkv.steps.values.report:sections"),
            report_before_done=True,
            reproduce=lambda r, mm: ValuesSettings(dtype=r.dtype),
            help="Project every value to the vocabulary; agreement with its key's triggers (Fig 4–6, Table 2).")
