"""Query parameters and JSON answers, for every router: each parameter a user types is read here
(integers through `ffkv.parse.parse_int`), so a malformed or huge value is a 422, never a 500."""
from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from ffkv.errors import FfkvError
from ffkv.parse import parse_int, shown
from ffkv.web.export import jsonable
from ffkv.web.tables import BadQuery


def api(data, status_code: int = 200) -> JSONResponse:
    return JSONResponse(jsonable(data), status_code=status_code)


def opt_int(v: str | None, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    """An optional integer query parameter ('' = absent); malformed -> 422."""
    if v is None or str(v).strip() == "":
        return None
    try:
        return parse_int(v, name, lo, hi)
    except FfkvError as e:  # a 422, never int()'s ValueError (a 5,000-digit value was a 500)
        raise BadQuery(str(e)) from None


def req_int(v: str | None, name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
    x = opt_int(v, name, lo, hi)
    return default if x is None else x


def opt_sign(v: str | None) -> int | None:
    if v is None or str(v).strip() in ("", "any"):
        return None
    s = str(v).strip()
    if s in ("1", "+1", "+", "pos"):
        return 1
    if s in ("-1", "-", "neg"):
        return -1
    raise BadQuery(f"sign must be 1 or -1 (got {shown(v)})")


def opt_bool(v: str | None, name: str) -> bool | None:
    if v is None or str(v).strip() in ("", "any"):
        return None
    s = str(v).strip().lower()
    if s in ("1", "true", "yes"):
        return True
    if s in ("0", "false", "no"):
        return False
    raise BadQuery(f"{name} must be yes or no (got {shown(v)})")


def opt_str(v: str | None) -> str | None:
    return None if v is None or str(v).strip() == "" else str(v)


def hide_pos0(v: str | None) -> bool:
    """`?pos0=hide`: hide position-0 examples (on a memory page its trigger rows and samples at
    position 0; on search and layer lists the first-position memories, `measures.first_position`);
    absent, '' or show: shown, so every URL without it reads as before."""
    s = "" if v is None else str(v).strip()
    if s in ("", "show"):
        return False
    if s == "hide":
        return True
    raise BadQuery(f"pos0 must be show or hide (got {shown(v)})")


def census_filter(b, v: str | None) -> tuple[str, ...] | None:
    """`?class=NAME[,NAME…]`: memories in any of these census classes (`measures.class_members`);
    absent or '' is no filter. A run without a census, or a name it has no class of, is one line."""
    from ffkv.web.measures import NO_CENSUS, census_classes

    names = [x.strip() for x in ("" if v is None else str(v)).split(",") if x.strip()]
    if not names:
        return None
    valid = census_classes(b)
    if not valid:
        raise BadQuery(f"class: {NO_CENSUS}")
    bad = [x for x in names if x not in valid]
    if bad:
        raise BadQuery(f"class must be one of {', '.join(valid)} (got {shown(bad[0])})")
    return tuple(c for c in valid if c in names)  # the census's order, each once


# ---- worth (`ffkv worth`: the table memory_worth, read per memory by `ffkv.steps.worth.report.of_browser`) ----
LAYER_SORTS = ("dim", "worth")  # a layer list's orders: by dim (the default), by worth (descending)


def layer_sort(b, v: str | None) -> str:
    """`?sort=dim|worth` of a layer's list: by dim (absent, ''), or by worth, the largest first
    (then by dim; memories without a worth last); worth on a run without its table is one line."""
    s = "" if v is None else str(v).strip()
    if s in ("", "dim"):
        return "dim"
    if s != "worth":
        raise BadQuery(f"sort must be {' or '.join(LAYER_SORTS)} (got {shown(v)})")
    from ffkv.web.measures import worths

    worths(b, "sort=worth")
    return s


def finite(v: str | None, name: str, example: str) -> float | None:
    """An optional real-number query parameter ('' = absent); not a finite number (or over 40
    characters) is one line naming `name` and an `example`."""
    s = "" if v is None else str(v).strip()
    if not s:
        return None
    try:
        x = float(s) if len(s) <= 40 else math.nan
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise BadQuery(f"{name} must be a finite number, e.g. {example} (got {shown(v)})")
    return x


def min_worth(b, v: str | None) -> float | None:
    """`?min_worth=X`: only memories worth at least X (nats per predicted token; a memory without a
    worth never passes); absent or '' is no filter. Not a finite number, or a run without the worth
    table: one line."""
    x = finite(v, "min_worth", "0.001")
    if x is not None:
        from ffkv.web.measures import worths

        worths(b, "min_worth")
    return x


def multi(q, name: str) -> str | None:
    """A list parameter (`?class=`, `?regime=`) given once as NAME,NAME or repeated (?regime=pp&regime=nn):
    its values joined by commas; None when absent."""
    vals = q.getlist(name)
    return ",".join(vals) if vals else None


# ---- sign regimes (`ffkv mine --regimes`; who passes: `ffkv.web.measures.regime_members`) ----------------
def regime_filter(b, v: str | None, share: str | None = None):
    """`?regime=NAME[,NAME…]` (NAME one of `ffkv.mine.regimes.REGIMES`: pp, pn, np, nn, the sign of
    the gate then of the input) and `?min_regime_share=X` (0 to 1): a `RegimeFilter` for
    `measures.regime_members`, None when `regime` is absent or ''. An unknown name, a share without
    a regime or outside 0..1, a run without a census or without regimes: one line naming the fix."""
    from ffkv.web.measures import NO_CENSUS, NO_REGIMES, REGIMES, RegimeFilter, has_regimes

    names = [x.strip() for x in ("" if v is None else str(v)).split(",") if x.strip()]
    x = finite(share, "min_regime_share", "0.5")
    if not names:
        if x is not None:
            raise BadQuery("min_regime_share needs regime=NAME[,NAME…]: the regimes whose share of the mass "
                           "it bounds")
        return None
    bad = [n for n in names if n not in REGIMES]
    if bad:
        raise BadQuery(f"regime must be one of {', '.join(f'{r} {s}' for r, s in REGIMES.items())}, the signs of "
                       f"(gate, input) (got {shown(bad[0])})")
    if x is not None and not 0 <= x <= 1:
        raise BadQuery(f"min_regime_share must be from 0 to 1, a share of the activation mass (got {shown(share)})")
    if b.census is None:
        raise BadQuery(f"regime: {NO_CENSUS}")
    if not has_regimes(b):
        raise BadQuery(f"regime: {NO_REGIMES}")
    return RegimeFilter(tuple(r for r in REGIMES if r in names), x)  # REGIMES' order, each once
