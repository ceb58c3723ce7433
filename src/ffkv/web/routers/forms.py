"""What the memory page's annotation form shares with the annotation routes: the annotator
cookie, drafts, the form's state and its parsing, request limits. No routes."""
from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import Response
from markupsafe import Markup, escape

from ffkv.store.annotations import LIMITS, MAX_NAME, MAX_NOTE, MAX_PATTERNS, MAX_RECORD_BYTES
from ffkv.web.common import show_trigger, state
from ffkv.web.tables import ANNOTATE_TOP, BadQuery



COOKIE = "ffkv_annotator"
MAX_SLOTS = MAX_PATTERNS  # the annotation limits: ffkv.store.annotations


# ---- a memory page --------------------------------------------------------------------------------
def prefix_html(p: dict) -> Markup:
    """A prefix as HTML: its text escaped, the trigger token marked (built once per row here
    rather than in the template, which is the hot loop of a memory page)."""
    return Markup("".join(('<span class="prefix">', '<span class="muted">…</span>' if p["cut"] else "",
                           str(escape(p["head"])), "<mark>", str(escape(show_trigger(p["trigger"]))), "</mark></span>")))


def annotation_prefixes(request: Request, m: dict, sign: int) -> list[dict]:
    """The top-25 prefixes of one sign (from `m` when it holds them: not when its page hides
    position 0, since the annotation protocol reads the top 25 as they are)."""
    rows = m["triggers"]["+" if sign == 1 else "-"]
    if m["top"] < ANNOTATE_TOP or (m.get("pos0") or {}).get("hidden"):
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
