"""The memory browser's pages and JSON API.

Public URLs (links get shared; keep them):
- `/`: the overview, one row per layer.
- `/memory/{layer}/{dim}`: a memory page (`?top=N` trigger rows per sign, `?annotate_sign=-1`
  to annotate the negative list, `?slots=N` pattern slots in the form).
- `/search?token=…` (with k, lens, dir=promote|suppress, layer, match=merged|exact; the token
  typed as pages show it, ␣ for a space: `data.parse_token`), `/search?text=…` (mode=word|
  token, sign, layer), `/search?sort=…` (by measure: layer, label, agree); all with sort, order,
  page, per_page (a page past the last is a 404).
- `/api/memory/{layer}/{dim}`, `/api/search?…`: the same data as JSON.
- `/layer/{layer}` (`?page`, `per_page`; `ffkv.web.layers`) and `/api/layer/{layer}`.
- Downloads: `?format=csv|json` on `/`, `/search`, `/layer/{layer}`, `/annotations`;
  `/memory/{layer}/{dim}/triggers.csv|json` (`ffkv.web.export`).
- `/api/memory/{layer}/{dim}/similar`: nearest memories by value, key, co-activation
  (`ffkv.web.neighbours`).
- `/api/memory/{layer}/{dim}/activations?top=&sign=&samples=` (or `?sentence=N`): the memory's
  coefficient m at every token of the examples its page shows (`ffkv.web.activations`; the pages'
  script tints the tokens with it); `/api/activations?examples=L/D/SID/POS,…`: the same for
  several memories at once (a search page's rows, each its own memory).
More: `/sentence/{id}` (a trigger's provenance; permalink; `?memory=L/D` tints it by that memory), `/annotations` (who annotated what;
the human Fig 2), `/memory/{layer}/{dim}/reverify` (recompute a stored coefficient with the
model), `/random`, `/report/`, and their `/api/…` twins; writes are POSTs checked by
`common.same_origin`.
"""
from __future__ import annotations

import json
import re

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, Response
from markupsafe import Markup, escape

from ffkv.errors import FfkvError
from ffkv.store.annotations import LIMITS, MAX_JSON_DEPTH, MAX_NAME, MAX_NOTE, MAX_PATTERNS, MAX_RECORD_BYTES
from ffkv.web import activations, plots
from ffkv.web.common import STATIC_DIR, no_cross_site_fetch, render, same_origin, show_trigger, state
from ffkv.web.search import LABELS, MEASURE_SORTS, TEXT_SORTS, TOKEN_SORTS
from ffkv.web.params import api, opt_bool, opt_int, opt_sign, opt_str, req_int
from ffkv.web.tables import ANNOTATE_TOP, BadQuery, NotFound

router = APIRouter()

COOKIE = "ffkv_annotator"
MAX_SLOTS = MAX_PATTERNS  # the annotation limits: ffkv.store.annotations
STATIC_FILES = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file()}
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon"}
REPORT_CSP = ("default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; base-uri 'none'; "
              "form-action 'none'; frame-ancestors 'none'")


def memory_data(request: Request, layer: int, dim: int, top: int, all_samples: bool = True) -> dict:
    from ffkv.web.panels import step_panels

    b = state(request)
    m = b.memory(layer, dim, top, all_samples)
    m["panels"] = step_panels(b.run, layer, dim)
    return m


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


@router.get("/report/", include_in_schema=False)
def report(request: Request):
    p = state(request).path / "report" / "index.html"
    if not p.is_file():
        raise NotFound(f"this run has no report yet; build it with `ffkv report {state(request).name}`")
    return FileResponse(p, media_type="text/html; charset=utf-8", headers={"Content-Security-Policy": REPORT_CSP})


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
        rows.append({**r,
                     "active_plot": plots.bar(act["mean"], label=f"active share {act['mean']:.3f}")
                     if act and act.get("mean") is not None else None,
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
        return export.download(overview_table(ov), list(OVERVIEW_COLUMNS), "ffkv-layers", fmt)
    return render(request, "overview.html", ov=ov, rows=overview_rows(ov))


OVERVIEW_COLUMNS = ("layer", "mined", "active_mean", "agreement", "agreement_ci_low", "agreement_ci_high",
                    "agreement_shuffled", "agreement_n", "shallow", "semantic", "both", "not_covered",
                    "patterns_per_key", "annotated")


def overview_table(ov: dict) -> list[dict]:
    """The overview's layer table, flat (its CSV and JSON download)."""
    out = []
    for r in ov["rows"]:
        ag, act, pat = r.get("agreement") or {}, r.get("active") or {}, r.get("patterns") or {}
        out.append({"layer": r["layer"], "mined": r["mined"], "active_mean": act.get("mean"),
                    "agreement": ag.get("agreement"), "agreement_ci_low": ag.get("ci_low"),
                    "agreement_ci_high": ag.get("ci_high"), "agreement_shuffled": ag.get("shuffled"),
                    "agreement_n": ag.get("n"), **{k: pat.get(k) for k in ("shallow", "semantic", "both",
                                                                          "not_covered", "patterns_per_key")},
                    "annotated": r.get("annotated")})
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


# ---- a memory page --------------------------------------------------------------------------------
def prefix_html(p: dict) -> Markup:
    """A prefix as HTML: its text escaped, the trigger token marked (built once per row here
    rather than in the template, which is the hot loop of a memory page)."""
    return Markup("".join(('<span class="prefix">', '<span class="muted">…</span>' if p["cut"] else "",
                           str(escape(p["head"])), "<mark>", str(escape(show_trigger(p["trigger"]))), "</mark></span>")))


def annotation_prefixes(request: Request, m: dict, sign: int) -> list[dict]:
    """The top-25 prefixes of one sign (from `m` when it holds them)."""
    rows = m["triggers"]["+" if sign == 1 else "-"]
    if m["top"] < ANNOTATE_TOP:
        rows = state(request).memory(m["layer"], m["dim"], ANNOTATE_TOP)["triggers"]["+" if sign == 1 else "-"]
    rows = [r for r in rows if r["rank"] <= ANNOTATE_TOP]
    for r in rows:  # only the rows the form shows
        r["prefix_html"] = prefix_html(r["prefix"])
    return rows


def annotator_cookie(request: Request) -> str:
    """The annotator's name from its cookie (percent-encoded UTF-8: `set_annotator_cookie`)."""
    from urllib.parse import unquote

    return unquote(request.cookies.get(COOKIE, ""), errors="replace").strip()[:MAX_NAME]


def set_annotator_cookie(resp: Response, name: str) -> None:
    """Remember the annotator's name: any Unicode, percent-encoded (a cookie holds Latin-1 only,
    and `Łukasz` raised UnicodeEncodeError after the annotation was saved)."""
    from urllib.parse import quote

    resp.set_cookie(COOKIE, quote(name.strip()[:MAX_NAME], safe=""), max_age=365 * 24 * 3600, httponly=True,
                    samesite="strict")


def blank_slot() -> dict:
    return {"description": "", "kind": None, "prefixes": set()}


# Forms refused by validation, kept (in memory, a bounded number, for an hour) so that the page
# shown after the refusal can be reloaded without posting again: app.js replaces the POST's
# history entry with `?draft=ID`, which form_state reads back.
DRAFTS_KEPT, DRAFT_SECONDS = 64, 3600


def _drafts(request: Request):
    import collections
    import threading

    app_state = request.app.state
    if getattr(app_state, "annotation_drafts", None) is None:
        app_state.annotation_drafts = (collections.OrderedDict(), threading.Lock())
    return app_state.annotation_drafts


def keep_draft(request: Request, layer: int, dim: int, form: dict, error: str) -> str:
    import secrets
    import time

    drafts, lock = _drafts(request)
    key = secrets.token_urlsafe(12)
    with lock:
        drafts[key] = (time.monotonic(), layer, dim, {**form, "error": error})
        while len(drafts) > DRAFTS_KEPT:
            drafts.popitem(last=False)
    return key


def get_draft(request: Request, layer: int, dim: int, key: str) -> dict | None:
    import time

    drafts, lock = _drafts(request)
    with lock:
        d = drafts.get(str(key))
    if d is None or d[1:3] != (layer, dim) or time.monotonic() - d[0] > DRAFT_SECONDS:
        return None
    return d[3]


def typed_state(params) -> dict | None:
    """The form as typed, from a GET that carries it (the "more pattern slots" button without
    JavaScript submits the form to the memory page); None when `params` carry no form."""
    if not any(k in ("annotator", "note") or SLOT_FIELD.fullmatch(k) for k in params):
        return None
    _, slots = patterns_from_form(params, check=False)
    return {"annotator": str(params.get("annotator") or "")[:MAX_NAME], "note": str(params.get("note") or "")[:MAX_NOTE],
            "slots": slots}


def form_state(request: Request, layer: int, dim: int, sign: int, slots: int | None) -> dict:
    """The annotation form: the annotator (cookie) and their saved patterns for this key; or the
    form as typed (a GET carrying it, or a refused form's `?draft=`)."""
    q = request.query_params
    draft = get_draft(request, layer, dim, q["draft"]) if q.get("draft") else None
    typed = draft or typed_state(q)
    if typed is not None:
        who, note, slots_ = typed["annotator"], typed["note"], list(typed["slots"])
        sign = typed.get("sign", sign)
    else:
        who = annotator_cookie(request)
        pats, note = [], ""
        if who:
            for a in state(request).annotations(layer, dim):
                if a["annotator"] == who and a["sign"] == sign:
                    pats, note = a["patterns"], a["note"]
        slots_ = [{"description": p["description"], "kind": p["kind"], "prefixes": set(p["prefixes"])}
                  for p in pats]
    n = min(max(slots or 0, len(slots_) + (0 if typed is not None else 2), 3), MAX_SLOTS)
    slots_ += [blank_slot() for _ in range(n - len(slots_))]
    return {"annotator": who, "note": note, "slots": slots_[:MAX_SLOTS], "sign": sign, "limits": LIMITS,
            "error": (draft or {}).get("error"), "draft": q.get("draft") if draft else None}


def stats_plot(st: dict | None):
    """The key's signed activation histogram over the occupied bins (and the zero bin)."""
    if not st or not st.get("hist"):
        return None
    h = st["hist"]
    a, b = h["shown"]
    cls = {-1: "neg", 0: "zero-bin", 1: "pos"}
    classes = [cls.get(x, "bar") for x in h["sign"][a:b + 1]] if h.get("sign") else None
    labels = h["labels"][a:b + 1]
    return plots.histogram(h["counts"][a:b + 1], labels, classes, axis=(labels[0], "", labels[-1]),
                           label=f"coefficients of this key over {h['total']:,} corpus tokens (log counts)")


def render_memory(request: Request, layer: int, dim: int, top: int, sign: int, slots: int | None,
                  form: dict | None = None, error: str | None = None, status_code: int = 200,
                  all_samples: bool = False):
    b = state(request)
    m = memory_data(request, layer, dim, top, all_samples)
    can_annotate = m["mined"] and b.n_prefixes(layer, dim, sign) > 0
    form = form or form_state(request, layer, dim, sign, slots)
    prefixes = annotation_prefixes(request, m, sign) if can_annotate else []
    hist = stats_plot(m.get("stats"))
    return render(request, "memory.html", status_code=status_code, m=m, form=form, form_error=error,
                  prefixes=prefixes, can_annotate=can_annotate, hist=hist, b=b, slots=len(form["slots"]),
                  max_slots=MAX_SLOTS, all_samples=all_samples)


@router.get("/memory/{layer}/{dim}", include_in_schema=False)
def memory_page(request: Request, layer: int, dim: int, top: str | None = None, annotate_sign: str | None = None,
                slots: str | None = None, samples: str | None = None):
    if samples not in (None, "", "all", "first"):
        raise BadQuery(f"samples must be all or first (got {samples!r})")
    return render_memory(request, layer, dim, req_int(top, "top", 25, 1, 200),
                         opt_sign(annotate_sign) or 1, opt_int(slots, "slots", 1, MAX_SLOTS),
                         all_samples=samples == "all")


@router.get("/api/memory/{layer}/{dim}")
def api_memory(request: Request, layer: int, dim: int, top: str | None = None):
    return api(memory_data(request, layer, dim, req_int(top, "top", 25, 1, 200)))


@router.get("/random", include_in_schema=False)
def random_memory(request: Request):
    l, d = state(request).random_key()
    return RedirectResponse(f"/memory/{l}/{d}", status_code=302, headers={"Cache-Control": "no-store"})


# ---- annotation -----------------------------------------------------------------------------------
SLOT_FIELD = re.compile(r"p\d+_(description|kind|prefixes)")


def patterns_from_form(form, check: bool = True) -> tuple[list[dict], list[dict]]:
    """(patterns for the store, slots to re-show) from the form fields p{j}_description, p{j}_kind,
    p{j}_prefixes. Blank slots (no description, no ticks) are skipped. With `check`, a slot the
    store would refuse raises BadQuery naming it as the form does (S1, S2, …); without, what
    cannot be read is dropped (re-showing a form as typed)."""
    pats, slots = [], []
    for j in range(MAX_SLOTS):
        desc = str(form.get(f"p{j}_description") or "")
        kind = form.get(f"p{j}_kind") or None
        raw = form.getlist(f"p{j}_prefixes")
        if f"p{j}_description" not in form and not raw and kind is None:
            continue
        pre = []
        for v in raw:
            try:
                pre.append(int(str(v)))
            except ValueError:
                if check:
                    raise BadQuery(f"S{j + 1}: prefix index {str(v)[:20]!r} is not an integer") from None
        slots.append({"description": desc[:LIMITS["description"]],
                      "kind": kind if kind in ("shallow", "semantic") else None, "prefixes": set(pre)})
        if not desc.strip() and not pre:
            continue
        if check:
            name = f"S{j + 1}" + (f" ({desc.strip()[:40]!r})" if desc.strip() else "")
            if not desc.strip():
                raise BadQuery(f"{name}: prefixes are ticked but the pattern has no description; "
                               "describe it, or clear its ticks")
            if kind not in ("shallow", "semantic"):
                raise BadQuery(f"{name}: kind must be shallow or semantic; choose one")
            if not pre:
                raise BadQuery(f"{name}: tick the prefixes this pattern covers")
        pats.append({"description": desc, "kind": kind, "prefixes": pre})
    return pats, slots


@router.post("/memory/{layer}/{dim}/annotate", include_in_schema=False, dependencies=[Depends(same_origin)])
async def annotate_form(request: Request, layer: int, dim: int):
    """Save the form, then 303 to the memory page (Post/Redirect/Get: a reload does not post
    again). A refused form: 422, the page again with the message and the input, and a draft id
    that app.js puts in the URL, so a reload shows the draft instead of posting it again. The
    response (cookie included) is built before the save: once saved, nothing can fail."""
    b = state(request)
    b.check_key(layer, dim)
    too_big(request)
    try:
        form = await request.form(max_files=0, max_fields=200 + MAX_SLOTS * (ANNOTATE_TOP + 3))
    except Exception:  # noqa: BLE001 - a malformed or oversized body
        raise BadQuery("the form could not be read (too many fields or a malformed body)") from None
    sign = opt_sign(form.get("sign")) or 1
    annotator = str(form.get("annotator") or "")
    note = str(form.get("note") or "")
    _, slots = patterns_from_form(form, check=False)  # the form as typed, to show again if refused
    try:
        pats, _ = patterns_from_form(form)
        resp = RedirectResponse(f"/memory/{layer}/{dim}?annotate_sign={sign}#annotations", status_code=303)
        if annotator.strip():
            set_annotator_cookie(resp, annotator)
        await run_in_threadpool(b.annotate, annotator, layer, dim, pats, sign, note)
    except FfkvError as e:
        if isinstance(e, NotFound):
            raise
        error = " ".join(str(e).split())
        state_ = {"annotator": annotator[:MAX_NAME], "note": note[:MAX_NOTE], "sign": sign, "limits": LIMITS,
                  "slots": (slots + [blank_slot(), blank_slot()])[:MAX_SLOTS]}
        key = keep_draft(request, layer, dim, state_, error)
        state_["draft"] = key
        return await run_in_threadpool(render_memory, request, layer, dim, 25, sign, None, state_, error, 422)
    return resp


def too_big(request: Request) -> None:
    """413 for an annotation body over MAX_RECORD_BYTES (as its Content-Length says; the app's
    BodyLimit also counts what arrives)."""
    from fastapi import HTTPException

    try:
        n = int(request.headers.get("content-length") or 0)
    except ValueError:
        n = 0
    if n > MAX_RECORD_BYTES:
        raise HTTPException(413, f"an annotation is at most {MAX_RECORD_BYTES:,} bytes (this body: {n:,})")


def json_depth(text: str) -> int:
    """How deeply `text` (JSON) nests arrays and objects, counted without parsing it: Python's
    json recurses once per level, and a 200 KB body of `[[[[…` raised RecursionError (a 500)."""
    depth = top = 0
    for tok in _JSON_NESTING.findall(text):
        if tok in "[{":
            depth += 1
            top = max(top, depth)
        elif tok in "]}":
            depth -= 1
    return top


_JSON_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')  # strings (skipped) or brackets


@router.post("/api/memory/{layer}/{dim}/annotations", dependencies=[Depends(same_origin)])
async def api_annotate(request: Request, layer: int, dim: int):
    b = state(request)
    b.check_key(layer, dim)
    too_big(request)
    raw = await request.body()
    if len(raw) > MAX_RECORD_BYTES:
        from fastapi import HTTPException

        raise HTTPException(413, f"an annotation is at most {MAX_RECORD_BYTES:,} bytes")
    try:
        text = raw.decode("utf-8")
        if json_depth(text) > MAX_JSON_DEPTH:
            raise BadQuery(f"the body nests deeper than {MAX_JSON_DEPTH} levels; an annotation is "
                           "{annotator, sign, note, patterns: [{description, kind, prefixes: [...]}]}")
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadQuery("the body must be JSON: {annotator, sign, note, patterns}") from None
    if not isinstance(body, dict):
        raise BadQuery("the body must be a JSON object: {annotator, sign, note, patterns}")
    extra = set(body) - {"annotator", "sign", "note", "patterns"}
    if extra:
        raise BadQuery(f"unknown field(s) {sorted(extra)[:10]}; expected annotator, sign, note, patterns")
    rec = await run_in_threadpool(b.annotate, body.get("annotator"), layer, dim, body.get("patterns", []),
                                  body.get("sign", 1), body.get("note", ""))
    return api({"saved": rec}, status_code=201)


ANNOTATION_COLUMNS = ("annotator", "layer", "dim", "sign", "pattern", "kind", "description", "prefixes", "note",
                      "updated")


def annotation_table(recs: list[dict]) -> list[dict]:
    """Annotations flat: one row per pattern (pattern 0 and empty pattern columns for none)."""
    out = []
    for a in recs:
        base = {k: a.get(k) for k in ("annotator", "layer", "dim", "sign", "note", "updated")}
        pats = a.get("patterns") or [{}]
        for j, p in enumerate(pats):
            out.append({**base, "pattern": j + 1 if p else None, "kind": p.get("kind"),
                        "description": p.get("description"),
                        "prefixes": [int(x) + 1 for x in p.get("prefixes") or []] if p else None})
    return out


@router.get("/annotations", include_in_schema=False)
def annotations_page(request: Request, annotator: str | None = None, format: str | None = None):  # noqa: A002
    from ffkv.web import export

    fmt = export.check_format(format)
    b = state(request)
    recs = b.annotations()
    who = opt_str(annotator)
    shown = [r for r in recs if who is None or r["annotator"] == who]
    if fmt:
        return export.download(annotation_table(shown), list(ANNOTATION_COLUMNS),
                               "ffkv-annotations" + (f"-{who}" if who else ""), fmt)
    stats = b.annotation_stats()
    fig2 = []
    for r in (stats or {}).get("fig2") or []:
        fig2.append({**r, "plot": plots.stacked([(r.get("shallow"), "c-shallow", "shallow"),
                                                 (r.get("semantic"), "c-semantic", "semantic"),
                                                 (r.get("both"), "c-both", "both"),
                                                 (r.get("not_covered"), "c-none", "not covered")],
                                                label=f"layer {r['layer']}: prefixes by kind")})
    return render(request, "annotations.html", recs=shown, annotators=sorted({r["annotator"] for r in recs}),
                  who=who, stats=stats, fig2=fig2, total=len(recs),
                  memories=len({(r["layer"], r["dim"]) for r in recs}),
                  lists=len({(r["layer"], r["dim"], r["sign"]) for r in recs}))


@router.get("/api/annotations")
def api_annotations(request: Request):
    b = state(request)
    return api({"annotations": b.annotations(), "stats": b.annotation_stats()})


# ---- re-verify ------------------------------------------------------------------------------------
def reverify(request: Request, layer: int, dim: int, sign: int, rank: int) -> dict:
    import time

    b = state(request)
    b.check_key(layer, dim)
    rows = [r for r in b.trig.rows(layer, dim) if r["sign"] == sign and r["rank"] == rank]
    if not rows:
        raise NotFound(f"memory {layer}/{dim} has no trigger of sign {sign:+d} and rank {rank}")
    r = rows[0]
    srow = b.sentence_row(r["sentence_id"])
    ids = [int(t) for t in b.sentence_tokens(srow)[: r["position"] + 1]]
    t0 = time.time()
    loaded = b.model_loaded
    mm = b.model()
    t1 = time.time()
    with b.foreground.busy(), b.model_lock:
        import torch

        with torch.no_grad():
            x, mask = mm.batch([ids])
            cap = mm.capture(x, mask, layers=[layer], what=("m",))
            now = float(cap[layer]["m"][0, r["position"], dim].float())
    stored = float(r["coef"])
    return {"layer": layer, "dim": dim, "sign": sign, "rank": rank, "sentence_id": r["sentence_id"],
            "position": r["position"], "prefix": b.prefix(srow, r["position"]), "stored": stored, "now": now,
            "abs_diff": abs(now - stored), "rel_diff": abs(now - stored) / abs(stored) if stored else None,
            "model": b.model_id, "device": str(mm.device), "dtype": str(mm.dtype).replace("torch.", ""),
            "model_load_seconds": None if loaded else round(t1 - t0, 2),
            "compute_seconds": round(time.time() - t1, 3), "permalink": b.permalink(r["sentence_id"], r["position"])}


@router.get("/memory/{layer}/{dim}/reverify", include_in_schema=False, dependencies=[Depends(no_cross_site_fetch)])
def reverify_page(request: Request, layer: int, dim: int, sign: str | None = "1", rank: str | None = "1"):
    res = reverify(request, layer, dim, opt_sign(sign) or 1, req_int(rank, "rank", 1, 1, 100000))
    return render(request, "reverify.html", r=res)


@router.get("/api/memory/{layer}/{dim}/reverify", dependencies=[Depends(no_cross_site_fetch)])
def api_reverify(request: Request, layer: int, dim: int, sign: str | None = "1", rank: str | None = "1"):
    return api(reverify(request, layer, dim, opt_sign(sign) or 1, req_int(rank, "rank", 1, 1, 100000)))


# ---- sentences (provenance) -----------------------------------------------------------------------
@router.get("/sentence/{sid}", include_in_schema=False)
def sentence_page(request: Request, sid: int, pos: str | None = None, corpus: str | None = None,
                  memory: str | None = None):
    b = state(request)
    s = b.sentence(sid, opt_int(pos, "pos", 0))
    mem = activations.parse_memory(memory)
    if mem is not None:
        b.check_key(*mem)
    mismatch = bool(corpus) and not b.corpus_sha.startswith(str(corpus).lower())
    return render(request, "sentence.html", s=s, corpus_mismatch=mismatch, corpus_asked=corpus, memory=mem)


# ---- per-token coefficients (the colours of examples: ffkv.web.activations) ---------------------------
@router.get("/api/memory/{layer}/{dim}/activations", dependencies=[Depends(no_cross_site_fetch)])
def api_activations(request: Request, layer: int, dim: int, top: str | None = None, samples: str | None = None,
                    sign: str | None = None, sentence: str | None = None):
    """m of memory layer/dim at every token of the examples its page shows (`top` trigger rows
    of each sign, or of `sign`; the quantile samples the page shows: one per level, or every one
    with samples=all, or none), or of one `sentence`."""
    b = state(request)
    b.check_key(layer, dim)
    if samples not in (None, "", "all", "first", "none"):
        raise BadQuery(f"samples must be all, first or none (got {samples[:20]!r})")
    sid = opt_int(sentence, "sentence", 0, 2**62)
    if sid is not None:
        b.sentence_row(sid)  # 404 for a sentence not in the run
        examples = [(sid, None)]
    else:
        examples = activations.page_examples(b, layer, dim, req_int(top, "top", 25, 1, activations.MAX_TOP),
                                             samples or "first", opt_sign(sign))
    return api(activations.activations(b, request.app.state, layer, dim, examples))


@router.get("/api/activations", dependencies=[Depends(no_cross_site_fetch)])
def api_activations_many(request: Request, examples: str | None = None):
    """m of each example's memory at every token of its window (`examples`: LAYER/DIM/SENTENCE/
    POSITION, comma-separated; a search page asks for its rows)."""
    b = state(request)
    items = activations.parse_examples(examples)
    for layer, dim, sid, pos in items:
        b.check_key(layer, dim)
        n = len(b.sentence_tokens(b.sentence_row(sid)))  # 404 for a sentence not in the run
        if pos >= n:
            raise BadQuery(f"examples: sentence {sid} has {n} tokens, so no position {pos}")
    return api(activations.activations_many(b, request.app.state, items))


@router.get("/api/sentence/{sid}")
def api_sentence(request: Request, sid: int, pos: str | None = None):
    return api(state(request).sentence(sid, opt_int(pos, "pos", 0)))


# ---- search ---------------------------------------------------------------------------------------
def do_search(request: Request, p: dict) -> dict:
    b = state(request)
    page = req_int(p.get("page"), "page", 1, 1, 10**6)
    per_page = req_int(p.get("per_page"), "per_page", 50, 1, 500)
    layer = opt_int(p.get("layer"), "layer")
    sort, order = opt_str(p.get("sort")), opt_str(p.get("order"))
    token, text = p.get("token"), p.get("text")
    if token is not None and token != "":
        res = b.search_token(token, k=req_int(p.get("k"), "k", 10, 1, 10**6), lens=opt_str(p.get("lens")),
                             direction=opt_str(p.get("dir")) or "promote", layer=layer, sort=sort,
                             order=order, page=page, per_page=per_page,
                             match=opt_str(p.get("match")) or "merged")
    elif text is not None and text != "":
        res = b.search_text(text, mode=opt_str(p.get("mode")) or "word", sign=opt_sign(p.get("sign")),
                            layer=layer, sort=sort, order=order, page=page, per_page=per_page)
    else:
        res = b.search_measure(sort=sort, order=order, layer=layer, label=opt_str(p.get("label")),
                               agree=opt_bool(p.get("agree"), "agree"), page=page, per_page=per_page)
    check_page(res)
    b.add_summaries(res.get("results") or [])
    return res


def check_page(res: dict) -> None:
    """A page past the last one is a 404 (page 1 of no results is a page saying so). Not
    checked while the token index is still being built: its total is not known yet."""
    if res.get("status") in ("building", "absent", "failed"):
        return
    last = max(1, -(-int(res.get("total") or 0) // res["per_page"]))
    if res["page"] > last:
        raise NotFound(f"page {res['page']} does not exist: these results have {last} page{'s' if last > 1 else ''} "
                       f"of {res['per_page']}")


SEARCH_PARAMS = ("token", "text", "sort", "order", "page", "per_page", "k", "lens", "dir", "layer", "mode",
                 "sign", "label", "agree", "match", "format")


def search_params(request: Request) -> dict:
    q = request.query_params
    unknown = sorted(set(q) - set(SEARCH_PARAMS))
    if unknown:
        raise BadQuery(f"unknown search parameter(s) {unknown}; use {', '.join(SEARCH_PARAMS)}")
    return {k: q.get(k) for k in SEARCH_PARAMS if k in q}


@router.get("/search", include_in_schema=False, dependencies=[Depends(no_cross_site_fetch)])
def search_page(request: Request):
    from ffkv.web import export

    p = search_params(request)
    fmt = export.check_format(p.pop("format", None))
    if fmt:
        return search_download(request, p, fmt)
    res = do_search(request, p)
    return render(request, "search.html", res=res, p=p, b=state(request), labels=LABELS,
                  measure_sorts=list(MEASURE_SORTS), token_sorts=list(TOKEN_SORTS), text_sorts=list(TEXT_SORTS),
                  refresh=res.get("status") == "building")


@router.get("/api/search", dependencies=[Depends(no_cross_site_fetch)])
def api_search(request: Request):
    p = search_params(request)
    if p.get("format") not in (None, "", "json"):
        from ffkv.web import export

        return search_download(request, {k: v for k, v in p.items() if k != "format"}, export.check_format(p["format"]))
    p.pop("format", None)
    res = do_search(request, p)
    status = 503 if res.get("mode") == "token" and res.get("status") in ("building", "absent") else 200
    if res.get("status") == "failed":
        status = 500
    out = api(res, status_code=status)
    if status == 503:
        out.headers["Retry-After"] = "2"
    return out


@router.get("/api/index")
def api_index_status(request: Request):
    return api(state(request).index_status())


@router.post("/index/build", include_in_schema=False, dependencies=[Depends(same_origin)])
def build_index(request: Request):
    state(request).start_index()
    return RedirectResponse("/search", status_code=303)


# ---- downloads (CSV and JSON of a table page: `ffkv.web.export`) -----------------------------------
DOWNLOAD_MAX = 10_000  # rows of a search download (every page of the results, up to this)
SEARCH_COLUMNS = {
    "token": ("layer", "dim", "token", "token_text", "rank", "prob", "max_prob", "precision", "mined", "summary"),
    "text": ("layer", "dim", "sign", "n", "best_rank", "best_coef", "sentence_id", "position", "prefix", "summary"),
    "summary": ("layer", "dim", "summary"),
    "measure": ("layer", "dim", "mined", "n_triggers", "top_coef", "max_prob", "entropy", "top_token",
                "top_token_text", "max_prob_neg", "top_token_neg", "top_token_neg_text", "precision",
                "precision_neg", "rank", "target_prob", "agree", "label", "n_patterns", "coverage", "summary"),
}


def search_download(request: Request, p: dict, fmt: str):
    """Every row of a search's results (up to DOWNLOAD_MAX) as CSV or JSON; ranks as in the JSON
    API (0 = the value's top token)."""
    from ffkv.web import export

    q = {**p, "page": "1", "per_page": "500"}
    res = do_search(request, q)
    if res.get("status") in ("building", "absent", "failed"):
        raise FfkvError("the token index is not ready yet; download once the search page shows results")
    rows = list(res["results"])
    while len(rows) < min(res["total"], DOWNLOAD_MAX):
        q["page"] = str(int(q["page"]) + 1)
        more = do_search(request, q)["results"]
        if not more:
            break
        rows += more
    rows = rows[:DOWNLOAD_MAX]
    kind = res.get("text_mode") if res["mode"] == "text" and res.get("text_mode") == "summary" else res["mode"]
    columns = list(SEARCH_COLUMNS[kind])
    for r in rows:
        if isinstance(r.get("prefix"), dict):
            r["prefix"] = r["prefix"].get("full")
        if isinstance(r.get("expert"), dict):  # a mixture of experts: the expert and its own dim
            ex = r["expert"]
            r["expert"], r["expert_dim"], r["shared_expert"] = ex["expert"], ex["dim"], ex["shared"]
    if state(request).moe is not None:
        columns[2:2] = ["expert", "expert_dim", "shared_expert"]
    what = {"token": p.get("token"), "text": p.get("text")}.get(res["mode"]) or res.get("sort") or "results"
    return export.download(rows, columns, f"ffkv-search-{res['mode']}-{what}"[:80], fmt)


TRIGGER_COLUMNS = ("layer", "dim", "sign", "rank", "coef", "sentence_id", "position", "prefix", "trigger_token",
                   "next_token", "next_token_text", "next_token_rank_in_value", "doc_id", "title", "patterns")


@router.get("/memory/{layer}/{dim}/triggers.{fmt}", include_in_schema=False)
@router.get("/api/memory/{layer}/{dim}/triggers.{fmt}")
def memory_triggers_download(request: Request, layer: int, dim: int, fmt: str):
    """A memory's trigger tables (both lists, every stored rank) as CSV or JSON; the rank of the
    next token in the value's distribution is 0 for its top token, empty when unknown."""
    from ffkv.web import export

    fmt = export.check_format(fmt)
    if fmt is None:
        raise NotFound("a memory's triggers download as triggers.csv or triggers.json")
    m = state(request).memory(layer, dim, 200)
    rows = []
    for key in ("+", "-"):
        for t in m["triggers"][key]:
            badge = t.get("badge") or {}
            rows.append({**t, "prefix": t["prefix"]["full"], "trigger_token": t["prefix"]["trigger"],
                         "next_token_rank_in_value": badge.get("rank"),
                         "patterns": [f"A{x + 1}" for x in t.get("patterns") or []]})
    return export.download(rows, list(TRIGGER_COLUMNS), f"ffkv-memory-{layer}-{dim}-triggers", fmt)


# ---- a layer page ---------------------------------------------------------------------------------
def layer_context(request: Request, layer: int, page: str | None, per_page: str | None) -> dict:
    from ffkv.web.layers import layer_data

    return layer_data(state(request), layer, req_int(page, "page", 1, 1, 10**6),
                      req_int(per_page, "per_page", 100, 1, 1000))


@router.get("/layer/{layer}", include_in_schema=False)
def layer_page(request: Request, layer: int, page: str | None = None, per_page: str | None = None,
               format: str | None = None):  # noqa: A002 - the URL's parameter
    from ffkv.web import export
    from ffkv.web.layers import MEMORY_COLUMNS, layer_memories

    fmt = export.check_format(format)
    if fmt:
        state(request).check_key(layer, 0)
        return export.download(layer_memories(state(request), layer), list(MEMORY_COLUMNS),
                               f"ffkv-layer-{layer}-memories", fmt)
    d = layer_context(request, layer, page, per_page)
    hist = None
    if d["density"] and d["density"]["hist"]:
        h = d["density"]["hist"]
        hist = plots.histogram(h["counts"], h["labels"], None, axis=("0", "density", "1"),
                               label=f"keys of layer {layer} by the share of tokens with m > 0 ({h['total']:,} keys)",
                               log=False)
    fig2 = []
    for r in (d["patterns"] or {}).get("fig2") or []:
        fig2.append({**r, "plot": plots.stacked([(r.get("shallow"), "c-shallow", "shallow"),
                                                 (r.get("semantic"), "c-semantic", "semantic"),
                                                 (r.get("both"), "c-both", "both"),
                                                 (r.get("not_covered"), "c-none", "not covered")],
                                                label=f"layer {layer} ({r['scope']}): prefixes by kind")})
    return render(request, "layer.html", d=d, hist=hist, fig2=fig2)


@router.get("/api/layer/{layer}")
def api_layer(request: Request, layer: int, page: str | None = None, per_page: str | None = None):
    return api(layer_context(request, layer, page, per_page))


# ---- similar memories -----------------------------------------------------------------------------
@router.get("/api/memory/{layer}/{dim}/similar")
def api_similar(request: Request, layer: int, dim: int):
    """Nearest memories by value direction, key direction (cosine, all layers) and co-activation;
    the cosine lists are null while the server computes them (status: building)."""
    return api(state(request).similar(layer, dim))
