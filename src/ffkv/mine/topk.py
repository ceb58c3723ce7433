"""Streaming top-t trigger examples per key: a mergeable state.

Order is total and documented: score descending, then sentence_id, then position. Because
the order is total, mining in any batch size, shard count or merge order gives the same
lists, and merge(mine(A), mine(B)) == mine(A ∪ B).
"""
from __future__ import annotations

import numpy as np
import torch

SID_MAX = np.iinfo(np.int64).max
POS_MAX = np.iinfo(np.int32).max


def _desc_key(score: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """int64 key, smallest first = highest score, ties by `tie` (0 <= tie < 2^31)."""
    f = (-score).float() + 0.0  # +0.0 folds -0.0 into 0.0
    bits = f.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long() + (1 << 31)
    return (ordered << 31) | tie


def _key_score(key: torch.Tensor) -> torch.Tensor:
    """Inverse of _desc_key's score part."""
    o = ((key >> 31) - (1 << 31)).to(torch.int32)
    bits = torch.where(o >= 0, o, o ^ 0x7FFFFFFF)
    return -bits.view(torch.float32)


class LayerTopK:
    """Top-t (score, sentence_id, position) for n keys of one layer and one sign.

    Stored key-major, (n, t). One prefix per sentence (the default) means a list never holds
    a sentence twice, so (score, sentence_id) orders it totally and packs into one int64:
    a merge is a single topk. With several prefixes per sentence, a lexicographic sort.
    """

    TIE_LIMIT = 1 << 31

    def __init__(self, t: int, n: int, per_prefix: bool = False):
        self.t, self.per_prefix = t, per_prefix
        self.key = torch.full((n, t), torch.iinfo(torch.long).max, dtype=torch.long)
        self.sid = torch.full((n, t), SID_MAX, dtype=torch.long)
        self.pos = torch.full((n, t), POS_MAX, dtype=torch.int32)

    @property
    def score(self) -> torch.Tensor:
        s = _key_score(self.key)
        return s.masked_fill(self.sid == SID_MAX, -float("inf"))

    def _take(self, cols, key, sid, pos) -> None:
        if cols is None:
            self.key, self.sid, self.pos = key, sid, pos
        else:
            self.key[cols], self.sid[cols], self.pos[cols] = key, sid, pos

    def _merge(self, cols, key, sid, pos) -> None:
        """Merge candidates (len(cols), N) into the lists of keys `cols` (None: all keys)."""
        sel = (lambda a: a) if cols is None else (lambda a: a.index_select(0, cols))
        key = torch.cat([sel(self.key), key], 1)
        sid = torch.cat([sel(self.sid), sid], 1)
        pos = torch.cat([sel(self.pos), pos], 1)
        if not self.per_prefix:
            idx = torch.topk(key, self.t, dim=1, largest=False, sorted=True).indices
        else:  # lexicographic (key's score part, sid, pos): stable sorts, last key first
            idx = torch.argsort(pos, dim=1, stable=True)
            for k in (sid, key >> 31):
                idx = idx.gather(1, torch.argsort(k.gather(1, idx), dim=1, stable=True))
            idx = idx[:, : self.t]
        self._take(cols, key.gather(1, idx), sid.gather(1, idx), pos.gather(1, idx))

    def update(self, score: torch.Tensor, sid: torch.Tensor, pos: torch.Tensor, local: torch.Tensor) -> None:
        """Candidates (N, n): score, sid, pos; `local` ranks them by (sid, pos) within the batch."""
        if not self.per_prefix and int(sid.max()) >= self.TIE_LIMIT:
            raise ValueError("sentence ids must be < 2^31")
        tie = local if self.per_prefix else sid
        key = _desc_key(score, tie)
        # Only keys where some candidate beats (or, per prefix, ties) the current t-th can change.
        if self.per_prefix:
            cols = ((key >> 31) <= (self.key[:, -1] >> 31)).any(0).nonzero().squeeze(1)
        else:
            cols = (key < self.key[:, -1]).any(0).nonzero().squeeze(1)
        if cols.numel() == 0:
            return
        key, sid, pos = (a.index_select(1, cols).T for a in (key, sid, pos))
        if key.shape[1] > self.t:
            idx = torch.topk(key, self.t, dim=1, largest=False, sorted=False).indices
            key, sid, pos = key.gather(1, idx), sid.gather(1, idx), pos.gather(1, idx)
        if self.per_prefix:  # batch-local ties are resolved; re-key by the score part alone
            key = (key >> 31) << 31
        self._merge(cols if cols.numel() < self.key.shape[0] else None, key.contiguous(),
                    sid.contiguous(), pos.contiguous())

    def merge(self, other: "LayerTopK") -> None:
        self._merge(None, other.key, other.sid, other.pos)


class TopKState:
    """All layers and signs. Arrays are (t, n_dims) per (sign, layer)."""

    def __init__(self, layers: list[int], dims: list[int] | None, d_m: int, t: int,
                 negative: bool = False, per_prefix: bool = False):
        self.layers, self.t, self.negative, self.per_prefix = list(layers), t, negative, per_prefix
        self.dims = None if dims is None else list(dims)
        self._dim_idx = None if dims is None else torch.as_tensor(self.dims, dtype=torch.long)
        n = d_m if dims is None else len(self.dims)
        self.signs = (1, -1) if negative else (1,)
        self.lists = {(s, l): LayerTopK(t, n, per_prefix) for s in self.signs for l in self.layers}

    @torch.no_grad()
    def update(self, layer: int, m: torch.Tensor, mask: torch.Tensor, sids: torch.Tensor) -> None:
        """m (B, T, d_m) coefficients, mask (B, T) bool, sids (B,) sentence ids."""
        m = m.float()
        if self._dim_idx is not None:
            m = m.index_select(-1, self._dim_idx.to(m.device))
        m = m.cpu()
        mask = mask.cpu().bool()
        sids = sids.cpu()
        B, T, n = m.shape
        row_rank = torch.argsort(torch.argsort(sids))  # local order of rows by sentence id
        for s in self.signs:
            sc = m if s == 1 else -m
            if not bool(mask.all()):
                sc = sc.masked_fill(~mask.unsqueeze(-1), -float("inf"))
            if self.per_prefix:
                cand = sc.reshape(B * T, n)
                pos = torch.arange(T, dtype=torch.int32).repeat(B).unsqueeze(1).expand(B * T, n)
                sid = sids.repeat_interleave(T).unsqueeze(1).expand(B * T, n)
                local = (row_rank.repeat_interleave(T) * T + torch.arange(T).repeat(B)).unsqueeze(1).expand(B * T, n)
            else:
                cand, p = sc.max(dim=1)  # first position among equal maxima
                pos = p.to(torch.int32)
                sid = sids.unsqueeze(1).expand(B, n)
                local = row_rank.unsqueeze(1).expand(B, n)
            self.lists[(s, layer)].update(cand, sid.contiguous(), pos.contiguous(), local.contiguous())

    def merge(self, other: "TopKState") -> "TopKState":
        if (other.layers, other.dims, other.t, other.signs, other.per_prefix) != (
                self.layers, self.dims, self.t, self.signs, self.per_prefix):
            raise ValueError("cannot merge top-k states mined with different settings")
        for k, v in self.lists.items():
            v.merge(other.lists[k])
        return self

    # ---- persistence: plain numeric arrays, no pickles -------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for (s, l), v in self.lists.items():
            tag = f"{'p' if s == 1 else 'n'}{l}"
            out[f"key_{tag}"] = v.key.numpy()
            out[f"sid_{tag}"] = v.sid.numpy()
            out[f"pos_{tag}"] = v.pos.numpy()
        return out

    def load_arrays(self, arrs) -> "TopKState":
        for (s, l), v in self.lists.items():
            tag = f"{'p' if s == 1 else 'n'}{l}"
            v.key = torch.from_numpy(np.array(arrs[f"key_{tag}"]))
            v.sid = torch.from_numpy(np.array(arrs[f"sid_{tag}"]))
            v.pos = torch.from_numpy(np.array(arrs[f"pos_{tag}"]))
        return self

    def rows(self):
        """Yield column arrays (layer, dim, sign, rank, coef, sentence_id, position) per list."""
        for (s, l), v in sorted(self.lists.items(), key=lambda kv: (kv[0][1], -kv[0][0])):
            score, sid, pos = v.score.numpy().T, v.sid.numpy().T, v.pos.numpy().T
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
