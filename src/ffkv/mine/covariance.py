"""The keys' second moment C = E[m mᵀ] of chosen layers, from the mining pass (`ffkv mine
--covariance LAYERS`): ROME's and MEMIT's preconditioner (`ffkv facts edit`), which their own
code gathers in a separate pass of its own (a day and more for a 7B model).

A tracker (`ffkv.mine.trackers`): per batch and layer one product Mᵀ M over the valid tokens
(float32, the captures' precision), summed in float64 for up to `FLUSH` batches and then carried
in exact integer limbs (`ffkv.mine.rules.to_limbs`; flushed too before a checkpoint, a merge or
the table), so merging states (Ray shards) adds integers: associative and order-free, bit for bit.
A resumed pass, or one split into other batches, differs from an unbroken one by float rounding
only (float64 between flushes, float32 within a batch). Converting to limbs costs more than the
product itself (0.38 s against 0.2 s for SmolLM2's 1,536² on this CPU), hence the float64 run
between flushes. State: 32·d_m² bytes per layer (SmolLM2: 75 MB), plus the sums of m.

Table ``key_covariance`` (a public contract): layer int16, dim int32, tokens int64 (valid tokens
seen), mean float64 (E[m_dim]), moment list<float64> (row dim of C: E[m_dim·m_j] for every j of
the layer, in dim order). Read it with `ffkv.store.query.key_covariance(run, layer)`.
"""
from __future__ import annotations

import numpy as np
import torch

from ffkv.mine.groups import layer_groups, unit_of
from ffkv.mine.rules import from_limbs, to_limbs

TABLE = "key_covariance"
FLUSH = 32  # batches summed in float64 before they join the exact limbs


class KeyCovariance:
    name = "covariance"

    def __init__(self, layers: list[int], cov_layers, d_m: int, device=None, group: int = 1):
        self.layers = list(layers)
        self.cov = sorted({int(l) for l in cov_layers})
        missing = [l for l in self.cov if l not in self.layers]
        if missing:
            raise ValueError(f"covariance layers {missing} are not among the mined layers")
        self.n, self.group = int(d_m), int(group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.groups = layer_groups(self.layers, group)  # the pass's layout (MineState checks it)
        self._unit = unit_of(self.groups)
        self.tokens = 0
        self.second = {l: torch.zeros((3, self.n, self.n), dtype=torch.long, device=self.device) for l in self.cov}
        self.first = {l: torch.zeros((3, self.n), dtype=torch.long, device=self.device) for l in self.cov}
        self._acc2 = {l: torch.zeros((self.n, self.n), dtype=torch.float64, device=self.device) for l in self.cov}
        self._acc1 = {l: torch.zeros(self.n, dtype=torch.float64, device=self.device) for l in self.cov}
        self._pending = 0  # batches in the float64 sums

    def flush(self) -> None:
        """The float64 sums into the exact limbs."""
        if self._pending:
            for l in self.cov:
                self.second[l] += to_limbs(self._acc2[l])
                self.first[l] += to_limbs(self._acc1[l])
                self._acc2[l].zero_()
                self._acc1[l].zero_()
            self._pending = 0

    @torch.no_grad()
    def update(self, batch, cap) -> None:
        if cap.layers == self.groups[0]:
            self.tokens += batch.tokens
        want = [(i, l) for i, l in enumerate(cap.layers) if l in self.second]
        if not want:
            return
        blocks, _ = cap.blocks()  # padding is 0 there: it adds nothing to either sum
        n = self.n
        for i, l in want:
            for b in blocks:
                M = b[..., i * n:(i + 1) * n].reshape(-1, n)
                self._acc2[l] += M.T @ M
                self._acc1[l] += M.sum(0, dtype=torch.float64)
        if want[-1][1] == self.cov[-1]:  # a batch is counted once, at its last covariance layer
            self._pending += 1
            if self._pending >= FLUSH:
                self.flush()

    def _check(self, other: "KeyCovariance") -> None:
        if (other.layers, other.cov, other.n) != (self.layers, self.cov, self.n):
            raise ValueError("cannot merge covariance states of different layers")

    def merge(self, other: "KeyCovariance") -> "KeyCovariance":
        self._check(other)
        self.flush()
        other.flush()
        self.tokens += other.tokens
        for l in self.cov:
            self.second[l] += other.second[l].to(self.device)
            self.first[l] += other.first[l].to(self.device)
        return self

    def arrays(self) -> dict[str, np.ndarray]:
        self.flush()
        out = {"tokens": np.array([self.tokens], np.int64)}
        for l in self.cov:
            out[f"second_{l}"] = self.second[l].cpu().numpy()
            out[f"first_{l}"] = self.first[l].cpu().numpy()
        return out

    def load_arrays(self, arrs) -> "KeyCovariance":
        new = {}
        for l in self.cov:
            for name, shape in (("second", (3, self.n, self.n)), ("first", (3, self.n))):
                a = np.asarray(arrs[f"{name}_{l}"])
                if a.shape != shape or a.dtype != np.int64:
                    raise KeyError(f"covariance array {name}_{l} has shape {a.shape}, not {shape}")
                new[(name, l)] = torch.from_numpy(a.copy()).to(self.device)
        self.tokens = int(np.asarray(arrs["tokens"])[0])
        for (name, l), t in new.items():
            getattr(self, name)[l] = t
        for l in self.cov:
            self._acc2[l].zero_()
            self._acc1[l].zero_()
        self._pending = 0
        return self

    def moments(self, l: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer l's (E[m] (n,), E[m mᵀ] (n, n)) float64 over the tokens seen."""
        self.flush()
        N = max(self.tokens, 1)
        return (from_limbs(self.first[l].cpu().numpy()) / N, from_limbs(self.second[l].cpu().numpy()) / N)

    def finish(self, ctx=None) -> dict:
        import pyarrow as pa

        parts = []
        for l in self.cov:
            mean, C = self.moments(l)
            parts.append(pa.table({
                "layer": pa.array(np.full(self.n, l, np.int16)),
                "dim": pa.array(np.arange(self.n, dtype=np.int32)),
                "tokens": pa.array(np.full(self.n, self.tokens, np.int64)),
                "mean": pa.array(mean),
                "moment": pa.FixedSizeListArray.from_arrays(pa.array(C.reshape(-1)), self.n).cast(
                    pa.list_(pa.float64())),
            }))
        return {TABLE: pa.concat_tables(parts)}
