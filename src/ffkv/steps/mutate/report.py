"""The `mutate` step's report section: Fig 3 (how much a key's coefficient drops when a token of its
trigger is removed), from `mutations_layers` (`ffkv.steps.mutate.compute`)."""
from __future__ import annotations

from ffkv.report.build import Builder, Section
from ffkv.steps.mutate import figures as F
from ffkv.steps.mutate import verdicts as V
from ffkv.steps.mutate.paper import FIG3


def sections(run, fig_dir) -> list:
    return [Builder.of(run, fig_dir).paper_section(FIG3, fig3)]


def differences(settings: dict) -> list[list[str]]:
    """The keys mutated per layer, beside the paper's 100."""
    if "keys_per_layer" not in settings:
        return []
    return [["mutated keys per layer", "100", str(settings["keys_per_layer"] or "all"), ""]]


def fig3(b: Builder) -> Section:
    (df,), miss = b.need("fig3", "mutations_layers")
    s = Section("fig3", V.fig3(df, b.L), missing=miss)
    if df is not None:
        s.figure = b.draw("fig3", F.fig3, df)
    return s
