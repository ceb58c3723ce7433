"""The tracker protocol of the mining pass, and what a tracker sees of one batch.

A tracker is a mergeable state fed by the one captured forward pass of `ffkv mine`
(`ffkv.mine.topk.TopKState`: top-t triggers; `ffkv.mine.stats.KeyStats`: histograms,
summaries, quantile samples, positions). Its verbs:

- ``update(batch, cap)``: fold one group of layers of one batch in (`ffkv.mine.groups.layer_groups`:
  the layers a tracker's state is laid out by). `cap.m` is their (B, T, G·n) coefficients side by side on
  the key axis, on the captures' device, and the state lives on the same device: no (B, T, n)
  tensor leaves it, and nothing reads device data on the host (a test runs `update` on the
  "meta" device). What the host knows of a batch (lengths, runs of equal length, sentence ids)
  comes in `Batch`, built once per batch before the forward pass.
- ``merge(other)``: fold a state of the same settings in (Ray shards, merged halves). Exact:
  counts are integers, sums are exact integer limbs, selections follow total orders, so
  merge(mine(A), mine(B)) == mine(A ∪ B) bit for bit, in any order.
- ``arrays()`` / ``load_arrays(arrays)``: plain numeric arrays (npz checkpoints, Ray results).
- ``finish(ctx) -> {table name: pyarrow.Table}``: the tables it writes.

`MineState` holds the trackers of one pass and feeds them; the mine step (`ffkv.steps.mine`)
declares which trackers exist and which tables each writes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ffkv.mine import fused_cuda, stats_cpu
from ffkv.mine.topk import length_runs, mask_runs, row_best

SID_LIMIT = (1 << 31) - 1  # sentence ids must be < 2^31 - 1 (top-k keys and sample hashes pack them)


def to_device(values, dtype, device) -> torch.Tensor:
    """A small host array on `device`; on CUDA through pinned memory without blocking, so the host
    does not wait for the device's queue (`ffkv.model.memories.pad_rows` copies the batch so)."""
    t = torch.as_tensor(values, dtype=dtype)
    dev = torch.device(device)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t if dev.type == "cpu" else t.to(dev)


@dataclass
class Batch:
    """One batch as the host knows it, built once before its forward pass.

    mask (B, T) bool and sids (B,) int64 live on the captures' device; lengths, runs (`length_runs`:
    right-padded rows of equal length as (a, b, L), or None when one masked pass is used),
    tokens (valid tokens) and padded (whether any position is padding) are host values.
    """
    mask: torch.Tensor
    sids: torch.Tensor
    lengths: list[int]
    runs: list[tuple[int, int, int]] | None
    tokens: int
    padded: bool
    right_padded: bool = True  # row i's valid tokens are positions [0, lengths[i])

    def lengths_on(self, device) -> torch.Tensor:
        """(B,) int32 row lengths on `device`, made once per batch (the fused CUDA read takes them)."""
        t = self.__dict__.get("_len")
        if t is None or t.device != torch.device(device):
            t = self.__dict__["_len"] = to_device(self.lengths, torch.int32, device)
        return t

    def weights(self, dtype=torch.float32) -> torch.Tensor:
        """(1, B·T) the mask as numbers (1 valid, 0 padding), on the device; made once per batch."""
        w = self.__dict__.get("_w")
        if w is None or w.dtype != dtype:
            w = self.__dict__["_w"] = self.mask.reshape(1, -1).to(dtype)
        return w

    @classmethod
    def from_lengths(cls, lengths, sids, mask: torch.Tensor) -> "Batch":
        """The rows of a right-padded batch: token counts and sentence ids known on the host."""
        lengths = [int(x) for x in lengths]
        sids = [int(x) for x in sids]
        if sids and (min(sids) < 0 or max(sids) >= SID_LIMIT):
            raise ValueError(f"sentence ids must lie in [0, 2^31 - 1), got {min(sids)}..{max(sids)}")
        B, T = mask.shape
        return cls(mask=mask.bool(), sids=to_device(sids, torch.long, mask.device),
                   lengths=lengths, runs=length_runs(lengths, T), tokens=sum(lengths),
                   padded=sum(lengths) < B * T)

    @classmethod
    def from_mask(cls, mask: torch.Tensor, sids) -> "Batch":
        """Any (B, T) mask (read on the host once); for callers outside the mining loop."""
        mask = mask.bool()
        B, T = mask.shape
        sids_t = torch.as_tensor(sids, dtype=torch.long).to(mask.device)
        s = sids_t.tolist()
        if s and (min(s) < 0 or max(s) >= SID_LIMIT):
            raise ValueError("sentence ids must lie in [0, 2^31 - 1)")
        lengths = mask.sum(1).tolist()
        runs = mask_runs(mask)
        return cls(mask=mask, sids=sids_t, lengths=lengths, runs=runs, tokens=int(sum(lengths)),
                   padded=int(sum(lengths)) < B * T, right_padded=runs is not None)


class LayerCapture:
    """One group of layers' coefficients m (B, T, G·n) in one batch (layer by layer on the key
    axis), with what several trackers share: each row's best coefficient per key and sign
    (`best`, computed once) and the valid tokens as views (`blocks`).

    `signs` and `stats` say what the trackers will ask for: where a compiled read runs (Triton on
    CUDA, `ffkv.mine.fused_cuda`; numba on a CPU, `ffkv.mine.stats_cpu`), one read of m answers
    all of it at the first question."""

    def __init__(self, layers, m: torch.Tensor, batch: Batch, signs=(1,), stats: bool = False,
                 aux: dict | None = None):
        self.layers = tuple(layers) if isinstance(layers, (tuple, list)) else (int(layers),)
        self.layer, self.raw, self.batch = self.layers[0], m, batch
        # other captures that trackers `need` (`MineState.needs`), name -> one (B, T, n) per layer
        # of the group, the mined dims kept: g, the gate pre-activations (`ffkv.mine.regimes`)
        self.aux = dict(aux or {})
        self.n = m.shape[-1]
        self._m = m if m.dtype == torch.float32 else None
        self._best: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._want = (tuple(signs), bool(stats))
        self._fused = None  # None: not tried; False: not here; else the kernel's (hist, sums)

    @property
    def m(self) -> torch.Tensor:
        """The coefficients as float32 (cast once, where the captures came in another dtype)."""
        if self._m is None:
            self._m = self.raw.float()
        return self._m

    def _read(self):
        """One compiled read of the captures, where one runs: Triton on CUDA, numba on a CPU."""
        if self._fused is None:
            self._fused = False
            dev = self.raw.device
            r = None
            if self.batch.right_padded and fused_cuda.available(dev):
                r = fused_cuda.capture(self.raw, self.batch.lengths_on(dev), fused_cuda.bin_lut(dev), *self._want)
            elif stats_cpu.available(dev):
                r = stats_cpu.capture(self.m, self.batch.mask, fused_cuda.bin_lut(dev), *self._want)
            if r is not None:
                self._best.update(r[0])
                self._fused = r[1:]
        return self._fused

    def best(self, sign: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, n) best sign·m per row and key, and its first position (`ffkv.mine.topk.row_best`)."""
        if sign not in self._best:
            self._read()
        if sign not in self._best:
            self._best[sign] = row_best(self.m, self.batch.mask, sign, self.batch.runs)
        return self._best[sign]

    def hist_sums(self):
        """(hist (NB, n), sums of m and m² (2, n) float64) from the compiled read, or None (the
        tracker computes them itself)."""
        r = self._read()
        return r if r and r[0] is not None else None

    def blocks(self) -> tuple[list[torch.Tensor], int]:
        """The valid tokens as (b, L, n) views, and how many padded zeros they hold.

        Runs of equal length are views with no copy; otherwise one block with padding set to 0.0,
        whose count (B·T − tokens) a histogram takes off its zero bin.
        """
        b = self.batch
        if b.runs is not None:
            return [self.m[a:e, :L] for a, e, L in b.runs], 0
        return [self.m.masked_fill(~b.mask.unsqueeze(-1), 0.0)], b.mask.numel() - b.tokens


class MineState:
    """The trackers of one mining pass, fed from one capture per batch.

    `update(layer, m, batch)` takes the raw capture (B, T, d_m) of one layer and keeps the mined
    dims. At the last layer of a group (`ffkv.mine.groups`, the trackers' layout) it sets the group's
    captures side by side, casts to float32 on their device and hands one `LayerCapture` to every
    tracker.
    """

    def __init__(self, trackers: dict, layers: list[int], dims: list[int] | None, device=None):
        self.trackers = dict(trackers)
        self.layers = list(layers)
        self.dims = None if dims is None else list(dims)
        self._dim_idx = None if dims is None else torch.as_tensor(self.dims, dtype=torch.long, device=device)
        layouts = {tuple(getattr(t, "groups", [(l,) for l in self.layers])) for t in self.trackers.values()}
        if len(layouts) > 1:
            raise ValueError("the trackers of one pass must group their layers alike")
        self.groups = list(layouts.pop()) if layouts else [(l,) for l in self.layers]
        self._last = {g[-1]: g for g in self.groups}
        self._signs = tuple(sorted({s for t in self.trackers.values() for s in getattr(t, "signs", (1,))},
                                   reverse=True)) or (1,)
        self._stats = "stats" in self.trackers
        self._held: list[tuple[int, torch.Tensor]] = []
        self._aux_held: dict[str, list[torch.Tensor]] = {}
        # captures beside m that some tracker needs (e.g. "g": `ffkv.mine.regimes`), in
        # `ffkv.model.memories.QUANTITIES` names
        self.needs = tuple(sorted({q for t in self.trackers.values() for q in getattr(t, "needs", ())}))
        # trackers that read each layer as it comes (`update_layer`): what they need beside m is
        # read and let go at once, not held for the group (10 of SmolLM2's gate captures, 126 MB a
        # batch, kept the allocator from reusing their memory: page faults on every fresh one)
        self._per_layer = [t for t in self.trackers.values() if hasattr(t, "update_layer")]
        self._grouped = [t for t in self.trackers.values() if not hasattr(t, "update_layer")]
        self._held_needs = tuple(sorted({q for t in self._grouped for q in getattr(t, "needs", ())}))
        self._buf: torch.Tensor | None = None  # the groups' captures side by side, reused batch to batch

    @property
    def topk(self):
        return self.trackers["topk"]

    @property
    def stats(self):
        return self.trackers.get("stats")

    @torch.no_grad()
    def update(self, layer: int, m: torch.Tensor, batch: Batch, aux: dict | None = None) -> None:
        """`aux`: the layer's other captures (B, T, d_m) by name, one for each of `needs`."""
        if self._dim_idx is not None:
            m = m.index_select(-1, self._dim_idx)
        self._held.append((layer, m))
        got = {}
        for q in self.needs:
            t = (aux or {}).get(q)
            if t is None:
                raise RuntimeError(f"layer {layer}: the trackers need capture {q!r} beside m")
            got[q] = t if self._dim_idx is None else t.index_select(-1, self._dim_idx)
        for t in self._per_layer:
            t.update_layer(layer, m, got, batch)
        for q in self._held_needs:
            self._aux_held.setdefault(q, []).append(got[q])
        g = self._last.get(layer)
        if g is None:
            return
        held, self._held = self._held, []
        aux_held, self._aux_held = self._aux_held, {}
        if tuple(l for l, _ in held) != g:
            raise RuntimeError(f"layers {[l for l, _ in held]} captured where the trackers expect {list(g)}")
        xs = [x for _, x in held]
        # float32 for the torch paths; the fused CUDA kernel reads the captures' own dtype
        dtype = xs[0].dtype if fused_cuda.available(xs[0].device) else torch.float32
        if len(held) == 1:
            m = xs[0].to(dtype)
        else:  # into one reused buffer: a fresh 100 MB tensor per group pays its page faults
            # again on a CPU (cat 35 ms, into the buffer 6 ms), and the cast comes free
            shape = (*xs[0].shape[:-1], sum(x.shape[-1] for x in xs))
            need = math.prod(shape)
            buf = self._buf
            if buf is None or buf.numel() < need or buf.device != xs[0].device or buf.dtype != dtype:
                self._buf = buf = None
                self._buf = buf = torch.empty(need, dtype=dtype, device=xs[0].device)
            m = torch.cat(xs, -1, out=buf[:need].view(shape))
        cap = LayerCapture(g, m, batch, self._signs, self._stats, aux_held)
        for t in self._grouped:
            t.update(batch, cap)

    def merge(self, other: "MineState") -> "MineState":
        if set(other.trackers) != set(self.trackers):
            raise ValueError("cannot merge mining states with different trackers")
        for k, t in self.trackers.items():
            t.merge(other.trackers[k])
        return self

    def arrays(self) -> dict[str, np.ndarray]:
        """Top-k arrays under their own names (as checkpoints always had them), others prefixed."""
        out = {}
        for k, t in self.trackers.items():
            out.update({(a if k == "topk" else f"{k}__{a}"): v for a, v in t.arrays().items()})
        return out

    def load_arrays(self, arrs) -> "MineState":
        """Restore every tracker; KeyError when `arrs` lacks one (a checkpoint of other trackers)."""
        names = set(arrs.files) if hasattr(arrs, "files") else set(arrs.keys())
        parts = {}
        for k in self.trackers:  # every tracker's arrays are there before any is loaded
            pre = f"{k}__"
            parts[k] = arrs if k == "topk" else {a[len(pre):]: arrs[a] for a in names if a.startswith(pre)}
            if not parts[k]:
                raise KeyError(f"no arrays of tracker {k!r}")
        for k, t in self.trackers.items():
            t.load_arrays(parts[k])
        return self

    def finish(self, ctx) -> dict:
        """Every tracker's tables, {name: pyarrow.Table}."""
        out = {}
        for t in self.trackers.values():
            out.update(t.finish(ctx))
        return out


def feed(tracker, layer: int, m: torch.Tensor, mask: torch.Tensor, sids) -> None:
    """Update one tracker with one layer of a batch given by any mask (tests, small callers)."""
    batch = Batch.from_mask(mask, sids)
    tracker.update(batch, LayerCapture(layer, m.float(), batch))


# Ops that only make views or allocate: no kernel runs for them on a GPU.
_NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "view", "slice", "select", "expand", "reshape", "as_strided", "unsqueeze", "squeeze", "t", "transpose",
    "permute", "alias", "detach", "_reshape_alias", "empty", "empty_strided", "resize_", "lift_fresh", "unbind",
    "split", "chunk", "expand_as", "view_as", "contiguous", "flatten", "_unsafe_view",
    "to"))  # a `to` that converts counts its copy (a child op); a leaf `to` changed nothing


def count_ops(fn) -> int:
    """Aten ops that do work (leaf ops of torch.profiler's CPU trace, views and allocations left
    out) while `fn()` runs, and the fused path's Triton launches, one each whatever they run
    inside (in Triton's CPU interpreter, host copies): the CPU proxy of a GPU's kernel launches
    (issue 24)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    evs = list(p.events())
    launches = sum(1 for e in evs if e.name == fused_cuda.KERNEL)
    ev = []
    for e in evs:
        if not e.name.startswith("aten::"):
            continue
        par = e.cpu_parent
        while par is not None and par.name != fused_cuda.KERNEL:
            par = par.cpu_parent
        if par is None:  # not inside a launch
            ev.append(e)
    parents = set()
    for e in ev:
        par = e.cpu_parent
        while par is not None and not par.name.startswith("aten::"):
            par = par.cpu_parent
        if par is not None:
            parents.add(par.id)
    return launches + sum(1 for e in ev if e.id not in parents and e.name not in _NO_KERNEL)


def tracker_ops_per_layer(state: MineState, ms: list, batch: Batch) -> float:
    """`count_ops` of feeding one batch's captures `ms` (one (B, T, n) per layer of `state`) to
    the trackers, per layer."""
    def feed_all():
        for l, m in zip(state.layers, ms):
            state.update(l, m, batch)
    return count_ops(feed_all) / len(state.layers)
