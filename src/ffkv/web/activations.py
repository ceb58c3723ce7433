"""Per-token coefficients of one memory over the examples a page shows (issue 26, Deliver 1).

A memory page's trigger rows (top, negative) and quantile samples, and a sentence page opened
with `?memory=L/D`, show each example as a window of its sentence around the trigger, one
`<span class="tk" data-i=…>` per token (`example_html`): the page needs no model and works
without JavaScript. `static/app.js` then fetches `/api/memory/L/D/activations?…` and tints
every token by the memory's coefficient m at that position (signed: two hues), with the value
in `data-m` and the token's title (hover) and shown on focus.

The coefficients come from the run's model (`Browser.model()`, the one verify and the explorer
use): the page's sentences in a few padded batches, each forward stopped after the memory's
layer (`MemoryModel.capture(layers=[L])` raises its private stop from a hook on that block, so
the later layers never run), reduced to the one dim at once by the capture's callback. m at
token j depends only on tokens ≤ j (a causal model; right padding is masked), so one forward
over a sentence gives every window of it. Results are cached per (layer, dim, sentence), up to
`CACHE_FLOATS` numbers in all: a page seen before is coloured at once.

JSON (`activations()`): {layer, dim, scale (largest |m| returned, what the tint is relative
to), examples: {sentence_id: {start, m: [m at tokens start, start+1, …]}}, computed (sentences
computed now), seconds}.
"""
from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict

import numpy as np
from markupsafe import Markup, escape

from ffkv.web.common import show_trigger, templates
from ffkv.web.data import PREFIX_TOKENS, BadQuery, NotFound

BEFORE = PREFIX_TOKENS  # tokens shown up to and including the trigger, as the prefix column did
AFTER = 12  # tokens shown after the trigger
MAX_TOP = 200  # trigger rows per sign, as the memory page allows
MAX_SENTENCE = 1024  # tokens of one sentence read for the sentence page
BATCH_TOKENS = 4096  # padded tokens per forward
CACHE_FLOATS = 4_000_000  # numbers kept in the cache (16 MB)
LEVELS = 8  # tint steps per sign (classes mp1..mp8, mn1..mn8 in style.css)
MEMORY = re.compile(r"\s*(\d{1,6})\s*[/:]\s*(\d{1,9})\s*")


# ---- the markup ---------------------------------------------------------------------------------
def window(n: int, position: int) -> tuple[int, int]:
    """[start, end) of the tokens shown around the trigger at `position` of an n-token sentence."""
    return max(0, position + 1 - BEFORE), min(n, position + 1 + AFTER)


def example_html(b, sentence_id: int, position: int) -> Markup:
    """A trigger's example: its sentence's tokens from `window`, each `<span class="tk"
    data-i=…>` (the trigger a `<mark>`), an ellipsis where the sentence goes on."""
    try:
        row = b.sentence_row(int(sentence_id))
    except NotFound:
        return Markup('<span class="muted">(sentence not in this run)</span>')
    toks = b.sentence_tokens(row).tolist()
    position = int(position)
    start, end = window(len(toks), position)
    vocab = b.vocab
    out = [f'<span class="ex prefix" data-sid="{int(sentence_id)}" data-pos="{position}">']
    if start > 0:
        out.append('<span class="muted">…</span>')
    for i in range(start, end):
        t = toks[i]
        text = vocab[t] if 0 <= t < len(vocab) else f"<{t}>"
        if i == position:
            out.append(f'<mark class="tk" data-i="{i}">{escape(show_trigger(text))}</mark>')
        else:
            out.append(f'<span class="tk{" after" if i > position else ""}" data-i="{i}">{escape(text)}</span>')
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
    """The memory page's "Intervene" links: the explorer on its top trigger's prefix, with this
    memory suppressed, doubled, negated, or set to its top coefficient at every position, each
    with a 20-token continuation."""
    from ffkv.web.explore import CONTINUE, Query

    rows = (m.get("triggers") or {}).get("+") or []
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


templates.globals.update(example=example_html, with_memory=with_memory, explore_links=explore_links)


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
def page_examples(b, layer: int, dim: int, top: int = 25, samples: bool = True,
                  sign: int | None = None) -> list[tuple[int, int]]:
    """(sentence_id, position) of the memory page's trigger rows (rank ≤ top, of `sign` or both)
    and, with `samples`, its quantile samples."""
    out = []
    for r in b.trig.rows(layer, dim):
        if r["rank"] <= top and (sign is None or r["sign"] == sign):
            out.append((int(r["sentence_id"]), int(r["position"])))
    if samples and sign is None and getattr(b, "key_samples", None) is not None:
        for r in b.key_samples.rows(layer, dim):
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
def compute(mm, layer: int, dim: int, seqs: list[list[int]], lock=None) -> list[np.ndarray]:
    """m of memory (layer, dim) at every token of each sequence: batched, padded on the right,
    each forward stopped after `layer`."""
    import torch

    from ffkv.corpus.batching import pack

    out: list[np.ndarray | None] = [None] * len(seqs)
    for idx in pack([len(s) for s in seqs], batch_tokens=BATCH_TOKENS, max_batch=64):
        idx = [int(i) for i in idx]
        got = {}

        def keep(l, name, t):  # (B, T, d_m) -> (B, T) of the one dim, at once
            got["m"] = t[..., dim].float().cpu()

        ids, mask = mm.batch([seqs[i] for i in idx])
        with (lock or threading.Lock()), torch.no_grad():
            mm.capture(ids, mask, layers=[layer], what=("m",), callback=keep)
        m = got["m"].numpy()
        for j, i in enumerate(idx):
            out[i] = m[j, :len(seqs[i])].astype(np.float32)
    return out


def activations(b, app_state, layer: int, dim: int, examples) -> dict:
    """The JSON the page's script reads (the module docstring lists its fields)."""
    t0 = time.time()
    b.check_key(layer, dim)
    need = spans(b, examples)
    c = cache(app_state)
    key = lambda sid: (layer, dim, sid)  # noqa: E731
    have = {sid: c.get(key(sid), e) for sid, (s, e) in need.items()}
    missing = [sid for sid, v in have.items() if v is None]
    computed = 0
    if missing:
        with c.compute:
            for sid in missing:  # another request may have computed them meanwhile
                have[sid] = c.get(key(sid), need[sid][1])
            missing = [sid for sid, v in have.items() if v is None]
            if missing:
                mm = b.model()
                seqs = [b.sentence_tokens(b.sentence_row(sid))[:need[sid][1]].tolist() for sid in missing]
                for sid, m in zip(missing, compute(mm, layer, dim, seqs, b.model_lock)):
                    c.put(key(sid), m)
                    have[sid] = m
                computed = len(missing)
    ex, scale = {}, 0.0
    for sid, (s, e) in need.items():
        m = have[sid][s:e]
        vals = [float(f"{x:.6g}") if np.isfinite(x) else None for x in m.tolist()]
        scale = max([scale] + [abs(x) for x in vals if x is not None])
        ex[str(sid)] = {"start": s, "m": vals}
    return {"layer": layer, "dim": dim, "scale": scale, "examples": ex, "computed": computed,
            "seconds": round(time.time() - t0, 3)}


def parse_memory(v: str | None) -> tuple[int, int] | None:
    """`L/D` (or `L:D`) of a sentence page's `?memory=`; '' or absent: None; else 422."""
    if v is None or not str(v).strip():
        return None
    mt = MEMORY.fullmatch(str(v))
    if not mt:
        raise BadQuery(f"memory must be LAYER/DIM, e.g. 2/17 (got {str(v)[:40]!r})")
    return int(mt.group(1)), int(mt.group(2))
