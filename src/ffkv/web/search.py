"""The browser's searches: by token (the token index), by text (trigger prefixes, trigger tokens,
one-line summaries) and by measure (the per-memory table `memories`, through DuckDB).

Every search takes the memory filters of `measures.memory_filter`: `hide_first` (?pos0=hide),
`classes` (?class=, census classes), `regimes` (?regime=, sign regimes: a `measures.RegimeFilter`) and
`min_worth` (?min_worth=, memories worth at least that, nats per predicted token; one without a worth
never passes). Worth (`ffkv worth`, table memory_worth; per memory `ffkv.steps.worth.report.of_browser`):
every search sorts by it (`sort=worth`, the largest first, memories without one last), and every
search's rows carry each memory's `worth` when the run has the table."""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ffkv.defs import LENSES
from ffkv.display import read_token
from ffkv.steps.worth.report import of_browser
from ffkv.web.measures import memory_filter
from ffkv.web.tables import BadQuery, NotFound, _f

# search orders: name -> (column, default direction)
MEASURE_SORTS = {
    "max_prob": ("max_prob", "desc"), "max_prob_neg": ("max_prob_neg", "desc"),
    "precision": ("precision", "desc"), "precision_neg": ("precision_neg", "desc"),
    "agreement": ("rank", "asc"), "target_prob": ("target_prob", "desc"),
    "entropy": ("entropy", "asc"), "coverage": ("coverage", "desc"),
    "patterns": ("n_patterns", "desc"), "coef": ("top_coef", "desc"),
    "layer": ("layer", "asc"), "worth": ("worth", "desc"),
}
TOKEN_SORTS = {"prob": ("prob", "desc"), "rank": ("rank", "asc"), "max_prob": ("max_prob", "desc"),
               "precision": ("precision", "desc"), "layer": ("layer", "asc"), "worth": ("worth", "desc")}
TEXT_SORTS = {"count": ("n", "desc"), "rank": ("best_rank", "asc"), "coef": ("best_coef", "desc"),
              "layer": ("layer", "asc"), "worth": ("worth", "desc")}
LABELS = ("shallow", "semantic", "both", "none")
TOKEN_MATCHES = ("merged", "exact")  # how a typed token finds vocabulary tokens (`Browser.resolve_token`)
MAX_TOKEN_QUERY = 200  # characters of a typed token


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


class Search:
    """The searches of a `Browser` (`b`), each a page of results as plain data."""

    def __init__(self, b):
        self.b = b

    def resolve_token(self, q: str | TokenQuery, match: str = "merged") -> list[int]:
        """Token ids a typed token names (`parse_token`): a token id; or, match `exact`, the
        tokens whose decoded text is exactly the text read; match `merged`, those and the ones
        equal to it with surrounding whitespace ignored and case folded (␣which finds ␣which,
        which, ␣Which, Which)."""
        if match not in TOKEN_MATCHES:
            raise BadQuery(f"match must be {' or '.join(TOKEN_MATCHES)} (got {match!r})")
        tq = q if isinstance(q, TokenQuery) else parse_token(q)
        if tq.token_id is not None:
            if not 0 <= tq.token_id < self.b.V:
                raise NotFound(f"token id {tq.token_id} is outside the vocabulary (0–{self.b.V - 1})")
            return [tq.token_id]
        ids = set(self.b._exact.get(tq.text, []))
        if match == "merged":
            ids |= set(self.b._norm.get(tq.text.strip().casefold(), []))
        return sorted(ids)

    def suggest(self, q: str, n: int = 12) -> list[int]:
        k = q.strip().casefold()  # q: the text read from the typed token
        if not k:
            return []
        out = [i for i, s in enumerate(self.b.vocab) if s.strip().casefold().startswith(k)]
        return sorted(out, key=lambda i: (len(self.b.vocab[i].strip()), i))[:n]

    def _order(self, sorts: dict, sort: str | None, order: str | None, default: str) -> tuple[str, str, str]:
        """(sort, column, direction) of `?sort=`/`?order=`; sort=worth on a run without the worth
        table is one line naming `ffkv worth RUN`."""
        sort = sort or default
        if sort not in sorts:
            raise BadQuery(f"sort must be one of {', '.join(sorts)} (got {sort!r})")
        col, direction = sorts[sort]
        if order is not None:
            if order not in ("asc", "desc"):
                raise BadQuery(f"order must be asc or desc (got {order!r})")
            direction = order
        if sort == "worth":
            from ffkv.web.measures import worths

            worths(self.b, "sort=worth")
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
                     page: int = 1, per_page: int = 50, match: str = "merged", hide_first: bool = False,
                     classes=None, regimes=None, min_worth: float | None = None) -> dict:
        """Memories whose value ranks a token within k (promote: +v; suppress: −v); by default
        the value's probability of the token first, or (sort=worth) the memory's worth. The memory
        filters (`hide_first`, `classes`, `regimes`, `min_worth`) as `measures.memory_filter` reads them."""
        lens = lens or self.b.lens
        if lens not in LENSES:
            raise BadQuery(f"lens must be naive or norm (got {lens!r})")
        if direction not in ("promote", "suppress"):
            raise BadQuery(f"dir must be promote or suppress (got {direction!r})")
        sort, col, how = self._order(TOKEN_SORTS, sort, order, "prob")
        page, per_page = self._page(page, per_page)
        tq = parse_token(q)
        if layer is not None and not 0 <= layer < self.b.L:
            raise BadQuery(f"layer must be in 0..{self.b.L - 1}")
        ids = self.resolve_token(tq, match)
        base = {"mode": "token", "query": q, "read": tq.text, "match": match,
                "tokens": [{"token": t, "text": self.b.tok(t)} for t in ids],
                "k": k, "lens": lens, "dir": direction, "sort": sort, "order": how, "page": page,
                "per_page": per_page, "layer": layer}
        if not ids:
            return {**base, "status": "no_token", "total": 0, "results": [],
                    "suggestions": [{"token": t, "text": self.b.tok(t)} for t in self.suggest(tq.text or "")]}
        idx = self.b.token_index()
        if idx is None:
            st = self.b.index_state
            return {**base, "status": st.status, "total": 0, "results": [], "index": self.b.index_status()}
        if not 1 <= k <= idx.k:
            raise BadQuery(f"k must be in 1..{idx.k} (the token index keeps ranks below {idx.k})")
        if lens not in idx.lenses:
            raise BadQuery(f"the token index has lenses {', '.join(idx.lenses)}, not {lens}")
        hit = idx.lookup(lens, 1 if direction == "promote" else -1, ids, k)
        mem = hit["mem"]
        if layer is not None:
            keep = (mem // self.b.d_m) == layer
            hit = {c: v[keep] for c, v in hit.items()}
            mem = hit["mem"]
        chosen = memory_filter(self.b, hide_first, classes, regimes, min_worth)
        if chosen is not None:
            keep = chosen[mem]
            hit = {c: v[keep] for c, v in hit.items()}
            mem = hit["mem"]
        meas = self.b.memories
        sign = 1 if direction == "promote" else -1  # every number of a row is of s·v: −v when suppressing
        suffix = "" if sign == 1 else "_neg"
        mp = meas.column("max_prob" + suffix).to_numpy(zero_copy_only=False)
        prec = meas.column("precision" + suffix).to_numpy(zero_copy_only=False)
        worth = of_browser(self.b)
        cols = {"layer": mem // self.b.d_m, "dim": mem % self.b.d_m, "token": hit["token"], "rank": hit["rank"],
                "prob": hit["prob"], "max_prob": mp[mem] if len(mem) else np.zeros(0),
                "precision": prec[mem] if len(mem) else np.zeros(0),
                "worth": worth[mem] if worth is not None and len(mem) else np.full(len(mem), np.nan)}
        key = cols[col].astype(np.float64)
        key = np.where(np.isnan(key), np.inf, key if how == "asc" else -key)
        order_ = np.lexsort((cols["dim"], cols["layer"], cols["rank"], key))
        total = len(order_)
        sel = order_[(page - 1) * per_page: page * per_page]
        mined = self.b.memories.column("mined").to_numpy(zero_copy_only=False)
        results = [{"layer": int(cols["layer"][i]), "dim": int(cols["dim"][i]), "token": int(cols["token"][i]),
                    "token_text": self.b.tok(cols["token"][i]), "rank": int(cols["rank"][i]),
                    "prob": float(cols["prob"][i]), "max_prob": _f(cols["max_prob"][i]),
                    "precision": _f(cols["precision"][i]), "mined": bool(mined[mem[i]]), "sign": sign}
                   for i in sel]
        for r in results:  # each row's example: its memory's top trigger of that sign (coloured by m)
            r["sentence_id"], r["position"] = self.top_trigger(r["layer"], r["dim"], sign)
            if worth is not None:
                r["worth"] = _f(worth[r["layer"] * self.b.d_m + r["dim"]])
        return {**base, "status": "ready", "total": total, "memories": int(len(np.unique(mem))),
                "results": results, "index_k": idx.k,
                "index_source": idx.source}

    def top_trigger(self, layer: int, dim: int, sign: int = 1) -> tuple[int | None, int | None]:
        """(sentence_id, position) of a memory's best trigger: rank 1 of its list of `sign`, else of
        its other list; (None, None) for a memory not mined."""
        rows = self.b.trig.indices(layer, dim)
        if not len(rows):
            return None, None
        best = min(rows.tolist(), key=lambda i: (int(self.b.trig_sign[i]) != sign, int(self.b.trig_rank[i])))
        t = self.b.trig.table
        return int(t.column("sentence_id")[best].as_py()), int(t.column("position")[best].as_py())

    def search_text(self, q: str, *, mode: str = "word", sign: int | None = None, layer: int | None = None,
                    sort: str | None = None, order: str | None = None, page: int = 1,
                    per_page: int = 50, hide_first: bool = False, classes=None, regimes=None,
                    min_worth: float | None = None) -> dict:
        """Memories with triggers whose prefix contains a word (mode word), or whose trigger token
        is a token (mode token: the decoded token, spaces ignored, case folded), one row per memory
        and list, by default the most matching triggers first; mode summary: memories whose
        one-line summary contains the words (`search_summary`). The memory filters as
        `measures.memory_filter` reads them."""
        if mode == "summary":
            return self.search_summary(q, layer=layer, page=page, per_page=per_page, hide_first=hide_first,
                                       classes=classes, regimes=regimes, min_worth=min_worth,
                                       sort=sort, order=order)
        if mode not in ("word", "token"):
            raise BadQuery(f"mode must be word, token or summary (got {mode!r})")
        if sign not in (None, 1, -1):
            raise BadQuery("sign must be 1 or -1")
        if layer is not None and not 0 <= layer < self.b.L:
            raise BadQuery(f"layer must be in 0..{self.b.L - 1}")
        q = q or ""
        if mode == "word" and not q.strip():
            raise BadQuery("text: type a word, e.g. city")
        if len(q) > 200:
            raise BadQuery("text: at most 200 characters")
        sort, col, how = self._order(TEXT_SORTS, sort, order, "count")
        page, per_page = self._page(page, per_page)
        if mode == "token":  # the trigger token, typed as in token search (merged)
            ids = self.resolve_token(parse_token(q, "text"), "merged")
            sel = np.nonzero(np.isin(self.b.trig_token, np.asarray(ids, np.int64)))[0] if ids else np.zeros(0, np.int64)
        else:  # the run's text index (`ffkv.web.textindex`), or the reference scan when it is off
            from ffkv.web import textindex

            ti = textindex.get(self.b)
            sel = ti.word_hits(q) if ti is not None else self._word_hits(q)
        if len(sel) and sign is not None:
            sel = sel[self.b.trig_sign[sel] == sign]
        if len(sel) and layer is not None:
            sel = sel[(self.b.trig.code[sel] // self.b.d_m) == layer]
        chosen = memory_filter(self.b, hide_first, classes, regimes, min_worth)
        if len(sel) and chosen is not None:
            sel = sel[chosen[self.b.trig.code[sel]]]
        base = {"mode": "text", "text_mode": mode, "query": q, "sign": sign, "layer": layer, "sort": sort,
                "order": how, "page": page, "per_page": per_page, "triggers_matched": int(len(sel))}
        if not len(sel):
            return {**base, "total": 0, "memories": 0, "results": []}
        by_worth = sort == "worth"
        if by_worth:  # grouped in any order, then ordered by the memory's worth below
            col = "layer"
        if mode == "word" and ti is not None:
            g = ti.groups(sel, col, how)
        else:
            hits = self.b.trig.table.take(pa.array(sel, pa.int64())).select(
                ["layer", "dim", "sign", "rank", "coef", "sentence_id", "position"])
            with self.b._con_lock:
                self.b._con.register("hits", hits)
                try:
                    g = self.b._con.sql(
                        f"""SELECT layer, dim, sign, count(*) AS n, min(rank) AS best_rank,
                                   arg_min(coef, rank) AS best_coef, arg_min(sentence_id, rank) AS sentence_id,
                                   arg_min(position, rank) AS position
                            FROM hits GROUP BY layer, dim, sign
                            ORDER BY {col} {how.upper()} NULLS LAST, layer, dim, sign DESC""").to_arrow_table()
                finally:
                    self.b._con.unregister("hits")
        total = g.num_rows  # rows: (memory, list) pairs, a memory's two lists apart
        codes = g.column("layer").to_numpy().astype(np.int64) * self.b.d_m + g.column("dim").to_numpy()
        worth = of_browser(self.b)
        if by_worth:  # ORDER BY worth {how} NULLS LAST, layer, dim, sign DESC
            w = worth[codes]
            key = np.where(np.isnan(w), np.inf, w if how == "asc" else -w)
            o = np.lexsort((-g.column("sign").to_numpy().astype(np.int64), g.column("dim").to_numpy(),
                            g.column("layer").to_numpy(), key))
            g, codes = g.take(pa.array(o)), codes[o]
        rows = g.slice((page - 1) * per_page, per_page).to_pylist()
        for r in rows:
            if worth is not None:
                r["worth"] = _f(worth[r["layer"] * self.b.d_m + r["dim"]])
            srow = self.b.sentence_row(r["sentence_id"])
            r["prefix"] = self.b.prefix(srow, r["position"])
            r["permalink"] = self.b.permalink(r["sentence_id"], r["position"])
        return {**base, "total": total, "memories": int(len(np.unique(codes))), "results": rows}

    def _word_hits(self, q: str) -> np.ndarray:
        """Trigger rows whose prefix text contains `q` as a whole word (case-insensitive).

        A prefix's text is its tokens' decoded texts joined (the `vocab` table's `text`), so it
        can end inside a corpus word: "The" is a word of the prefix "The" cut from "Then". With
        e_p the end of token p: prefix p contains the word when some occurrence not preceded by a
        word character ends at or before e_p and is followed there by a non-word character (or
        e_p itself, the prefix's end). A boundary is asked for only at an end of `q` that is a word
        character (`word_edges`): "%" is found in "85%", "85%" not in "185%".
        """
        from ffkv.web.textindex import word_edges

        words = q.strip()
        head, tail = word_edges(words)
        occ = re.compile((r"(?<!\w)" if head else "") + r"(?=(" + re.escape(words) + r"))", re.IGNORECASE)
        rough = re.compile(re.escape(words), re.IGNORECASE)
        big = np.iinfo(np.int64).max
        first = np.full(len(self.b.sent_ids), big, np.int64)  # first position of a whole-word match
        extra: list[int] = []  # row * 2^32 + position: prefixes cut right after an occurrence
        texts = self.b._texts.to_pylist() if len(self.b.sent_ids) < 200_000 else None
        for row in range(len(self.b.sent_ids)):
            text = texts[row] if texts is not None else self.b._texts[row].as_py()
            if not rough.search(text or ""):
                continue
            pieces = [self.b.tok(t) for t in self.b.sentence_tokens(row)]
            s = "".join(pieces)
            ends = np.cumsum([len(p) for p in pieces])
            for m in occ.finditer(s):
                e = m.start() + len(m.group(1))
                if not tail or e >= len(s) or not (s[e].isalnum() or s[e] == "_"):
                    first[row] = min(first[row], int(np.searchsorted(ends, e, "left")))
                else:
                    p = int(np.searchsorted(ends, e, "left"))
                    if p < len(ends) and ends[p] == e:
                        extra.append(row * (1 << 32) + p)
        tpos = self.b.trig.table.column("position").to_numpy().astype(np.int64)
        hit = tpos >= first[self.b.trig_row]
        if extra:
            hit |= np.isin(self.b.trig_row.astype(np.int64) * (1 << 32) + tpos, np.asarray(extra, np.int64))
        return np.nonzero(hit)[0]

    def search_summary(self, q: str, *, layer: int | None = None, page: int = 1, per_page: int = 50,
                       hide_first: bool = False, classes=None, regimes=None, min_worth: float | None = None,
                       sort: str | None = None, order: str | None = None) -> dict:
        """Memories whose one-line summary contains every word of `q` (case folded), by memory, or
        (sort=worth) by worth; any other sort of the text search leaves them by memory."""
        words = (q or "").casefold().split()
        if not words:
            raise BadQuery("text: type a word, e.g. city")
        if len(q) > 200:
            raise BadQuery("text: at most 200 characters")
        if layer is not None and not 0 <= layer < self.b.L:
            raise BadQuery(f"layer must be in 0..{self.b.L - 1}")
        by_worth = sort == "worth"
        if by_worth:
            _, _, how = self._order(TEXT_SORTS, sort, order, "layer")
        page, per_page = self._page(page, per_page)
        sm = self.b.summaries
        lines = self.b._lazy("_summary_lines", lambda: {
            int(c): sm.line(int(c)).casefold()
            for c in np.union1d(self.b.keys, np.asarray(sorted(sm.value), np.int64))})
        ann = self.b.notes.annotation_parts()
        chosen = memory_filter(self.b, hide_first, classes, regimes, min_worth)
        hits = []
        for c, text in lines.items():
            if chosen is not None and not chosen[c]:
                continue
            if c in ann:
                text = sm.line(c, ann[c]).casefold()
            if (layer is None or c // self.b.d_m == layer) and all(w in text for w in words):
                hits.append(c)
        hits.sort()
        worth = of_browser(self.b)
        if by_worth:
            w = worth[np.asarray(hits, np.int64)]
            hits = [hits[i] for i in np.lexsort((hits, np.where(np.isnan(w), np.inf, w if how == "asc" else -w)))]
        rows = [{"layer": c // self.b.d_m, "dim": c % self.b.d_m} for c in hits[(page - 1) * per_page: page * per_page]]
        if worth is not None:
            for r in rows:
                r["worth"] = _f(worth[r["layer"] * self.b.d_m + r["dim"]])
        return {"mode": "text", "text_mode": "summary", "query": q, "layer": layer, "sign": None,
                "sort": "worth" if by_worth else "layer", "order": how if by_worth else "asc", "page": page,
                "per_page": per_page, "total": len(hits), "memories": len(hits),
                "triggers_matched": 0, "results": self.b.add_summaries(rows)}

    def search_measure(self, *, sort: str | None = None, order: str | None = None, layer: int | None = None,
                       label: str | None = None, agree: bool | None = None, mined_only: bool = True,
                       page: int = 1, per_page: int = 50, hide_first: bool = False, classes=None,
                       regimes=None, min_worth: float | None = None) -> dict:
        """Memories ordered by a measure (value max-probability, precision@50, agreement, worth, …),
        through the memory filters (`measures.memory_filter`). A run with the worth table gives each
        row its `worth` (null without one: last in either order); sorting by worth without the table
        is one line."""
        sort, col, how = self._order(MEASURE_SORTS, sort, order, "max_prob")
        page, per_page = self._page(page, per_page)
        where, params = [], []
        if mined_only:
            where.append("mined")
        if layer is not None:
            if not 0 <= layer < self.b.L:
                raise BadQuery(f"layer must be in 0..{self.b.L - 1}")
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
        chosen = memory_filter(self.b, hide_first, classes, regimes, min_worth)
        src = None
        worth = of_browser(self.b)
        if worth is not None:  # the per-memory table with each memory's worth (NaN stored as null)
            src = self.b._lazy("_memories_worth", lambda: self.b.memories.append_column(
                "worth", pa.array(worth, pa.float64(), from_pandas=True)))
        if chosen is not None:
            src = (self.b.memories if src is None else src).filter(chosen)
        with self.b._con_lock:  # the chosen rows under a name of their own while both queries run
            con, name = self.b._con, "memories" if src is None else "memories_chosen"
            if src is not None:
                con.register(name, src)
            try:
                total = con.sql(f"SELECT count(*) AS n FROM {name}{w}", params=params or None
                                ).to_arrow_table().column("n")[0].as_py()
                rows = con.sql(f"SELECT * FROM {name}{w} ORDER BY {col} {how.upper()} NULLS LAST, layer, dim "
                               f"LIMIT {int(per_page)} OFFSET {int((page - 1) * per_page)}", params=params or None
                               ).to_arrow_table().to_pylist()
            finally:
                if src is not None:
                    con.unregister(name)
        for r in rows:
            r["top_token_text"] = self.b.tok(r["top_token"])
            r["top_token_neg_text"] = self.b.tok(r["top_token_neg"])
        return {"mode": "measure", "sort": sort, "order": how, "layer": layer, "label": label, "agree": agree,
                "has_worth": worth is not None,
                "page": page, "per_page": per_page, "total": int(total), "results": rows}

    def _sql(self, q: str, params=None) -> pa.Table:
        with self.b._con_lock:
            return self.b._con.sql(q, params=params or None).to_arrow_table()
