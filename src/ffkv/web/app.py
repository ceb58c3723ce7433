"""The app factory: `create_app(run)` -> a FastAPI app serving one run directory.

Layers, outermost first: security headers on every response (`common.SECURITY_HEADERS`), a
Host check against DNS rebinding (only the names the server is reached by), the access token
when the server is reachable from other machines (`TokenAuth`: `ffkv serve --allow-remote`), a
cap on request bodies, then the routes of `routes` and, when it loads, the prediction explorer's
(`ffkv.web.routers.explorer`). Errors never show a traceback: 404 and 422 pages (JSON under /api/),
and a plain 500 page whose details go to the server's log only.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import sys
import time
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ffkv.errors import FfkvError
from ffkv.web.common import MAX_BODY, SECURITY_HEADERS, error_page

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
log = logging.getLogger("ffkv.web")


class SecurityHeaders:
    """Pure ASGI middleware: add `SECURITY_HEADERS` to every HTTP response (a route may set its
    own Content-Security-Policy, e.g. the report's), and `Server-Timing: app;dur=MS`, the time
    from the request to the response's start (what benchmarks/bench_serve.py reads)."""

    def __init__(self, app):
        self.app = app
        self.headers = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        t0 = time.perf_counter()

        async def send_(msg):
            if msg["type"] == "http.response.start":
                have = {k.lower() for k, _ in msg.get("headers", [])}
                msg["headers"] = list(msg.get("headers", [])) + [(k, v) for k, v in self.headers if k not in have]
                msg["headers"].append((b"server-timing", f"app;dur={1000 * (time.perf_counter() - t0):.2f}".encode()))
            await send(msg)

        return await self.app(scope, receive, send_)


class BodyLimit:
    """Pure ASGI middleware: refuse request bodies over `limit` bytes with 413."""

    def __init__(self, app, limit: int = MAX_BODY):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.limit
                except ValueError:
                    too_big = True
                if too_big:
                    return await _plain(send, 413, b"request body too large")
        seen = 0

        async def receive_():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooBig()
            return msg

        try:
            return await self.app(scope, receive_, send)
        except _TooBig:
            return await _plain(send, 413, b"request body too large")


class _TooBig(Exception):
    pass


async def _plain(send, status: int, body: bytes, headers: list | None = None):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())] + list(headers or [])})
    await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    """True for a name or address that only this machine reaches (localhost, 127.0.0.0/8, ::1)."""
    h = str(host).strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(host: str) -> list[str]:
    """Host header values accepted when bound to `host`: the loopback names, and `host` itself
    unless it is a wildcard (0.0.0.0 or ::, which no client names). Never "*": a wildcard
    would let a DNS-rebinding page reach the server."""
    out = list(LOOPBACK_NAMES)
    if host not in out and host not in WILDCARD_HOSTS:
        out.append(host)
    return out


TOKEN_COOKIE = "ffkv_token"


def token_cookie_name(token: str) -> str:
    """The token's cookie, named after the token: two servers on one machine (other ports) keep
    their own."""
    return f"{TOKEN_COOKIE}_{hashlib.sha256(token.encode()).hexdigest()[:8]}"


class TokenAuth:
    """Pure ASGI middleware: every request (pages, API, static files, reads and writes) must
    carry the server's access token, as Jupyter does: `?token=…` once (its response sets an
    HttpOnly SameSite=Strict cookie), that cookie, or `Authorization: Bearer …`. Anything else
    is 401 in one line."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token.encode()
        self.cookie = token_cookie_name(token)

    def _ok(self, value) -> bool:
        if not value:
            return False
        v = value.encode() if isinstance(value, str) else value
        return hmac.compare_digest(v, self.token)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict((k.lower(), v) for k, v in scope.get("headers", []))
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer " and self._ok(auth[7:].strip()):
            return await self.app(scope, receive, send)
        cookies = SimpleCookie()
        try:
            cookies.load(headers.get(b"cookie", b"").decode("latin-1"))
        except Exception:  # noqa: BLE001 - a malformed Cookie header is no token
            cookies = SimpleCookie()
        if self.cookie in cookies and self._ok(cookies[self.cookie].value):
            return await self.app(scope, receive, send)
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in query if k == "token"]
        if given and self._ok(given[-1]):
            # Pass the request on, and set the cookie on its response. (Not a redirect to the URL
            # without the token: a link followed from another site would not send a SameSite=Strict
            # cookie set on the way, and the user would meet a 401.)
            cookie = (f"{self.cookie}={self.token.decode()}; Path=/; HttpOnly; SameSite=Strict; "
                      f"Max-Age={30 * 24 * 3600}").encode()

            async def send_(msg):
                if msg["type"] == "http.response.start":
                    msg["headers"] = list(msg.get("headers", [])) + [(b"set-cookie", cookie)]
                await send(msg)

            return await self.app(scope, receive, send_)
        if scope["type"] != "http":
            return await send({"type": "websocket.close", "code": 1008})
        return await _plain(send, 401, b"this ffkv server needs its access token: open the URL with ?token= "
                                       b"that `ffkv serve` printed, or send Authorization: Bearer TOKEN\n",
                            [(b"www-authenticate", b'Bearer realm="ffkv"')])


def create_app(run, *, host: str = "127.0.0.1", allowed_hosts: list[str] | None = None,
               token: str | None = None, index_k: int | None = None, build_index: bool = False,
               log_fn=None) -> FastAPI:
    """A FastAPI app serving run directory `run` (its tables are loaded now).

    `allowed_hosts`: the Host header values served (default `allowed_hosts_for(host)`; "*" is
    refused). `token`: the access token every request must carry (`TokenAuth`); required when
    `host` is not loopback (`ffkv serve --allow-remote` makes one)."""
    if not is_loopback(host) and not token:
        raise FfkvError(f"serving {host} (beyond this machine) needs an access token "
                        "(ffkv serve --allow-remote makes one)")
    hosts = list(allowed_hosts or allowed_hosts_for(host))
    if "*" in hosts or any(not h or "*" in h[1:] for h in hosts):
        raise FfkvError(f"allowed hosts {hosts}: give the names clients use, not a wildcard")
    from ffkv.web import routes
    from ffkv.web.data import Browser
    from ffkv.web.tables import LEFT, BadQuery, Left, NotFound

    say = log_fn or (lambda msg: print(f"ffkv serve: {msg}", file=sys.stderr))
    app = FastAPI(title="ffkv memory browser", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.browser = Browser(run, index_k=index_k, log=say)
    app.state.has_explore = False

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        titles = {404: "Not found", 403: "Forbidden", 405: "Method not allowed", 413: "Too large"}
        detail = exc.detail if isinstance(exc.detail, str) else ""
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"There is no page at {request.url.path}."
        return error_page(request, exc.status_code, titles.get(exc.status_code, "Error"), detail)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("path", "query", "body"))
            parts.append(f"{loc}: {e.get('msg', 'invalid')}")
        return error_page(request, 422, "Malformed request", "; ".join(parts))

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound):
        return error_page(request, 404, "Not found", " ".join(str(exc).split()))

    @app.exception_handler(BadQuery)
    async def bad_query(request: Request, exc: BadQuery):
        return error_page(request, 422, "Malformed request", " ".join(str(exc).split()))

    @app.exception_handler(Left)
    async def left(request: Request, exc: Left):
        say(f"{exc} not computed ({request.url.path}): the page was left before the model was free")
        return Response(status_code=LEFT)

    @app.exception_handler(FfkvError)
    async def ffkv_error(request: Request, exc: FfkvError):
        return error_page(request, 422, "Cannot do that", " ".join(str(exc).split()))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.exception("error while serving %s", request.url.path)
        say(f"error while serving {request.url.path}: {type(exc).__name__}: {exc}")
        return error_page(request, 500, "Internal error", "Something went wrong on the server; its log has the details.")

    app.include_router(routes.router)
    try:
        from ffkv.web.routers import explorer  # the prediction explorer, when it loads
    except ImportError:
        explorer = None
    except Exception as e:  # noqa: BLE001 - a broken explorer must not take the browser down
        say(f"warning: the prediction explorer is unavailable ({type(e).__name__}: {e})")
        explorer = None
    if explorer is not None and hasattr(explorer, "router"):
        app.include_router(explorer.router)
        app.state.has_explore = True

    app.add_middleware(BodyLimit)
    if token:
        app.add_middleware(TokenAuth, token=token)
    app.state.token = token
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)
    app.add_middleware(SecurityHeaders)
    import threading

    threading.Thread(target=app.state.browser.warm, name="ffkv-warm", daemon=True).start()
    if build_index:
        app.state.browser.start_index()
    return app
