"""No route of the browser answers 5xx to a client's input (issue 27 item 5): Hypothesis drives
every route of the app, the pages outside the API's schema included (`app.routes`, enumerated,
not listed by hand), with generated path parameters, query strings, form bodies and JSON bodies,
through FastAPI's TestClient on a copy of `test_web`'s tiny run. Bounded: 25 examples per route
and method."""
from __future__ import annotations

import json
import shutil
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_web import llama, web_run  # noqa: F401  (fixtures)

HOST = "http://127.0.0.1:8000"
EXAMPLES = 25

# names the routes read (so that generated queries and forms reach their parsers), then any text
QUERY_NAMES = ["top", "annotate_sign", "slots", "samples", "sign", "rank", "pos", "corpus", "token", "text", "sort",
               "order", "page", "per_page", "k", "lens", "dir", "layer", "mode", "label", "agree", "annotator",
               "draft", "note", "p0_description", "p0_kind", "p0_prefixes", "p1_prefixes", "suppress", "scale",
               "set", "at", "contrast", "contrast_id", "memory", "n", "generate", "format"]
FORM_NAMES = ["annotator", "sign", "note", "p0_description", "p0_kind", "p0_prefixes", "p1_description",
              "p1_kind", "p1_prefixes", "p19_prefixes", "p20_description", "p99999999999_kind"]
NUMBERS = ["0", "1", "2", "-1", "25", "79", "80", "200", "1000000", "99999999999999999999999", "1e308", "-1e308",
           "nan", "inf", "-inf", "0x10", "1.5", "+1", "-", " 1 ", "", "١", "1_000",
           "-0", "+0", "1e3", "1E-3", "𝟙", "²", "9" * 5000, "-" + "9" * 5000]  # 5,000 digits: past the int-string limit
WORDS = ["the", "␣the", " the", "shallow", "semantic", "any", "all", "first", "yes", "no", "promote", "suppress",
         "norm", "naive", "precision", "max_prob", "desc", "asc", "word", "token", "1:5", "0:0,1:1", "2:79:3.5",
         "last", "<script>alert(1)</script>", "%00", "../../manifest.json", "\x00", "\u202e", "Łukasz", "李明"]


def texts(max_size=30):
    return st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=max_size)


values = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(WORDS), st.integers(-2**70, 2**70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr), texts())
names = st.one_of(st.sampled_from(QUERY_NAMES), texts(12))
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), texts(),
                      st.sampled_from(["shallow", "semantic", "x"]))
json_any = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                       st.dictionaries(texts(10), c, max_size=4)), max_leaves=20)
names_ = st.sampled_from(["Łukasz", "李明", "Zoë 🙂", "a;b=c", "%41"]) | texts().filter(str.strip)
# well-formed annotations (saved, or refused by the store's checks) and anything else
good_pattern = st.fixed_dictionaries({"description": texts().filter(str.strip),
                                      "kind": st.sampled_from(["shallow", "semantic"]),
                                      "prefixes": st.lists(st.integers(0, 26), min_size=1, max_size=5)})
pattern = good_pattern | st.fixed_dictionaries({}, optional={
    "description": json_any | texts(), "kind": json_any | st.sampled_from(["shallow", "semantic"]),
    "prefixes": st.lists(st.integers(-3, 30) | json_leaf, max_size=5), "x": json_leaf})
annotation = st.fixed_dictionaries({"annotator": names_, "sign": st.sampled_from([1, -1]),
                                    "patterns": st.lists(good_pattern, max_size=3)}, optional={"note": texts(60)}) | \
    st.fixed_dictionaries({}, optional={
        "annotator": texts() | json_leaf, "sign": st.sampled_from([1, -1, 0, 2, "1", True, None, 1.0]),
        "note": texts(60) | json_leaf, "patterns": st.lists(pattern, max_size=4) | json_any, "extra": json_leaf})
form_fields = st.tuples(st.just("annotator"), names_).map(lambda t: [t]) | st.just([])
deep = st.integers(1000, 100_000).map(lambda n: ("[" * n + "]" * n).encode())  # Python's json recurses per level
slot_fields = st.lists(st.tuples(st.sampled_from(FORM_NAMES) | texts(10), values | st.integers(0, 26).map(str)),
                       max_size=8)

# what each page reads, so that most generated queries reach its parsers (a name it does not
# know is refused before that)
ROUTE_NAMES = {"/search": ["token", "text", "sort", "order", "page", "per_page", "k", "lens", "dir", "layer", "mode",
                           "sign", "label", "agree", "match"],
               "/memory": ["top", "annotate_sign", "slots", "samples", "draft", "annotator", "note", "p0_description",
                           "p0_kind", "p0_prefixes", "sign", "rank"],
               "/explore": ["text", "suppress", "scale", "set", "at", "contrast", "contrast_id", "lens", "top", "n"],
               "/sentence": ["pos", "corpus", "memory"], "/annotations": ["annotator"]}
KEYS = {"layer": st.integers(0, 3), "dim": st.integers(0, 81), "sid": st.integers(0, 260)}


def query_names(path: str):
    tail = path.removeprefix("/api")
    own = next((v for k, v in ROUTE_NAMES.items() if tail.startswith(k)), QUERY_NAMES)
    return st.one_of(st.sampled_from(own), st.sampled_from(own), st.sampled_from(own), names)


def path_value(name: str):
    if name == "name":  # static files and figures
        return st.one_of(st.sampled_from(["style.css", "app.js", "nope.css", "fig1.png", "..", "x.svg"]), texts())
    return st.one_of(KEYS.get(name, st.integers(0, 5)).map(str), KEYS.get(name, st.integers(0, 5)).map(str),
                     st.sampled_from(["-1", "80", "999999999999999999999", "abc", "1.5", "0x1", " 1"]),
                     texts(10).filter(lambda s: s not in ("", ".", "..")))


@pytest.fixture(scope="module")
def app(web_run, tmp_path_factory):  # noqa: F811
    from ffkv.web.app import create_app

    run = tmp_path_factory.mktemp("routes-property") / "run"
    shutil.copytree(web_run, run, ignore=shutil.ignore_patterns("annotations.sqlite*"))
    a = create_app(run, log_fn=lambda m: None)
    a.state.browser.wait_index(timeout=300)  # a token search while it builds is a 503 on purpose
    return a


def all_routes(routes, prefix=""):
    """(path, route) of every route, into included routers (FastAPI ≥ 0.16x keeps an included
    router as one `_IncludedRouter` entry of `app.routes`)."""
    from starlette.routing import Route

    for r in routes:
        if isinstance(r, Route):
            yield prefix + r.path, r
        elif hasattr(r, "original_router"):
            ctx = getattr(r, "include_context", None)
            yield from all_routes(r.original_router.routes, prefix + (getattr(ctx, "prefix", "") or ""))
        elif hasattr(r, "routes"):  # a Mount
            yield from all_routes(r.routes, prefix + getattr(r, "path", ""))


def route_methods(app) -> list[tuple]:
    out = []
    for path, r in all_routes(app.routes):
        for m in sorted((r.methods or {"GET"}) - {"HEAD"}):
            out.append((path, r, m))
    return out


def test_every_route_answers_below_500(app):
    from fastapi.testclient import TestClient

    client = TestClient(app, base_url=HOST, raise_server_exceptions=False)
    cases = route_methods(app)
    paths = {p for p, _, _ in cases}
    # the enumeration found the pages outside the schema and the writes too
    assert {"/", "/memory/{layer}/{dim}", "/memory/{layer}/{dim}/annotate", "/api/memory/{layer}/{dim}/annotations",
            "/annotations", "/search", "/static/{name}", "/sentence/{sid}"} <= paths, paths
    assert any(m == "POST" for _, _, m in cases) and len(cases) >= 25
    failures, seen = [], set()
    for path_, route, method in cases:
        params = list(route.param_convertors)

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(path=st.fixed_dictionaries({p: path_value(p) for p in params}),
               query=st.lists(st.tuples(query_names(path_), values), max_size=4),
               form=st.tuples(form_fields, slot_fields).map(lambda t: t[0] + t[1]),
               body=st.one_of(annotation, json_any, st.binary(max_size=40), deep),
               kind=st.sampled_from(["form", "json", "json", "raw"]))
        def check(path, query, form, body, kind):
            url = path_
            for p, v in path.items():
                url = url.replace("{" + p + "}", quote(v, safe=""))
            kw = {"params": query, "follow_redirects": False}
            if method == "POST":
                kw["headers"] = {"Origin": HOST}
                if kind == "form":
                    kw["data"] = {}
                    for k, v in form:  # repeated names (ticks) as lists
                        kw["data"].setdefault(k, []).append(v)
                elif kind == "json" and not isinstance(body, bytes):
                    kw["content"] = json.dumps(body).encode()
                    kw["headers"]["Content-Type"] = "application/json"
                else:
                    kw["content"] = body if isinstance(body, bytes) else str(body).encode()
            r = client.request(method, url, **kw)
            if r.status_code >= 500 and (method, path_) not in seen:  # the first of each route
                seen.add((method, path_))
                failures.append((method, url, query, kind, r.status_code, r.text[:200]))
            assert r.status_code < 500, (method, url, query, r.status_code, r.text[:300])

        try:
            check()
        except AssertionError:
            pass  # collected in `failures`: every route gets its turn before the test fails
    assert not failures, "\n".join(map(str, failures[:20]))
