"""The `mutate` step's report section: Fig 3 (how much a key's coefficient drops when a token of its
trigger is removed), from `mutations_layers` (`ffkv.steps.mutate.compute`)."""
from __future__ import annotations

from ffkv.report import figures as F
from ffkv.report import verdicts as V
from ffkv.report.build import Builder, Section


def sections(run, fig_dir) -> list:
    return [Builder.of(run, fig_dir).paper_section(fig3, 3)]


def fig3(b: Builder) -> Section:
    (df,), miss = b.need("fig3", "mutations_layers")
    s = Section("fig3", V.fig3(df, b.L), missing=miss)
    if df is not None:
        s.figure = b.draw("fig3", F.fig3, df)
    return s
