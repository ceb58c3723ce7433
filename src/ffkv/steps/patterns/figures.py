"""The `patterns` step's figure: Fig 2, the pattern kinds of each layer's trigger prefixes."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ffkv.report.figures import finish, new_figure, reference, styled
from ffkv.steps.patterns.paper import FIG2

COLORS = {"shallow": "#4C72B0", "both": "#8172B2", "semantic": "#DD8452", "not_covered": "#CCCCCC"}


# ---- Fig 2 ---------------------------------------------------------------------------------------------
@styled
def fig2(df: pd.DataFrame, title: str = "Pattern kinds of the top-25 trigger prefixes") -> Figure:
    if "scope" in df.columns:
        scope = "semantic_sample" if (df["scope"] == "semantic_sample").any() else "all"
        df = df[df["scope"] == scope]
    df = df.sort_values("layer")
    fig, ax = new_figure()
    bottom = np.zeros(len(df))
    for k, label in (("shallow", "shallow"), ("both", "shallow + semantic"), ("semantic", "semantic"),
                     ("not_covered", "not covered")):
        v = df[k].fillna(0).to_numpy() * 100
        ax.bar(df["layer"], v, bottom=bottom, color=COLORS[k], label=label, width=0.8)
        bottom += v
    reference(ax, FIG2.reference)
    return finish(fig, ax, df["layer"], "% of prefixes", title, ylim=(0, 100))
