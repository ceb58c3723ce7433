"""The example step's report section, shaped like one of the paper's figures: its own paper entry
(what the paper says that this measure reads), a verdict from the shared statistics
(`ffkv.report.stats`) and a figure in the report's style (`ffkv.report.figures`), drawn by
`Builder.paper_section` beside the paper's own sections. Imported only when a report is built."""
from __future__ import annotations

import pandas as pd

from ffkv.report.build import Builder, Section
from ffkv.report.figures import finish, new_figure, styled
from ffkv.report.paper import Paper
from ffkv.report.stats import THIRDS, Verdict, by_test, frame, judged, layer_thirds, layers_test, pct_na, span, weighted

from . import NAME

PAPER = Paper(
    id=NAME, place=2.5,
    title="§3.1 (example step) — how many different tokens end a key's trigger prefixes",
    measure="per key, the share of distinct last tokens among its top trigger prefixes, averaged per layer",
    setup="the top-25 trigger prefixes of the keys the experts read",
    result="Keys of the lower layers fire on shallow patterns, such as prefixes ending in the same word; "
           "keys of the upper layers on semantic ones, whose prefixes end in many different words.",
    tables=(NAME,),
    notes={"depth": None, "subword": None},
)


def per_layer(table) -> pd.DataFrame:
    """layer, share: the mean share of distinct last tokens among a key's prefixes."""
    df = table.assign(share=table["distinct"] / table["triggers"].where(table["triggers"] > 0))
    return df.groupby("layer", as_index=False)["share"].mean()


@judged
def verdict(table, n_layers: int | None = None) -> Verdict:
    """Same trend when the top third of the layers has a larger distinct share than the bottom third."""
    df = frame(table, NAME, NAME.replace("_", "-"))
    crit = ("same trend when a key's trigger prefixes end in a larger share of distinct tokens in the top third "
            f"of the layers than in the bottom third ({THIRDS}), layers as units (Mann–Whitney p < 0.05); "
            "differs when significantly smaller; inconclusive otherwise")
    per = per_layer(df)
    _, bottom, _, top = layer_thirds(per, n_layers, f"the `{NAME}` table")
    d, p = layers_test(per[per["layer"].isin(top)]["share"], per[per["layer"].isin(bottom)]["share"])
    meas = (f"distinct share {pct_na(weighted(per, bottom, 'share'))} in layers {span(bottom)} vs "
            f"{pct_na(weighted(per, top, 'share'))} in layers {span(top)} (p = {p:.2g})")
    return Verdict(by_test(d, p), crit, meas)


@styled
def figure(per: pd.DataFrame):
    fig, ax = new_figure()
    ax.plot(per["layer"], per["share"] * 100, "o-", ms=3.5, color="C0", label="distinct last tokens (mean share)")
    return finish(fig, ax, per["layer"], "% of a key's prefixes", "Distinct last tokens of a key's top triggers",
                  ylim=(0, 100))


def section(b: Builder) -> Section:
    (df,), miss = b.need(NAME, NAME)
    s = Section(NAME, verdict(df, b.L), missing=miss)
    if df is not None and len(df):
        s.figure = b.draw(NAME, figure, per_layer(df))
    return s


def sections(run, fig_dir) -> list:
    return [Builder.of(run, fig_dir).paper_section(PAPER, section)]
