"""The text search's index (`/search?text=`, issue 27 item 10): built once per run, in memory, on the
first text search, then shared by every request without a lock.

What `Browser.search_text` needs, computed without its per-request scans:
- `word_hits(q)`: the trigger rows whose prefix contains `q` as a whole word, equal to
  `Browser._word_hits(q)` (kept there as the reference). Every sentence's text and every sentence's
  decoded tokens are joined once into two strings, rows apart by a NUL, so that one regex pass over
  each (the same regexes as the reference) finds the candidate sentences and the occurrences, and the
  token an occurrence ends in is a binary search over the tokens' end offsets. A query holding a NUL
  goes the reference's way.
- `groups(sel, col, how)`: the (memory, list) rows of a selection of trigger rows, equal to the
  reference's DuckDB `GROUP BY layer, dim, sign` (count, best rank and that trigger's coefficient,
  sentence and position) in the same order, by numpy over the trigger table kept in (list, rank)
  order: a list's first selected row is its best.

`FFKV_TEXT_SEARCH=scan` in the server's environment turns the index off (the reference path), which
`benchmarks/bench_serve.py --text-load` uses to time both on the same run.
"""
from __future__ import annotations

import os
import re
import string
import threading

import numpy as np
import pyarrow as pa

SEP = "\x00"  # between two sentences' texts in the joined strings: never a word character
GROUP_COLUMNS = ("layer", "dim", "sign", "n", "best_rank", "best_coef", "sentence_id", "position")
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("FFKV_TEXT_SEARCH", "index").strip().lower() != "scan"


def get(browser) -> "TextIndex | None":
    """The browser's index (built on first use), or None when turned off (`FFKV_TEXT_SEARCH=scan`)."""
    if not enabled():
        return None
    ti = browser.__dict__.get("_text_index")
    if ti is None:
        with _lock:
            ti = browser.__dict__.get("_text_index")
            if ti is None:
                ti = TextIndex(browser)
                browser.__dict__["_text_index"] = ti
    return ti


def word_edges(q: str) -> tuple[bool, bool]:
    """Whether a whole-word match of `q` needs a boundary before it and after it: only where its
    first (last) character is a word character, as a regex's \\b would; "%" or "(" stand alone."""
    def wordy(c: str) -> bool:
        return c.isalnum() or c == "_"

    return (bool(q) and wordy(q[0]), bool(q) and wordy(q[-1]))


class TextIndex:
    """Immutable once built (the text part on first `word_hits`); safe to read from many threads."""

    def __init__(self, browser):
        self.b = browser
        t = browser.trig.table

        def arr(name, dtype):  # the table's own buffer when the type is already that (no copy)
            return np.asarray(t.column(name).to_numpy(), dtype=dtype)

        layer, dim, sign, rank = arr("layer", np.int16), arr("dim", np.int32), arr("sign", np.int8), arr("rank", np.int16)
        key = (layer.astype(np.int64) * int(browser.d_m) + dim) * 2 + (sign > 0)
        if len(key) and int(key.max()) < 2 ** 31:
            key = key.astype(np.int32)
        # (list, rank) order: the stored order (layer, sign desc, dim, rank) already is one, when each
        # list's rows are contiguous and rank-ascending
        n = len(key)
        change = np.ones(n, bool)
        if n:
            change[1:] = key[1:] != key[:-1]
        contiguous = n == 0 or (int(change.sum()) == len(np.unique(key))
                                and bool(np.all(change[1:] | (rank[1:] > rank[:-1]))))
        self.perm = None if contiguous else np.lexsort((rank, key)).astype(np.int64)
        self.inv = None
        if self.perm is not None:
            self.inv = np.empty(n, np.int64)
            self.inv[self.perm] = np.arange(n)
            key, layer, dim, sign, rank = key[self.perm], layer[self.perm], dim[self.perm], sign[self.perm], rank[self.perm]

        def col(name, dtype):
            a = arr(name, dtype)
            return a if self.perm is None else a[self.perm]

        self.key = key
        self.layer, self.dim, self.sign, self.rank = layer, dim, sign, rank
        self.coef = col("coef", np.float32)
        self.sid = col("sentence_id", np.int64)
        self.pos = arr("position", np.int32)  # table order (word hits)
        self._text = None
        self._text_lock = threading.Lock()

    # ---- word hits ---------------------------------------------------------------------------------
    def _build_text(self):
        b = self.b
        texts = b._texts.to_pylist()
        lens = np.fromiter((len(x or "") for x in texts), np.int64, len(texts))
        text_start = np.zeros(len(texts), np.int64)
        if len(texts):
            text_start[1:] = np.cumsum(lens + 1)[:-1]
        texts_cat = SEP.join(x or "" for x in texts)
        vocab = b.vocab
        flat = b.tok_flat
        pieces = [vocab[t] if 0 <= t < len(vocab) else f"<{t}>" for t in flat.tolist()]
        tlen = np.fromiter((len(p) for p in pieces), np.int64, len(pieces))
        off = b.tok_offsets
        n_rows = len(off) - 1
        row_of_tok = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(off))
        ends = np.cumsum(tlen) + row_of_tok  # a token's end in the joined string (one SEP per row before it)
        cs = np.concatenate([[0], np.cumsum(tlen)])
        tok_start = cs[off[:-1]] + np.arange(n_rows, dtype=np.int64)  # a row's first character
        tok_cat = SEP.join("".join(pieces[off[r]:off[r + 1]]) for r in range(n_rows))
        # each row's triggers by position, for the prefixes cut right after an occurrence
        rk = b.trig_row.astype(np.int64) * (1 << 32) + self.pos
        order = np.argsort(rk, kind="stable")
        # the joined strings folded char by char (a char's lower() when it is one char), so that for an
        # ASCII query `str.find` on them finds exactly what the IGNORECASE regex finds, except for the
        # letters some non-ASCII char of the run also matches (Kelvin sign and k, long s and s, …)
        chars = set(texts_cat) | set(tok_cat)
        fold = {c: c.lower() for c in chars if c.lower() != c and len(c.lower()) == 1}
        table = str.maketrans(fold)
        unsafe = set()
        wide = [c for c in chars if ord(c) > 127]
        for letter in string.ascii_letters + string.digits + "_":
            pat = re.compile(re.escape(letter), re.IGNORECASE)
            if any(pat.fullmatch(c) and fold.get(c, c) != letter.lower() for c in wide):
                unsafe.add(letter.lower())
        self._text = (texts_cat, text_start, tok_cat, tok_start, ends, rk[order], order.astype(np.int32),
                      texts_cat.translate(table), tok_cat.translate(table), frozenset(unsafe))

    def text(self):
        if self._text is None:
            with self._text_lock:
                if self._text is None:
                    self._build_text()
        return self._text

    def word_hits(self, q: str) -> np.ndarray:
        """Trigger rows (table order, ascending) whose prefix contains `q` as a whole word
        (case-insensitive): `Browser._word_hits(q)`, from the joined strings."""
        words = q.strip()
        if SEP in words or not words:
            return self.b._word_hits(q)
        texts_cat, text_start, tok_cat, tok_start, ends, rk_sorted, rk_order, texts_low, tok_low, unsafe = self.text()
        b = self.b
        n_rows = len(text_start)
        low = words.lower()
        fast = words.isascii() and len(low) == len(words) and not (set(low) & unsafe)
        rough = re.compile(re.escape(words), re.IGNORECASE)
        # sentences whose text contains the words (the reference's first filter): one match per row
        cand = np.zeros(n_rows, bool)
        pos, n_text = 0, len(texts_cat)
        while pos <= n_text:
            if fast:
                at = texts_low.find(low, pos)
            else:
                m = rough.search(texts_cat, pos)
                at = -1 if m is None else m.start()
            if at < 0:
                break
            r = int(np.searchsorted(text_start, at, "right")) - 1
            cand[r] = True
            pos = int(text_start[r + 1]) if r + 1 < n_rows else n_text + 1
        big = np.iinfo(np.int32).max
        first = np.full(n_rows, big, np.int32)
        if not cand.any():
            return np.zeros(0, np.int64)
        starts, stops = [], []
        head, tail = word_edges(words)  # boundaries only at the query's word-character ends
        if fast:  # every occurrence (overlapping ones too) not preceded by a word character
            at, n = tok_low.find(low), len(low)
            while at >= 0:
                c = tok_cat[at - 1] if at else ""
                if not head or not (c.isalnum() or c == "_"):
                    starts.append(at)
                    stops.append(at + n)
                at = tok_low.find(low, at + 1)
        else:
            occ = re.compile((r"(?<!\w)" if head else "") + r"(?=(" + re.escape(words) + r"))", re.IGNORECASE)
            for m in occ.finditer(tok_cat):
                starts.append(m.start())
                stops.append(m.start() + len(m.group(1)))
        if not starts:
            return np.zeros(0, np.int64)
        starts = np.asarray(starts, np.int64)
        stops = np.asarray(stops, np.int64)
        rows = np.searchsorted(tok_start, starts, "right") - 1
        keep = cand[rows]
        starts, stops, rows = starts[keep], stops[keep], rows[keep]
        n_cat = len(tok_cat)
        # followed by a non-word character (SEP at a sentence's end) or nothing: a whole word
        whole = np.fromiter((not tail or e >= n_cat or not (tok_cat[e].isalnum() or tok_cat[e] == "_")
                             for e in stops.tolist()), bool, len(stops))
        p = np.searchsorted(ends, stops, "left")  # the token the occurrence ends in (flat index)
        tok_in_row = p - b.tok_offsets[rows]
        w = whole
        if w.any():
            np.minimum.at(first, rows[w], tok_in_row[w].astype(np.int32))
        # each matched row's triggers from its first whole-word position on, by the (row, position) index
        rs = np.flatnonzero(first < big).astype(np.int64)
        lo = np.searchsorted(rk_sorted, rs * (1 << 32) + first[rs], "left")
        hi = np.searchsorted(rk_sorted, (rs + 1) * (1 << 32), "left")
        count = hi - lo
        total = int(count.sum())
        hit = np.zeros(len(self.pos), bool)
        if total:
            keep = count > 0
            lo, count = lo[keep], count[keep]
            step = np.ones(total, np.int64)
            step[0] = lo[0]
            heads = np.cumsum(count)[:-1]
            step[heads] = lo[1:] - (lo[:-1] + count[:-1] - 1)
            hit[rk_order[np.cumsum(step)]] = True
        cut = ~whole & (p < len(ends))
        cut[cut] = ends[p[cut]] == stops[cut]  # a prefix that ends right after the occurrence
        if cut.any():
            want = np.unique(rows[cut] * (1 << 32) + tok_in_row[cut])
            i = np.searchsorted(rk_sorted, want, "left")
            lo = i
            hi = np.searchsorted(rk_sorted, want, "right")
            if (hi > lo).any():
                idx = np.concatenate([rk_order[a:z] for a, z in zip(lo.tolist(), hi.tolist()) if z > a])
                hit[idx] = True
        return np.nonzero(hit)[0]

    # ---- grouping ----------------------------------------------------------------------------------
    def groups(self, sel: np.ndarray, col: str, how: str) -> pa.Table:
        """The reference's `SELECT layer, dim, sign, count(*) AS n, min(rank) AS best_rank,
        arg_min(coef, rank) AS best_coef, arg_min(sentence_id, rank), arg_min(position, rank) FROM hits
        GROUP BY layer, dim, sign ORDER BY {col} {how} NULLS LAST, layer, dim, sign DESC` over the
        trigger rows `sel` (table order)."""
        s = np.asarray(sel, np.int64)
        if self.perm is not None:
            s = np.sort(self.inv[s])
        elif len(s) > 1 and np.any(s[1:] < s[:-1]):
            s = np.sort(s)
        if len(s) == 0:
            return pa.table({c: pa.array([], t) for c, t in zip(GROUP_COLUMNS, (
                pa.int16(), pa.int32(), pa.int8(), pa.int64(), pa.int16(), pa.float32(), pa.int64(), pa.int32()))})
        k = self.key[s]
        head = np.ones(len(s), bool)
        head[1:] = k[1:] != k[:-1]
        at = np.flatnonzero(head)
        n = np.diff(np.append(at, len(s))).astype(np.int64)
        best = s[at]  # each list's best-ranked selected row
        cols = {"layer": self.layer[best], "dim": self.dim[best], "sign": self.sign[best], "n": n,
                "best_rank": self.rank[best], "best_coef": self.coef[best], "sentence_id": self.sid[best],
                "position": self.pos[best if self.perm is None else self.perm[best]]}
        prim = cols[col]
        if np.issubdtype(prim.dtype, np.floating):
            nan = np.isnan(prim)  # DuckDB sorts NaN above every number
            v = np.where(nan, 0, prim).astype(np.float64)
            keys = (-v, ~nan) if how == "desc" else (v, nan)  # (secondary, primary)
        else:
            v = prim.astype(np.int64)
            keys = ((-v,) if how == "desc" else (v,))
        order = np.lexsort((-cols["sign"].astype(np.int64), cols["dim"], cols["layer"]) + keys)  # last: primary
        return pa.table({c: pa.array(cols[c][order]) for c in GROUP_COLUMNS})
