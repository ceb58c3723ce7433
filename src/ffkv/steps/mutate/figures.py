"""The `mutate` step's figure: Fig 3, the coefficient's relative change when a token is removed."""
from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from ffkv.report.figures import finish, new_figure, styled

COLORS = {"first": "#55A868", "last": "#C44E52", "random": "#8C8C8C"}


# ---- Fig 3 ---------------------------------------------------------------------------------------------
@styled
def fig3(df: pd.DataFrame) -> Figure:
    fig, ax = new_figure()
    offsets = {"first": -0.22, "random": 0.0, "last": 0.22}
    for m, off in offsets.items():
        d = df[df["mutation"] == m].sort_values("layer")
        if d.empty:
            continue
        x = d["layer"].to_numpy() + off
        ax.errorbar(x, d["median"], yerr=[d["median"] - d["q25"], d["q75"] - d["median"]], fmt="o",
                    ms=3.5, capsize=2, color=COLORS[m], label=f"remove {m} token (median, IQR)")
        ax.plot(x, d["mean"], "x", ms=4, color=COLORS[m], alpha=0.6)
    ax.axhline(0, color="black", lw=0.6)
    return finish(fig, ax, df["layer"], "relative change of the coefficient",
                   "Removing a token from a trigger example (× = mean)")
