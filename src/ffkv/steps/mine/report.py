"""The `mine` step's report section: key activation profiles (density per layer, a few keys'
histograms), drawn by `ffkv.report.keystats` from the pass's key statistics. A run mined before
them, or with --no-stats, has none."""
from __future__ import annotations


def sections(run, fig_dir) -> list:
    from ffkv.report import keystats
    from ffkv.report.build import figure_html
    from ffkv.steps import ReportSection

    sec = keystats.section(run, fig_dir)
    if sec is None:
        return []
    figs = "".join(figure_html(f, sec["title"]) for f in sec["figures"])
    return [ReportSection("keystats", sec["title"], figs + sec["html"], short="Key activations")]
