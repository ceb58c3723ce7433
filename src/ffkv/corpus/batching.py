"""Pack token sequences of similar length into batches under a token budget."""
from __future__ import annotations

import numpy as np


def pack(lengths, batch_tokens: int = 2048, max_batch: int = 64) -> list[np.ndarray]:
    """Index batches such that max_len × batch_size ≤ batch_tokens; sorted by length so
    padding stays small. Deterministic: ties in length keep input order."""
    lengths = np.asarray(lengths)
    if len(lengths) == 0:
        return []
    order = np.argsort(lengths, kind="stable")
    batches, cur, cur_max = [], [], 0
    for i in order:
        L = int(lengths[i])
        new_max = max(cur_max, L)
        if cur and (new_max * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch):
            batches.append(np.array(cur))
            cur, new_max = [], L
        cur.append(int(i))
        cur_max = new_max
    if cur:
        batches.append(np.array(cur))
    return batches


def padding_share(lengths, batches) -> float:
    """Share of the padded (B, T) grid that is padding."""
    lengths = np.asarray(lengths)
    total = sum(int(lengths[b].max()) * len(b) for b in batches)
    return 1.0 - float(lengths.sum()) / total if total else 0.0
