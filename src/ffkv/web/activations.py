"""Per-token coefficients of one memory over the examples a page shows (issue 26, Deliver 1).

A memory page's trigger rows (top, negative) and quantile samples, and a sentence page opened
with `?memory=L/D`, show each example as a window of its sentence around the trigger, one
`<span class="tk" data-i=…>` per token (`example_html`): the page needs no model and works
without JavaScript. `static/app.js` then fetches `/api/memory/L/D/activations?…` and tints
every token by the memory's coefficient m at that position (signed: two hues), with the value
in `data-m` and the token's title (hover) and shown on focus. Search rows show one example
each, of the row's own memory (`data-memory="L/D"` on the example), and their page fetches
`/api/activations?examples=L/D/SID/POS,…` (`act_src`) the same way: one colouring path,
one scale per memory.

The coefficients come from the run's model (`Browser.model()`, the one verify and the explorer
use): the page's sentences in a few padded batches, each forward stopped after the memory's
layer (`MemoryModel.capture(layers=[L])` raises its private stop from a hook on that block, so
the later layers never run), reduced to the one dim at once by the capture's callback. m at
token j depends only on tokens ≤ j (a causal model; right padding is masked), so one forward
over a sentence gives every window of it, and one forward gives every memory a page asks of
that sentence (each layer's few dims picked at once). Results are cached per (layer, dim,
sentence), up to `CACHE_FLOATS` numbers in all: a page seen before is coloured at once.

JSON of one memory (`activations()`): {layer, dim, scale (largest |m| returned), scale_pos and
scale_neg (largest m > 0 and largest −m of m < 0: each sign's tint is relative to its own, so both
sides' examples show), examples: {sentence_id: {start, m: [m at tokens start, start+1, …]}}, computed
((memory, sentence) pairs computed now), seconds}. Of several (`activations_many()`):
{memories: {"L/D": {layer, dim, scale, scale_pos, scale_neg, examples}}, computed, seconds}.
"""
from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from contextlib import nullcontext

import numpy as np
from markupsafe import Markup, escape

from ffkv.web.common import show_trigger, templates
from ffkv.web.tables import PREFIX_TOKENS, BadQuery, Left, NotFound

BEFORE = PREFIX_TOKENS  # tokens shown up to and including the trigger, as the prefix column did
AFTER = 12  # tokens shown after the trigger
MAX_TOP = 200  # trigger rows per sign, as the memory page allows
MAX_SENTENCE = 1024  # tokens of one sentence read for the sentence page
BATCH_TOKENS = 4096  # padded tokens per forward
RATIO = 1.5  # a batch ends where a length passes 1.5× its shortest: on a CPU padding costs in full
CACHE_FLOATS = 4_000_000  # numbers kept in the cache (16 MB)
LEVELS = 8  # tint steps per sign (classes mp1..mp8, mn1..mn8 in style.css)
MEMORY = re.compile(r"\s*(\d{1,6})\s*[/:]\s*(\d{1,9})\s*")
EXAMPLE = re.compile(r"(\d{1,6})/(\d{1,9})/(\d{1,19})/(\d{1,9})")  # L/D/SID/POS of `act_src`
MAX_EXAMPLES = 500  # examples of one /api/activations request (a search page's rows)


# ---- the markup ---------------------------------------------------------------------------------
def window(n: int, position: int) -> tuple[int, int]:
    """[start, end) of the tokens shown around the trigger at `position` of an n-token sentence."""
    return max(0, position + 1 - BEFORE), min(n, position + 1 + AFTER)


def example_html(b, sentence_id: int, position: int, layer: int | None = None, dim: int | None = None) -> Markup:
    """A trigger's example: its sentence's tokens from `window`, each `<span class="tk"
    data-i=…>` (the trigger a `<mark>`), an ellipsis where the sentence goes on. With layer and
    dim (a search row), the example names its memory, which the page's colours follow."""
    try:
        row = b.sentence_row(int(sentence_id))
    except NotFound:
        return Markup('<span class="muted">(sentence not in this run)</span>')
    toks = b.sentence_tokens(row).tolist()
    position = int(position)
    start, end = window(len(toks), position)
    vocab = b.vocab
    shown = b._lazy("_vocab_html", lambda: [str(escape(v)) for v in vocab])  # escaped once per server
    mem = f' data-memory="{int(layer)}/{int(dim)}"' if layer is not None and dim is not None else ""
    out = [f'<span class="ex prefix" data-sid="{int(sentence_id)}" data-pos="{position}"{mem}>']
    if start > 0:
        out.append('<span class="muted">…</span>')
    for i in range(start, end):
        t = toks[i]
        text = vocab[t] if 0 <= t < len(vocab) else f"<{t}>"
        if i == position:
            out.append(f'<mark class="tk" data-i="{i}">{escape(show_trigger(text))}</mark>')
        else:
            out.append(f'<span class="tk{" after" if i > position else ""}" data-i="{i}">'
                       f'{shown[t] if 0 <= t < len(shown) else escape(text)}</span>')
    if end < len(toks):
        out.append('<span class="muted">…</span>')
    out.append("</span>")
    return Markup("".join(out))


def with_memory(permalink: str, layer: int, dim: int) -> str:
    """A sentence permalink that also colours the sentence by memory layer/dim."""
    path, _, frag = str(permalink).partition("#")
    sep = "&" if "?" in path else "?"
    return f"{path}{sep}memory={int(layer)}/{int(dim)}" + (f"#{frag}" if frag else "")


def explore_links(m: dict, b) -> list[dict] | None:
    """The memory page's "Intervene" links: the explorer on the top trigger's prefix of the
    memory's dominant side (`m["dominant"]`), with this memory suppressed, doubled, negated, or set
    to that side's top coefficient at every position, each with a 20-token continuation."""
    from ffkv.web.explore import CONTINUE, Query

    trig = m.get("triggers") or {}
    first, other = ("-", "+") if m.get("dominant") == -1 else ("+", "-")
    rows = trig.get(first) or trig.get(other) or []
    if not rows:
        return None
    t = rows[0]
    text = (t.get("prefix") or {}).get("full") or ""
    if not text.strip():
        return None
    key = f"{m['layer']}:{m['dim']}"
    coef = float(t.get("coef") or 0.0)
    out = [("suppress", "m = 0 at the last position", Query(text=text, suppress=key)),
           ("×2", "m doubled at the last position", Query(text=text, suppress=f"{key}*2")),
           ("×−1", "m negated at the last position", Query(text=text, suppress=f"{key}*-1"))]
    if np.isfinite(coef) and coef != 0:
        out.append((f"set m = {coef:.3g} everywhere", "m set to its top coefficient at every position",
                    Query(text=text, suppress=f"{key}={coef:.4g}", at="all")))
    return [{"label": label, "title": title, "url": q.url(**{"continue": CONTINUE})}
            for label, title, q in out] + [{"label": "no edit", "title": "the prediction and continuation as they are",
                                            "url": Query(text=text).url(**{"continue": CONTINUE})}]


def act_src(rows) -> str | None:
    """The colours' URL of a search page: one example per row that has one (layer, dim,
    sentence_id, position), at most MAX_EXAMPLES; None when no row has one."""
    ex = [f"{int(r['layer'])}/{int(r['dim'])}/{int(r['sentence_id'])}/{int(r['position'])}"
          for r in rows if r.get("sentence_id") is not None and r.get("position") is not None]
    return "/api/activations?examples=" + ",".join(ex[:MAX_EXAMPLES]) if ex else None


def parse_examples(v: str | None) -> list[tuple[int, int, int, int]]:
    """`L/D/SID/POS,…` of /api/activations: a BadQuery (one line) unless 1..MAX_EXAMPLES of them."""
    parts = [x for x in str(v or "").split(",") if x.strip()]
    if not parts:
        raise BadQuery("examples: give LAYER/DIM/SENTENCE/POSITION, comma-separated, e.g. 2/17/40/3")
    if len(parts) > MAX_EXAMPLES:
        raise BadQuery(f"examples: at most {MAX_EXAMPLES} (got {len(parts)})")
    out = []
    for x in parts:
        mt = EXAMPLE.fullmatch(x.strip())
        if not mt:
            raise BadQuery(f"examples: each is LAYER/DIM/SENTENCE/POSITION, e.g. 2/17/40/3 (got {x.strip()[:40]!r})")
        out.append(tuple(int(g) for g in mt.groups()))
    return out


templates.globals.update(example=example_html, with_memory=with_memory, explore_links=explore_links,
                         act_src=act_src)


# ---- the cache ----------------------------------------------------------------------------------
class Cache:
    """(layer, dim, sentence_id) -> m (float32) over the sentence's first tokens; LRU by numbers."""

    def __init__(self, floats: int = CACHE_FLOATS):
        self.floats, self.size = floats, 0
        self.items: OrderedDict = OrderedDict()
        self.lock = threading.Lock()  # the dict
        self.compute = threading.Lock()  # one computation at a time: a second asks the cache again

    def get(self, key, end: int):
        with self.lock:
            v = self.items.get(key)
            if v is None or len(v) < end:
                return None
            self.items.move_to_end(key)
            return v

    def put(self, key, v: np.ndarray) -> None:
        with self.lock:
            old = self.items.pop(key, None)
            if old is not None:
                self.size -= len(old)
            self.items[key] = v
            self.size += len(v)
            while self.size > self.floats and len(self.items) > 1:
                _, x = self.items.popitem(last=False)
                self.size -= len(x)


_state_lock = threading.Lock()


def cache(app_state) -> Cache:
    with _state_lock:
        if getattr(app_state, "activation_cache", None) is None:
            app_state.activation_cache = Cache()
        return app_state.activation_cache


# ---- which examples a page shows ----------------------------------------------------------------
def page_examples(b, layer: int, dim: int, top: int = 25, samples: str = "first",
                  sign: int | None = None, hide_pos0: bool = False) -> list[tuple[int, int]]:
    """(sentence_id, position) of the memory page's trigger rows (rank ≤ top, of `sign` or both)
    and its quantile samples as the page shows them (`samples`: first, one per activation level
    as by default; all, as with ?samples=all; none), so that no sentence is computed in vain.
    `hide_pos0` (the page's ?pos0=hide): no example at position 0, and each list's `top` best
    of the rest, as the page shows them."""
    out = []
    kept = {1: 0, -1: 0}
    rows = b.trig.rows(layer, dim)
    for r in (sorted(rows, key=lambda r: (-r["sign"], r["rank"])) if hide_pos0 else rows):
        if sign is not None and r["sign"] != sign:
            continue
        if hide_pos0:
            if r["position"] != 0 and kept[r["sign"]] < top:
                kept[r["sign"]] += 1
                out.append((int(r["sentence_id"]), int(r["position"])))
        elif r["rank"] <= top:
            out.append((int(r["sentence_id"]), int(r["position"])))
    if samples != "none" and sign is None and getattr(b, "key_samples", None) is not None:
        st = b.key_statistics(layer, dim, samples == "all") or {}
        for r in st.get("samples") or []:
            if not (hide_pos0 and int(r["position"]) == 0):
                out.append((int(r["sentence_id"]), int(r["position"])))
    return out


def spans(b, examples) -> dict[int, tuple[int, int]]:
    """sentence_id -> [start, end) covering every example's window in it."""
    need: dict[int, tuple[int, int]] = {}
    for sid, pos in examples:
        try:
            n = len(b.sentence_tokens(b.sentence_row(sid)))
        except NotFound:
            continue
        s, e = window(n, pos) if pos is not None else (0, min(n, MAX_SENTENCE))
        if sid in need:
            s, e = min(s, need[sid][0]), max(e, need[sid][1])
        need[sid] = (s, e)
    return need


# ---- the forward --------------------------------------------------------------------------------
def compute(mm, seqs: list[list[int]], jobs: list[list[tuple[int, int]]], lock=None, start: int = 0,
            stream=None) -> list[dict]:
    """m at every token of each sequence, for the memories `jobs[i]` ((layer, dim) pairs) asks
    of sequence i: {(layer, dim): m}. Batched, padded on the right, each forward stopped after
    the deepest layer its batch needs, each captured layer reduced to its asked dims at once.
    With `start` > 0, `stream(i)` is sequence i's residual stream entering block `start` (len, d)
    and blocks below it are skipped (`ffkv.model.stream`; every asked layer is ≥ start)."""
    import torch

    from ffkv.corpus.batching import pack
    from ffkv.model.onednn import products_of
    from ffkv.model.stream import from_stream, padded

    out: list[dict] = [{} for _ in seqs]
    for idx in pack([len(s) for s in seqs], batch_tokens=BATCH_TOKENS, max_batch=64, ratio=RATIO):
        idx = [int(i) for i in idx]
        dims: dict[int, list[int]] = {}
        for i in idx:
            for layer, dim in jobs[i]:
                dims.setdefault(layer, []).append(dim)
        dims = {layer: sorted(set(ds)) for layer, ds in dims.items()}
        got = {}

        def keep(l, name, t):  # (B, T, d_m) -> (B, T, the layer's asked dims), at once
            got[l] = t[..., dims[l]].float().cpu().numpy()

        ids, mask = mm.batch([seqs[i] for i in idx])
        skip = (from_stream(mm, start, padded([stream(i) for i in idx], ids.shape[1], ids.device, mm.dtype))
                if start else nullcontext())
        # products with the weights through oneDNN on a CPU (`ffkv.model.onednn`): about 2×
        # MKL's speed here (SmolLM2, 40 sentences to layer 15: 6–8 s against 12–17 s on a busy
        # machine); the values change by float rounding only
        with (lock or threading.Lock()), torch.no_grad(), products_of(mm), skip:
            mm.capture(ids, mask, layers=sorted(dims), what=("m",), callback=keep)
        for j, i in enumerate(idx):
            for layer, dim in jobs[i]:
                out[i][(layer, dim)] = got[layer][j, :len(seqs[i]), dims[layer].index(dim)].astype(np.float32)
    return out


def activations_many(b, app_state, items, skip_pos0: bool = False, turn=None) -> dict:
    """m at the tokens of each example `items` names ((layer, dim, sentence_id, position), the
    position None for a whole sentence), from the cache or one batched computation; the JSON
    of several memories (the module docstring lists its fields). `skip_pos0`: a sentence's first
    token sets no scale (?pos0=hide: a first-position memory's huge m there would leave every
    other token untinted). `turn(lock)`: called before a computation waits for a lock, False
    when the request's client has gone meanwhile (`Left` is raised then: no forward for a page
    already left, so the next page's colours are not queued behind it)."""
    t0 = time.time()
    asked: dict[tuple[int, int], list] = {}
    for layer, dim, sid, pos in items:
        asked.setdefault((int(layer), int(dim)), []).append((int(sid), pos))
    for layer, dim in asked:
        b.check_key(layer, dim)
    need = {k: spans(b, ex) for k, ex in asked.items()}  # memory -> {sid: (start, end)}
    c = cache(app_state)

    def look():
        return [(k, sid) for k, sp in need.items() for sid in sp if have.get((k, sid)) is None]

    have = {(k, sid): c.get((*k, sid), e) for k, sp in need.items() for sid, (s, e) in sp.items()}
    missing = look()
    computed = 0
    if missing:
        if turn is not None and not (turn(c.compute) and turn(b.model_lock)):
            raise Left(f"{len(missing)} colours")
        fg = getattr(b, "foreground", None)
        with (fg.busy() if fg is not None else nullcontext()), c.compute:
            for k, sid in missing:  # another request may have computed them meanwhile
                have[(k, sid)] = c.get((*k, sid), need[k][sid][1])
            missing = look()
            if missing:
                mm = b.model()
                end: dict[int, int] = {}
                jobs: dict[int, list] = {}
                for k, sid in missing:
                    end[sid] = max(end.get(sid, 0), need[k][sid][1])
                    jobs.setdefault(sid, []).append(k)
                for sid, k, m in _computed(b, mm, jobs, end):
                    c.put((*k, sid), m)
                    have[(k, sid)] = m
                computed = len(missing)
    memories = {}
    for (layer, dim), sp in need.items():
        ex, pos, neg = {}, 0.0, 0.0
        for sid, (s, e) in sp.items():
            vals = [float(f"{x:.6g}") if np.isfinite(x) else None for x in have[((layer, dim), sid)][s:e].tolist()]
            sc = vals[1:] if skip_pos0 and s == 0 else vals
            p, n = sign_scales(sc)
            pos, neg = max(pos, p), max(neg, n)
            ex[str(sid)] = {"start": s, "m": vals}
        # one scale per sign: a memory running from +0.9 to −6 shows its + examples tinted too
        memories[f"{layer}/{dim}"] = {"layer": layer, "dim": dim, "scale": max(pos, neg), "scale_pos": pos,
                                      "scale_neg": neg, "examples": ex}
    return {"memories": memories, "computed": computed, "seconds": round(time.time() - t0, 3)}


def _computed(b, mm, jobs: dict[int, list], end: dict[int, int]):
    """(sentence_id, (layer, dim), m) of every job: memories of layers ≥ K from the run's stream
    entering block K once the server has it (`ffkv.web.residuals`), the rest from the tokens."""
    from ffkv.web.residuals import streams

    st = streams(b)
    st.begin()
    K = st.start if st.ready() else None
    parts = {0: {}, K: {}} if K else {0: {}}
    for sid, ks in jobs.items():
        for k in ks:
            parts[K if K and k[0] >= K else 0].setdefault(sid, []).append(k)
    for start, js in parts.items():
        sids = list(js)
        if not sids:
            continue
        rows = [b.sentence_row(sid) for sid in sids]
        seqs = [b.sentence_tokens(r)[:end[sid]].tolist() for r, sid in zip(rows, sids)]
        fetch = (lambda i: st.rows(rows[i], len(seqs[i]))) if start else None
        for sid, ms in zip(sids, compute(mm, seqs, [js[sid] for sid in sids], b.model_lock, start, fetch)):
            for k, m in ms.items():
                yield sid, k, m


TEXT_TOKENS = 256  # tokens of a typed text (the explorer's cap); longer is cut at the side asked, or refused


def sign_scales(vals) -> tuple[float, float]:
    """(largest m > 0, largest −m of m < 0) of the values (None skipped), 0 where none: each sign's
    tint is relative to its own, so a memory running from +0.9 to −6 shows its + side too."""
    pos = max([0.0] + [x for x in vals if x is not None and x > 0])
    neg = max([0.0] + [-x for x in vals if x is not None and x < 0])
    return pos, neg


def level(m: float, scale: float) -> int:
    """A coefficient's tint step, 0..LEVELS, against its sign's scale (static/app.js rounds alike)."""
    if not scale or not np.isfinite(m):
        return 0
    return int(min(LEVELS, np.floor(LEVELS * abs(m) / scale + 0.5)))


def tint(m, scale_pos: float, scale_neg: float) -> str:
    """The tint class of a coefficient shown server-side (mp1..mp8, mn1..mn8, or ''), by `level`
    against its sign's scale (`sign_scales`): what static/app.js gives a fetched token, for panels
    that draw their own tinted tokens (the census's sign-regime examples)."""
    if m is None or not np.isfinite(m) or m == 0:
        return ""
    k = level(m, scale_pos if m > 0 else scale_neg)
    return tint_class(k if m > 0 else -k)


def tint_class(signed_level: int) -> str:
    """The tint class of a signed level (+k: mp k, −k: mn k, 0: none), as static/app.js names them."""
    k = int(signed_level)
    return f"mp{k}" if k > 0 else f"mn{-k}" if k < 0 else ""


templates.globals.update(tint=tint, tint_class=tint_class, sign_scales=sign_scales)


def text_activations(b, layer: int, dim: int, text: str, truncate: str | None = None) -> dict:
    """One memory's coefficient m at every token of a typed text (issue 48: your own text), the
    forward stopped after its layer (`compute`, the examples' colouring). JSON: {layer, dim, text,
    tokens: [{i, token, text, m, level}], scale_pos, scale_neg, cut, seconds}; `level` signed."""
    from ffkv.errors import FfkvError
    from ffkv.web.explain import fit_text

    t0 = time.time()
    b.check_key(layer, dim)
    if not text or not text.strip():
        raise BadQuery("type a text: the coefficient is read at each of its tokens")
    from ffkv.web.explore import MAX_CHARS

    if len(text) > MAX_CHARS:  # the explorer's cap, checked before tokenizing
        raise BadQuery(f"the text is {len(text):,} characters long; at most {MAX_CHARS:,}")
    mm = b.model()
    try:
        ids, cut = fit_text(mm, text, TEXT_TOKENS, truncate)
    except FfkvError as e:
        raise BadQuery(str(e).replace("--truncate", "truncate")) from None
    fg = getattr(b, "foreground", None)
    with fg.busy() if fg is not None else nullcontext():
        m = compute(mm, [ids], [[(layer, dim)]], b.model_lock)[0][(layer, dim)]
    vals = [float(f"{x:.6g}") if np.isfinite(x) else None for x in m.tolist()]
    pos, neg = sign_scales(vals)
    toks = [{"i": i, "token": int(t), "text": b.tok(t), "m": x,
             "level": 0 if x is None else (level(x, pos) if x > 0 else -level(x, neg))}
            for i, (t, x) in enumerate(zip(ids, vals))]
    top = sorted((t for t in toks if t["m"] is not None), key=lambda t: -abs(t["m"]))[:10]
    return {"layer": layer, "dim": dim, "text": text, "tokens": toks, "scale_pos": pos, "scale_neg": neg,
            "top": [t["i"] for t in top], "cut": cut, "seconds": round(time.time() - t0, 3)}


def activations(b, app_state, layer: int, dim: int, examples, skip_pos0: bool = False, turn=None) -> dict:
    """The JSON of one memory's page (the module docstring lists its fields)."""
    b.check_key(layer, dim)
    j = activations_many(b, app_state, [(layer, dim, sid, pos) for sid, pos in examples], skip_pos0, turn)
    one = j["memories"].get(f"{layer}/{dim}") or {"layer": layer, "dim": dim, "scale": 0.0, "scale_pos": 0.0,
                                                   "scale_neg": 0.0, "examples": {}}
    return {**one, "computed": j["computed"], "seconds": j["seconds"]}


def parse_memory(v: str | None) -> tuple[int, int] | None:
    """`L/D` (or `L:D`) of a sentence page's `?memory=`; '' or absent: None; else 422."""
    if v is None or not str(v).strip():
        return None
    mt = MEMORY.fullmatch(str(v))
    if not mt:
        raise BadQuery(f"memory must be LAYER/DIM, e.g. 2/17 (got {str(v)[:40]!r})")
    return int(mt.group(1)), int(mt.group(2))
