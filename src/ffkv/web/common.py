"""What every page of the browser shares: security headers, templates, origin checks, state.

The memory browser (`ffkv.web.routes`) and the prediction explorer (`ffkv.web.explore`) both
build on this module:

- `CSP` and `SECURITY_HEADERS` are set on every response by the app (`ffkv.web.app`): no
  request leaves the page for another origin (scripts, styles and images come from `/static/`
  or are inline SVG; no inline script or style attribute is allowed).
- `templates`: one Jinja2 environment over `ffkv/web/templates` (and a step's own partials,
  "package:file.html"), autoescaping every `{{ }}` (corpus, vocabulary and annotation strings
  are untrusted). `render(request, name, **ctx)`
  renders a page extending `base.html` (blocks `title` and `content`).
- `same_origin(request)`: a FastAPI dependency for every state-changing route (POST). A request
  whose `Origin` (or, without one, `Referer`) is not this server's own origin is refused with
  403; `Sec-Fetch-Site: cross-site|same-site` is refused too. Clients that send none of these
  headers (curl, scripts) are not browsers and cannot be made to post by another site.
- `state(request)`: the app's `ffkv.web.data.Browser` (the run's tables in memory, search, the
  lazily loaded model: `state(request).model()`).
- `error_page(request, status, title, detail)`: an HTML (or JSON under /api/) error response
  without a traceback.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from fastapi import HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from jinja2 import ChoiceLoader, Environment, FileSystemLoader, FunctionLoader, StrictUndefined, select_autoescape
from markupsafe import Markup, escape

from ffkv.display import number, show_token

WEB_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = WEB_DIR / "templates"
STATIC_DIR = WEB_DIR / "static"

# Everything comes from this server; no inline script, no inline style attribute, no framing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "font-src 'self'; connect-src 'self'; form-action 'self'; base-uri 'none'; "
       "frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
MAX_BODY = 256 * 1024  # bytes of a POST body; an annotation form is a few kB


def esc(x) -> Markup:
    """HTML-escape anything (None -> empty), for strings built outside a template."""
    return escape("" if x is None else str(x))


def fmt(x, digits: int = 3) -> str:
    """A browser cell (`ffkv.display.number`): a dash when missing, yes/no, whole from 1,000."""
    return number(x, digits, missing="–", yes_no=True, whole_from=1000)


def pct(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{100 * float(x):.{digits}f}%"


def show_trigger(text) -> str:
    """A trigger token inside its prefix: `show_token(text, inline=True)` (marks only when the
    token is nothing but whitespace, which would otherwise be an empty highlight)."""
    return show_token(text, inline=True)


def urlencode_clean(params: dict) -> str:
    """A query string of the non-empty parameters."""
    return urlencode([(k, v) for k, v in params.items() if v is not None and str(v) != ""])


def query_with(request, **changes) -> str:
    """The request's query string with `changes` set (None or '' drops the key), every other
    parameter kept as given, a repeated one (?regime=pp&regime=nn) with all its values."""
    kept = [(k, v) for k, v in request.query_params.multi_items() if k not in changes]
    return urlencode([(k, v) for k, v in kept + list(changes.items()) if v is not None and str(v) != ""])


def show_time(ts) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(float(ts)))
    except (TypeError, ValueError, OverflowError):
        return ""


class _Templates(Environment):
    """Jinja2's environment, with `x.name` on a plain dict read as the key first. Jinja tries the
    attribute first, and for a dict that fails with an AttributeError on every row of every table
    (about a third of a memory page's rendering time). A key that is also a dict method's name
    (`values`, `items`, `get`, …) is written `x['values']` in the templates, as before; where no
    such key exists, `x.items()` and `x.get(…)` still reach the method."""

    def getattr(self, obj, attribute):
        if type(obj) is dict:
            try:
                return obj[attribute]
            except KeyError:
                pass
        return super().getattr(obj, attribute)


def step_template(name: str):
    """A template named "package:file.html" (`Step.panel_template`), read from that package's own
    folder: a step's partials live beside its code, a plugin's included, and no file of ffkv names them."""
    pkg, sep, rel = name.partition(":")
    if not sep or not pkg or not rel or rel.startswith("/") or ".." in rel.replace("\\", "/").split("/"):
        return None
    from importlib.resources import files

    try:
        path = Path(str(files(pkg).joinpath(rel)))
    except (ImportError, TypeError, ValueError):
        return None
    if not path.is_file():
        return None
    mtime = path.stat().st_mtime
    return path.read_text(encoding="utf-8"), str(path), lambda: path.is_file() and path.stat().st_mtime == mtime


templates = _Templates(loader=ChoiceLoader([FileSystemLoader(str(TEMPLATES_DIR)), FunctionLoader(step_template)]),
                       autoescape=select_autoescape(enabled_extensions=("html", "svg"), default=True),
                       undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
templates.filters.update(fmt=fmt, pct=pct, tok=show_token, trig=show_trigger, urlencode_clean=urlencode_clean,
                         datetime=show_time)
templates.globals.update(fmt=fmt, pct=pct, tok=show_token, query_with=query_with)


def render(request: Request, name: str, status_code: int = 200, **ctx) -> HTMLResponse:
    """Render template `name` (which extends base.html) with `ctx`, plus `request` and `nav`."""
    st = getattr(request.app.state, "browser", None)
    base = {"request": request, "run_name": getattr(st, "name", ""),
            "has_explore": getattr(request.app.state, "has_explore", False),
            "has_report": bool(st is not None and getattr(st, "has_report", False))}
    html = templates.get_template(name).render(**base, **ctx)
    return HTMLResponse(html, status_code=status_code)


def state(request: Request):
    """The app's `ffkv.web.data.Browser`."""
    return request.app.state.browser


# ---- writes: same origin only ------------------------------------------------------------------
def _origin_of(url: str) -> str | None:
    try:
        u = urlsplit(url)
    except ValueError:
        return None
    if not u.scheme or not u.netloc:
        return None
    return f"{u.scheme}://{u.netloc}".lower()


def own_origin(request: Request) -> str:
    host = request.headers.get("host") or f"{request.url.hostname}:{request.url.port}"
    return f"{request.url.scheme}://{host}".lower()


def same_origin(request: Request) -> None:
    """Refuse (403) a state-changing request that a browser sent on behalf of another origin."""
    site = request.headers.get("sec-fetch-site")
    if site in ("cross-site", "same-site"):
        raise HTTPException(403, "cross-origin request refused")
    origin = request.headers.get("origin")
    if origin is not None:
        if origin.lower() == "null" or _origin_of(origin) != own_origin(request):
            raise HTTPException(403, "cross-origin request refused")
        return
    referer = request.headers.get("referer")
    if referer is not None and _origin_of(referer) != own_origin(request):
        raise HTTPException(403, "cross-origin request refused")


def no_cross_site_fetch(request: Request) -> None:
    """Refuse (403) a GET that costs the server real work (loading the model, building the
    token index) when another site's page fetches it as a subresource (an <img>, a script, a
    fetch). Following a shared link (a top-level navigation) stays allowed."""
    site = request.headers.get("sec-fetch-site")
    if site in ("cross-site", "same-site") and request.headers.get("sec-fetch-mode") != "navigate":
        raise HTTPException(403, "cross-site request refused")


# ---- errors ------------------------------------------------------------------------------------
def wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def error_page(request: Request, status: int, title: str, detail: str = "") -> HTMLResponse | JSONResponse:
    """An error response without a traceback: JSON under /api/, else an HTML page."""
    if wants_json(request):
        return JSONResponse({"error": title, "detail": detail, "status": status}, status_code=status)
    try:
        return render(request, "error.html", status_code=status, status=status, title=title, detail=detail)
    except Exception:  # noqa: BLE001 - never fail while reporting a failure
        return HTMLResponse(f"<!DOCTYPE html><title>{esc(title)}</title><h1>{status} {esc(title)}</h1>"
                            f"<p>{esc(detail)}</p>", status_code=status)


def memory_url(layer: int, dim: int) -> str:
    return f"/memory/{int(layer)}/{int(dim)}"


templates.globals.update(memory_url=memory_url)
