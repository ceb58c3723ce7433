"""The facts page (issue 47; data: `ffkv.web.facts`).

Public URLs (links get shared; keep them):
- `/facts` (`?kind=ffn|hidden|attn`): the traced facts (`ffkv facts trace`) as ROME's heatmaps,
  averaged and per fact; the editors' scores (`ffkv facts evaluate`); the run's kept edits; a
  form to locate a fact's memories. `/api/facts`: the same as JSON.
- `/facts/locate?prompt=…&subject=…` (with target, method=direct|grad|ig, at=subject|last,
  top): the memories that hold the fact, each linked to its page, with the ablation check.
  `/api/facts/locate?…`: as JSON. Runs the model (through the explorer's gate).
- `/facts/edit/{name}` (`?tokens=N`): an edit's fact before and after, greedy continuations side
  by side. `/api/facts/edit/{name}`.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from ffkv.errors import FfkvError
from ffkv.web.common import error_page, render, state
from ffkv.web.params import api, opt_str, req_int

router = APIRouter()


def _overview(request: Request, kind: str | None) -> dict:
    from ffkv.web import facts

    run = state(request).run
    tr = facts.traces(run)
    kinds = tr["kinds"] if tr else []
    if kind is not None and kind not in facts.KINDS:
        raise FfkvError(f"kind {kind!r}: choose {', '.join(facts.KINDS)}")
    return {"traces": tr, "kind": kind or (kinds[0] if kinds else "ffn"), "scores": facts.scores(run),
            "edits": facts.edits(run)}


@router.get("/facts", include_in_schema=False)
def facts_page(request: Request, kind: str | None = None):
    try:
        d = _overview(request, opt_str(kind))
    except FfkvError as e:
        return error_page(request, 422, "Bad request", str(e))
    return render(request, "facts.html", d=d)


@router.get("/api/facts")
def api_facts(request: Request, kind: str | None = None):
    try:
        return api(_overview(request, opt_str(kind)))
    except FfkvError as e:
        return error_page(request, 422, "Bad request", str(e))


async def _located(request: Request, prompt, subject, target, method, at, top) -> dict:
    from ffkv.web import facts
    from ffkv.web.explore import with_model

    prompt, subject = opt_str(prompt), opt_str(subject)
    if not prompt or not subject:
        raise FfkvError("give a prompt with {} for the subject, and the subject")
    if len(prompt) + len(subject) > 1000:
        raise FfkvError("the prompt and subject are too long (1,000 characters at most)")
    n = req_int(top, "top", 20, 1, facts.MAX_TOP)
    return await with_model(request, lambda mm: facts.located(mm, prompt, subject, opt_str(target),
                                                              opt_str(method) or "direct", opt_str(at) or "subject", n))


class _Missing(Exception):
    pass


async def _answer(request: Request, fn, page: str | None):
    from ffkv.web.explore import Busy

    try:
        d = await fn()
    except _Missing as e:
        return error_page(request, 404, "Not found", str(e))
    except Busy as e:
        resp = error_page(request, 503, "Busy", str(e))
        resp.headers["Retry-After"] = "2"
        return resp
    except FfkvError as e:
        return error_page(request, 422, "Bad request", str(e))
    return render(request, page, d=d) if page else api(d)


@router.get("/facts/locate", include_in_schema=False)
async def locate_page(request: Request, prompt: str | None = None, subject: str | None = None,
                      target: str | None = None, method: str | None = None, at: str | None = None,
                      top: str | None = None):
    return await _answer(request, lambda: _located(request, prompt, subject, target, method, at, top),
                         "facts_locate.html")


@router.get("/api/facts/locate")
async def api_locate(request: Request, prompt: str | None = None, subject: str | None = None,
                     target: str | None = None, method: str | None = None, at: str | None = None,
                     top: str | None = None):
    return await _answer(request, lambda: _located(request, prompt, subject, target, method, at, top), None)


async def _edit(request: Request, name: str, tokens: str | None) -> dict:
    from ffkv.web import facts
    from ffkv.web.explore import with_model

    run = state(request).run
    try:
        facts.edit_path(run, name)  # a missing one is a 404 before the model loads
    except FfkvError as e:
        raise _Missing(str(e)) from None
    n = req_int(tokens, "tokens", 20, 0, 100)
    return await with_model(request, lambda mm: facts.before_after(mm, run, name, n))


@router.get("/facts/edit/{name}", include_in_schema=False)
async def edit_page(request: Request, name: str, tokens: str | None = None):
    return await _answer(request, lambda: _edit(request, name, tokens), "facts_edit.html")


@router.get("/api/facts/edit/{name}")
async def api_edit(request: Request, name: str, tokens: str | None = None):
    return await _answer(request, lambda: _edit(request, name, tokens), None)
