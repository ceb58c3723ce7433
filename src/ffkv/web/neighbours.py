"""Similar memories (issue 26 item 3): the nearest memories of a memory, across all layers, by three
measures, each named where it is shown:

- `value`: cosine similarity of the value vectors v_i (`MemoryModel.values`, row i: what memory i
  writes to the residual stream), the largest first;
- `key`: cosine similarity of the key vectors k_i (`MemoryModel.keys`: the gate keys of a gated FFN),
  the largest first;
- `coactivation`: memories whose top trigger list (sign +1) shares the most sentences with this
  one's (count of shared trigger sentences, then their Jaccard index |A ∩ B| / |A ∪ B|).

The two cosine lists need the model's weights: `nearest` computes the TOP best of every memory in
row chunks (never the whole N × N matrix), in a background thread (`Neighbours.start`), and keeps
the table in memory (`neighbours_table`: layer, dim, kind, rank, n_layer, n_dim, cosine; TOP rows
per memory and kind). A run that holds a `neighbours` table of that form is read instead. The
server does not write it into the run (it writes only annotations): it stores it once in ffkv's
cache folder (`FFKV_CACHE`, default ~/.cache/ffkv), under `neighbours/` and a digest of every key
and value vector of the model (`weights_digest`), so the next server of any run of the same
weights reads it instead of spending minutes of CPU again (SmolLM2: about 4 minutes here).
Co-activation is read from the triggers table on each request.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

TOP = 10
KINDS = ("value", "key")
MEASURES = {"value": "cosine similarity of the value vectors v (what each memory writes), across all layers",
            "key": "cosine similarity of the key vectors k (what each memory reads), across all layers",
            "coactivation": "shared sentences between the two memories' top trigger lists (then their "
                            "Jaccard index)"}


def nearest(x, top: int = TOP, chunk: int = 256, pause=None):
    """(idx, cos): for each row of x (N, d), the `top` other rows of largest cosine similarity,
    largest first (float32; the order of cosines equal to rounding is torch.topk's). A zero row
    has cosine 0 with every row. `pause()`, when given, is called before each chunk of rows (the
    server's background build waits there while a person's request runs)."""
    import torch

    x = torch.as_tensor(x).float()
    n = x.shape[0]
    k = min(top, max(n - 1, 0))
    norm = x.norm(dim=1, keepdim=True)
    u = x / torch.where(norm > 0, norm, torch.ones_like(norm))
    idx = np.zeros((n, k), np.int64)
    cos = np.zeros((n, k), np.float32)
    if k == 0:
        return idx, cos
    for a in range(0, n, chunk):
        if pause is not None:
            pause()
        b = min(a + chunk, n)
        s = u[a:b] @ u.T
        s[torch.arange(b - a), torch.arange(a, b)] = -torch.inf  # not itself
        v, i = torch.topk(s, k, dim=1)
        idx[a:b], cos[a:b] = i.numpy(), v.numpy()
    return idx, cos


def neighbours_table(mm, top: int = TOP, progress=None, pause=None) -> pa.Table:
    """The nearest memories of every memory by value and by key direction (cosine, all layers)."""
    import torch

    L = mm.n_layers
    cols: dict[str, list] = {c: [] for c in ("layer", "dim", "kind", "rank", "n_layer", "n_dim", "cosine")}
    with torch.no_grad():
        for j, kind in enumerate(KINDS):
            mats = [(mm.values(l) if kind == "value" else mm.keys(l)).detach().float().cpu() for l in range(L)]
            d_m = mats[0].shape[0]
            idx, cos = nearest(torch.cat(mats), top, pause=pause)
            n, k = idx.shape
            code = np.repeat(np.arange(n), k)
            cols["layer"].append((code // d_m).astype(np.int16))
            cols["dim"].append((code % d_m).astype(np.int32))
            cols["kind"].append(np.full(n * k, kind, object))
            cols["rank"].append(np.tile(np.arange(1, k + 1, dtype=np.int16), n))
            cols["n_layer"].append((idx.ravel() // d_m).astype(np.int16))
            cols["n_dim"].append((idx.ravel() % d_m).astype(np.int32))
            cols["cosine"].append(cos.ravel())
            if progress:
                progress(j + 1, len(KINDS))
    return pa.table({c: pa.array(np.concatenate(v)) if c != "kind" else pa.array(np.concatenate(v).tolist(), pa.string())
                     for c, v in cols.items()})


def weights_digest(mm) -> str:
    """sha256 of what the cosine lists depend on: every key and value vector of every layer (in
    float32), the list length and the measures."""
    import torch

    h = hashlib.sha256(f"neighbours v1|{TOP}|{','.join(KINDS)}|{mm.n_layers}|{mm.d_m}".encode())
    with torch.no_grad():
        for layer in range(mm.n_layers):
            for w in (mm.keys(layer), mm.values(layer)):
                h.update(np.ascontiguousarray(w.detach().float().cpu().numpy()).tobytes())
    return h.hexdigest()


def cache_path(mm) -> Path:
    from ffkv.files import cache_dir

    return cache_dir() / "neighbours" / f"{weights_digest(mm)[:32]}.parquet"


COLUMNS = ["layer", "dim", "kind", "rank", "n_layer", "n_dim", "cosine"]


class Neighbours:
    """The cosine lists of one server: read from the run's `neighbours` table when it has one,
    else computed from the model's weights in a background thread on first use."""

    def __init__(self, b):
        self.b = b
        self.status, self.error, self.seconds = "absent", "", 0.0
        self.lock = threading.Lock()
        self.by = None  # kind -> (codes sorted, rows) arrays
        if b.run.has_table("neighbours"):
            from ffkv.store import query

            self._take(query.table(b.run, "neighbours"), "run")

    def _take(self, t: pa.Table, source: str) -> None:
        from ffkv.web.tables import ByKey

        by = {}
        kinds = np.asarray(t.column("kind").to_pylist(), object)
        for kind in KINDS:
            sub = t.filter(pa.array(kinds == kind))
            by[kind] = ByKey(sub, self.b.d_m)
        self.by, self.source, self.status = by, source, "ready"

    def start(self) -> None:
        with self.lock:
            if self.status in ("building", "ready"):
                return
            self.status, self.error = "building", ""
        threading.Thread(target=self._build, name="ffkv-neighbours", daemon=True).start()

    def _build(self) -> None:
        t0 = time.time()
        try:
            mm = self.b.model()
            path = cache_path(mm)
            if path.exists():
                try:
                    t = pq.read_table(path)
                    if t.column_names == COLUMNS:
                        self._take(t, f"stored by an earlier server from the same weights ({path})")
                        self.seconds = round(time.time() - t0, 1)
                        self.b.log(f"similar memories read from {path} in {self.seconds} s")
                        return
                except Exception:  # noqa: BLE001 - a damaged cache file is computed again
                    pass
            fg = getattr(self.b, "foreground", None)
            t = neighbours_table(mm, pause=fg.wait if fg is not None else None)
            self.seconds = round(time.time() - t0, 1)
            self.b.log(f"similar memories computed in {self.seconds} s ({t.num_rows:,} rows)")
            try:  # written whole or not at all (temp file, then rename)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                pq.write_table(t, tmp)
                os.replace(tmp, path)
            except OSError as e:
                self.b.log(f"similar memories not stored in {path.parent}: {e}")
            self._take(t, "computed by the server from the model's weights")
        except Exception as e:  # noqa: BLE001 - shown on the memory page, logged
            self.status, self.error = "failed", " ".join(str(e).split())[:300] or type(e).__name__
            self.b.log(f"similar memories failed: {self.error}")

    def wait(self, timeout: float = 600) -> None:
        """Start (if needed) and wait; for tests and benchmarks."""
        self.start()
        t = time.time()
        while self.status == "building" and time.time() - t < timeout:
            time.sleep(0.05)

    def of(self, kind: str, layer: int, dim: int) -> list[dict]:
        rows = self.by[kind].rows(layer, dim)
        rows.sort(key=lambda r: r["rank"])
        return [{"layer": int(r["n_layer"]), "dim": int(r["n_dim"]), "cosine": float(r["cosine"])} for r in rows]


def coactivation(b, layer: int, dim: int, top: int = TOP) -> list[dict]:
    """Memories whose top trigger list (sign +1) shares the most sentences with this memory's."""
    pos = b._lazy("_pos_by_sentence", lambda: _pos_index(b))
    sorted_sent, sorted_code, n_of = pos
    mine = b.trig.indices(layer, dim)
    mine = mine[b.trig_sign[mine] == 1]
    sents = np.unique(b.trig_row[mine])
    if not len(sents):
        return []
    a = np.searchsorted(sorted_sent, sents, "left")
    e = np.searchsorted(sorted_sent, sents, "right")
    counts = np.bincount(np.concatenate([sorted_code[x:y] for x, y in zip(a, e)]),
                         minlength=b.L * b.d_m)  # O(rows), not a sort of them
    counts[b.code(layer, dim)] = 0
    u = np.nonzero(counts)[0]
    if not len(u):
        return []
    shared = counts[u]
    if len(u) > top:  # only those that can be in the top: as many shared sentences as the top-th
        keep = shared >= np.partition(shared, len(u) - top)[len(u) - top]
        u, shared = u[keep], shared[keep]
    jac = shared / (len(sents) + n_of[u] - shared)
    o = np.lexsort((u, -jac, -shared))[:top]
    return [{"layer": int(u[i] // b.d_m), "dim": int(u[i] % b.d_m), "shared": int(shared[i]),
             "jaccard": float(jac[i])} for i in o]


def _pos_index(b):
    """Positive trigger rows ordered by sentence row (their sentence rows and memory codes); and
    each memory's number of such rows."""
    rows = np.nonzero(b.trig_sign == 1)[0]
    sent = b.trig_row[rows]
    order = np.argsort(sent, kind="stable")
    code = b.trig.code[rows]
    n_of = np.bincount(code.astype(np.int64), minlength=b.L * b.d_m)
    return sent[order], code[order], n_of


def similar(b, layer: int, dim: int) -> dict:
    """A memory's similar memories by each measure (the cosine lists once they are computed)."""
    nb = b.neighbours_state
    if nb.status == "absent":
        nb.start()
    out = {"measures": MEASURES, "status": nb.status, "error": nb.error or None,
           "source": getattr(nb, "source", None), "coactivation": coactivation(b, layer, dim)}
    for kind in KINDS:
        out[kind] = nb.of(kind, layer, dim) if nb.status == "ready" else None
    return out
