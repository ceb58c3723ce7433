"""The token index (`value_index`, see `ffkv.memories.value_index`) in memory: per lens and
sign, each memory's best tokens and each token's memories, by binary search."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


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
        from ffkv.memories.value_index import index_k

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
