"""The `mutate` step as one unit: its settings (from which `ffkv mutate` is generated) and its place
in `reproduce`. The experiment (paper §3.2, Fig 3) and its tables' columns are in
`ffkv.steps.mutate.compute`, the printed summary in `.summary`; both are imported when the step runs."""
from __future__ import annotations

from dataclasses import dataclass

from ffkv.parse import parse_sign
from ffkv.steps.settings import Flag, a_seed, a_sign, at_least, budget, setting
from ffkv.steps.lifecycle import Step
from ffkv.steps import lazy

DEFAULT_KEYS_PER_LAYER = 10  # the paper used 100 (a flag for GPU users: --keys-per-layer 100)
DEFAULT_EXAMPLES = 50


_budget = budget(16)  # --batch-tokens: parse, check


@dataclass(frozen=True)
class MutateSettings:
    """The `mutate` step's settings (`ffkv mutate`'s options). `batch_tokens` changes speed only
    and is not recorded; `dtype` is recorded and is the dtype the model is opened with."""
    keys_per_layer: int = setting(DEFAULT_KEYS_PER_LAYER, "Keys sampled per layer (seeded); the paper used 100 "
                                  "(a GPU setting); 0 = every mined key.", check=at_least(0),
                                  reproduce=Flag(default=3, presets={"full": 100}, min=1,
                                                 help="Keys per layer for mutate (default 3; the paper: 100)."))
    examples: int = setting(DEFAULT_EXAMPLES, "Top trigger examples per key.", check=at_least(1))
    sign: int = setting(1, "Which triggers: + (top positive, the paper) or - (most negative).", parse=parse_sign,
                        shown="+", check=a_sign)
    seed: int = setting(0, "Seed of the key sample and of the random mutation.", check=a_seed)
    layers: tuple[int, ...] | None = setting(None, "Only these layers (repeatable).", flag="--layer")
    batch_tokens: int | str = setting("auto", "Padded tokens per re-scoring batch: auto (2048 on a CPU; sized from "
                                      "free memory on CUDA) or a number >= 16.", check=_budget[1], parse=_budget[0],
                                      recorded=False)
    dtype: str = setting("auto", "The model's dtype (the command's --dtype).")


# by name (as the step's compute and summary): loaded when the step runs
record = lazy("ffkv.steps.mutate.compute:record")


STEP = Step(name="mutate", settings=MutateSettings, requires=("mine",), tables=("mutations", "mutations_layers"),
            compute=lazy("ffkv.steps.mutate.compute:compute"), record=record, cli=True,
            summary=lazy("ffkv.steps.mutate.summary:summary"),
            sections=lazy("ffkv.steps.mutate.report:sections"),
            differences=lazy("ffkv.steps.mutate.report:differences"),
            report_before_done=True,
            reproduce=lambda r, mm: MutateSettings(keys_per_layer=r.keys_per_layer, seed=r.seed, dtype=r.dtype),
            help="Fig 3: remove the first, last or a random token of each key's top trigger examples and report "
                 "the relative change of the key's coefficient per layer (tables `mutations`, `mutations_layers`).")
