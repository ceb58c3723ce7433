"""The prediction explorer's page and its JSON (the engine: `ffkv.web.explore`).

Public URLs (links get shared; keep them):
- `/explore?text=…`: the page. Optional: `suppress=L:D,…` (`L:D` scales memory D of layer L by
  `scale`, default 0 = suppress; `L:D*F` scales it by F; `L:D=V` sets its coefficient to V),
  `scale=F`, `at=last|all` (edit the last position or every position), `contrast=TOKEN` (text
  that is one token, typed as the pages show tokens: ␣ for a space, see `ffkv.display.read_token`;
  it wins over `contrast_id=N`, a token id), `lens=naive|norm` (of the contributions; both
  lenses are always read), `top=K` (memories per layer), `continue=N` (a greedy continuation of
  N ≤ `MAX_CONTINUE` tokens, with and without the edits, side by side; 0 or absent: none; the
  form sends `CONTINUE` = 20 unless changed, memory pages link with it), `edit=NAME` (a fact edit kept
  in the run by `ffkv facts edit`, in the weights while the page is computed; the continuation then
  shows the unedited model beside it), `pos=P` (the token position explained, 0-based; default the
  last, negative counts from the end; outside the text: 422, one line): its prediction,
  contributions, lens tables and hardest-firing memories, with `at=last` editing that position and
  the continuation following it (the page's tokens link to each position), `hardest=K` (rows of
  "memories that fire hardest here", default `HARDEST` = 20).
- `/api/explore?…`: what the page shows, as JSON: `ffkv.web.explain`'s result (its
  docstring lists the fields; `tokens` and `n_tokens` are the whole text's) plus `pos` (the
  explained position, 0-based) and `token` (its token), `hardest` (the memories of all layers with
  the largest |m| there: layer, dim, coef, contrib to the prediction), `query` (the parameters as
  understood) and `url` (the page).
- `/explore.css`: the page's stylesheet (served from here: the CSP allows only this origin).
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from markupsafe import Markup

from ffkv.defs import LENSES
from ffkv.errors import FfkvError
from ffkv.parse import parse_interventions
from ffkv.web import plots
from ffkv.web.common import error_page, render
from ffkv.web.explore import (CONTINUE, HARDEST, MAX_CHARS, MAX_CONTINUE, MAX_TOKENS, Busy, Query, _items,
                              parse_query, run_query)
from ffkv.web.params import api

router = APIRouter()

EXAMPLES = ("The Eiffel Tower is in the city of", "The capital of Japan is the city of",
            "She poured herself a cup of hot")

CSS = """
.xp-form textarea { width: 100%; max-width: none; font-size: 1.05em; font-family: inherit; }
.xp-form .row { display: flex; flex-wrap: wrap; gap: 0.5em 1.2em; align-items: center; margin-top: 0.5em; }
.xp-form input[name=suppress] { width: 22em; font-family: ui-monospace, monospace; }
.xp-form input[name=contrast] { width: 9em; }
.xp-pred { font-size: 1.25em; }
.xp-pred .tok { background: #ffe08a; border-radius: 3px; padding: 0 0.2em; }
.xp-pred .tok.after { background: #f6c7b6; }
.xp-grid { display: grid; grid-template-columns: minmax(0, 2fr) minmax(0, 3fr); gap: 0 1.2em; align-items: start; }
@media (max-width: 1100px) { .xp-grid { grid-template-columns: 1fr; } }
.xp-two { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 0 0.8em; }
@media (max-width: 700px) { .xp-two { grid-template-columns: minmax(0, 1fr); } }
table.xp-layers td { white-space: nowrap; }
table.xp-layers td.mems { white-space: normal; font-size: 0.92em; }
table.xp-layers th.group { text-align: center; border-left: 2px solid #ddd; }
table.xp-layers td.first, table.xp-layers th.first { border-left: 2px solid #ddd; }
.xp-changed { background: #fde9e2; }
.xp-p { color: #5c5c5c; font-size: 0.85em; margin-left: 0.2em; }
.xp-after { display: block; color: #a0401f; font-size: 0.9em; }
.xp-mem { white-space: nowrap; margin-right: 0.4em; display: inline-block; }
table.xp-layers td.mems { min-width: 12em; }
.xp-edit { font-size: 0.85em; }
.xp-cont { white-space: pre-wrap; line-height: 1.7; overflow-wrap: break-word; }
.xp-cont .tok { white-space: pre-wrap; border-right: 1px dotted #ccc; }
.xp-cont .tok.xp-diff { background: #fde9e2; }
input[name=continue] { width: 4.5em; }
svg .xp-pos { fill: #2e8b57; } svg .xp-neg { fill: #c44e52; } svg .xp-mid { stroke: #999; stroke-width: 1; }
tr.xp-edited { background: #fff3cf; }
.xp-toks { display: flex; flex-wrap: wrap; gap: 0.25em 0.15em; align-items: baseline; }
.xp-toks a.tok { color: inherit; text-decoration: none; margin-right: 0; }
.xp-toks a.tok:hover { outline: 1px solid #8ab8ff; }
.xp-toks a.tok.xp-at { background: #ffe08a; outline: 2px solid #c99a00; color: #1a1a1a; }
.xp-toks a.tok.xp-after { color: #595959; }
@media (prefers-color-scheme: dark) { .xp-toks a.tok.xp-after { color: #9aa3ad; } }
input[name=pos] { width: 5em; }
table#hardest-table { width: auto; }
"""


def _busy(request: Request, e: Busy) -> Response:
    resp = error_page(request, 503, "Busy", str(e))
    resp.headers["Retry-After"] = "2"
    return resp


# ---- the page's helpers ---------------------------------------------------------------------------
def signed_bar(x: float, vmax: float, width: int = 90, height: int = 11) -> Markup:
    """A bar from the middle: right (green) for a positive contribution, left (red) for a negative one."""
    if x is None or vmax <= 0 or x != x:
        return Markup("")
    half = width / 2
    w = min(abs(x) / vmax, 1.0) * half
    x0 = half if x >= 0 else half - w
    cls = "xp-pos" if x >= 0 else "xp-neg"
    return Markup(f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
                  f'aria-hidden="true"><rect class="{cls}" x="{x0:.1f}" y="1" width="{w:.1f}" height="{height - 2}"/>'
                  f'<line class="xp-mid" x1="{half}" y1="0" x2="{half}" y2="{height}"/></svg>')


def page_context(q: Query, r: dict) -> dict:
    """URLs and scales the template needs beside the result (the result itself is not changed)."""
    edited = {(e.layer, e.dim) for e in q.edits}

    def add(*keys) -> str:
        items = _items(q.suppress)
        have = {(e.layer, e.dim) for e in q.edits}
        items += [f"{l}:{d}" for l, d in keys if (l, d) not in have]
        return q.url(suppress=",".join(items))

    def remove(layer: int, dim: int) -> str:
        keep = []
        for item in _items(q.suppress):
            iv = parse_interventions(item)[0]
            if (iv.layer, iv.dim) != (layer, dim):
                keep.append(item)
        return q.url(suppress=",".join(keep))

    lists = [r["top_memories"]["up"], r["top_memories"]["down"]]
    if r.get("contrast_memories"):
        lists += [r["contrast_memories"]["up"], r["contrast_memories"]["down"]]
    vmax = max([abs(m["contrib"]) for ms in lists[:2] for m in ms] + [1e-12])
    cmax = max([abs(m["contrib_contrast"]) for ms in lists[2:] for m in ms] + [1e-12])
    hmax = max([abs(m["contrib"]) for m in r.get("hardest") or []] + [1e-12])
    # the contributions' units in short (the header's title gives them in full)
    unit = r.get("contrib_units", "").split(":")[0]
    return {"add_url": add, "remove_url": remove, "edited": edited, "vmax": vmax, "cmax": cmax, "hmax": hmax,
            "contrib_unit": unit,
            "layer_top_url": lambda row: add(*[(m["layer"], m["dim"]) for m in row["memories"]]),
            "clear_url": q.url(suppress="", scale="", at=""),
            "contrast_url": lambda tid: q.url(contrast="", contrast_id=tid),
            "no_contrast_url": q.url(contrast="", contrast_id=""),
            "lens_url": lambda lens: q.url(lens=lens), "api_url": q.url("/api/explore"),
            "at_url": lambda at: q.url(at="" if at == "last" else at),
            # each token of the text explains its own position (the last one: no pos= in the URL)
            "pos_url": lambda i: q.url(pos="" if i == r["n_tokens"] - 1 else i),
            "signed_bar": signed_bar,
            "pbar": lambda p: plots.bar(p, width=50, height=10, label=f"p = {p:.3f}")}


# ---- routes ---------------------------------------------------------------------------------------
@router.get("/explore.css", include_in_schema=False)
def explore_css():
    return Response(CSS, media_type="text/css; charset=utf-8", headers={"Cache-Control": "max-age=3600"})


@router.get("/explore", include_in_schema=False)
async def explore_page(request: Request):
    """The page; a mistake in the form (422) shows the form again with the reason above it."""
    r, error, status = None, None, 200
    try:
        q = parse_query(request)
    except FfkvError as e:
        q, error, status = Query(text=(request.query_params.get("text") or "")[:MAX_CHARS],
                                 suppress=request.query_params.get("suppress") or ""), str(e), 422
    if error is None and q.text.strip():
        try:
            r = await run_query(request, q)
        except Busy as e:
            return _busy(request, e)
        except FfkvError as e:
            error, status = str(e), 422
    ctx = page_context(q, r) if r else {}
    examples = [(t, Query(text=t).url()) for t in EXAMPLES]
    return render(request, "explore.html", status_code=status, q=q, r=r, error=error, examples=examples,
                  max_tokens=MAX_TOKENS, max_chars=MAX_CHARS, lenses=LENSES, max_continue=MAX_CONTINUE,
                  default_continue=CONTINUE, default_hardest=HARDEST, **ctx)


@router.get("/api/explore")
async def api_explore(request: Request):
    q = parse_query(request)
    if not q.text.strip():
        raise FfkvError("text is required: /api/explore?text=…[&suppress=L:D,…&scale=F&at=last|all"
                        "&contrast=TOKEN&lens=naive|norm&top=K&continue=N&pos=P&hardest=K]")
    try:
        r = await run_query(request, q)
    except Busy as e:
        return _busy(request, e)
    return api(r)
