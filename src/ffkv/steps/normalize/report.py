"""The `normalize` step's report section: one verdict and figure per claim (C1-C5), made by
`ffkv.report.normalize` from the step's tables; only for a run whose step is done."""
from __future__ import annotations


def sections(run, fig_dir) -> list:
    from ffkv.report import normalize as N
    from ffkv.report.build import Builder
    from ffkv.steps import ReportSection

    if not run.step_done("normalize"):
        return []
    b = Builder.of(run, fig_dir)
    its = N.items(b.t.get, fig_dir, gated=bool(b.m.get("gated")), run_path=str(run.path))
    return [ReportSection("normalize", "Normalized memories", N.section_html(its, "figures"),
                          tuple(N.verdict_records(its)), whole=True)]
