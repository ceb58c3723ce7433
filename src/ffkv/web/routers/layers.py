"""A layer's page and its JSON twin (`ffkv.web.layers`). Its lists of memories take `?page=`,
`?per_page=`, the memory filters of every search (`?pos0=hide`, `?class=NAME[,NAME…]`,
`?regime=NAME[,NAME…]` with `?min_regime_share=X`, `?min_worth=X`; a list parameter may also be
repeated) and `?sort=dim|worth` (worth: the largest first), the page, its JSON and its CSV alike. A
filter or order whose table the run lacks gets one line naming the step that makes it."""
from __future__ import annotations

from fastapi import APIRouter, Query, Request

from ffkv.web import plots
from ffkv.web.common import render, state
from ffkv.web.measures import FIRST_POSITION, REGIMES
from ffkv.web.params import (api, census_filter, hide_pos0, layer_sort, min_worth, multi, regime_filter,
                             req_int)


router = APIRouter()


# ---- a layer page ---------------------------------------------------------------------------------
def layer_filters(request: Request) -> dict:
    """The layer list's filters and order from the URL, read and checked (`ffkv.web.params`), as
    `layers.layer_data`'s and `layer_memories`' keywords."""
    b, q = state(request), request.query_params
    return {"hide_first": hide_pos0(q.get("pos0")), "classes": census_filter(b, multi(q, "class")),
            "regimes": regime_filter(b, multi(q, "regime"), q.get("min_regime_share")),
            "min_worth": min_worth(b, q.get("min_worth")), "sort": layer_sort(b, q.get("sort"))}


# the parameters `layer_filters` reads, declared so that the API's schema lists them
CLASS = Query(None, alias="class")  # ?class=NAME[,NAME…]: the census classes a list keeps (`census_filter`)
REGIME = Query(None)  # ?regime=NAME[,NAME…]: the sign regimes a list keeps (`regime_filter`)


@router.get("/layer/{layer}", include_in_schema=False)
def layer_page(request: Request, layer: int, page: str | None = None, per_page: str | None = None,
               format: str | None = None, pos0: str | None = None,  # noqa: A002 - the URL's parameter
               klass: str | None = CLASS, sort: str | None = None, regime: str | None = REGIME,
               min_regime_share: str | None = None, min_worth: str | None = None):
    from ffkv.web import export
    from ffkv.web.layers import MEMORY_COLUMNS, layer_data, layer_memories

    fmt = export.check_format(format)
    f = layer_filters(request)
    if fmt:
        state(request).check_key(layer, 0)
        rows = layer_memories(state(request), layer, **f)
        columns = list(MEMORY_COLUMNS)
        if rows and "worth" in rows[0]:  # a run with `ffkv worth`: each memory's worth, before its summary
            columns.insert(columns.index("summary"), "worth")
        name = f"ffkv-layer-{layer}-memories" + "".join("-" + c for c in f["classes"] or ())
        if f["regimes"]:
            name += "-regime-" + "-".join(f["regimes"].names)
            if f["regimes"].min_share is not None:
                name += f"-{f['regimes'].min_share:g}"
        if f["min_worth"] is not None:
            name += f"-worth-{f['min_worth']:g}"
        return export.download(rows, export.one_based(rows, columns, ("rank",)),
                               name + ("-by-worth" if f["sort"] == "worth" else ""), fmt, census=state(request).census)
    d = layer_data(state(request), layer, req_int(page, "page", 1, 1, 10**6),
                   req_int(per_page, "per_page", 100, 1, 1000), **f)
    hist = None
    if d["density"] and d["density"]["hist"]:
        h = d["density"]["hist"]
        hist = plots.histogram(h["counts"], h["labels"], None, axis=("0", "density", "1"),
                               label=f"keys of layer {layer} by the share of tokens with {h.get('measure', 'm > 0')} "
                               f"({h['total']:,} keys)",
                               log=False)
    fig2 = []
    for r in (d["patterns"] or {}).get("fig2") or []:
        fig2.append({**r, "plot": plots.stacked([(r.get("shallow"), "c-shallow", "shallow"),
                                                 (r.get("semantic"), "c-semantic", "semantic"),
                                                 (r.get("both"), "c-both", "both"),
                                                 (r.get("not_covered"), "c-none", "not covered")],
                                                label=f"layer {layer} ({r['scope']}): prefixes by kind")})
    return render(request, "layer.html", d=d, hist=hist, fig2=fig2, first_threshold=FIRST_POSITION, regimes=REGIMES)


@router.get("/api/layer/{layer}")
def api_layer(request: Request, layer: int, page: str | None = None, per_page: str | None = None,
              pos0: str | None = None, klass: str | None = CLASS, sort: str | None = None,
              regime: str | None = REGIME, min_regime_share: str | None = None, min_worth: str | None = None):
    from ffkv.web.layers import layer_data

    return api(layer_data(state(request), layer, req_int(page, "page", 1, 1, 10**6),
                          req_int(per_page, "per_page", 100, 1, 1000), **layer_filters(request)))
