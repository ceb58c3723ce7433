"""Pack token sequences of similar length into batches under a token budget."""
from __future__ import annotations

import numpy as np


def pack(lengths, batch_tokens: int = 2048, max_batch: int = 64, ratio: float | None = None) -> list[np.ndarray]:
    """Index batches such that max_len × batch_size ≤ batch_tokens and batch_size ≤ max_batch;
    sorted by length so padding stays small. Deterministic: ties in length keep input order.

    With `ratio`, a batch also ends when a length exceeds `ratio` × its shortest: padding stays
    under 1 − 1/ratio (a third for 1.5). `mutate` re-scores with ratio=1.5, max_batch=256: on a
    CPU padding costs in full, and a small batch costs hardly more per token than a big one.
    A sequence longer than batch_tokens gets a batch of its own."""
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")
    batches, cur, lo, hi = [], [], 0, 0  # lo, hi: the current batch's shortest and longest
    for i in order:
        L = int(lengths[i])
        if cur and (max(hi, L) * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch
                    or (ratio is not None and L > ratio * lo)):
            batches.append(np.array(cur))
            cur = []
        if not cur:
            lo = hi = L
        cur.append(int(i))
        hi = max(hi, L)
    if cur:
        batches.append(np.array(cur))
    return batches


def padding_share(lengths, batches) -> float:
    """Share of the padded (B, T) grid that is padding."""
    lengths = np.asarray(lengths)
    total = sum(int(lengths[b].max()) * len(b) for b in batches)
    return 1.0 - float(lengths.sum()) / total if total else 0.0
