"""A memory's page and its JSON twin, re-verify, a sentence's page, the per-token
coefficients that tint examples, and similar memories."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse

from ffkv.web import activations, plots
from ffkv.web.common import no_cross_site_fetch, render, state
from ffkv.web.panels import later_labels, panel_html, step_panels
from ffkv.web.params import api, hide_pos0, opt_int, opt_sign, req_int
from ffkv.web.tables import BadQuery, Left, NotFound
from ffkv.web.routers.forms import MAX_SLOTS, annotation_prefixes, form_state


router = APIRouter()


def memory_data(request: Request, layer: int, dim: int, top: int, all_samples: bool = True,
                hide0: bool = False, panels: str = "all") -> dict:
    """The memory page's data with the steps' panels: `panels` "all" (the JSON twin: every panel,
    the later ones too), "now" (the page: those without a forward, and in `later` what the
    placeholder offers), "later" (the later-panels page: only those) or "none" (no panel yet)."""
    b = state(request)
    m = b.memory(layer, dim, top, all_samples, hide0)
    m["panels"] = [] if panels == "none" else step_panels(b.run, layer, dim, panels)
    if panels == "now":
        m["later"] = later_labels(b.run, layer, dim)
    return m


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
                  all_samples: bool = False, hide0: bool = False):
    b = state(request)
    m = memory_data(request, layer, dim, top, all_samples, hide0, panels="now")
    can_annotate = m["mined"] and b.n_prefixes(layer, dim, sign) > 0
    form = form or form_state(request, layer, dim, sign, slots)
    prefixes = annotation_prefixes(request, m, sign) if can_annotate else []
    hist = stats_plot(m.get("stats"))
    return render(request, "memory.html", status_code=status_code, m=m, form=form, form_error=error,
                  prefixes=prefixes, can_annotate=can_annotate, hist=hist, b=b, slots=len(form["slots"]),
                  max_slots=MAX_SLOTS, all_samples=all_samples, panel_html=panel_html(m))


@router.get("/memory/{layer}/{dim}", include_in_schema=False)
def memory_page(request: Request, layer: int, dim: int, top: str | None = None, annotate_sign: str | None = None,
                slots: str | None = None, samples: str | None = None, pos0: str | None = None):
    if samples not in (None, "", "all", "first"):
        raise BadQuery(f"samples must be all or first (got {samples!r})")
    return render_memory(request, layer, dim, req_int(top, "top", 25, 1, 200),
                         opt_sign(annotate_sign) or 1, opt_int(slots, "slots", 1, MAX_SLOTS),
                         all_samples=samples == "all", hide0=hide_pos0(pos0))


POLL = 0.2  # seconds between looks at whether a request waiting for the model still has its client


def client_gone(request: Request) -> bool:
    """Whether the client of `request` has disconnected (a page left, its fetch aborted), asked from
    a sync route's worker thread (Starlette's `is_disconnected`, on the server's event loop); False
    where that cannot be asked (not in a server's worker thread)."""
    import anyio.from_thread

    try:
        return bool(anyio.from_thread.run(request.is_disconnected))
    except RuntimeError:
        return False


def model_turn(request: Request, lock) -> bool:
    """Wait until the model's forward `lock` is free, looking every POLL seconds whether the client
    is still there: True when it is (the forward may run), False once it has left (a page left
    before its turn: its forward would only hold back the next page's). The lock is released again:
    the forward takes it itself."""
    while not lock.acquire(timeout=POLL):
        if client_gone(request):
            return False
    lock.release()
    return not client_gone(request)


@router.get("/memory/{layer}/{dim}/later-panels", include_in_schema=False, dependencies=[Depends(no_cross_site_fetch)])
def later_panels_page(request: Request, layer: int, dim: int):
    """The steps' later panels of memory layer/dim (`Step.later_panels`: a model forward each), drawn
    as the memory page draws its panels, on a page of their own: the memory page links here (no
    JavaScript needed) and its script fetches this page once the colours are done and moves the
    panels (`[data-later-panels]`'s children) into its placeholder. A request whose client leaves
    before the model is free (the page left: app.js aborts its fetch, the browser closes the
    connection) runs no forward and raises `Left` (a 499 and a log line: `model_turn`), so a quick `j` does not queue the
    next page's colours behind panels nobody will see; a forward already running finishes."""
    b = state(request)
    m = memory_data(request, layer, dim, 25, panels="none")
    if later_labels(b.run, layer, dim) and not model_turn(request, b.model_lock):
        raise Left(f"later panels of memory {layer}/{dim}")
    m["panels"] = step_panels(b.run, layer, dim, "later")
    return render(request, "memory_later.html", m=m, panel_html=panel_html(m))


@router.get("/api/memory/{layer}/{dim}")
def api_memory(request: Request, layer: int, dim: int, top: str | None = None, pos0: str | None = None):
    return api(memory_data(request, layer, dim, req_int(top, "top", 25, 1, 200), hide0=hide_pos0(pos0)))


@router.get("/random", include_in_schema=False)
def random_memory(request: Request):
    l, d = state(request).random_key()
    return RedirectResponse(f"/memory/{l}/{d}", status_code=302, headers={"Cache-Control": "no-store"})


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
SENTENCE_ROWS = 200  # trigger rows a sentence page shows at a time (?page= for the rest; ?per_page=)


def sentence_paged(request: Request, sid: int, pos: str | None, page: str | None, per_page: str | None) -> dict:
    """A sentence with one page of its trigger rows (`per_page`, SENTENCE_ROWS unless asked), and
    where that page stands: page, pages, per_page, first (0-based index of its first row)."""
    s = state(request).sentence(sid, opt_int(pos, "pos", 0), top=2**62)
    n, per = req_int(page, "page", 1, 1, 10**6), req_int(per_page, "per_page", SENTENCE_ROWS, 1, 1000)
    last = max(1, -(-s["n_triggers"] // per))
    if n > last:
        raise NotFound(f"page {n} does not exist: sentence {sid} has {last} page{'s' if last > 1 else ''} "
                       f"of {per} trigger rows")
    first = (n - 1) * per
    s["triggers"] = s["triggers"][first:first + per]
    return {**s, "page": n, "pages": last, "per_page": per, "first": first}


@router.get("/sentence/{sid}", include_in_schema=False)
def sentence_page(request: Request, sid: int, pos: str | None = None, corpus: str | None = None,
                  memory: str | None = None, page: str | None = None, per_page: str | None = None):
    b = state(request)
    mem = activations.parse_memory(memory)
    if mem is not None:
        b.check_key(*mem)
    s = sentence_paged(request, sid, pos, page, per_page)
    n, last, first = s["page"], s["pages"], s["first"]
    mismatch = bool(corpus) and not b.corpus_sha.startswith(str(corpus).lower())
    return render(request, "sentence.html", s=s, corpus_mismatch=mismatch, corpus_asked=corpus, memory=mem,
                  page=n, pages=last, first=first, page_url=lambda k: str(request.url.include_query_params(page=k)))


# ---- per-token coefficients (the colours of examples: ffkv.web.activations) ---------------------------
@router.get("/api/memory/{layer}/{dim}/activations", dependencies=[Depends(no_cross_site_fetch)])
def api_activations(request: Request, layer: int, dim: int, top: str | None = None, samples: str | None = None,
                    sign: str | None = None, sentence: str | None = None, pos0: str | None = None):
    """m of memory layer/dim at every token of the examples its page shows (`top` trigger rows
    of each sign, or of `sign`; the quantile samples the page shows: one per level, or every one
    with samples=all, or none; with pos0=hide, as the page with it: no example at position 0,
    and position 0 sets no scale), or of one `sentence`."""
    b = state(request)
    b.check_key(layer, dim)
    if samples not in (None, "", "all", "first", "none"):
        raise BadQuery(f"samples must be all, first or none (got {samples[:20]!r})")
    hide0 = hide_pos0(pos0)
    sid = opt_int(sentence, "sentence", 0, 2**62)
    if sid is not None:
        b.sentence_row(sid)  # 404 for a sentence not in the run
        examples = [(sid, None)]
    else:
        examples = activations.page_examples(b, layer, dim, req_int(top, "top", 25, 1, activations.MAX_TOP),
                                             samples or "first", opt_sign(sign), hide_pos0=hide0)
    return api(activations.activations(b, request.app.state, layer, dim, examples, skip_pos0=hide0,
                                       turn=lambda lock: model_turn(request, lock)))


def _truncate(v: str | None) -> str | None:
    if v not in (None, "", "left", "right"):
        raise BadQuery(f"truncate must be left (keep the end) or right (keep the start) (got {v!r})")
    return v or None


@router.get("/memory/{layer}/{dim}/text", include_in_schema=False, dependencies=[Depends(no_cross_site_fetch)])
def memory_text_page(request: Request, layer: int, dim: int, text: str | None = None, truncate: str | None = None):
    """A typed text's tokens tinted by this memory's coefficient (no JavaScript needed)."""
    b = state(request)
    b.check_key(layer, dim)
    res = (activations.text_activations(b, layer, dim, text, _truncate(truncate)) if text
           else {"layer": layer, "dim": dim, "text": "", "tokens": [], "cut": None})
    return render(request, "memory_text.html", r=res, truncate=truncate or "", max_tokens=activations.TEXT_TOKENS)


@router.get("/api/memory/{layer}/{dim}/text", dependencies=[Depends(no_cross_site_fetch)])
def api_memory_text(request: Request, layer: int, dim: int, text: str | None = None, truncate: str | None = None):
    return api(activations.text_activations(state(request), layer, dim, text or "", _truncate(truncate)))


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
    return api(activations.activations_many(b, request.app.state, items,
                                            turn=lambda lock: model_turn(request, lock)))


@router.get("/api/sentence/{sid}")
def api_sentence(request: Request, sid: int, pos: str | None = None, page: str | None = None,
                 per_page: str | None = None):
    """The sentence page's JSON: its trigger rows a page at a time, as the page pages them."""
    return api(sentence_paged(request, sid, pos, page, per_page))


# ---- similar memories -----------------------------------------------------------------------------
@router.get("/api/memory/{layer}/{dim}/similar")
def api_similar(request: Request, layer: int, dim: int):
    """Nearest memories by value direction, key direction (cosine, all layers) and co-activation;
    the cosine lists are null while the server computes them (status: building)."""
    return api(state(request).similar(layer, dim))
