"""The worth step's views: the memory page's panel, the overview's columns, the report's section and
the browser's per-memory array (what layer lists sort by and search filters on: `by_code`, `of_browser`),
all read from `memory_worth` (columns in `ffkv.steps.worth.compute`)."""
from __future__ import annotations

NO_WORTH = "this run has no worth table (memory_worth): run `ffkv worth RUN`"
NOTE = ("First-order estimate (attribution patching, −m·∂L/∂m averaged over the predicted tokens) of the rise "
        "of the model's next-token loss when the memory is removed (m = 0 at every token).")


def _check_line(run) -> str:
    c = (run.step("worth").get("summary") or {}).get("check")
    if not c:
        return ""
    rho = c.get("spearman")
    return (f" Checked by really removing {len(c['memories'])} memories over {c['tokens']:,} tokens: Spearman "
            f"{'n/a' if rho is None else f'{rho:.2f}'} between estimate and real rise.")


def panels(run, layer: int, dim: int) -> list:
    from ffkv.steps import Panel
    from ffkv.store import query

    rows = query.table(run, "memory_worth", filters=[("layer", "=", int(layer)), ("dim", "=", int(dim))]).to_pylist()
    if not rows:
        return []
    r = rows[0]
    d_m = int((run.manifest.get("model") or {}).get("d_m") or 0)
    out = [("removing it", f"{r['worth']:+.4g} nats per predicted token (over {r['tokens']:,} tokens)"),
           ("rank in its layer", f"{r['rank']:,}" + (f" of {d_m:,}" if d_m else ""))]
    if r["ablated"] is not None:
        out.append(("checked by removal", f"real rise {r['ablated']:+.4g}, estimate {r['estimate_check']:+.4g} "
                                          "(over the check's tokens)"))
    return [Panel("Worth", ("measure", "value"), tuple(out), note=NOTE + _check_line(run))]


def overview(run) -> dict:
    """Per layer: the summed worth of its memories and its most valuable one's."""
    import numpy as np

    from ffkv.store import query

    t = query.table(run, "memory_worth", columns=["layer", "worth"]).to_pandas()
    g = t.groupby("layer")["worth"]
    return {"worth: total": {int(k): float(v) for k, v in g.sum().items()},
            "worth: top": {int(k): float(v) for k, v in g.max().items() if np.isfinite(v)}}


def sections(run, fig_dir) -> list:
    from ffkv.report.html import table
    from ffkv.steps import ReportSection
    from ffkv.store import query

    t = query.table(run, "memory_worth", columns=["layer", "dim", "worth"]).to_pandas()
    rows = []
    for l, g in t.groupby("layer"):
        best = g.loc[g["worth"].idxmax()]
        rows.append([int(l), f"{g['worth'].sum():+.4g}", f"{int(best['dim'])}", f"{best['worth']:+.4g}",
                     f"{100 * (g['worth'] > 0).mean():.1f}%"])
    html = (f"<p>{NOTE}{_check_line(run)}</p>"
            + table(["layer", "Σ worth (nats/token)", "most valuable dim", "its worth", "memories worth > 0"], rows,
                    num={0, 1, 2, 3, 4}))
    return [ReportSection("worth", "What the memories are worth", html, short="Worth")]


def by_code(run, layers: int, d_m: int):
    """Each memory's worth by code (layer·d_m + dim): float64 (layers·d_m,), NaN for a memory without
    a row; None for a run without `memory_worth`."""
    import numpy as np

    from ffkv.store import query

    if not run.has_table("memory_worth"):
        return None
    t = query.table(run, "memory_worth", columns=["layer", "dim", "worth"])
    code = t.column("layer").to_numpy().astype(np.int64) * d_m + t.column("dim").to_numpy().astype(np.int64)
    out = np.full(layers * d_m, np.nan)
    ok = (code >= 0) & (code < layers * d_m)
    out[code[ok]] = t.column("worth").to_numpy(zero_copy_only=False).astype(np.float64)[ok]
    return out


def of_browser(b):
    """`by_code` of a browser's run (`ffkv.web.data.Browser`), read once and kept."""
    return b._lazy("_worth_by_code", lambda: (by_code(b.run, b.L, b.d_m),))[0]
