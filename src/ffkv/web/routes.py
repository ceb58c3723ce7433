"""The memory browser's pages and JSON API: every feature's router (`ffkv.web.routers`), in one.

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
- `/facts`, `/facts/locate?…`, `/facts/edit/{name}` and their `/api/…` twins: traced facts, a
  fact's memories, an edit before and after (`routers.facts`, `ffkv.web.facts`).
More: `/sentence/{id}` (a trigger's provenance; permalink; `?memory=L/D` tints it by that memory), `/annotations` (who annotated what;
the human Fig 2), `/memory/{layer}/{dim}/reverify` (recompute a stored coefficient with the
model), `/random`, `/report/`, and their `/api/…` twins; writes are POSTs checked by
`common.same_origin`.

Where each lives: `routers.site` (the overview, `/api`, static files, the report), `routers.memory`
(memory pages, re-verify, sentences, activations, similar memories), `routers.annotation`,
`routers.search` (with its downloads and the token index), `routers.downloads` (a memory's
triggers), `routers.layers`; `routers.forms` holds what the memory page and the annotation routes
share; every query parameter is read by `ffkv.web.params`. The prediction explorer's router
(`routers.explorer`, its engine `ffkv.web.explore`) is added by `ffkv.web.app` when it loads.
"""
from __future__ import annotations

from fastapi import APIRouter

from ffkv.web.routers import annotation, downloads, facts, layers, memory, search, site

router = APIRouter()
for _feature in (site, memory, annotation, search, downloads, layers, facts):
    router.include_router(_feature.router)
