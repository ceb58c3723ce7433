"""A layer's page and its JSON twin (`ffkv.web.layers`). Its list of memories takes `?page=`,
`?per_page=`, `?pos0=hide`, `?class=NAME[,NAME…]` and `?sort=dim|worth` (worth: the largest first;
a run without `ffkv worth` gets one line naming it), the page, its JSON and its CSV alike."""
from __future__ import annotations

from fastapi import APIRouter, Query, Request

from ffkv.web import plots
from ffkv.web.common import render, state
from ffkv.web.measures import FIRST_POSITION
from ffkv.web.params import api, census_filter, hide_pos0, layer_sort, req_int


router = APIRouter()


# ---- a layer page ---------------------------------------------------------------------------------
def layer_context(request: Request, layer: int, page: str | None, per_page: str | None,
                  pos0: str | None = None, klass: str | None = None, sort: str | None = None) -> dict:
    from ffkv.web.layers import layer_data

    b = state(request)
    return layer_data(b, layer, req_int(page, "page", 1, 1, 10**6),
                      req_int(per_page, "per_page", 100, 1, 1000), hide_pos0(pos0), census_filter(b, klass),
                      layer_sort(b, sort))


CLASS = Query(None, alias="class")  # ?class=NAME[,NAME…]: the census classes a list keeps (`census_filter`)


@router.get("/layer/{layer}", include_in_schema=False)
def layer_page(request: Request, layer: int, page: str | None = None, per_page: str | None = None,
               format: str | None = None, pos0: str | None = None,  # noqa: A002 - the URL's parameter
               klass: str | None = CLASS, sort: str | None = None):
    from ffkv.web import export
    from ffkv.web.layers import MEMORY_COLUMNS, layer_memories

    fmt = export.check_format(format)
    hide = hide_pos0(pos0)
    classes = census_filter(state(request), klass)
    order = layer_sort(state(request), sort)
    if fmt:
        state(request).check_key(layer, 0)
        rows = layer_memories(state(request), layer, hide_first=hide, classes=classes, sort=order)
        columns = list(MEMORY_COLUMNS)
        if rows and "worth" in rows[0]:  # a run with `ffkv worth`: each memory's worth, before its summary
            columns.insert(columns.index("summary"), "worth")
        return export.download(rows, export.one_based(rows, columns, ("rank",)),
                               f"ffkv-layer-{layer}-memories" + "".join("-" + c for c in classes or ())
                               + ("-by-worth" if order == "worth" else ""), fmt, census=state(request).census)
    d = layer_context(request, layer, page, per_page, pos0, klass, sort)
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
    return render(request, "layer.html", d=d, hist=hist, fig2=fig2, first_threshold=FIRST_POSITION)


@router.get("/api/layer/{layer}")
def api_layer(request: Request, layer: int, page: str | None = None, per_page: str | None = None,
              pos0: str | None = None, klass: str | None = CLASS, sort: str | None = None):
    return api(layer_context(request, layer, page, per_page, pos0, klass, sort))
