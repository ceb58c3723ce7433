"""The prediction explorer's engine: follow one prediction through the layers, and intervene on
memories (the page and its JSON: `ffkv.web.routers.explorer`).

The explorer needs only the model (loaded lazily by the app's `Browser`), so it works on a run
without the key steps. One model call runs at a time (holding the browser's `model_lock`, shared
with re-verification); at most `QUEUE` more wait for it, and a request beyond that gets 503 at
once instead of a place in an unbounded queue. Identical requests are answered from a small
cache. Texts are capped at `MAX_TOKENS` tokens, interventions are checked against the model's
layers and dims: both give 422 with the reason, never a traceback.

The explained position (`pos=`, 0-based; default the last token, negative from the end): its
next-token prediction, the contributions, the lens tables and the edits "at last" are all of that
position. A causal model computes position p from tokens 0..p alone, so `explain(..., pos=p)` reads the
text's first p+1 tokens (the same ids, not a re-tokenized prefix) as it reads a whole text, and
"at last" edits their last position, p; the continuation continues those p+1 tokens. A position
outside the text is one line (422). `hardest`: the memories of all layers with the largest |m| at
the position (m the capture's coefficient, `explain`'s, which tests hold equal to
`MemoryModel.coefficients`), each with its contribution to the prediction.

Continuation (`continuation`): the model's own greedy `generate` (`MemoryModel.greedy`), once as
it is and once inside `MemoryModel.intervene(edits, at)`: with `at=last` each forward of the
generation edits its last position, so the text's last token and every generated token are
edited (the key-value cache keeps them edited); with `at=all` every position is. It stops early
where the model ends its text (its end-of-text token).

Edit sizes: a scale factor F (`scale=` or `L:D*F`) and a set value V (`L:D=V`) must be finite
and at most `MAX_EDIT` (1e6) in magnitude, a thousand times beyond any coefficient a model
computes; a larger one would only overflow (1e308 gave m = inf and p = nan everywhere). Should
an allowed edit still overflow (a half-precision model), a result holding a non-finite number
is refused the same way: 422, one line.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from ffkv.defs import LENSES
from ffkv.display import read_token
from ffkv.errors import FfkvError
from ffkv.parse import parse_int, parse_interventions
from ffkv.web.common import urlencode_clean

MAX_TOKENS = 256  # tokens of one text; the speed goal is set at 64
MAX_CHARS = 8_000  # characters, checked before tokenizing
QUEUE = 4  # requests that may wait while one runs; beyond that: 503
CACHE = 64  # results kept for identical requests
MAX_TOP = 20  # memories per layer
MAX_EDIT = 1e6  # largest |F| of a scale and |V| of a set (see the module docstring)
CONTINUE = 20  # tokens of continuation the form asks for
MAX_CONTINUE = 100
HARDEST = 20  # rows of "memories that fire hardest here"
MAX_HARDEST = 200


# ---- the gate: one model call at a time, a bounded queue ----------------------------------------
class Busy(Exception):
    pass


@dataclass
class Explorer:
    """Per-app state: the admission counter and the result cache."""
    queue: int = QUEUE
    pending: int = 0  # running + waiting
    lock: threading.Lock = field(default_factory=threading.Lock)
    run_lock: threading.Lock = field(default_factory=threading.Lock)
    cache: OrderedDict = field(default_factory=OrderedDict)

    def admit(self) -> None:
        with self.lock:
            if self.pending >= 1 + self.queue:
                raise Busy(f"the explorer is busy: {self.pending - 1} request(s) already wait for the "
                           f"model, the most it queues; try again in a moment")
            self.pending += 1

    def release(self) -> None:
        with self.lock:
            self.pending -= 1

    @contextmanager
    def admitted(self):
        """The request holds a place in the queue while it runs (`Busy` when there is none)."""
        self.admit()
        try:
            yield
        finally:
            self.release()

    def cached(self, key):
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        return None

    def keep(self, key, value) -> None:
        with self.lock:
            self.cache[key] = value
            while len(self.cache) > CACHE:
                self.cache.popitem(last=False)


_state_lock = threading.Lock()


def explorer(request: Request) -> Explorer:
    st = request.app.state
    with _state_lock:
        if getattr(st, "explorer", None) is None:
            st.explorer = Explorer(queue=getattr(st, "explore_queue", QUEUE))
        return st.explorer


def _browser(request: Request):
    return getattr(request.app.state, "browser", None)


def _model(request: Request):
    """The model: `app.state.explore_model` when set (an app without a run), else the run's."""
    mm = getattr(request.app.state, "explore_model", None)
    return mm if mm is not None else _browser(request).model()


def _shape(request: Request) -> tuple[int, int]:
    """(layers, d_m), from the run's manifest when there is one (no need to load the model)."""
    b = _browser(request)
    if getattr(request.app.state, "explore_model", None) is None and b is not None:
        return b.L, b.d_m
    mm = _model(request)
    return mm.n_layers, mm.d_m


# ---- the query ------------------------------------------------------------------------------------
@dataclass
class Query:
    text: str = ""
    suppress: str = ""
    scale: float = 0.0
    scale_raw: str = ""
    at: str = "last"
    contrast: str = ""
    contrast_id: int | None = None
    lens: str = ""
    top: int = 3
    cont: int = 0  # `continue=`: tokens of greedy continuation (0: none)
    edits: list = field(default_factory=list)
    fact_edit: str = ""  # `edit=NAME`: a fact edit kept in the run (`ffkv facts edit`), in the weights
    edit_stamp: int = 0  # its folder's mtime: a remade edit is not answered from the cache
    pos: int | None = None  # `pos=`: the explained position as typed (None: the last; negative: from the end)
    hardest: int = HARDEST  # `hardest=`: rows of the memories firing hardest at the position

    def params(self, **changes) -> dict:
        p = {"text": self.text, "suppress": self.suppress, "scale": self.scale_raw,
             "at": "" if self.at == "last" else self.at, "contrast": self.contrast,
             "contrast_id": "" if self.contrast_id is None else self.contrast_id,
             "lens": self.lens, "top": "" if self.top == 3 else self.top,
             "continue": self.cont or "", "edit": self.fact_edit, "pos": "" if self.pos is None else self.pos,
             "hardest": "" if self.hardest == HARDEST else self.hardest}
        p.update(changes)
        return p

    def url(self, path: str = "/explore", **changes) -> str:
        q = urlencode_clean(self.params(**changes))
        return f"{path}?{q}" if q else path

    def key(self) -> tuple:
        return (self.text, tuple(self.edits), self.at, self.contrast, self.contrast_id, self.lens, self.top,
                self.cont, self.fact_edit, self.edit_stamp, self.pos, self.hardest)


def _items(suppress: str) -> list[str]:
    return [s.strip() for s in suppress.split(",") if s.strip()]


def parse_query(request: Request) -> Query:
    """The page's parameters, checked; anything wrong is an FfkvError (422)."""
    g = request.query_params
    text = g.get("text") or ""
    if len(text) > MAX_CHARS:
        raise FfkvError(f"the text is {len(text):,} characters long; the explorer takes at most "
                        f"{MAX_CHARS:,} characters and {MAX_TOKENS} tokens")
    q = Query(text=text, suppress=",".join(_items(g.get("suppress") or "")))
    q.scale_raw = (g.get("scale") or "").strip()
    if q.scale_raw:
        try:
            q.scale = float(q.scale_raw)
        except ValueError:
            raise FfkvError(f"scale {q.scale_raw!r} is not a number") from None
        if not math.isfinite(q.scale):
            raise FfkvError(f"scale {q.scale_raw!r} is not a finite number")
        if abs(q.scale) > MAX_EDIT:
            raise FfkvError(f"scale {q.scale_raw!r} is too large: the explorer takes |scale| ≤ {MAX_EDIT:g}")
    q.at = (g.get("at") or "last").strip()
    if q.at not in ("last", "all"):
        raise FfkvError(f"at {q.at!r}: choose last (the last position) or all (every position)")
    q.contrast = g.get("contrast") or ""
    contrast_text(q)  # a malformed escape: 422 now, before the model is asked
    cid = (g.get("contrast_id") or "").strip()
    if cid and not q.contrast:  # a typed contrast wins over an id carried from a link
        q.contrast_id = parse_int(cid, "contrast_id", lo=0)
    q.lens = (g.get("lens") or "").strip()
    if q.lens and q.lens not in LENSES:
        raise FfkvError(f"lens {q.lens!r}: choose naive or norm")
    top = (g.get("top") or "").strip()
    if top:
        q.top = parse_int(top, "top (memories per layer)", 1, MAX_TOP)
    cont = (g.get("continue") or "").strip()
    if cont:
        q.cont = parse_int(cont, "continue (tokens to continue)", 0, MAX_CONTINUE)
    pos = (g.get("pos") or "").strip()
    if pos:  # within the text: checked once it is tokenized (`resolve_pos`)
        q.pos = parse_int(pos, "pos (the token position explained)")
    hardest = (g.get("hardest") or "").strip()
    if hardest:
        q.hardest = parse_int(hardest, "hardest (memories firing hardest)", 1, MAX_HARDEST)
    name = (g.get("edit") or "").strip()
    if name:
        from ffkv.web.facts import edit_path

        b = _browser(request)
        if b is None:
            raise FfkvError("edit= needs a run (its edits are kept there)")
        q.fact_edit, q.edit_stamp = name, edit_path(b.run, name).stat().st_mtime_ns
    if q.suppress:
        L, d_m = _shape(request)
        q.edits = parse_interventions(q.suppress, L, d_m, scale=q.scale, what="suppress")
        for e in q.edits:
            if abs(e.value) > MAX_EDIT:
                raise FfkvError(f"suppress: {e.layer}:{e.dim} {'scales by' if e.op == 'scale' else 'sets m to'} "
                                f"{e.value:g}, too large: the explorer takes factors and values up to "
                                f"{MAX_EDIT:g} in magnitude")
    return q


def contrast_text(q: Query) -> str | None:
    """The contrast token's text as typed (␣ = space, escapes: `ffkv.display.read_token`)."""
    if not q.contrast:
        return None
    try:
        return read_token(q.contrast)
    except ValueError as e:
        raise FfkvError(f"contrast: {e}") from None


def _finite(x) -> bool:
    """Whether every number in a result is finite."""
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_finite(v) for v in x)
    return True


# ---- running the engine ---------------------------------------------------------------------------
def using_model(request: Request, ex: Explorer, fn):
    """fn(mm) with the model to itself: the explorer's lock, the browser's foreground mark and its
    model lock (its re-verification runs the same model). In a worker thread."""
    b = _browser(request)
    fg = getattr(b, "foreground", None)
    with ex.run_lock, (fg.busy() if fg is not None else nullcontext()):
        mm = _model(request)
        with getattr(b, "model_lock", None) or nullcontext():
            return fn(mm)


async def with_model(request: Request, fn):
    """fn(mm) when the gate admits the request (`Busy` beyond its queue): what any page that runs
    the model (the explorer, the facts page) goes through."""
    ex = explorer(request)
    with ex.admitted():
        return await run_in_threadpool(using_model, request, ex, fn)


def _compute(request: Request, q: Query, ex: Explorer) -> dict:
    from ffkv.web.explain import explain, fit_text, resolve_pos

    def go(mm):
        ids = fit_text(mm, q.text, MAX_TOKENS)[0]
        pos = resolve_pos(q.pos, len(ids))
        prefix = ids[:pos + 1]  # what the prediction at pos and the continuation read
        fe, base = None, None
        if q.fact_edit:  # the run's fact edit in the weights; the unedited model's continuation beside
            from ffkv.steps.facts.edit import Edit, applied
            from ffkv.web.facts import edit_path

            fe = Edit.load(edit_path(_browser(request).run, q.fact_edit))
            base = continuation(mm, q.text, q.cont, ids=prefix) if q.cont else None
        with applied(mm, fe) if fe is not None else nullcontext():
            res = explain(mm, q.text, q.top, q.edits, at=q.at,
                          contrast=q.contrast_id if q.contrast_id is not None else contrast_text(q),
                          lens=q.lens or None, ids=ids, pos=pos, n_hardest=q.hardest)
            cont = continuation(mm, q.text, q.cont, q.edits, q.at, ids=prefix) if q.cont else None
        if base is not None:  # without = the unedited model; with = the fact edit (and any memory edits)
            edited = cont["edited"] or cont["original"]
            cont = {**cont, "original": base["original"], "edited": edited,
                    "diverges_at": _diverges(base["original"]["ids"], edited["ids"])}
        res["continuation"] = cont
        res["fact_edit"] = None if fe is None else {"name": q.fact_edit, "method": fe.method, "layers": fe.layers,
                                                    "facts": fe.facts}
        return res

    res = using_model(request, ex, go)
    if not _finite(res):
        raise FfkvError("these edits overflow the model's numbers (the result holds inf or nan); "
                        "use a smaller scale or value")
    res["query"] = {"text": q.text, "suppress": q.suppress, "scale": q.scale, "at": q.at,
                    "contrast": q.contrast or None, "contrast_id": q.contrast_id, "lens": res["lens"],
                    "top": q.top, "interventions": [str(e) for e in q.edits], "continue": q.cont,
                    "pos": q.pos, "hardest": q.hardest}
    res["url"] = q.url()
    return res


def continuation(mm, text: str, n: int, edits=(), at: str = "last", ids: list[int] | None = None) -> dict:
    """`n` greedy tokens after `text` (or after the token ids `ids`: the explored position's
    prefix), as the model writes them (`original`) and under the edits (`edited`, None without
    edits): {n, original, edited: {ids, tokens, text}, diverges_at (index of the first token that
    differs, None when none does)}."""
    from ffkv.web.explain import fit_text

    if ids is None:
        ids = fit_text(mm, text, MAX_TOKENS)[0]
    if len(ids) + n > mm.max_length:
        raise FfkvError(f"the text ({len(ids)} tokens) and {n} more exceed the model's context of "
                        f"{mm.max_length:,} tokens; ask for fewer (continue=)")

    def read(new: list[int]) -> dict:
        return {"ids": new, "tokens": [mm.tok.decode([i]) for i in new], "text": mm.tok.decode(new)}

    original = read(mm.greedy(ids, n))
    edited, diverges = None, None
    if edits:
        with mm.intervene(list(edits), at=at):
            edited = read(mm.greedy(ids, n))
        diverges = _diverges(original["ids"], edited["ids"])
    return {"n": n, "at": at, "original": original, "edited": edited, "diverges_at": diverges}


def _diverges(a: list, b: list) -> int | None:
    """The index of the first token where two continuations differ (None: none does)."""
    return next((i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]), None)


async def run_query(request: Request, q: Query) -> dict:
    """The result for `q`: from the cache, or computed when the gate admits the request."""
    ex = explorer(request)
    key = q.key()
    hit = ex.cached(key)
    if hit is not None:
        return hit
    with ex.admitted():  # raises Busy: nothing waits beyond the queue
        res = await run_in_threadpool(_compute, request, q, ex)
    ex.keep(key, res)
    return res
