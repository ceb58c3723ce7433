"""The `worth` step as one unit: what a memory is worth to the model, as the rise in its loss when
the memory is removed, over the run's own mined sentences (issue 48, item 6). Its settings (from
which `ffkv worth RUN` is generated) and its place in the registry; the estimate, the ablation
check and the table's columns are in `ffkv.steps.worth.compute`, the browser's and the report's
views in `.report`."""
from __future__ import annotations

from dataclasses import dataclass

from ffkv.steps import lazy
from ffkv.steps.lifecycle import Step
from ffkv.steps.settings import a_seed, at_least, budget, setting

TABLES = ("memory_worth",)
_budget = budget(1)


@dataclass(frozen=True)
class WorthSettings:
    """What `ffkv worth` is asked for; all but `batch_tokens` (speed and memory only) recorded."""
    tokens: int = setting(10_000, "Tokens of the run's mined sentences (in their order) over which each memory's "
                                  "worth is estimated.", check=at_least(1))
    check: int = setting(16, "Memories whose estimate is checked by really removing them (half the largest "
                             "estimates, half drawn at random; 0: no check).", check=at_least(0))
    check_tokens: int = setting(1_024, "Tokens of the check's ablations (the first of the estimate's).",
                                check=at_least(1))
    seed: int = setting(0, "Seed of the check's random memories.", check=a_seed)
    batch_tokens: int | str = setting("auto", "Token budget of one forward and backward batch (speed and memory "
                                      "only): auto (512 on a CPU) or a number.", check=_budget[1], parse=_budget[0],
                                      recorded=False)
    dtype: str = setting("auto", "The model's dtype (the command's --dtype).")


STEP = Step("worth", WorthSettings, requires=("mine",), tables=TABLES,
            compute=lazy("ffkv.steps.worth.compute:compute"), record=lazy("ffkv.steps.worth.compute:record"),
            cli=True, summary=lazy("ffkv.steps.worth.compute:summary"),
            sections=lazy("ffkv.steps.worth.report:sections"), panels=lazy("ffkv.steps.worth.report:panels"),
            overview=lazy("ffkv.steps.worth.report:overview"),
            help="What each memory is worth: the rise of the model's next-token loss over the run's sentences when "
                 "the memory is removed (m = 0 at every token), estimated for every memory at once by attribution "
                 "patching (−m·∂L/∂m, one backward pass a batch), and checked against real removals of a sample. "
                 "Table memory_worth; shown on memory and layer pages.")
