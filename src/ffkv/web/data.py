"""The run as the browser sees it: its tables read once, kept in memory, indexed by memory.

Every table comes through the read API (`ffkv.store.query`): `query.table` for the Arrow tables
held in memory, `query.connect` for a DuckDB connection whose views read the run's Parquet files
and on which the in-memory per-memory table `memories` is registered for searches by measure.
Per-memory lookups (a memory page) are binary searches over the tables sorted by
code = layer × d_m + dim, so a page costs no scan: the default run's 4.6M trigger rows are read
once at startup.

Nothing here writes the run's Parquet tables. The only write is `annotate` (through
`ffkv.store.annotations.AnnotationStore`, i.e. `annotations.sqlite`). The token index
(`value_index`, see `ffkv.experiments.value_index`) is read from the run when present, else
built in memory in a background thread on first use; so is the model (`model()`), loaded
lazily the first time something needs it (re-verify, the index, the explorer).
"""
from __future__ import annotations

import math
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ffkv.defs import LENSES
from ffkv.display import read_token
from ffkv.errors import FfkvError
from ffkv.store import query
from ffkv.model import identity

MAX_TOP = 200          # trigger rows per sign a page may ask for
PREFIX_TOKENS = 32     # a long prefix shows its last tokens (the permalink shows the sentence)
ANNOTATE_TOP = 25      # prefixes an annotator reads (the paper's protocol)
PRECISION_K = 50
MUTATIONS = ("first", "last", "random")

# search orders: name -> (column, default direction)
MEASURE_SORTS = {
    "max_prob": ("max_prob", "desc"), "max_prob_neg": ("max_prob_neg", "desc"),
    "precision": ("precision", "desc"), "precision_neg": ("precision_neg", "desc"),
    "agreement": ("rank", "asc"), "target_prob": ("target_prob", "desc"),
    "entropy": ("entropy", "asc"), "coverage": ("coverage", "desc"),
    "patterns": ("n_patterns", "desc"), "coef": ("top_coef", "desc"),
    "layer": ("layer", "asc"),
}
TOKEN_SORTS = {"prob": ("prob", "desc"), "rank": ("rank", "asc"), "max_prob": ("max_prob", "desc"),
               "precision": ("precision", "desc"), "layer": ("layer", "asc")}
TEXT_SORTS = {"count": ("n", "desc"), "rank": ("best_rank", "asc"), "coef": ("best_coef", "desc"),
              "layer": ("layer", "asc")}
LABELS = ("shallow", "semantic", "both", "none")
TOKEN_MATCHES = ("merged", "exact")  # how a typed token finds vocabulary tokens (`Browser.resolve_token`)
MAX_TOKEN_QUERY = 200  # characters of a typed token


class NotFound(FfkvError):
    """An unknown memory, sentence or token: a 404."""


class BadQuery(FfkvError):
    """A malformed query: a 422."""


@dataclass(frozen=True)
class TokenQuery:
    """A token as a user typed it, read: a token id (`#123`, `id:123`) or a token's text."""
    typed: str
    token_id: int | None = None
    text: str | None = None


def parse_token(typed: str | None, what: str = "token") -> TokenQuery:
    """THE parser of a typed token (token search, trigger-token search; the explorer's contrast
    reads its text with the same `ffkv.display.read_token`): `#123` or `id:123` is a token id;
    anything else is a token's text in the notation the pages show tokens in (␣ a space, ↵ a
    newline, → a tab, escapes such as \\n or \\u00e9; see `ffkv.display`). A real space typed
    is a space. Empty, over-long or malformed input is a BadQuery with one line."""
    typed = "" if typed is None else str(typed)
    if len(typed) > MAX_TOKEN_QUERY:
        raise BadQuery(f"{what}: at most {MAX_TOKEN_QUERY} characters")
    m = re.fullmatch(r"\s*(?:#|id:)([0-9]{1,12})\s*", typed, re.ASCII)
    if m:
        return TokenQuery(typed, token_id=int(m.group(1)))
    try:
        text = read_token(typed)
    except ValueError as e:
        raise BadQuery(f"{what}: {e}") from None
    if text == "":
        raise BadQuery(f"{what}: type a token, e.g. Paris or ␣Paris (␣ is a space), or #123 for a token id")
    return TokenQuery(typed, text=text)


# ---- per-memory lookups ----------------------------------------------------------------------------
class ByKey:
    """The rows of a table grouped by memory, code = layer × d_m + dim, without reordering the
    table: `code` is in table order, `order` (None when the table is already sorted by code)
    a stable argsort, so a memory's rows keep the table's order among themselves."""

    def __init__(self, table: pa.Table, d_m: int):
        table = table.combine_chunks()  # one chunk: take() of a few rows stays O(rows)
        code = (table.column("layer").to_numpy().astype(np.int64) * d_m
                + table.column("dim").to_numpy().astype(np.int64))
        if len(code) and code.max() < 2 ** 31:
            code = code.astype(np.int32)
        self.order = None
        if len(code) and np.any(code[1:] < code[:-1]):
            self.order = np.argsort(code, kind="stable").astype(np.int64)
        self.sorted_code = code if self.order is None else code[self.order]
        self.table, self.code, self.d_m = table, code, d_m

    def span(self, layer: int, dim: int) -> tuple[int, int]:
        # the needle in the array's own dtype: a Python int would make numpy cast the whole array
        c = self.sorted_code.dtype.type(int(layer) * self.d_m + int(dim))
        return (int(np.searchsorted(self.sorted_code, c, "left")),
                int(np.searchsorted(self.sorted_code, c, "right")))

    def indices(self, layer: int, dim: int) -> np.ndarray:
        """Row numbers (in table order) of one memory's rows."""
        a, b = self.span(layer, dim)
        return np.arange(a, b) if self.order is None else self.order[a:b]

    def slice(self, layer: int, dim: int) -> pa.Table:
        if self.order is None:
            a, b = self.span(layer, dim)
            return self.table.slice(a, b - a)
        return self.table.take(pa.array(self.indices(layer, dim)))

    def rows(self, layer: int, dim: int) -> list[dict]:
        return self.slice(layer, dim).to_pylist()


def _order_by_token(p: dict, by_mem: np.ndarray) -> np.ndarray:
    """Positions (in memory order) sorted by token, rank, memory. The stored table is already in
    that order, so inverting by_mem gives it without a second lexsort; otherwise sort."""
    inv = np.empty_like(by_mem)
    inv[by_mem] = np.arange(len(by_mem))
    t, r, m = p["token"][inv], p["rank"][inv], p["mem"][inv]
    ok = len(t) < 2 or bool(np.all((t[1:] > t[:-1]) | ((t[1:] == t[:-1]) & (
        (r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (m[1:] >= m[:-1]))))))
    return (inv if ok else np.lexsort((p["mem"], p["rank"], p["token"]))).astype(np.int32)


class TokenIndex:
    """The `value_index` table in memory: per (lens, sign), rows sorted by memory and by token."""

    def __init__(self, table: pa.Table, d_m: int, source: str):
        from ffkv.experiments.value_index import index_k

        rk = table.column("rank").to_numpy().astype(np.int16)
        self.k = index_k(table) or (int(rk.max()) + 1 if len(rk) else 0)
        self.source = source
        self.rows = table.num_rows
        self.parts: dict[tuple[str, int], dict] = {}
        lens_names = sorted(pc.unique(table.column("lens")).to_pylist())  # np.unique on strings: 1.4 s
        lens = pc.index_in(table.column("lens"), pa.array(lens_names)).to_numpy(zero_copy_only=False)
        sign = table.column("sign").to_numpy()
        tok = table.column("token").to_numpy().astype(np.int32)
        prob = table.column("prob").to_numpy().astype(np.float32)
        mem = (table.column("layer").to_numpy().astype(np.int32) * np.int32(d_m)
               + table.column("dim").to_numpy().astype(np.int32))
        for li, ln in enumerate(lens_names):
            for s in (1, -1):
                sel = np.nonzero((lens == li) & (sign == s))[0]
                if not len(sel):
                    continue
                p = {"token": tok[sel], "rank": rk[sel], "prob": prob[sel], "mem": mem[sel]}
                by_mem = np.lexsort((p["rank"], p["mem"]))
                p = {c: v[by_mem] for c, v in p.items()}
                p["by_token"] = _order_by_token(p, by_mem)
                p["tok_sorted"] = p["token"][p["by_token"]]
                self.parts[(str(ln), s)] = p
        self.lenses = sorted({ln for ln, _ in self.parts})

    def of_memory(self, lens: str, sign: int, code: int, k: int | None = None) -> list[tuple[int, int, float]]:
        """(token, rank, prob) of one direction, best first, ranks < k."""
        p = self.parts.get((lens, sign))
        if p is None:
            return []
        c = np.int32(code)
        a, b = np.searchsorted(p["mem"], c, "left"), np.searchsorted(p["mem"], c, "right")
        out = [(int(t), int(r), float(q)) for t, r, q in zip(p["token"][a:b], p["rank"][a:b], p["prob"][a:b])]
        return [x for x in out if k is None or x[1] < k]

    def lookup(self, lens: str, sign: int, tokens, k: int) -> dict[str, np.ndarray]:
        """Rows whose token is one of `tokens` with rank < k: arrays mem, token, rank, prob."""
        p = self.parts.get((lens, sign))
        empty = {c: np.zeros(0, np.int64) for c in ("mem", "token", "rank")} | {"prob": np.zeros(0, np.float32)}
        if p is None:
            return empty
        idx = []
        for t in sorted(set(int(x) for x in tokens)):
            t = np.int32(t)
            a, b = np.searchsorted(p["tok_sorted"], t, "left"), np.searchsorted(p["tok_sorted"], t, "right")
            idx.append(p["by_token"][a:b])
        if not idx:
            return empty
        rows = np.concatenate(idx)
        rows = rows[p["rank"][rows] < k]
        return {c: p[c][rows] for c in ("mem", "token", "rank", "prob")}


@dataclass
class IndexState:
    status: str = "absent"  # absent | building | ready | failed
    done: int = 0
    total: int = 0
    error: str = ""
    started: float = 0.0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _num(x: float) -> str:
    return f"{x:.3g}" if x >= 1e-3 or x == 0 else f"2^{math.log2(x):.0f}"


def hist_layout(st: dict | None) -> dict | None:
    """The bins of `key_hist` (`query.stats_layout`: per bin its sign and the |m| bounds
    lo <= |m| < hi, in value order; see `ffkv.mine.stats`), with a label per bin."""
    if not isinstance(st, dict) or not all(isinstance(st.get(k), list) for k in ("sign", "lo", "hi")):
        return None
    labels = []
    for sg, lo, hi in zip(st["sign"], st["lo"], st["hi"]):
        if sg == 0:
            labels.append("m = 0")
        elif hi is None or (isinstance(hi, float) and math.isinf(hi)):
            labels.append(f"m ≥ {_num(lo)}" if sg > 0 else f"m ≤ −{_num(lo)}")
        elif sg > 0:
            labels.append(f"{_num(lo)} ≤ m < {_num(hi)}")
        else:
            labels.append(f"−{_num(hi)} < m ≤ −{_num(lo)}")
    return {"sign": [int(x) for x in st["sign"]], "labels": labels, "n": len(labels)}


def position_buckets(n: int) -> list[str]:
    """Labels of `key_stats.pos_hist`: 0, 1, 2–3, 4–7, …, the last one open."""
    out = ["0"] + [f"{2 ** (b - 1)}" if b == 1 else f"{2 ** (b - 1)}–{2 ** b - 1}" for b in range(1, n)]
    if n > 1:
        out[-1] = f"≥ {2 ** (n - 2)}"
    return out


# ---- the browser's view of a run -------------------------------------------------------------------
class Browser:
    """A run's tables in memory, with what the pages and searches need. Thread-safe for reads."""

    def __init__(self, run_path, *, index_k: int | None = None, log=None):
        from ffkv.store.run import Run

        t0 = time.time()
        self.log = log or (lambda msg: None)
        self.run = Run(run_path)
        self.path = Path(self.run.path)
        self.name = str(run_path)
        query.check_triggers(self.run)
        man = self.run.manifest
        model = man.get("model") or {}
        trig = query.table(self.run, "triggers", columns=list(query.TRIGGER_COLUMNS))
        self.vocab: list[str] = query.vocab_texts(self.run) if self.run.has_table("vocab") else []
        self.L = int(model.get("layers") or (pc.max(trig.column("layer")).as_py() + 1))
        self.d_m = int(model.get("d_m") or (pc.max(trig.column("dim")).as_py() + 1))
        self.V = int(model.get("vocab_size") or len(self.vocab))
        if len(self.vocab) < self.V:
            self.vocab += [f"<{i}>" for i in range(len(self.vocab), self.V)]
        vs = self.run.settings("values") or {}
        self.lens = self.run.step_lens("values")
        corpus = man.get("corpus") or {}
        self.corpus_source = corpus.get("source")
        self.corpus_sha = corpus.get("sha256") or ""
        self.model_id = model.get("model_id") or model.get("model") or "?"
        self.index_k = index_k
        self.has_report = (self.path / "report" / "index.html").exists()

        self._load_sentences()
        self._load_triggers(trig)
        self._load_step_tables(vs)

        # built on first use (or by `warm()` in the background): searches need them, the overview not
        self._lazy_lock = threading.RLock()
        self._con_lock = threading.Lock()

        # lazily: token index, model, annotation store
        self._index: TokenIndex | None = None
        self.index_state = IndexState()
        if self.run.has_table("value_index"):
            self._index = TokenIndex(query.table(self.run, "value_index"), self.d_m, "run")
            self.index_state.status = "ready"
        self._mm = None
        self._mm_lock = threading.Lock()
        self.model_lock = threading.Lock()  # one forward pass at a time
        self._store = None
        self._store_lock = threading.Lock()
        self.load_seconds = round(time.time() - t0, 2)

    def _load_sentences(self) -> None:
        """Sentences sorted by id, their token ids flat with offsets."""
        # sentences: ids sorted, token ids flat with offsets
        cols = [c for c in ("sentence_id", "doc_id", "title", "text", "token_ids")
                if c in query.schema_names(self.run, "sentences")]
        sent = query.table(self.run, "sentences", columns=cols)
        sid = sent.column("sentence_id").to_numpy().astype(np.int64)
        order = np.argsort(sid, kind="stable")
        if np.any(order != np.arange(len(order))):
            sent, sid = sent.take(pa.array(order)), sid[order]
        self.sent, self.sent_ids = sent, sid
        tok_col = sent.column("token_ids").combine_chunks()
        self.tok_offsets = tok_col.offsets.to_numpy().astype(np.int64)
        self.tok_flat = tok_col.values.to_numpy().astype(np.int32)
        self._texts = sent.column("text")
        self._docs = sent.column("doc_id").to_numpy() if "doc_id" in cols else None
        self._titles = sent.column("title") if "title" in cols else None

    def _load_triggers(self, trig) -> None:
        """Triggers grouped by memory, each with its sentence's row."""
        # triggers, grouped by memory; the token at each trigger's position
        self.trig = ByKey(trig, self.d_m)
        t = self.trig.table
        tsid = t.column("sentence_id").to_numpy().astype(np.int64)
        n_sent = len(self.sent_ids)
        if n_sent and self.sent_ids[0] == 0 and self.sent_ids[-1] == n_sent - 1:  # ids 0..N-1: the row is the id
            row = tsid
            ok = (tsid >= 0) & (tsid < n_sent)
        else:
            row = np.searchsorted(self.sent_ids, tsid)
            row[row >= n_sent] = 0
            ok = (self.sent_ids[row] == tsid) if n_sent else np.zeros(len(tsid), bool)
        if not ok.all():
            raise FfkvError(f"{int((~ok).sum())} trigger rows point to sentences missing from the "
                            f"`sentences` table of {self.path}; the run is inconsistent (re-run `ffkv mine`)")
        self.trig_row = row.astype(np.int32)
        self.trig_sign = t.column("sign").to_numpy().astype(np.int8)
        self.trig_rank = t.column("rank").to_numpy().astype(np.int16)
        self.keys = np.nonzero(np.bincount(self.trig.code, minlength=self.L * self.d_m))[0].astype(np.int64)
        self.negative = bool((self.trig_sign == -1).any())

    def _load_step_tables(self, vs: dict) -> None:
        """The other steps' tables, when the run has them."""
        # the other steps' tables, when present
        def opt(name, by_key=True):
            if not self.run.has_table(name):
                return None
            tb = query.table(self.run, name)
            return ByKey(tb, self.d_m) if by_key else tb

        self.values = opt("values")
        self.agreement = opt("values_agreement")
        self.patterns = opt("patterns")
        self.pattern_keys = opt("pattern_keys")
        self.mutations = opt("mutations")
        self.key_stats = opt("key_stats")
        self.key_hist = opt("key_hist")
        self.key_samples = opt("key_samples")
        self.hist_layout = hist_layout(query.stats_layout(self.run))
        self.values_layers = opt("values_layers", False)
        self.compose_layers = opt("compose_layers", False)
        self.patterns_fig2 = opt("patterns_fig2", False)
        self.values_top_k = int(vs.get("top_k") or 10)

    # ---- what is built on first use -----------------------------------------------------------
    def _lazy(self, name: str, make):
        v = self.__dict__.get(name)
        if v is None:
            with self._lazy_lock:
                v = self.__dict__.get(name)
                if v is None:
                    v = make()
                    self.__dict__[name] = v
        return v

    @property
    def memories(self) -> pa.Table:
        """One row per memory of the model: the measures searched by (see `_memories_table`)."""
        return self._lazy("_memories", self._memories_table)

    @property
    def _precision(self) -> tuple[np.ndarray, np.ndarray]:
        return self._lazy("_precision_", lambda: tuple(
            self.memories.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
            for c in ("precision", "precision_neg")))

    @property
    def _con(self):
        def make():
            con = query.connect(self.run)
            con.register("memories", self.memories)
            return con
        return self._lazy("_con_", make)

    def _vocab_index(self, key) -> dict[str, list[int]]:
        """key(token string) -> the token ids with that key (several tokens can share one)."""
        d: dict[str, list[int]] = {}
        for i, s in enumerate(self.vocab):
            d.setdefault(key(s), []).append(i)
        return d

    @property
    def _norm(self) -> dict[str, list[int]]:
        return self._lazy("_norm_", lambda: self._vocab_index(lambda s: s.strip().casefold()))

    @property
    def _exact(self) -> dict[str, list[int]]:
        return self._lazy("_exact_", lambda: self._vocab_index(lambda s: s))

    @property
    def trig_token(self) -> np.ndarray:
        """The token at each trigger's position (table order)."""
        return self._lazy("_trig_token", lambda: self.tok_flat[
            self.tok_offsets[self.trig_row] + self.trig.table.column("position").to_numpy().astype(np.int64)])

    def warm(self) -> None:
        """Build everything that is otherwise built on first use (called in a background thread)."""
        for name in ("memories", "_precision", "_con", "_norm", "_exact", "trig_token", "summaries"):
            getattr(self, name)

    # ---- one-line summaries (`ffkv.web.summary`) ---------------------------------------------
    @property
    def summaries(self):
        """The parts of every memory's one-line summary (`ffkv.web.summary.Summaries`)."""
        from ffkv.web.summary import Summaries

        return self._lazy("_summaries", lambda: Summaries(self))

    @property
    def neighbours_state(self):
        """Similar memories by value and key direction (`ffkv.web.neighbours.Neighbours`)."""
        from ffkv.web.neighbours import Neighbours

        return self._lazy("_neighbours", lambda: Neighbours(self))

    def similar(self, layer: int, dim: int) -> dict:
        """Nearest memories by value direction, key direction and co-activation (`ffkv.web.neighbours`)."""
        from ffkv.web.neighbours import similar

        self.check_key(layer, dim)
        return similar(self, layer, dim)

    def _annotation_parts(self) -> dict[int, dict]:
        from ffkv.web.summary import annotation_part

        by: dict[int, list[dict]] = {}
        for a in self.annotations():
            by.setdefault(self.code(a["layer"], a["dim"]), []).append(a)
        return {c: p for c, recs in by.items() if (p := annotation_part(recs)) is not None}

    def summary(self, layer: int, dim: int) -> str:
        """A memory's one-line summary of measurements (`ffkv.web.summary.summary_line`)."""
        return self.summaries.line(self.code(layer, dim), self._annotation_parts().get(self.code(layer, dim)))

    def add_summaries(self, rows: list[dict]) -> list[dict]:
        """Set `summary` on rows that carry layer and dim (search results, layer lists)."""
        ann = self._annotation_parts() if rows else {}
        for r in rows:
            c = self.code(r["layer"], r["dim"])
            r["summary"] = self.summaries.line(c, ann.get(c))
        return rows

    def search_summary(self, q: str, *, layer: int | None = None, page: int = 1, per_page: int = 50) -> dict:
        """Memories whose one-line summary contains every word of `q` (case folded), by memory."""
        words = (q or "").casefold().split()
        if not words:
            raise BadQuery("text: type a word, e.g. city")
        if len(q) > 200:
            raise BadQuery("text: at most 200 characters")
        if layer is not None and not 0 <= layer < self.L:
            raise BadQuery(f"layer must be in 0..{self.L - 1}")
        page, per_page = self._page(page, per_page)
        sm = self.summaries
        lines = self._lazy("_summary_lines", lambda: {
            int(c): sm.line(int(c)).casefold()
            for c in np.union1d(self.keys, np.asarray(sorted(sm.value), np.int64))})
        ann = self._annotation_parts()
        hits = []
        for c, text in lines.items():
            if c in ann:
                text = sm.line(c, ann[c]).casefold()
            if (layer is None or c // self.d_m == layer) and all(w in text for w in words):
                hits.append(c)
        hits.sort()
        rows = [{"layer": c // self.d_m, "dim": c % self.d_m} for c in hits[(page - 1) * per_page: page * per_page]]
        return {"mode": "text", "text_mode": "summary", "query": q, "layer": layer, "sign": None, "sort": "layer",
                "order": "asc", "page": page, "per_page": per_page, "total": len(hits), "memories": len(hits),
                "triggers_matched": 0, "results": self.add_summaries(rows)}

    # ---- small helpers ------------------------------------------------------------------------
    def check_key(self, layer: int, dim: int) -> None:
        if not (0 <= layer < self.L):
            raise NotFound(f"layer {layer} does not exist: the model has layers 0–{self.L - 1}")
        if not (0 <= dim < self.d_m):
            raise NotFound(f"dim {dim} does not exist: each layer has dims 0–{self.d_m - 1}")

    def code(self, layer: int, dim: int) -> int:
        return int(layer) * self.d_m + int(dim)

    def is_mined(self, layer: int, dim: int) -> bool:
        c = self.code(layer, dim)
        i = np.searchsorted(self.keys, c)
        return bool(i < len(self.keys) and self.keys[i] == c)

    def tok(self, t) -> str | None:
        if t is None:
            return None
        t = int(t)
        return self.vocab[t] if 0 <= t < len(self.vocab) else f"<{t}>"

    def sentence_row(self, sid: int) -> int:
        i = int(np.searchsorted(self.sent_ids, sid))
        if i >= len(self.sent_ids) or self.sent_ids[i] != sid:
            raise NotFound(f"sentence {sid} is not in this run")
        return i

    def sentence_tokens(self, row: int) -> np.ndarray:
        return self.tok_flat[self.tok_offsets[row]:self.tok_offsets[row + 1]]

    def doc_of(self, row: int) -> dict:
        return {"doc_id": int(self._docs[row]) if self._docs is not None else None,
                "title": self._titles[row].as_py() if self._titles is not None else None}

    def neighbours(self, layer: int, dim: int) -> dict:
        """Previous and next mined memory in (layer, dim) order, wrapping around."""
        c = self.code(layer, dim)
        i = int(np.searchsorted(self.keys, c, "left"))
        j = int(np.searchsorted(self.keys, c, "right"))
        prev = self.keys[i - 1] if i > 0 else self.keys[-1]
        nxt = self.keys[j] if j < len(self.keys) else self.keys[0]
        return {"prev": divmod(int(prev), self.d_m), "next": divmod(int(nxt), self.d_m)}

    def random_key(self, rng=random) -> tuple[int, int]:
        return divmod(int(self.keys[rng.randrange(len(self.keys))]), self.d_m)

    # ---- per-memory measures (search by measure) -------------------------------------------------
    def _memories_table(self) -> pa.Table:
        N = self.L * self.d_m
        code = np.arange(N)
        nan = lambda: np.full(N, np.nan, np.float32)  # noqa: E731
        cols: dict[str, np.ndarray] = {"layer": (code // self.d_m).astype(np.int16),
                                       "dim": (code % self.d_m).astype(np.int32)}
        mined = np.zeros(N, bool)
        mined[self.keys] = True
        cols["mined"] = mined
        n_trig = np.bincount(self.trig.code, minlength=N)[:N]
        cols["n_triggers"] = n_trig.astype(np.int32)
        top_coef = nan()
        first = (self.trig_sign == 1) & (self.trig_rank == 1)
        top_coef[self.trig.code[first]] = self.trig.table.column("coef").to_numpy()[first]
        cols["top_coef"] = top_coef
        masks = {}
        top_tok = {"value": np.full(N, -1, np.int64), "neg_value": np.full(N, -1, np.int64)}
        for kind in ("value", "neg_value"):
            mp, en = nan(), nan()
            if self.values is not None:
                vt = self.values.table
                sel = pc.equal(vt.column("kind"), kind)
                sub = vt.filter(sel)
                c = (sub.column("layer").to_numpy().astype(np.int64) * self.d_m
                     + sub.column("dim").to_numpy().astype(np.int64))
                mp[c] = sub.column("max_prob").to_numpy()
                en[c] = sub.column("entropy").to_numpy()
                first_tok = pc.list_element(sub.column("top_tokens"), 0).to_numpy(zero_copy_only=False)
                top_tok[kind][c] = first_tok.astype(np.int64)
            suffix = "" if kind == "value" else "_neg"
            cols["max_prob" + suffix] = mp
            cols["entropy" + suffix] = en
            cols["top_token" + suffix] = top_tok[kind].astype(np.int32)
            masks["top_token" + suffix] = top_tok[kind] < 0
        cols.update(self._precision_at_k(top_tok, N))
        agree = np.zeros(N, bool)
        agree_null = np.ones(N, bool)
        rank = np.full(N, -1, np.int64)
        tprob = nan()
        if self.agreement is not None:
            at = self.agreement.table
            c = self.agreement.code
            a = at.column("agree")
            agree_null[c] = a.is_null().to_numpy(zero_copy_only=False)
            agree[c] = a.fill_null(False).to_numpy(zero_copy_only=False)
            rank[c] = at.column("rank").fill_null(-1).to_numpy()
            tprob[c] = at.column("target_prob").fill_null(np.nan).to_numpy()
        label = np.full(N, None, object)
        n_pat = np.zeros(N, np.int32)
        cov = nan()
        if self.pattern_keys is not None:
            pk = self.pattern_keys.table
            sel = pc.equal(pk.column("sign"), 1)
            sub = pk.filter(sel)
            c = (sub.column("layer").to_numpy().astype(np.int64) * self.d_m
                 + sub.column("dim").to_numpy().astype(np.int64))
            label[c] = sub.column("label").to_numpy(zero_copy_only=False)
            n_pat[c] = sub.column("n_patterns").to_numpy()
            cov[c] = sub.column("coverage").to_numpy()
        arrays = {k: pa.array(v) for k, v in cols.items() if not k.startswith("top_token")}
        for k in ("top_token", "top_token_neg"):
            arrays[k] = pa.array(cols[k], mask=masks[k])
        arrays["agree"] = pa.array(agree, mask=agree_null)
        arrays["rank"] = pa.array(rank, pa.int32(), mask=rank < 0)
        arrays["target_prob"] = pa.array(tprob, mask=np.isnan(tprob))
        arrays["label"] = pa.array(label.tolist(), pa.string())
        arrays["n_patterns"] = pa.array(n_pat)
        arrays["coverage"] = pa.array(cov, mask=np.isnan(cov))
        for k in ("max_prob", "max_prob_neg", "entropy", "entropy_neg", "precision", "precision_neg", "top_coef"):
            arrays[k] = pa.array(cols[k], mask=np.isnan(cols[k]))
        return pa.table(arrays)

    def _precision_at_k(self, top_tok: dict, N: int) -> dict:
        """precision@50: share of a key's rank ≤ 50 triggers (sign +1 for v, −1 for −v) whose
        next token is the direction's top token (the values step's Table 2 definition)."""
        out = {}
        nxt = self.trig.table.column("next_token").fill_null(-1).to_numpy().astype(np.int64)
        for s, kind, name in ((1, "value", "precision"), (-1, "neg_value", "precision_neg")):
            sel = (self.trig_sign == s) & (self.trig_rank <= PRECISION_K)
            c = self.trig.code[sel]
            hit = (nxt[sel] == top_tok[kind][c]) & (top_tok[kind][c] >= 0)
            n = np.bincount(c, minlength=N)[:N]
            h = np.bincount(c, weights=hit, minlength=N)[:N]
            with np.errstate(invalid="ignore", divide="ignore"):
                pr = np.where((n > 0) & (top_tok[kind] >= 0), h / np.maximum(n, 1), np.nan)
            out[name] = pr.astype(np.float32)
        return out

    def measures(self, layer: int, dim: int) -> dict:
        return self.memories.slice(self.code(layer, dim), 1).to_pylist()[0]

    # ---- the token index ---------------------------------------------------------------------
    def token_index(self, start: bool = True) -> TokenIndex | None:
        """The index when ready; else starts building it (in a thread) and returns None."""
        if self._index is not None:
            return self._index
        if start:
            self.start_index()
        return None

    def start_index(self) -> None:
        st = self.index_state
        with st.lock:
            if st.status in ("building", "ready"):
                return
            st.status, st.done, st.total, st.error, st.started = "building", 0, 0, "", time.time()
        threading.Thread(target=self._build_index, name="ffkv-value-index", daemon=True).start()

    def _build_index(self) -> None:
        from ffkv.experiments.value_index import DEFAULT_K, build_index

        st = self.index_state
        try:
            mm = self.model()

            def progress(done, total):
                st.done, st.total = done, total

            # weights only (no hooks, no forward pass): no need to hold `model_lock`
            table = build_index(mm, k=self.index_k or DEFAULT_K, progress=progress)
            self._index = TokenIndex(table, self.d_m, "built in memory")
            st.status, st.seconds = "ready", round(time.time() - st.started, 1)
            self.log(f"token index built in memory in {st.seconds} s ({table.num_rows:,} rows)")
        except Exception as e:  # noqa: BLE001 - shown on the search page, logged
            st.status, st.error = "failed", " ".join(str(e).split())[:300] or type(e).__name__
            self.log(f"token index failed: {st.error}")

    def wait_index(self, timeout: float = 600) -> TokenIndex:
        """Start (if needed) and wait for the index; for tests and benchmarks."""
        self.start_index()
        t = time.time()
        while self._index is None:
            if self.index_state.status == "failed":
                raise FfkvError(f"token index failed: {self.index_state.error}")
            if time.time() - t > timeout:
                raise FfkvError("token index: timed out")
            time.sleep(0.05)
        return self._index

    # ---- the model ---------------------------------------------------------------------------
    def model(self):
        """The run's model, loaded on first use (CPU), shared by every page."""
        if self._mm is None:
            with self._mm_lock:
                if self._mm is None:
                    from ffkv.model.load import quiet_hf

                    quiet_hf()
                    t = time.time()
                    self._mm = identity.open_model(self.run, device="cpu")
                    self.log(f"model loaded in {time.time() - t:.1f} s")
        return self._mm

    @property
    def model_loaded(self) -> bool:
        return self._mm is not None

    # ---- annotations -------------------------------------------------------------------------
    def store(self, create: bool = True):
        """The run's AnnotationStore (None when there is none yet and `create` is False)."""
        if self._store is None:
            if not create and not (self.path / "annotations.sqlite").exists():
                return None
            with self._store_lock:
                if self._store is None:
                    from ffkv.store.annotations import AnnotationStore

                    self._store = AnnotationStore(self.run)
        return self._store

    def annotations(self, layer=None, dim=None) -> list[dict]:
        st = self.store(create=False)
        if st is None:
            return []
        kw = {k: v for k, v in (("layer", layer), ("dim", dim)) if v is not None}
        return st.list(**kw)

    def annotate(self, annotator, layer, dim, patterns, sign=1, note="") -> dict:
        st = self.store()
        st.add_annotation(annotator, layer, dim, patterns, sign=sign, note=note)
        return next(r for r in st.list(layer=layer, dim=dim)
                    if r["annotator"] == annotator.strip() and r["sign"] == sign)

    def annotation_stats(self) -> dict | None:
        st = self.store(create=False)
        return st.stats() if st is not None else None

    def n_prefixes(self, layer: int, dim: int, sign: int) -> int:
        idx = self.trig.indices(layer, dim)
        return int(((self.trig_sign[idx] == sign) & (self.trig_rank[idx] <= ANNOTATE_TOP)).sum())

    # ---- a memory page -----------------------------------------------------------------------
    def prefix(self, row: int, position: int) -> dict:
        """A prefix's text (its tokens' decoded texts joined): `full`, and for display its last
        PREFIX_TOKENS tokens as `head` + `trigger` (the last token), `cut` when shortened."""
        vocab = self.vocab
        texts = [vocab[t] for t in self.sentence_tokens(row)[: position + 1].tolist()]
        cut = max(0, len(texts) - PREFIX_TOKENS)
        return {"head": "".join(texts[cut:-1]), "trigger": texts[-1] if texts else "",
                "cut": cut > 0, "full": "".join(texts)}

    def value_ranks(self, layer: int, dim: int, sign: int, lens: str | None = None):
        """token -> rank of a direction (+v: sign 1, −v: −1) and the bound below which ranks are
        known: from the token index when ready, else from the `values` table (top_k tokens)."""
        lens = lens or self.lens
        if self._index is not None and (lens, sign) in self._index.parts:
            got = self._index.of_memory(lens, sign, self.code(layer, dim))
            return {t: r for t, r, _ in got}, self._index.k, "index"
        if self.values is not None and lens == self.lens:
            kind = "value" if sign == 1 else "neg_value"
            for r in self.values.rows(layer, dim):
                if r["kind"] == kind:
                    out: dict[int, int] = {}
                    for j, t in enumerate(r["top_tokens"]):
                        out.setdefault(int(t), j)
                    return out, len(r["top_tokens"]), "values"
        return {}, 0, None

    def memory(self, layer: int, dim: int, top: int = 25, all_samples: bool = True) -> dict:
        """Everything a memory page shows, as plain data (the JSON API returns it as is)."""
        self.check_key(layer, dim)
        top = max(1, min(int(top), MAX_TOP))
        mined = self.is_mined(layer, dim)
        values_rows = self.values.rows(layer, dim) if self.values is not None else []
        if not mined and not values_rows:
            raise NotFound(f"memory {layer}/{dim} has no triggers and no values in this run "
                           f"(mined: {len(self.keys):,} of {self.L * self.d_m:,} memories)")
        idx = self.trig.indices(layer, dim)
        trig = self.trig.table.take(pa.array(idx)).to_pylist()
        srows = self.trig_row[idx].tolist()
        muts: dict[tuple[int, int], dict] = {}
        if self.mutations is not None:
            for m in self.mutations.rows(layer, dim):
                muts.setdefault((m["sign"], m["rank"]), {})[m["mutation"]] = m["rel_change"]
        pats = self.patterns.rows(layer, dim) if self.patterns is not None else []
        covered: dict[tuple[int, int], list[int]] = {}
        for p in pats:
            for i in p["covered"] or []:
                covered.setdefault((p["sign"], i + 1), []).append(p["pattern_id"])
        ranks = {s: self.value_ranks(layer, dim, s) for s in (1, -1)}
        triggers: dict[str, list[dict]] = {"+": [], "-": []}
        for j in sorted(range(len(trig)), key=lambda j: (-trig[j]["sign"], trig[j]["rank"])):
            r, row = trig[j], srows[j]
            key = "+" if r["sign"] == 1 else "-"
            if len(triggers[key]) >= top:
                continue
            nt = r["next_token"]
            # the direction this trigger writes: +v when its coefficient is ≥ 0, else −v
            direction = 1 if (r["coef"] or 0) >= 0 else -1
            rk, bound, src = ranks[direction]
            badge = None
            if nt is not None and src is not None:
                badge = {"rank": rk.get(int(nt)), "bound": bound, "direction": direction, "source": src}
            triggers[key].append({
                **r, "prefix": self.prefix(row, r["position"]), "next_token_text": self.tok(nt),
                **self.doc_of(row), "badge": badge, "mutations": muts.get((r["sign"], r["rank"])),
                "patterns": covered.get((r["sign"], r["rank"]), []),
                "permalink": self.permalink(r["sentence_id"], r["position"])})
        views = self.vocab_views(layer, dim)
        vals = {}
        for v in values_rows:
            vals[v["kind"]] = {"max_prob": v["max_prob"], "entropy": v["entropy"],
                               "tokens": [{"token": int(t), "text": self.tok(t), "prob": float(p)}
                                          for t, p in zip(v["top_tokens"], v["top_probs"])]}
        agreement = self.agreement.rows(layer, dim) if self.agreement is not None else []
        agreement = agreement[0] if agreement else None
        if agreement is not None:
            agreement = {**agreement, "next_token_text": self.tok(agreement.get("next_token")),
                         "value_top_text": self.tok(agreement.get("value_top"))}
        pk = self.pattern_keys.rows(layer, dim) if self.pattern_keys is not None else []
        mut_summary = []
        if self.mutations is not None:
            mrows = self.mutations.rows(layer, dim)
            for kind in MUTATIONS:
                xs = np.array([m["rel_change"] for m in mrows if m["mutation"] == kind
                               and m["rel_change"] is not None and not math.isnan(m["rel_change"])])
                if len(xs):
                    mut_summary.append({"mutation": kind, "n": int(len(xs)), "mean": float(xs.mean()),
                                        "median": float(np.median(xs)), "share_lower": float((xs < 0).mean())})
        c = self.code(layer, dim)
        prec = {"k": PRECISION_K, "value": _f(self._precision[0][c]), "neg_value": _f(self._precision[1][c])}
        return {
            "layer": layer, "dim": dim, "mined": mined, "lens": self.lens, "top": top,
            "model": self.model_id, "corpus_sha256": self.corpus_sha, "negative": self.negative,
            "triggers": triggers, "n_triggers": {"+": int(sum(1 for r in trig if r["sign"] == 1)),
                                                 "-": int(sum(1 for r in trig if r["sign"] == -1))},
            "values": vals, "vocab_views": views, "agreement": agreement,
            "precision": prec,
            "patterns": pats, "pattern_keys": pk, "mutations": mut_summary,
            "annotations": self.annotations(layer, dim),
            "stats": self.key_statistics(layer, dim, all_samples),
            "summary": self.summary(layer, dim),
            "similar": self.similar(layer, dim),
            "links": {**{k: {"layer": v[0], "dim": v[1]} for k, v in self.neighbours(layer, dim).items()}}
            if len(self.keys) else {},
        }

    def vocab_views(self, layer: int, dim: int, n: int = 10) -> dict:
        """Top tokens of +v and of −v (= the bottom of +v) under each lens the index has; without
        the index, the run's lens from the `values` table."""
        out = {"source": None, "k": None, "lenses": {}}
        idx = self._index
        if idx is not None:
            out["source"], out["k"] = idx.source, idx.k
            for ln in idx.lenses:
                out["lenses"][ln] = {
                    ("+v" if s == 1 else "-v"): [{"token": t, "text": self.tok(t), "rank": r, "prob": p}
                                                 for t, r, p in idx.of_memory(ln, s, self.code(layer, dim))[:n]]
                    for s in (1, -1)}
            return out
        if self.values is not None:
            out["source"], out["k"] = "values", self.values_top_k
            d = {}
            for v in self.values.rows(layer, dim):
                if v["kind"] in ("value", "neg_value"):
                    d["+v" if v["kind"] == "value" else "-v"] = [
                        {"token": int(t), "text": self.tok(t), "rank": j, "prob": float(p)}
                        for j, (t, p) in enumerate(zip(v["top_tokens"][:n], v["top_probs"][:n]))]
            if d:
                out["lenses"][self.lens] = d
        return out

    def key_statistics(self, layer: int, dim: int, all_samples: bool = True) -> dict | None:
        """The key-statistics tables of `ffkv mine` for one key (None when the run has none):
        summary rows per sign, the signed histogram, the positions of each sentence's best
        coefficient, and sample prefixes per histogram bin (strongest first)."""
        if self.key_stats is None and self.key_hist is None and self.key_samples is None:
            return None
        lay = self.hist_layout
        label = (lambda b: lay["labels"][b] if lay and 0 <= b < lay["n"] else f"bin {b}")  # noqa: E731
        out: dict = {"stats": [], "hist": None, "samples": [], "n_samples": 0}
        if self.key_stats is not None:
            for r in self.key_stats.rows(layer, dim):
                ph = r.pop("pos_hist", None)
                if ph is not None:
                    r["positions"] = [{"bucket": b, "count": int(c)} for b, c in zip(position_buckets(len(ph)), ph)]
                out["stats"].append(r)
        if self.key_hist is not None:
            rows = self.key_hist.rows(layer, dim)
            if rows:
                n = lay["n"] if lay else max(r["bin"] for r in rows) + 1
                counts = [0] * n
                for r in rows:
                    if 0 <= r["bin"] < n:
                        counts[r["bin"]] += int(r["count"])
                occ = [b for b, c in enumerate(counts) if c]
                zero = lay["sign"].index(0) if lay and 0 in lay["sign"] else None
                lo, hi = min(occ + ([zero] if zero is not None else [])), max(occ + ([zero] if zero is not None else []))
                out["hist"] = {"counts": counts, "labels": [label(b) for b in range(n)],
                               "sign": lay["sign"] if lay else None, "shown": [lo, hi], "total": sum(counts)}
        if self.key_samples is not None:
            rows = self.key_samples.rows(layer, dim)
            order = sorted(range(len(rows)), key=lambda j: (-(rows[j].get("sign") or 0),
                                                            -(rows[j].get("sign") or 1) * rows[j].get("bin", 0), j))
            out["n_samples"] = len(rows)
            seen = set()
            for j in order:
                r = rows[j]
                level = (r.get("sign"), r.get("bin"))
                if not all_samples and level in seen:
                    continue
                seen.add(level)
                try:
                    srow = self.sentence_row(int(r["sentence_id"]))
                except (NotFound, KeyError, TypeError):
                    continue
                out["samples"].append({**r, "level": label(int(r.get("bin", -1))),
                                       "prefix": self.prefix(srow, int(r["position"])),
                                       "permalink": self.permalink(r["sentence_id"], r["position"])})
        return out

    def permalink(self, sentence_id: int, position: int) -> str:
        q = f"?pos={int(position)}"
        if self.corpus_sha:
            q += f"&corpus={self.corpus_sha[:12]}"
        return f"/sentence/{int(sentence_id)}{q}#t{int(position)}"

    # ---- a sentence (provenance) ---------------------------------------------------------------
    def sentence(self, sid: int, pos: int | None = None, top: int = 200) -> dict:
        row = self.sentence_row(sid)
        toks = self.sentence_tokens(row)
        if pos is not None and not (0 <= pos < len(toks)):
            raise NotFound(f"sentence {sid} has {len(toks)} tokens; position {pos} does not exist")
        sel = np.nonzero(self.trig_row == row)[0]
        t = self.trig.table.take(pa.array(sel)).to_pylist() if len(sel) else []
        t.sort(key=lambda r: (r["position"] != pos, r["rank"], r["layer"], r["dim"]))
        return {"sentence_id": int(sid), **self.doc_of(row), "text": self._texts[row].as_py(),
                "tokens": [{"i": i, "token": int(x), "text": self.tok(x)} for i, x in enumerate(toks)],
                "position": pos, "corpus_source": self.corpus_source, "corpus_sha256": self.corpus_sha,
                "triggers": t[:top], "n_triggers": len(t)}

    # ---- search ------------------------------------------------------------------------------
    def resolve_token(self, q: str | TokenQuery, match: str = "merged") -> list[int]:
        """Token ids a typed token names (`parse_token`): a token id; or, match `exact`, the
        tokens whose decoded text is exactly the text read; match `merged`, those and the ones
        equal to it with surrounding whitespace ignored and case folded (␣which finds ␣which,
        which, ␣Which, Which)."""
        if match not in TOKEN_MATCHES:
            raise BadQuery(f"match must be {' or '.join(TOKEN_MATCHES)} (got {match!r})")
        tq = q if isinstance(q, TokenQuery) else parse_token(q)
        if tq.token_id is not None:
            if not 0 <= tq.token_id < self.V:
                raise NotFound(f"token id {tq.token_id} is outside the vocabulary (0–{self.V - 1})")
            return [tq.token_id]
        ids = set(self._exact.get(tq.text, []))
        if match == "merged":
            ids |= set(self._norm.get(tq.text.strip().casefold(), []))
        return sorted(ids)

    def suggest(self, q: str, n: int = 12) -> list[int]:
        k = q.strip().casefold()  # q: the text read from the typed token
        if not k:
            return []
        out = [i for i, s in enumerate(self.vocab) if s.strip().casefold().startswith(k)]
        return sorted(out, key=lambda i: (len(self.vocab[i].strip()), i))[:n]

    @staticmethod
    def _order(sorts: dict, sort: str | None, order: str | None, default: str) -> tuple[str, str, str]:
        sort = sort or default
        if sort not in sorts:
            raise BadQuery(f"sort must be one of {', '.join(sorts)} (got {sort!r})")
        col, direction = sorts[sort]
        if order is not None:
            if order not in ("asc", "desc"):
                raise BadQuery(f"order must be asc or desc (got {order!r})")
            direction = order
        return sort, col, direction

    @staticmethod
    def _page(page: int, per_page: int) -> tuple[int, int]:
        if page < 1:
            raise BadQuery("page must be ≥ 1")
        if not 1 <= per_page <= 500:
            raise BadQuery("per_page must be in 1..500")
        return page, per_page

    def search_token(self, q: str, *, k: int = 10, lens: str | None = None, direction: str = "promote",
                     layer: int | None = None, sort: str | None = None, order: str | None = None,
                     page: int = 1, per_page: int = 50, match: str = "merged") -> dict:
        """Memories whose value ranks a token within k (promote: +v; suppress: −v); by default
        the value's probability of the token first."""
        lens = lens or self.lens
        if lens not in LENSES:
            raise BadQuery(f"lens must be naive or norm (got {lens!r})")
        if direction not in ("promote", "suppress"):
            raise BadQuery(f"dir must be promote or suppress (got {direction!r})")
        sort, col, how = self._order(TOKEN_SORTS, sort, order, "prob")
        page, per_page = self._page(page, per_page)
        tq = parse_token(q)
        if layer is not None and not 0 <= layer < self.L:
            raise BadQuery(f"layer must be in 0..{self.L - 1}")
        ids = self.resolve_token(tq, match)
        base = {"mode": "token", "query": q, "read": tq.text, "match": match,
                "tokens": [{"token": t, "text": self.tok(t)} for t in ids],
                "k": k, "lens": lens, "dir": direction, "sort": sort, "order": how, "page": page,
                "per_page": per_page, "layer": layer}
        if not ids:
            return {**base, "status": "no_token", "total": 0, "results": [],
                    "suggestions": [{"token": t, "text": self.tok(t)} for t in self.suggest(tq.text or "")]}
        idx = self.token_index()
        if idx is None:
            st = self.index_state
            return {**base, "status": st.status, "total": 0, "results": [], "index": self.index_status()}
        if not 1 <= k <= idx.k:
            raise BadQuery(f"k must be in 1..{idx.k} (the token index keeps ranks below {idx.k})")
        if lens not in idx.lenses:
            raise BadQuery(f"the token index has lenses {', '.join(idx.lenses)}, not {lens}")
        hit = idx.lookup(lens, 1 if direction == "promote" else -1, ids, k)
        mem = hit["mem"]
        if layer is not None:
            keep = (mem // self.d_m) == layer
            hit = {c: v[keep] for c, v in hit.items()}
            mem = hit["mem"]
        meas = self.memories
        mp = meas.column("max_prob").to_numpy(zero_copy_only=False)
        prec = meas.column("precision").to_numpy(zero_copy_only=False)
        cols = {"layer": mem // self.d_m, "dim": mem % self.d_m, "token": hit["token"], "rank": hit["rank"],
                "prob": hit["prob"], "max_prob": mp[mem] if len(mem) else np.zeros(0),
                "precision": prec[mem] if len(mem) else np.zeros(0)}
        key = cols[col].astype(np.float64)
        key = np.where(np.isnan(key), np.inf, key if how == "asc" else -key)
        order_ = np.lexsort((cols["dim"], cols["layer"], cols["rank"], key))
        total = len(order_)
        sel = order_[(page - 1) * per_page: page * per_page]
        mined = self.memories.column("mined").to_numpy(zero_copy_only=False)
        results = [{"layer": int(cols["layer"][i]), "dim": int(cols["dim"][i]), "token": int(cols["token"][i]),
                    "token_text": self.tok(cols["token"][i]), "rank": int(cols["rank"][i]),
                    "prob": float(cols["prob"][i]), "max_prob": _f(cols["max_prob"][i]),
                    "precision": _f(cols["precision"][i]), "mined": bool(mined[mem[i]])} for i in sel]
        return {**base, "status": "ready", "total": total, "memories": int(len(np.unique(mem))),
                "results": results, "index_k": idx.k,
                "index_source": idx.source}

    def index_status(self) -> dict:
        st = self.index_state
        return {"status": st.status if self._index is None else "ready", "done": st.done, "total": st.total,
                "error": st.error, "k": self._index.k if self._index is not None else None,
                "source": self._index.source if self._index is not None else None,
                "model_loaded": self.model_loaded}

    def _sql(self, q: str, params=None) -> pa.Table:
        with self._con_lock:
            return self._con.sql(q, params=params or None).to_arrow_table()

    def search_text(self, q: str, *, mode: str = "word", sign: int | None = None, layer: int | None = None,
                    sort: str | None = None, order: str | None = None, page: int = 1,
                    per_page: int = 50) -> dict:
        """Memories with triggers whose prefix contains a word (mode word), or whose trigger token
        is a token (mode token: the decoded token, spaces ignored, case folded); mode summary:
        memories whose one-line summary contains the words (`search_summary`)."""
        if mode == "summary":
            return self.search_summary(q, layer=layer, page=page, per_page=per_page)
        if mode not in ("word", "token"):
            raise BadQuery(f"mode must be word, token or summary (got {mode!r})")
        if sign not in (None, 1, -1):
            raise BadQuery("sign must be 1 or -1")
        if layer is not None and not 0 <= layer < self.L:
            raise BadQuery(f"layer must be in 0..{self.L - 1}")
        q = q or ""
        if mode == "word" and not q.strip():
            raise BadQuery("text: type a word, e.g. city")
        if len(q) > 200:
            raise BadQuery("text: at most 200 characters")
        sort, col, how = self._order(TEXT_SORTS, sort, order, "count")
        page, per_page = self._page(page, per_page)
        if mode == "token":  # the trigger token, typed as in token search (merged)
            ids = self.resolve_token(parse_token(q, "text"), "merged")
            sel = np.nonzero(np.isin(self.trig_token, np.asarray(ids, np.int64)))[0] if ids else np.zeros(0, np.int64)
        else:  # the run's text index (`ffkv.web.textindex`), or the reference scan when it is off
            from ffkv.web import textindex

            ti = textindex.get(self)
            sel = ti.word_hits(q) if ti is not None else self._word_hits(q)
        if len(sel) and sign is not None:
            sel = sel[self.trig_sign[sel] == sign]
        if len(sel) and layer is not None:
            sel = sel[(self.trig.code[sel] // self.d_m) == layer]
        base = {"mode": "text", "text_mode": mode, "query": q, "sign": sign, "layer": layer, "sort": sort,
                "order": how, "page": page, "per_page": per_page, "triggers_matched": int(len(sel))}
        if not len(sel):
            return {**base, "total": 0, "memories": 0, "results": []}
        if mode == "word" and ti is not None:
            g = ti.groups(sel, col, how)
        else:
            hits = self.trig.table.take(pa.array(sel, pa.int64())).select(
                ["layer", "dim", "sign", "rank", "coef", "sentence_id", "position"])
            with self._con_lock:
                self._con.register("hits", hits)
                try:
                    g = self._con.sql(
                        f"""SELECT layer, dim, sign, count(*) AS n, min(rank) AS best_rank,
                                   arg_min(coef, rank) AS best_coef, arg_min(sentence_id, rank) AS sentence_id,
                                   arg_min(position, rank) AS position
                            FROM hits GROUP BY layer, dim, sign
                            ORDER BY {col} {how.upper()} NULLS LAST, layer, dim, sign DESC""").to_arrow_table()
                finally:
                    self._con.unregister("hits")
        total = g.num_rows  # rows: (memory, list) pairs, a memory's two lists apart
        codes = g.column("layer").to_numpy().astype(np.int64) * self.d_m + g.column("dim").to_numpy()
        rows = g.slice((page - 1) * per_page, per_page).to_pylist()
        for r in rows:
            srow = self.sentence_row(r["sentence_id"])
            r["prefix"] = self.prefix(srow, r["position"])
            r["permalink"] = self.permalink(r["sentence_id"], r["position"])
        return {**base, "total": total, "memories": int(len(np.unique(codes))), "results": rows}

    def _word_hits(self, q: str) -> np.ndarray:
        """Trigger rows whose prefix text contains `q` as a whole word (case-insensitive).

        A prefix's text is its tokens' decoded texts joined (the `vocab` table's `text`), so it
        can end inside a corpus word: "The" is a word of the prefix "The" cut from "Then". With
        e_p the end of token p: prefix p contains the word when some occurrence not preceded by a
        word character ends at or before e_p and is followed there by a non-word character (or
        e_p itself, the prefix's end).
        """
        words = q.strip()
        occ = re.compile(r"(?<!\w)(?=(" + re.escape(words) + r"))", re.IGNORECASE)
        rough = re.compile(re.escape(words), re.IGNORECASE)
        big = np.iinfo(np.int64).max
        first = np.full(len(self.sent_ids), big, np.int64)  # first position of a whole-word match
        extra: list[int] = []  # row * 2^32 + position: prefixes cut right after an occurrence
        texts = self._texts.to_pylist() if len(self.sent_ids) < 200_000 else None
        for row in range(len(self.sent_ids)):
            text = texts[row] if texts is not None else self._texts[row].as_py()
            if not rough.search(text or ""):
                continue
            pieces = [self.tok(t) for t in self.sentence_tokens(row)]
            s = "".join(pieces)
            ends = np.cumsum([len(p) for p in pieces])
            for m in occ.finditer(s):
                e = m.start() + len(m.group(1))
                if e >= len(s) or not (s[e].isalnum() or s[e] == "_"):
                    first[row] = min(first[row], int(np.searchsorted(ends, e, "left")))
                else:
                    p = int(np.searchsorted(ends, e, "left"))
                    if p < len(ends) and ends[p] == e:
                        extra.append(row * (1 << 32) + p)
        tpos = self.trig.table.column("position").to_numpy().astype(np.int64)
        hit = tpos >= first[self.trig_row]
        if extra:
            hit |= np.isin(self.trig_row.astype(np.int64) * (1 << 32) + tpos, np.asarray(extra, np.int64))
        return np.nonzero(hit)[0]

    def search_measure(self, *, sort: str | None = None, order: str | None = None, layer: int | None = None,
                       label: str | None = None, agree: bool | None = None, mined_only: bool = True,
                       page: int = 1, per_page: int = 50) -> dict:
        """Memories ordered by a measure (value max-probability, precision@50, agreement, …)."""
        sort, col, how = self._order(MEASURE_SORTS, sort, order, "max_prob")
        page, per_page = self._page(page, per_page)
        where, params = [], []
        if mined_only:
            where.append("mined")
        if layer is not None:
            if not 0 <= layer < self.L:
                raise BadQuery(f"layer must be in 0..{self.L - 1}")
            where.append("layer = ?")
            params.append(layer)
        if label is not None:
            if label not in LABELS:
                raise BadQuery(f"label must be one of {', '.join(LABELS)}")
            where.append("label = ?")
            params.append(label)
        if agree is not None:
            where.append("agree = ?")
            params.append(bool(agree))
        w = (" WHERE " + " AND ".join(where)) if where else ""
        total = self._sql(f"SELECT count(*) AS n FROM memories{w}", params).column("n")[0].as_py()
        rows = self._sql(f"SELECT * FROM memories{w} ORDER BY {col} {how.upper()} NULLS LAST, layer, dim "
                         f"LIMIT {int(per_page)} OFFSET {int((page - 1) * per_page)}", params).to_pylist()
        for r in rows:
            r["top_token_text"] = self.tok(r["top_token"])
            r["top_token_neg_text"] = self.tok(r["top_token_neg"])
        return {"mode": "measure", "sort": sort, "order": how, "layer": layer, "label": label, "agree": agree,
                "page": page, "per_page": per_page, "total": int(total), "results": rows}

    # ---- the overview ------------------------------------------------------------------------
    def overview(self) -> dict:
        rows = [{"layer": l} for l in range(self.L)]
        mined = np.bincount(self.keys // self.d_m, minlength=self.L)
        for r in rows:
            r["mined"] = int(mined[r["layer"]])
        if self.values_layers is not None:
            for v in self.values_layers.to_pylist():
                if 0 <= v["layer"] < self.L:
                    rows[v["layer"]]["agreement"] = {k: v.get(k) for k in (
                        "agreement", "ci_low", "ci_high", "shuffled", "n", "n_agree", "rank_median")}
        if self.compose_layers is not None:
            for v in self.compose_layers.to_pylist():
                if v.get("lens", self.lens) == self.lens and 0 <= v["layer"] < self.L:
                    rows[v["layer"]]["active"] = {"mean": v.get("active_mean"), "eps": v.get("active_eps_mean")}
        elif self.key_stats is not None and ({"frac_active", "frac_pos"} & set(self.key_stats.table.column_names)):
            # the density of m > 0 per key (key_stats of `ffkv mine`), averaged over the layer's keys
            ks = self.key_stats.table
            col = "frac_active" if "frac_active" in ks.column_names else "frac_pos"
            if "sign" in ks.column_names:
                ks = ks.filter(pc.equal(ks.column("sign"), 1))
            lay = ks.column("layer").to_numpy()
            fp = ks.column(col).to_numpy(zero_copy_only=False).astype(np.float64)
            for l in range(self.L):
                x = fp[lay == l]
                if len(x):
                    rows[l]["active"] = {"mean": float(np.nanmean(x)), "eps": None, "source": "key_stats"}
        if self.patterns_fig2 is not None:
            f2 = self.patterns_fig2.to_pylist()
            scopes = {r["scope"] for r in f2}
            scope = "all" if "all" in scopes else (sorted(scopes)[0] if scopes else None)
            for v in f2:
                if v["scope"] == scope and 0 <= v["layer"] < self.L:
                    rows[v["layer"]]["patterns"] = {k: v.get(k) for k in (
                        "shallow", "semantic", "both", "not_covered", "keys", "patterns_per_key", "keys_with_pattern")}
                    rows[v["layer"]]["patterns"]["scope"] = scope
        ann = self.annotations()
        per = {}
        for a in ann:
            per.setdefault(a["layer"], set()).add((a["dim"], a["sign"]))
        for r in rows:
            r["annotated"] = len(per.get(r["layer"], ()))
        steps = {k: v.get("status") for k, v in (self.run.manifest.get("steps") or {}).items()}
        return {"run": self.name, "model": self.model_id, "layers": self.L, "d_m": self.d_m, "vocab": self.V,
                "lens": self.lens, "mined": int(len(self.keys)), "triggers": int(self.trig.table.num_rows),
                "negative": self.negative, "corpus_source": self.corpus_source, "corpus_sha256": self.corpus_sha,
                "sentences": int(len(self.sent_ids)), "steps": steps, "annotations": len(ann),
                "has_report": self.has_report, "index": self.index_status(), "rows": rows,
                "load_seconds": self.load_seconds}


def _f(x):
    x = float(x)
    return None if math.isnan(x) else x
