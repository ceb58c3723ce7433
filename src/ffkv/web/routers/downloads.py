"""A memory's trigger list as CSV or JSON (`ffkv.web.export` builds every download)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from ffkv.web.common import state
from ffkv.web.tables import NotFound


router = APIRouter()


TRIGGER_COLUMNS = ("layer", "dim", "sign", "rank", "coef", "sentence_id", "position", "prefix", "trigger_token",
                   "next_token", "next_token_text", "next_token_rank_in_value", "doc_id", "patterns")


@router.get("/memory/{layer}/{dim}/triggers.{fmt}", include_in_schema=False)
@router.get("/api/memory/{layer}/{dim}/triggers.{fmt}")
def memory_triggers_download(request: Request, layer: int, dim: int, fmt: str):
    """A memory's trigger tables (both lists, every stored rank) as CSV or JSON; the rank of the
    next token in the value's distribution (+v for a positive coefficient, −v for a negative one)
    is 1 for its top token (`next_token_rank_in_value_0`: 0), empty when unknown. No `title`
    column: no corpus reader records one."""
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
    columns = export.one_based(rows, list(TRIGGER_COLUMNS), ("next_token_rank_in_value",))
    return export.download(rows, columns, f"ffkv-memory-{layer}-{dim}-triggers", fmt)
