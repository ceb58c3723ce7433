"""Writing annotations (the form and the JSON API) and reading them back (`/annotations`)."""
from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from ffkv.errors import FfkvError
from ffkv.store.annotations import LIMITS, MAX_JSON_DEPTH, MAX_NAME, MAX_NOTE, MAX_RECORD_BYTES
from ffkv.web import plots
from ffkv.web.common import render, same_origin, state
from ffkv.web.params import api, opt_sign, opt_str
from ffkv.web.tables import ANNOTATE_TOP, BadQuery, NotFound
from ffkv.web.routers.forms import (MAX_SLOTS, blank_slot, json_depth, keep_draft, patterns_from_form,
                                    set_annotator_cookie, too_big)
from ffkv.web.routers.memory import render_memory


router = APIRouter()


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
