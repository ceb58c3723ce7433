"""The census's report section: the class shares by depth (`census_layers`), as a table. Imported
only when a report is built; drawn once the step has run."""
from __future__ import annotations

from ffkv.report.html import table
from ffkv.steps import ReportSection
from ffkv.steps.census.compute import IO_CLASSES, VOCAB_CLASSES


def sections(run, fig_dir) -> list:
    from ffkv.store import query

    t = query.table(run, "census_layers")
    rec = (run.manifest.get("settings") or {}).get("census") or {}
    cols = ["dead", "rare", *VOCAB_CLASSES, *IO_CLASSES]
    rows = [[r["layer"], r["memories"], *[("n/a" if r[c] is None else f"{100 * r[c]:.1f}%") for c in cols]]
            for r in t.to_pylist()]
    note = (f"<p>Shares of each layer's memories (dead and rare: of its mined memories). Thresholds: "
            f"|m| &gt; {rec.get('eps', 0):g} (read as |m| ≥ {rec.get('eps_used', 0):g}), rare below "
            f"{rec.get('rare', 1e-4):g} of the tokens, kurtosis &gt; {rec.get('kurtosis', 10):g}, variance · d &gt; "
            f"{rec.get('partition', 2):g}, |cos| &gt; {rec.get('cos', 0.1):g}; definitions in "
            f"<code>ffkv.steps.census.compute</code>.</p>")
    html = note + table(["layer", "memories", *[c.replace("_", " ") for c in cols]], rows,
                        num=set(range(2 + len(cols))))
    return [ReportSection("census", "Memory census by depth", html, short="Census")]
