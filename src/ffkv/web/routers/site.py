"""The overview, the API index, static files and the built report."""
from __future__ import annotations

import re

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from ffkv.web import plots
from ffkv.web.common import STATIC_DIR, render, state
from ffkv.web.params import api
from ffkv.web.tables import NotFound


router = APIRouter()


STATIC_FILES = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file()}
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon"}
REPORT_CSP = ("default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; base-uri 'none'; "
              "form-action 'none'; frame-ancestors 'none'")


# ---- static files and the report ------------------------------------------------------------------
@router.get("/static/{name}", include_in_schema=False)
def static(name: str):
    p = STATIC_FILES.get(name)  # a fixed set of files read at import: no path from the request
    if p is None:
        raise NotFound(f"no static file {name!r}")
    return FileResponse(p, media_type=STATIC_TYPES.get(p.suffix, "application/octet-stream"),
                        headers={"Cache-Control": "max-age=3600"})


@router.get("/favicon.ico", include_in_schema=False)
def favicon():
    return Response(status_code=204)


@router.get("/report", include_in_schema=False)
def report_redirect():
    return RedirectResponse("/report/", status_code=308)


MEM_SPAN = re.compile(r'<span class="mem" data-memory="(\d{1,6})/(\d{1,9})">(.*?)</span>')


def linked_report(html: str, stale: str | None = None) -> str:
    """The report as `ffkv serve` shows it: its memory ids (`ffkv.report.html.mem`) link to their
    pages, and a report older than the run's annotations or steps says so at the top."""
    html = MEM_SPAN.sub(lambda m: f'<a class="mem" href="/memory/{m[1]}/{m[2]}">{m[3]}</a>', html)
    if stale:
        note = f'<p class="stale" role="status" style="background:#fff3cd;padding:.5em 1em">{stale}</p>'
        html = re.sub(r"(<body[^>]*>)", lambda m: m[1] + note, html, count=1)
    return html


def report_staleness(run_path, name: str) -> str | None:
    """Why the built report is out of date, or None: a step finished or an annotation was saved
    after it was written."""
    import json
    import os

    built = os.stat(run_path / "report" / "index.html").st_mtime
    why = []
    try:
        steps = json.loads((run_path / "manifest.json").read_text()).get("steps") or {}
    except (OSError, ValueError):
        steps = {}
    later = sorted(k for k, v in steps.items() if isinstance(v, dict) and (v.get("finished") or 0) > built)
    if later:
        why.append("step" + ("s " if len(later) > 1 else " ") + ", ".join(later) + " finished")
    for f in ("annotations.sqlite", "annotations.sqlite-wal"):
        p = run_path / f
        if p.exists() and os.stat(p).st_mtime > built:
            why.append("annotations were saved")
            break
    if not why:
        return None
    return (f"This report is out of date: {' and '.join(why)} after it was built. "
            f"Rebuild it with <code>ffkv report {name}</code>.")


@router.get("/report/", include_in_schema=False)
def report(request: Request):
    from fastapi.responses import HTMLResponse

    b = state(request)
    p = b.path / "report" / "index.html"
    if not p.is_file():
        raise NotFound(f"this run has no report yet; build it with `ffkv report {b.name}`")
    import html as html_mod

    stale = report_staleness(b.path, html_mod.escape(str(b.name)))
    return HTMLResponse(linked_report(p.read_text(encoding="utf-8"), stale),
                        headers={"Content-Security-Policy": REPORT_CSP})


@router.get("/report/figures/{name}", include_in_schema=False)
def report_figure(request: Request, name: str):
    folder = state(request).path / "report" / "figures"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+\.(png|svg)", name) or not folder.is_dir():
        raise NotFound(f"no figure {name!r}")
    files = {p.name: p for p in folder.iterdir() if p.is_file()}
    if name not in files:
        raise NotFound(f"no figure {name!r}")
    return FileResponse(files[name], media_type=STATIC_TYPES[files[name].suffix],
                        headers={"Content-Security-Policy": REPORT_CSP})


# ---- the overview ---------------------------------------------------------------------------------
def overview_rows(ov: dict) -> list[dict]:
    rows = []
    max_ag = max([r["agreement"]["ci_high"] or 0 for r in ov["rows"] if r.get("agreement")] + [1e-9])
    for r in ov["rows"]:
        ag, act, pat = r.get("agreement"), r.get("active"), r.get("patterns")
        share = "eps_share" if act and act.get("eps_share") is not None else "mean"
        rows.append({**r,
                     # the headline density: |m| > ε (m > 0 sits near 50% on a gated FFN); m > 0 where no ε share
                     "active_share": act.get(share) if act else None,
                     "active_plot": plots.bar(act[share], label=f"active share {act[share]:.3f}")
                     if act and act.get(share) is not None else None,
                     "agreement_plot": plots.interval(ag["agreement"], ag["ci_low"], ag["ci_high"], ag["shuffled"],
                                                      vmax=max_ag, label="agreement with 95% interval; "
                                                      "tick: shuffled pairing") if ag else None,
                     "patterns_plot": plots.stacked([(pat.get("shallow"), "c-shallow", "shallow"),
                                                     (pat.get("semantic"), "c-semantic", "semantic"),
                                                     (pat.get("both"), "c-both", "both"),
                                                     (pat.get("not_covered"), "c-none", "not covered")],
                                                    label="prefixes by pattern kind") if pat else None})
    return rows


@router.get("/", include_in_schema=False)
def overview(request: Request, format: str | None = None):  # noqa: A002 - the URL's parameter
    from ffkv.web import export

    fmt = export.check_format(format)
    ov = state(request).overview()
    if fmt:
        extra = [f"{c['step']}.{c['title']}" for c in ov.get("step_columns", ())]
        return export.download(overview_table(ov), [*OVERVIEW_COLUMNS, *extra], "ffkv-layers", fmt)
    return render(request, "overview.html", ov=ov, rows=overview_rows(ov), density=density_measure(ov))


def density_measure(ov: dict) -> str:
    """What the overview's active share counts: |m| ≥ ε from key_hist, |m| > ε from compose, else m > 0."""
    for r in ov["rows"]:
        a = r.get("active") or {}
        if a.get("eps_share") is not None and a.get("eps_value") is not None:
            return f"|m| {'≥' if a.get('eps_source') == 'key_hist' else '>'} {a['eps_value']:g}"
    return "m > 0"


OVERVIEW_COLUMNS = ("layer", "mined", "active_mean", "active_eps_share", "active_eps", "agreement", "agreement_ci_low",
                    "agreement_ci_high",
                    "agreement_shuffled", "agreement_n", "shallow", "semantic", "both", "not_covered",
                    "patterns_per_key", "annotated")


def overview_table(ov: dict) -> list[dict]:
    """The overview's layer table, flat (its CSV and JSON download); a step's column is "step.title"."""
    out = []
    for r in ov["rows"]:
        steps = {f"{k}.{t}": v for k, cols in (r.get("steps") or {}).items() for t, v in cols.items()}
        ag, act, pat = r.get("agreement") or {}, r.get("active") or {}, r.get("patterns") or {}
        out.append({"layer": r["layer"], "mined": r["mined"], "active_mean": act.get("mean"),
                    "active_eps_share": act.get("eps_share"), "active_eps": act.get("eps_value"),
                    "agreement": ag.get("agreement"), "agreement_ci_low": ag.get("ci_low"),
                    "agreement_ci_high": ag.get("ci_high"), "agreement_shuffled": ag.get("shuffled"),
                    "agreement_n": ag.get("n"), **{k: pat.get(k) for k in ("shallow", "semantic", "both",
                                                                          "not_covered", "patterns_per_key")},
                    "annotated": r.get("annotated"), **steps})
    return out


@router.get("/api/overview")
def api_overview(request: Request):
    return api(state(request).overview())


@router.get("/api/", include_in_schema=False)
@router.get("/api", include_in_schema=False)
def api_index(request: Request):
    return api({"endpoints": {
        "/api/overview": "the run and one row per layer",
        "/api/memory/{layer}/{dim}?top=25": "a memory: triggers of both signs, values, vocabulary views, "
                                             "agreement, patterns, mutations, annotations, statistics",
        "/api/memory/{layer}/{dim}/reverify?sign=1&rank=1": "recompute a stored trigger's coefficient",
        "POST /api/memory/{layer}/{dim}/annotations": "save an annotation: {annotator, sign, note, patterns: "
                                                      "[{description, kind, prefixes}]}",
        "/api/search?token=…&k=10&lens=norm&dir=promote&match=merged|exact": "memories whose value ranks a "
                                                                             "token < k (␣ = a space)",
        "/api/search?text=…&mode=word|token": "memories whose trigger prefixes contain a word / end in a token",
        "/api/search?sort=max_prob|precision|agreement|…&layer=&label=&agree=": "memories by a measure",
        "/api/sentence/{id}": "a sentence, its tokens, its triggers",
        "/api/annotations": "every annotation and the human Fig 2",
        "/api/index": "the token index's status",
        "/api/layer/{layer}?page=1&per_page=100": "a layer: key density, agreement, best memories, pattern mix, "
                                                   "its memories with their one-line summaries",
        "/api/memory/{layer}/{dim}/similar": "nearest memories by value direction, key direction (cosine) and "
                                             "co-activation (shared trigger sentences)",
        "/api/search?…&format=csv": "every row of a search as CSV (also ?format=csv|json on /, /search, "
                                    "/layer/N, /annotations; /memory/L/D/triggers.csv|json)",
        "/api/search?text=…&mode=summary": "memories whose one-line summary of measurements contains the words",
        "/api/memory/{layer}/{dim}/activations?top=25": "the memory's coefficient m at every token of its "
                                                        "page's examples (or ?sentence=N: of one sentence)",
        "/api/activations?examples=L/D/SENTENCE/POSITION,…": "m of each example's memory at every token around "
                                                              "its trigger (a search page's rows)",
    }})
