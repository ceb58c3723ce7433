"""The run's tables as the browser reads them: loaded once, kept in memory, indexed by memory.

Every table comes through the read API (`ffkv.store.query`). Per-memory lookups are binary
searches over the tables sorted by code = layer × d_m + dim (`ByKey`), so a memory page costs no
scan: the default run's 4.6M trigger rows are read once at startup. Nothing here writes.
"""
from __future__ import annotations

import math
import random
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ffkv.errors import FfkvError
from ffkv.store import query

MAX_TOP = 200          # trigger rows per sign a page may ask for
PREFIX_TOKENS = 32     # a long prefix shows its last tokens (the permalink shows the sentence)
ANNOTATE_TOP = 25      # prefixes an annotator reads (the paper's protocol)
PRECISION_K = 50
MUTATIONS = ("first", "last", "random")


class NotFound(FfkvError):
    """An unknown memory, sentence or token: a 404."""


class BadQuery(FfkvError):
    """A malformed query: a 422."""


LEFT = 499  # "client closed request" (nginx's code): the status of an answer nobody reads


class Left(Exception):
    """A request whose client left while it waited for the model (a page left: its fetch aborted):
    answered 499 and logged, its forward not run (`ffkv.web.routers.memory.model_turn`)."""


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


def _f(x):
    x = float(x)
    return None if math.isnan(x) else x


class RunTables:
    """A run's tables in memory and the small lookups every part of the browser shares
    (a memory's code, a token's text, a sentence's row and tokens, a prefix, a permalink)."""

    def __init__(self, run_path, *, index_k: int | None = None, log=None):
        from ffkv.steps.lifecycle import check_run
        from ffkv.store.run import Run

        self.log = log or (lambda msg: None)
        self.run = Run(run_path)
        self.path = Path(self.run.path)
        self.name = str(run_path)
        check_run(self.run)  # every finished step's tables whole, or one line naming the rebuild
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
        # a mixture of experts (the manifest's `ffkv.model.arch.MoE.moe_info`): dim = e·d_expert + i
        self.moe = ({"experts": int(model["experts"]), "d_expert": int(model.get("d_expert") or 0),
                     "d_shared": int(model.get("d_shared_expert") or 0)}
                    if model.get("experts") and model.get("d_expert") else None)
        self.index_k = index_k
        self.has_report = (self.path / "report" / "index.html").exists()

        self._load_sentences()
        self._load_triggers(trig)
        self._load_step_tables(vs)

        # built on first use (or by `warm()` in the background): searches need them, the overview not
        self._lazy_lock = threading.RLock()
        self._con_lock = threading.Lock()

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
        self.census = opt("census", False)  # `ffkv census`: the class filters and each layer's class mix
        self.census_layers = opt("census_layers", False)
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

    # ---- small helpers ------------------------------------------------------------------------
    def check_key(self, layer: int, dim: int) -> None:
        if not (0 <= layer < self.L):
            raise NotFound(f"layer {layer} does not exist: the model has layers 0–{self.L - 1}")
        if not (0 <= dim < self.d_m):
            raise NotFound(f"dim {dim} does not exist: each layer has dims 0–{self.d_m - 1}")

    def expert_of(self, dim: int) -> dict | None:
        """A memory's expert in a mixture of experts, as `MemoryModel.expert_of` gives it
        (dim = e·d_expert + i; the shared expert, when there is one, is expert E after the E routed
        ones), with its label: {expert, dim, shared, label}; None for a dense FFN."""
        if self.moe is None:
            return None
        E, de = self.moe["experts"], self.moe["d_expert"]
        dim = int(dim)
        e, i = (dim // de, dim % de) if dim < E * de else (E, dim - E * de)
        shared = e >= E
        return {"expert": e, "dim": i, "shared": shared,
                "label": f"expert {e}, dim {i}" + (" (shared expert)" if shared else "")}

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

    def prefix(self, row: int, position: int) -> dict:
        """A prefix's text (its tokens' decoded texts joined): `full`, and for display its last
        PREFIX_TOKENS tokens as `head` + `trigger` (the last token), `cut` when shortened."""
        vocab = self.vocab
        texts = [vocab[t] for t in self.sentence_tokens(row)[: position + 1].tolist()]
        cut = max(0, len(texts) - PREFIX_TOKENS)
        return {"head": "".join(texts[cut:-1]), "trigger": texts[-1] if texts else "",
                "cut": cut > 0, "full": "".join(texts)}

    def permalink(self, sentence_id: int, position: int) -> str:
        q = f"?pos={int(position)}"
        if self.corpus_sha:
            q += f"&corpus={self.corpus_sha[:12]}"
        return f"/sentence/{int(sentence_id)}{q}#t{int(position)}"
