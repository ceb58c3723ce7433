"""Search by token, text or measure, its downloads (every page of the results), and the
token index's status and build. Every search takes the memory filters (`ffkv.web.measures.memory_filter`):
`?pos0=hide`, `?class=NAME[,NAME…]` (census classes), `?regime=NAME[,NAME…]` with an optional
`?min_regime_share=X` (sign regimes: `ffkv.web.params.regime_filter`) and `?min_worth=X` (memories worth
at least X, from `ffkv worth`); and `?sort=worth` (the largest first). A list parameter may also be
repeated (?regime=pp&regime=nn). Without the table a filter needs, it is one line (422) naming the
step that makes it (`ffkv census RUN`, `ffkv mine --regimes`, `ffkv worth RUN`)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse

from ffkv.errors import FfkvError
from ffkv.web.common import no_cross_site_fetch, render, same_origin, state
from ffkv.web.measures import FIRST_POSITION, REGIMES, census_classes, has_regimes
from ffkv.web.search import LABELS, MEASURE_SORTS, TEXT_SORTS, TOKEN_SORTS
from ffkv.steps.worth.report import of_browser
from ffkv.web.params import (api, census_filter, hide_pos0, min_worth, multi, opt_bool, opt_int, opt_sign, opt_str,
                             regime_filter, req_int)
from ffkv.web.tables import BadQuery, NotFound


router = APIRouter()


# ---- search ---------------------------------------------------------------------------------------
def do_search(request: Request, p: dict) -> dict:
    b = state(request)
    page = req_int(p.get("page"), "page", 1, 1, 10**6)
    per_page = req_int(p.get("per_page"), "per_page", 50, 1, 500)
    layer = opt_int(p.get("layer"), "layer")
    sort, order = opt_str(p.get("sort")), opt_str(p.get("order"))
    token, text = p.get("token"), p.get("text")
    hide = hide_pos0(p.get("pos0"))  # ?pos0=hide: no first-position memory in the results
    classes = census_filter(b, p.get("class"))  # ?class=dead,prediction: only memories of these census classes
    regimes = regime_filter(b, p.get("regime"), p.get("min_regime_share"))  # ?regime=pp,nn: of these sign regimes
    mw = min_worth(b, p.get("min_worth"))  # ?min_worth=0.001: only memories worth at least that
    if token is not None and token != "":
        res = b.search_token(token, k=req_int(p.get("k"), "k", 10, 1, 10**6), lens=opt_str(p.get("lens")),
                             direction=opt_str(p.get("dir")) or "promote", layer=layer, sort=sort,
                             order=order, page=page, per_page=per_page,
                             match=opt_str(p.get("match")) or "merged", hide_first=hide,
                             classes=classes, regimes=regimes, min_worth=mw)
    elif text is not None and text != "":
        res = b.search_text(text, mode=opt_str(p.get("mode")) or "word", sign=opt_sign(p.get("sign")),
                            layer=layer, sort=sort, order=order, page=page, per_page=per_page, hide_first=hide,
                            classes=classes, regimes=regimes, min_worth=mw)
    else:
        res = b.search_measure(sort=sort, order=order, layer=layer, label=opt_str(p.get("label")),
                               agree=opt_bool(p.get("agree"), "agree"), page=page, per_page=per_page,
                               hide_first=hide, classes=classes, regimes=regimes, min_worth=mw)
    res["pos0"] = "hide" if hide else "show"
    res["class"] = list(classes or [])
    res["regime"] = list(regimes.names) if regimes else []
    res["min_regime_share"] = regimes.min_share if regimes else None
    res["min_worth"] = mw
    res["has_worth"] = of_browser(b) is not None
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
                 "sign", "label", "agree", "match", "format", "pos0", "class", "regime", "min_regime_share",
                 "min_worth")
LIST_PARAMS = ("class", "regime")  # NAME,NAME or repeated (`multi`)


def search_params(request: Request) -> dict:
    q = request.query_params
    unknown = sorted(set(q) - set(SEARCH_PARAMS))
    if unknown:
        raise BadQuery(f"unknown search parameter(s) {unknown}; use {', '.join(SEARCH_PARAMS)}")
    return {k: multi(q, k) if k in LIST_PARAMS else q.get(k) for k in SEARCH_PARAMS if k in q}


@router.get("/search", include_in_schema=False, dependencies=[Depends(no_cross_site_fetch)])
def search_page(request: Request):
    from ffkv.web import export

    p = search_params(request)
    fmt = export.check_format(p.pop("format", None))
    if fmt:
        return search_download(request, p, fmt)
    res = do_search(request, p)
    return render(request, "search.html", res=res, p=p, b=state(request), labels=LABELS,
                  measure_sorts=[s for s in MEASURE_SORTS if s != "worth" or res["has_worth"]],
                  token_sorts=list(TOKEN_SORTS), text_sorts=list(TEXT_SORTS),
                  refresh=res.get("status") == "building", first_threshold=FIRST_POSITION,
                  census_classes=census_classes(state(request)),
                  regimes=REGIMES if has_regimes(state(request)) else {})


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
    "token": ("layer", "dim", "sign", "token", "token_text", "rank", "prob", "max_prob", "precision", "mined",
              "summary"),
    "text": ("layer", "dim", "sign", "n", "best_rank", "best_coef", "sentence_id", "position", "prefix", "summary"),
    "summary": ("layer", "dim", "summary"),
    "measure": ("layer", "dim", "mined", "n_triggers", "top_coef", "max_prob", "entropy", "top_token",
                "top_token_text", "max_prob_neg", "top_token_neg", "top_token_neg_text", "precision",
                "precision_neg", "rank", "target_prob", "direction", "agree", "label", "n_patterns", "coverage",
                "summary"),
}


def search_download(request: Request, p: dict, fmt: str):
    """Every row of a search's results (up to DOWNLOAD_MAX) as CSV or JSON; a value's ranks 1-based
    (1 = its top token), 0-based in `rank_0` (`export.one_based`)."""
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
    if any("worth" in r for r in rows):  # a run with `ffkv worth`: each memory's worth, before its summary
        columns.insert(columns.index("summary"), "worth")
    for r in rows:
        if isinstance(r.get("prefix"), dict):
            r["prefix"] = r["prefix"].get("full")
        if isinstance(r.get("expert"), dict):  # a mixture of experts: the expert and its own dim
            ex = r["expert"]
            r["expert"], r["expert_dim"], r["shared_expert"] = ex["expert"], ex["dim"], ex["shared"]
    if state(request).moe is not None:
        columns[2:2] = ["expert", "expert_dim", "shared_expert"]
    columns = export.one_based(rows, columns, ("rank",))
    what = {"token": p.get("token"), "text": p.get("text")}.get(res["mode"]) or res.get("sort") or "results"
    if res["class"]:
        what += "-" + "-".join(res["class"])
    if res["regime"]:
        what += "-regime-" + "-".join(res["regime"])
        if res["min_regime_share"] is not None:
            what += f"-{res['min_regime_share']:g}"
    if res["min_worth"] is not None:
        what += f"-worth-{res['min_worth']:g}"
    return export.download(rows, columns, f"ffkv-search-{res['mode']}-{what}"[:80], fmt, census=state(request).census)
