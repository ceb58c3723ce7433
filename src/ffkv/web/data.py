"""The run as the browser sees it: `Browser`, one object that the routes ask for everything, made
of parts, each its own module:

- `ffkv.web.tables.RunTables` (Browser's base): the run's tables read once, kept in memory,
  indexed by memory, and the small lookups every part shares;
- `ffkv.web.page.Pages`: what a memory page, a sentence page and the overview show;
- `ffkv.web.search.Search`: search by token, by text and by measure;
- `ffkv.web.measures`: the per-memory table `memories` the searches sort by;
- `ffkv.web.notes.Notes`: annotations (`annotations.sqlite`, the browser's only write) and the
  one-line summaries that show them;
- `ffkv.web.tokenindex`: the token index in memory.

Every table comes through the read API (`ffkv.store.query`). The token index (`value_index`, see
`ffkv.memories.value_index`) is read from the run when present, else built in memory in a
background thread on first use; so is the model (`model()`), loaded lazily the first time
something needs it (re-verify, the index, the explorer). This module re-exports, for callers
outside the browser, names its parts define (`NotFound`, `BadQuery`, `parse_token`, the sort
tables, …); the web modules import each from its owner.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from ffkv.errors import FfkvError
from ffkv.model import identity
from ffkv.store import query
from ffkv.web.measures import memories_table
from ffkv.web.notes import Notes
from ffkv.web.page import Pages
from ffkv.web.search import (LABELS, MAX_TOKEN_QUERY, MEASURE_SORTS, TEXT_SORTS, TOKEN_MATCHES,  # noqa: F401
                             TOKEN_SORTS, Search, TokenQuery, parse_token)
from ffkv.web.tables import (ANNOTATE_TOP, MAX_TOP, MUTATIONS, PRECISION_K, PREFIX_TOKENS,  # noqa: F401
                             BadQuery, ByKey, NotFound, RunTables, hist_layout, position_buckets)
from ffkv.web.tokenindex import IndexState, TokenIndex


class _Part:
    """A method of `Browser` that is the method of the same name of one of its parts."""

    def __init__(self, part: str):
        self.part = part

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, cls=None):
        return self if obj is None else getattr(getattr(obj, self.part), self.name)


class Foreground:
    """Requests a person is waiting on (a page's colours, the explorer, re-verify) say so with
    `busy()`; work in the background (similar memories from the model's weights) calls `wait()`
    between its chunks and pauses while any such request runs, so that it does not halve the CPU
    a page's colours get (at most `timeout` seconds per chunk: it never starves)."""

    def __init__(self):
        self.n = 0
        self.cv = threading.Condition()

    @contextmanager
    def busy(self):
        with self.cv:
            self.n += 1
        try:
            yield
        finally:
            with self.cv:
                self.n -= 1
                self.cv.notify_all()

    def wait(self, timeout: float = 10.0) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.n == 0, timeout)


class Browser(RunTables):
    """A run's tables in memory, with what the pages and searches need. Thread-safe for reads."""

    def __init__(self, run_path, *, index_k: int | None = None, log=None):
        t0 = time.time()
        super().__init__(run_path, index_k=index_k, log=log)
        self.pages, self.search, self.notes = Pages(self), Search(self), Notes(self)

        # lazily: token index, model
        self._index: TokenIndex | None = None
        self.index_state = IndexState()
        if self.run.has_table("value_index"):
            self._index = TokenIndex(query.table(self.run, "value_index"), self.d_m, "run")
            self.index_state.status = "ready"
        self._mm = None
        self._mm_lock = threading.Lock()
        self.model_lock = identity.forward_lock(self.run)  # one forward pass at a time, the steps' panels' too
        self.foreground = Foreground()  # requests a person waits on; background builds yield to them
        self.load_seconds = round(time.time() - t0, 2)

    # ---- the parts' methods: `b.memory(...)` is `b.pages.memory(...)` ----------------------------
    memory = _Part("pages")
    value_ranks = _Part("pages")
    vocab_views = _Part("pages")
    key_statistics = _Part("pages")
    sentence = _Part("pages")
    overview = _Part("pages")

    resolve_token = _Part("search")
    suggest = _Part("search")
    search_token = _Part("search")
    search_text = _Part("search")
    search_summary = _Part("search")
    search_measure = _Part("search")
    _word_hits = _Part("search")

    store = _Part("notes")
    annotations = _Part("notes")
    annotate = _Part("notes")
    annotation_stats = _Part("notes")
    n_prefixes = _Part("notes")
    summary = _Part("notes")
    add_summaries = _Part("notes")

    # ---- what is built on first use -----------------------------------------------------------
    @property
    def memories(self) -> pa.Table:
        """One row per memory of the model: the measures searched by (`ffkv.web.measures.memories_table`)."""
        return self._lazy("_memories", lambda: memories_table(self))

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

    def warm(self) -> None:
        """Build everything that is otherwise built on first use (called in a background thread)."""
        for name in ("memories", "_precision", "_con", "_norm", "_exact", "trig_token", "summaries"):
            getattr(self, name)

    # ---- one-line summaries and similar memories ---------------------------------------------
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

    # ---- the token index and the model -------------------------------------------------------
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
        from ffkv.memories.value_index import DEFAULT_K, build_index

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

    def index_status(self) -> dict:
        st = self.index_state
        return {"status": st.status if self._index is None else "ready", "done": st.done, "total": st.total,
                "error": st.error, "k": self._index.k if self._index is not None else None,
                "source": self._index.source if self._index is not None else None,
                "model_loaded": self.model_loaded}

    def model(self):
        """The run's model, loaded on first use (CPU), shared by every page."""
        if self._mm is None:
            with self._mm_lock:
                if self._mm is None:
                    from ffkv.model.load import quiet_hf

                    quiet_hf()
                    t = time.time()
                    self._mm = identity.shared_model(self.run)
                    self.log(f"model loaded in {time.time() - t:.1f} s")
        return self._mm

    @property
    def model_loaded(self) -> bool:
        return self._mm is not None

