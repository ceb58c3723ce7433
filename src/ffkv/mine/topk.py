"""Streaming top-t trigger examples per key: a mergeable state.

Order is total and documented: score descending, then sentence_id, then position. Because
the order is total, mining in any batch size, shard count or merge order gives the same
lists, and merge(mine(A), mine(B)) == mine(A ∪ B).
"""
from __future__ import annotations

import numpy as np
import torch

from ffkv.mine import fused_cuda
from ffkv.mine.groups import layer_groups, unit_of
from ffkv.mine.rules import pack_key

SID_MAX = np.iinfo(np.int64).max
POS_MAX = np.iinfo(np.int32).max


def _desc_key(score: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """int64 key, smallest first = highest score, ties by `tie` (0 <= tie < 2^31)."""
    f = (-score).float() + 0.0  # +0.0 folds -0.0 into 0.0
    return pack_key(f.view(torch.int32).long(), tie)


def _key_score(key: torch.Tensor) -> torch.Tensor:
    """Inverse of _desc_key's score part."""
    o = ((key >> 31) - (1 << 31)).to(torch.int32)
    bits = torch.where(o >= 0, o, o ^ 0x7FFFFFFF)
    return -bits.view(torch.float32)


class LayerTopK:
    """Top-t (score, sentence_id, position) for n keys of one layer and one sign.

    Stored key-major, (n, t). One prefix per sentence (the default) means a list never holds
    a sentence twice, so (score, sentence_id) orders it totally and packs into one int64:
    a merge is a single unsorted topk, and the sentence id is read back from the key.
    Lists are sorted only when read. With several prefixes per sentence, a lexicographic sort.
    """

    TIE_LIMIT = 1 << 31
    EMPTY = torch.iinfo(torch.long).max

    def __init__(self, t: int, n: int, per_prefix: bool = False, device=None):
        self.t, self.per_prefix = t, per_prefix
        self._key = torch.full((n, t), self.EMPTY, dtype=torch.long, device=device)
        self._pos = torch.full((n, t), POS_MAX, dtype=torch.int32, device=device)
        self._sid = torch.full((n, t), SID_MAX, dtype=torch.long, device=device) if per_prefix else None
        self._worst = torch.full((n,), self.EMPTY, dtype=torch.long, device=device)  # largest key per list
        self._dirty = False

    def _sort(self) -> None:
        if self._dirty:  # keys are unique per list (one sentence once), EMPTY slots identical
            idx = torch.argsort(self._key, dim=1)
            self._key, self._pos = self._key.gather(1, idx), self._pos.gather(1, idx)
            self._dirty = False

    @property
    def key(self) -> torch.Tensor:
        self._sort()
        return self._key

    @property
    def pos(self) -> torch.Tensor:
        self._sort()
        return self._pos

    @property
    def sid(self) -> torch.Tensor:
        if self.per_prefix:
            return self._sid
        key = self.key
        return torch.where(key == self.EMPTY, SID_MAX, key & (self.TIE_LIMIT - 1))

    @property
    def score(self) -> torch.Tensor:
        s = _key_score(self.key)
        return s.masked_fill(self.sid == SID_MAX, -float("inf"))

    def set_arrays(self, key: torch.Tensor, sid: torch.Tensor, pos: torch.Tensor) -> None:
        dev = self._key.device
        key, sid, pos = key.to(dev), sid.to(dev), pos.to(dev)
        self._key, self._pos = key, pos
        if self.per_prefix:
            self._sid = sid
            self._worst = key[:, -1].clone()
        else:
            self._worst = key.max(1).values
            self._dirty = True

    def _merge(self, cols, key, sid, pos) -> None:
        """Merge candidates (len(cols), N) into the lists of keys `cols` (None: all keys)."""
        sel = (lambda a: a) if cols is None else (lambda a: a.index_select(0, cols))
        key = torch.cat([sel(self._key), key], 1)
        pos = torch.cat([sel(self._pos), pos], 1)
        if not self.per_prefix:
            top = torch.topk(key, self.t, dim=1, largest=False, sorted=False)
            nkey, npos, worst = top.values, pos.gather(1, top.indices), top.values.max(1).values
            self._dirty = True
        else:  # lexicographic (key's score part, sid, pos): stable sorts, last key first
            sid = torch.cat([sel(self._sid), sid], 1)
            idx = torch.argsort(pos, dim=1, stable=True)
            for k in (sid, key >> 31):
                idx = idx.gather(1, torch.argsort(k.gather(1, idx), dim=1, stable=True))
            idx = idx[:, : self.t]
            nkey, npos, nsid = key.gather(1, idx), pos.gather(1, idx), sid.gather(1, idx)
            worst = nkey[:, -1]
        if cols is None:
            self._key, self._pos, self._worst = nkey, npos, worst
            if self.per_prefix:
                self._sid = nsid
        else:
            self._key[cols], self._pos[cols], self._worst[cols] = nkey, npos, worst
            if self.per_prefix:
                self._sid[cols] = nsid

    def update_rows(self, score: torch.Tensor, sids: torch.Tensor, pos: torch.Tensor) -> None:
        """One candidate per sentence and key: score and pos (B, n), sids (B,), all < 2^31
        (`ffkv.mine.trackers.Batch` checks them on the host)."""
        if not self.per_prefix and fused_cuda.available(self._key.device):
            self._sort()  # the kernel keeps the lists sorted, and needs them so, row-major
            self._key, self._pos = self._key.contiguous(), self._pos.contiguous()
            if fused_cuda.topk(score, pos.to(torch.int32), sids, self._key, self._pos):
                self._worst = None  # the lists are sorted: their last column, when asked for
                return
        key = _desc_key(score.T.contiguous(), sids.unsqueeze(0))  # (n, B): one row per list
        pos = pos.T.contiguous()
        # Only lists where some candidate beats the current t-th can change; when most can,
        # merging all of them is cheaper than selecting.
        if self._worst is None:
            self._worst = self._key[:, -1].clone()
        cols = (key < self._worst.unsqueeze(1)).any(1).nonzero().squeeze(1)
        if cols.numel() == 0:
            return
        if cols.numel() > key.shape[0] // 2:
            cols = None
        else:
            key, pos = key.index_select(0, cols), pos.index_select(0, cols)
        self._merge(cols, key, None, pos)

    def update(self, score: torch.Tensor, sid: torch.Tensor, pos: torch.Tensor, local: torch.Tensor) -> None:
        """Per-prefix candidates (N, n): score, sid, pos; `local` ranks them by (sid, pos) in the batch."""
        key = _desc_key(score, local)
        # Only keys where some candidate ties or beats the current t-th can change.
        cols = ((key >> 31) <= (self._worst >> 31)).any(0).nonzero().squeeze(1)
        if cols.numel() == 0:
            return
        key, sid, pos = (a.index_select(1, cols).T for a in (key, sid, pos))
        if key.shape[1] > self.t:
            idx = torch.topk(key, self.t, dim=1, largest=False, sorted=False).indices
            key, sid, pos = key.gather(1, idx), sid.gather(1, idx), pos.gather(1, idx)
        key = (key >> 31) << 31  # batch-local ties are resolved; re-key by the score part alone
        self._merge(cols if cols.numel() < self._key.shape[0] else None, key.contiguous(),
                    sid.contiguous(), pos.contiguous())

    def merge(self, other: "LayerTopK") -> None:
        self._merge(None, other._key, other._sid, other._pos)


RUN_LIMIT = 16  # more runs of equal length than this: one masked pass is cheaper than many views


def length_runs(lengths, T: int) -> list[tuple[int, int, int]] | None:
    """Rows of equal length as (a, b, L) runs, read on the host from the rows' lengths.

    None when views cannot stand for the mask: a row with no token, or more than RUN_LIMIT runs.
    """
    ln = [int(x) for x in lengths]
    if not ln or min(ln) <= 0 or max(ln) > T:
        return None
    runs, a = [], 0
    for b in range(1, len(ln) + 1):
        if b == len(ln) or ln[b] != ln[a]:
            runs.append((a, b, ln[a]))
            a = b
    return runs if len(runs) <= RUN_LIMIT else None


def mask_runs(mask: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """`length_runs` of a (B, T) mask when it is right-padded (reads the mask on the host)."""
    B, T = mask.shape
    lengths = mask.sum(1)
    if not bool((mask == (torch.arange(T, device=mask.device) < lengths.unsqueeze(1))).all()):
        return None
    return length_runs(lengths.tolist(), T)


def row_best(m: torch.Tensor, mask: torch.Tensor, sign: int, runs=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and key, the best (sign · m) over valid positions and its first position.

    (B, T, n) -> (B, n) scores and int32 positions, on m's device. Right-padded rows of equal
    length (`runs`, from `length_runs` on the host; by default read from the mask) are reduced as
    views, with no masked copy; max-with-indices along T is slow on CPU, so the first position
    comes from a weighted amax over `m == best`. With runs=None, one masked pass.
    """
    B, T, n = m.shape
    if runs is False:
        runs = mask_runs(mask)
    if runs is None:
        fill = -float("inf") if sign == 1 else float("inf")
        runs, m = [(0, B, T)], m.masked_fill(~mask.unsqueeze(-1), fill)
    score = torch.empty((B, n), dtype=m.dtype, device=m.device)
    pos = torch.empty((B, n), dtype=torch.int32, device=m.device)
    wdtype = torch.uint8 if T < (1 << 8) else torch.int16 if T < (1 << 15) else torch.int32
    w = torch.arange(T, 0, -1, dtype=wdtype, device=m.device).unsqueeze(1)  # first position weighs most
    for a, b, L in runs:
        v = m[a:b, :L]
        best = v.amax(1) if sign == 1 else v.amin(1)
        hit = v >= best.unsqueeze(1) if sign == 1 else v <= best.unsqueeze(1)  # i.e. == best
        first = (hit.view(torch.uint8) if wdtype == torch.uint8 else hit.to(wdtype)).mul_(w[:L]).amax(1)
        score[a:b] = best if sign == 1 else -best
        pos[a:b] = (T - first).to(torch.int32)
    return score, pos


class LayerSlice:
    """One layer's lists inside its group's `LayerTopK`: rows [a, b) of the group's key axis."""

    def __init__(self, unit: LayerTopK, a: int, b: int):
        self.unit, self.a, self.b = unit, a, b

    def __getattr__(self, name):  # key, pos, sid, score: the group's, this layer's rows
        if name not in ("key", "pos", "sid", "score"):
            raise AttributeError(name)
        return getattr(self.unit, name)[self.a:self.b]


class TopKState:
    """Top-t trigger lists of all layers and signs: a tracker (`ffkv.mine.trackers`).

    Lists are (G·n, t) per sign and group of layers (`ffkv.mine.groups.layer_groups`), kept on
    `device`, the captures' device; `lists[(sign, layer)]` reads one layer's rows.
    """

    name = "topk"

    def __init__(self, layers: list[int], dims: list[int] | None, d_m: int, t: int,
                 negative: bool = False, per_prefix: bool = False, device=None, group: int = 1):
        self.layers, self.t, self.negative, self.per_prefix = list(layers), t, negative, per_prefix
        self.dims = None if dims is None else list(dims)
        self.d_m, self.device, self.group = d_m, device, int(group)
        n = self.n = d_m if dims is None else len(self.dims)
        self.signs = (1, -1) if negative else (1,)
        self.groups = layer_groups(self.layers, group)
        self._unit = unit_of(self.groups)
        self.units = {(s, g): LayerTopK(t, n * len(g), per_prefix, device) for s in self.signs for g in self.groups}

    @property
    def lists(self) -> dict:
        """(sign, layer) -> that layer's lists (`LayerSlice`: key, pos, sid, score of (n, t))."""
        n = self.n
        return {(s, l): LayerSlice(self.units[(s, g)], i * n, (i + 1) * n)
                for s in self.signs for l, (g, i) in self._unit.items()}

    @torch.no_grad()
    def update(self, batch, cap) -> None:
        """Fold one group of one batch in: `cap.m` (B, T, G·n) on the lists' device, `batch` its rows."""
        mask, sids = batch.mask, batch.sids
        g = self._unit[cap.layers[0]][0]
        if g != cap.layers:
            raise ValueError(f"layers {list(cap.layers)} arrived where the lists hold {list(g)}")
        if self.per_prefix:
            m = cap.m
            B, T, n = m.shape
            dev = m.device
            row_rank = torch.argsort(torch.argsort(sids))  # local order of rows by sentence id
            ar = torch.arange(T, device=dev)
            pos = ar.to(torch.int32).repeat(B).unsqueeze(1).expand(B * T, n).contiguous()
            sid = sids.repeat_interleave(T).unsqueeze(1).expand(B * T, n).contiguous()
            local = (row_rank.repeat_interleave(T) * T + ar.repeat(B)).unsqueeze(1).expand(B * T, n).contiguous()
        for s in self.signs:
            if self.per_prefix:
                sc = m if s == 1 else -m
                if batch.runs is None or batch.padded:
                    sc = sc.masked_fill(~mask.unsqueeze(-1), -float("inf"))
                self.units[(s, g)].update(sc.reshape(B * T, n), sid, pos, local)
            else:
                score, p = cap.best(s)
                self.units[(s, g)].update_rows(score, sids, p)

    def _settings(self):
        return (self.layers, self.dims, self.t, self.signs, self.per_prefix)

    def merge(self, other: "TopKState") -> "TopKState":
        if other._settings() != self._settings():
            raise ValueError("cannot merge top-k states mined with different settings")
        if other.groups != self.groups:  # another layout: through its per-layer arrays
            other = TopKState(self.layers, self.dims, self.d_m, self.t, self.negative, self.per_prefix,
                              self.device, self.group).load_arrays(other.arrays())
        for k, v in self.units.items():
            v.merge(other.units[k])
        return self

    # ---- persistence: plain numeric arrays, one set per layer, whatever the grouping ----------
    def arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for (s, l), v in self.lists.items():
            tag = f"{'p' if s == 1 else 'n'}{l}"
            out[f"key_{tag}"] = v.key.cpu().numpy()
            out[f"sid_{tag}"] = v.sid.cpu().numpy()
            out[f"pos_{tag}"] = v.pos.cpu().numpy()
        return out

    def load_arrays(self, arrs) -> "TopKState":
        for (s, g), v in self.units.items():
            tags = [f"{'p' if s == 1 else 'n'}{l}" for l in g]
            v.set_arrays(*(torch.cat([torch.from_numpy(np.array(arrs[f"{a}_{t}"])) for t in tags])
                           for a in ("key", "sid", "pos")))
        return self

    def rows(self):
        """Yield column arrays (layer, dim, sign, rank, coef, sentence_id, position) per list."""
        for (s, l), v in sorted(self.lists.items(), key=lambda kv: (kv[0][1], -kv[0][0])):
            score, sid, pos = v.score.cpu().numpy().T, v.sid.cpu().numpy().T, v.pos.cpu().numpy().T
            t, n = score.shape
            dims = np.arange(n) if self.dims is None else np.asarray(self.dims)
            ok = np.isfinite(score)
            # (t, n) -> rows ordered by dim then rank
            rank = np.broadcast_to(np.arange(1, t + 1)[:, None], (t, n))
            dimg = np.broadcast_to(dims[None, :], (t, n))
            sel = ok.T
            yield {
                "layer": np.full(int(sel.sum()), l, np.int16),
                "dim": dimg.T[sel].astype(np.int32),
                "sign": np.full(int(sel.sum()), s, np.int8),
                "rank": rank.T[sel].astype(np.int16),
                "coef": (s * score.T[sel]).astype(np.float32),
                "sentence_id": sid.T[sel].astype(np.int64),
                "position": pos.T[sel].astype(np.int32),
            }

    def finish(self, ctx) -> dict:
        """The `triggers` table."""
        return {"triggers": triggers_table(self, ctx.sentence_batches())}


def next_tokens(sids: np.ndarray, positions: np.ndarray, sentences) -> tuple[np.ndarray, np.ndarray]:
    """The token after `positions` in sentences `sids`: (int32 tokens, bool whether there is one).

    `sentences`: a table, or an iterable of tables or record batches, with sentence_id and
    token_ids; read one batch at a time, so a corpus of any size is never held whole."""
    if hasattr(sentences, "column"):
        sentences = [sentences]
    order = np.argsort(sids, kind="stable")
    ss = sids[order]
    tok, has = np.zeros(len(sids), np.int32), np.zeros(len(sids), bool)
    for b in sentences:
        sid_col = np.asarray(b.column("sentence_id").to_numpy())
        lo, hi = np.searchsorted(ss, sid_col, "left"), np.searchsorted(ss, sid_col, "right")
        cnt = hi - lo
        if not cnt.any():
            continue
        col = b.column("token_ids")
        toks = col.combine_chunks() if hasattr(col, "combine_chunks") else col
        flat = toks.values.to_numpy(zero_copy_only=False)
        offs = toks.offsets.to_numpy()
        row = np.repeat(np.arange(len(sid_col)), cnt)  # each request's row in this batch
        req = order[np.repeat(lo, cnt) + np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)]
        nxt = offs[row] + positions[req].astype(np.int64) + 1
        ok = nxt < offs[row + 1]
        has[req] = ok
        tok[req] = np.where(ok, flat[np.minimum(nxt, max(len(flat) - 1, 0))] if len(flat) else 0, 0)
    return tok, has


def triggers_table(state: TopKState, sentences):
    """State (a TopKState, or a MineState holding one) -> the `triggers` table, with next_token
    looked up in the sentences (a table, or batches of one: `next_tokens`)."""
    import pyarrow as pa

    state = getattr(state, "topk", state)
    parts = list(state.rows())
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    next_tok, has = next_tokens(cols["sentence_id"], cols["position"], sentences)
    cols["next_token"] = pa.array(next_tok, mask=~has)
    return pa.table(cols)
