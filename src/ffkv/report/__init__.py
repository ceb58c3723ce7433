"""The HTML report of a run: the paper's figures and tables rebuilt from the run, each beside the
paper's own result and a computed verdict (`ffkv report RUN`; `build_report(run_path) -> Path`)."""
from __future__ import annotations


def build_report(run_path, out=None, log=None):
    """See `ffkv.report.build.build_report` (imported lazily: matplotlib and pandas load on use)."""
    from ffkv.report.build import build_report as _build_report

    return _build_report(run_path, out=out, log=log)


__all__ = ["build_report"]
