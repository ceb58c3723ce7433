"""The mining pass itself: settings, state, one captured forward per batch, checkpoints.

Shared by the single-process runner and the Ray workers (`ffkv.mine.distributed`).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ffkv.mine.topk import TopKState


@dataclass
class MineSettings:
    corpus: str | None = None
    max_sentences: int | None = None
    seed: int = 0
    field: str = "text"
    layers: list[int] | None = None
    dims: list[int] | None = None
    top_k: int = 50
    negative: bool = False
    per_prefix: bool = False
    batch_tokens: int = 2048

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def new_state(mm, s: MineSettings) -> TopKState:
    layers = s.layers if s.layers is not None else list(range(mm.n_layers))
    return TopKState(layers, s.dims, mm.d_m, s.top_k, negative=s.negative, per_prefix=s.per_prefix)


def mine_batches(mm, state: TopKState, token_lists, sids, batches, on_batch=None) -> TopKState:
    """Feed batches (lists of indices into token_lists) through one captured pass each."""
    for bi, idx in batches:
        seqs = [token_lists[i] for i in idx]
        ids, mask = mm.batch(seqs)
        bsids = torch.as_tensor([sids[i] for i in idx], dtype=torch.long)
        mbool = mask.bool()
        mm.capture(ids, mask, layers=state.layers, what=("m",),
                   callback=lambda l, name, m: state.update(l, m, mbool, bsids))
        if on_batch is not None:
            on_batch(bi, sum(map(len, seqs)))
    return state


def save_npz(path: Path, arrays: dict) -> None:
    """np.savez to a temp file, fsync, rename: a reader never sees half a checkpoint."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    try:
        np.savez(tmp, **arrays)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(path: Path, state: TopKState, cursor: int, key: str) -> None:
    save_npz(path, {"__cursor": np.array([cursor]), "__key": np.frombuffer(key.encode(), np.uint8),
                    **state.arrays()})


def load_checkpoint(path: Path, state: TopKState, key: str) -> int:
    """Restore `state` from a checkpoint of the same settings; returns the next batch index."""
    if not path.exists():
        return 0
    with np.load(path, allow_pickle=False) as z:
        if bytes(z["__key"]).decode() != key:
            return 0
        state.load_arrays(z)
        return int(z["__cursor"][0])
