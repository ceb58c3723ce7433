"""Pack token sequences of similar length into batches under a token budget."""
from __future__ import annotations

import numpy as np


def pack(lengths, batch_tokens: int = 2048, max_batch: int | None = None,
         ratio: float | None = None, slack: int = 0) -> list[np.ndarray]:
    """Index batches such that max_len × batch_size ≤ batch_tokens (and batch_size ≤ max_batch
    when given); sorted by length so padding stays small. Deterministic: ties in length keep
    input order.

    Mining passes no max_batch: its batches are bounded by the token budget alone, which
    `auto_batch_tokens` sizes from the device (a fixed 64-row cap kept GPU batches at ~2,000
    tokens whatever the budget; issue 24). compose and mutate pass their own caps.

    With `ratio`, a batch also ends when a length exceeds `ratio` × its shortest: padding stays
    under 1 − 1/ratio (a third for 1.5). (`mutate`'s re-scoring cuts at the cheapest split
    instead: `pack_cheapest`.)
    A sequence longer than batch_tokens gets a batch of its own. With `slack`, the ratio ends a
    batch only when the next row would add more than `slack` padded tokens (rows × the rise in
    length): short sequences (mutate's cached continuations, a few tokens each) then share
    batches, whose fixed cost per pass outweighs a few padded tokens."""
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")
    if max_batch is None and ratio is None:
        return _by_budget(lengths[order].astype(np.int64), order, int(batch_tokens))
    batches, cur, lo, hi = [], [], 0, 0  # lo, hi: the current batch's shortest and longest
    for i in order:
        L = int(lengths[i])
        if cur and (max(hi, L) * (len(cur) + 1) > batch_tokens
                    or (max_batch is not None and len(cur) >= max_batch)
                    or (ratio is not None and L > ratio * lo and len(cur) * (L - hi) > slack)):
            batches.append(np.array(cur))
            cur = []
        if not cur:
            lo = hi = L
        cur.append(int(i))
        hi = max(hi, L)
    if cur:
        batches.append(np.array(cur))
    return batches


def pack_cheapest(lengths, batch_tokens: int, max_batch: int, fixed: int) -> list[np.ndarray]:
    """Index batches of the fewest padded tokens plus `fixed` per batch (a pass's own cost, in
    tokens), each under max_len × rows ≤ batch_tokens and rows ≤ max_batch: the best split of the
    length-sorted order, by dynamic programming (a batch is a run of it). Why: `pack`'s greedy
    cut with a length ratio left mutate's re-scoring batches padded 1.26× to 1.47×.
    Deterministic: ties in length keep input order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    srt = lengths[order]
    n = len(srt)
    best = np.zeros(n + 1, dtype=np.int64)
    start = np.zeros(n + 1, dtype=np.int64)  # start[e]: first row of the batch that ends at e
    for e in range(1, n + 1):
        m = int(srt[e - 1])
        rows = max(1, min(int(max_batch), int(batch_tokens) // max(m, 1)))
        j = np.arange(max(0, e - rows), e)
        cost = best[j] + (e - j) * m
        k = int(np.argmin(cost))  # the first minimum: the longest batch among equals
        best[e], start[e] = cost[k] + fixed, j[k]
    out, e = [], n
    while e > 0:
        out.append(order[start[e]:e])
        e = int(start[e])
    return out[::-1]


def _by_budget(srt: np.ndarray, order: np.ndarray, bt: int) -> list[np.ndarray]:
    """`pack` under the budget alone, a batch at a time instead of a row at a time (a billion
    tokens' plan: seconds, not a minute). Sorted, a batch of rows j..e-1 costs srt[e-1]·(e−j),
    which grows with e, so its end is a search over the rows that could fit."""
    batches, j, n = [], 0, len(srt)
    while j < n:
        w = n - j if srt[j] <= 0 else min(n - j, max(1, bt // int(srt[j])))
        cost = srt[j:j + w] * np.arange(1, w + 1)
        e = j + max(1, int(np.searchsorted(cost, bt, side="right")))
        batches.append(order[j:e].astype(np.int64))
        j = e
    return batches


class Layout:
    """What the manifest records of a batch plan, summed as its batches arrive (the mine step
    packs chunk by chunk): the number of batches, mean valid tokens per batch, the padding share
    of the padded grids, the most rows in one batch, and (with the budget) the mean fill: padded
    tokens over the budget."""

    def __init__(self, batch_tokens: int | None = None):
        self.bt, self.n, self.tokens, self.grid, self.max_rows = batch_tokens, 0, 0, 0, 0

    def add(self, lengths, batches) -> "Layout":
        lengths = np.asarray(lengths)
        self.n += len(batches)
        self.tokens += int(sum(int(lengths[b].sum()) for b in batches))
        self.grid += sum(int(lengths[b].max()) * len(b) for b in batches)
        self.max_rows = max([self.max_rows, *map(len, batches)])
        return self

    def padding_share(self) -> float:
        return 1.0 - self.tokens / self.grid if self.grid else 0.0

    def record(self) -> dict:
        n = self.n
        out = {"batches": n, "mean_tokens": round(self.tokens / n, 1) if n else 0.0,
               "padding_share": round(self.padding_share(), 4), "max_rows": self.max_rows}
        if self.bt:
            out["fill"] = round(self.grid / n / self.bt, 4) if n else 0.0
        return out


def padding_share(lengths, batches) -> float:
    """Share of the padded (B, T) grid that is padding."""
    return Layout().add(lengths, batches).padding_share()


def layout(lengths, batches, batch_tokens: int | None = None) -> dict:
    """`Layout.record` of one whole plan."""
    return Layout(batch_tokens).add(lengths, batches).record()


# ---- the device's token budget ------------------------------------------------------------------
CPU_BATCH_TOKENS = 2048  # a CPU gains nothing from bigger batches; what mining always used there
MIN_AUTO, MAX_AUTO = 2048, 32768  # an H100 runs SmolLM2's shape at ~316k tok/s at 32,768 (issue 24)
MEM_SHARE = 0.5  # of the free memory left after the trackers' state: room for the allocator,
# attention's own buffers (eager attention holds heads × T scores per token) and fragmentation
TRACKER_BYTES_PER_KEY = 32  # per token and mined key: m in float32 (4), its bin index as int32 and
# int64 (12), m² (4), the best-position masks (2-3) and a masked copy (4), rounded up


def token_bytes(d: int, d_m: int, elem_bytes: int, keys: int | None = None, group: int = 1) -> int:
    """Device memory one token of a batch takes at the peak of a mining pass, logits-free
    (mining stops after the last mined layer, and no gradient keeps a layer's activations):
    one layer's working set, elem_bytes × (6·d + 3·d_m) (residual, norm, q, k, v, attention
    output; gate, up and their product), the captures a tracker update waits for,
    elem_bytes × keys × (group − 1), plus the trackers' float32 temporaries of the group's keys,
    TRACKER_BYTES_PER_KEY × keys × group (keys: d_m when every key of a layer is mined; group:
    layers per tracker update, `ffkv.mine.groups.group_size`)."""
    keys = d_m if keys is None else keys
    return (elem_bytes * (6 * d + 3 * d_m) + elem_bytes * keys * (group - 1)
            + TRACKER_BYTES_PER_KEY * keys * group)


def auto_batch_tokens(device: str, free_bytes: int | None = None, *, d: int = 0, d_m: int = 0,
                      elem_bytes: int = 4, keys: int | None = None, state_bytes: int = 0,
                      group: int = 1) -> int:
    """--batch-tokens auto: CPU_BATCH_TOKENS on a CPU; on CUDA
    MEM_SHARE × (free_bytes − state_bytes) / token_bytes(d, d_m, elem_bytes, keys, group),
    rounded down to a multiple of 256 and held within [MIN_AUTO, MAX_AUTO].

    free_bytes is the device's free memory with the model loaded (`torch.cuda.mem_get_info`),
    state_bytes what the trackers' state will take there. Pure: tests give it fake numbers."""
    if not str(device).startswith("cuda") or not free_bytes:
        return CPU_BATCH_TOKENS
    room = MEM_SHARE * max(0, int(free_bytes) - int(state_bytes))
    n = int(room // token_bytes(d, d_m, elem_bytes, keys, group)) // 256 * 256
    return max(MIN_AUTO, min(MAX_AUTO, n))


# ---- the steps after mining: compose, mutate, normalize -----------------------------------------
def step_token_bytes(d: int, d_m: int, n_layers: int, elem_bytes: int) -> int:
    """Device memory one token of a batch takes in a step after mining: one layer's working set,
    as `token_bytes` counts it, plus a residual and a coefficient vector of every layer held (the
    most any of these steps keeps of a token; a step that keeps less gets headroom)."""
    return elem_bytes * (6 * d + 3 * d_m) + elem_bytes * (n_layers + 1) * (d + d_m)


def step_batch(device: str, value, cpu_tokens: int, cpu_rows: int, free_bytes: int | None = None, *,
               d: int = 0, d_m: int = 0, n_layers: int = 0, elem_bytes: int = 4,
               row_bytes: int = 0) -> tuple[int, int]:
    """(token budget, row cap) of a step's forward batches for its --batch-tokens `value`.

    On a CPU: `value`, or the step's own `cpu_tokens` for auto, and its `cpu_rows` (bigger
    batches gain a CPU nothing). On CUDA, auto is MEM_SHARE × free_bytes / `step_token_bytes`,
    rounded down to a multiple of 256 within [cpu_tokens, MAX_AUTO]; the row cap then grows
    with the budget (budget / 8: short prefixes), bounded so that rows × `row_bytes` (a step's
    per-row buffers, such as a vocabulary projection) take at most a tenth of the free memory.
    Pure: tests give it fake numbers."""
    cuda = str(device).startswith("cuda") and bool(free_bytes)
    tokens = cpu_tokens if value == "auto" else int(value)
    if not cuda:
        return tokens, cpu_rows
    if value == "auto":
        room = MEM_SHARE * int(free_bytes)
        n = int(room // max(1, step_token_bytes(d, d_m, n_layers, elem_bytes))) // 256 * 256
        tokens = max(cpu_tokens, min(MAX_AUTO, n))
    rows = max(cpu_rows, tokens // 8)
    if row_bytes:
        rows = max(cpu_rows, min(rows, int(0.1 * free_bytes) // row_bytes))
    return tokens, rows


def tight_ratio(device, ratio: float = 1.5) -> float | None:
    """`pack`'s length ratio for a step's batches on `device`: tight on a CPU, where a padded token
    costs what a real one does; none on CUDA, where a pass's fixed cost (its launches) outweighs
    padding, and length-sorted batches under a large budget pad little anyway."""
    return None if str(device).startswith("cuda") else ratio


def device_memory(mm) -> tuple[str, int | None, int]:
    """(device, free bytes on it or None off CUDA, bytes per element of the model's dtype)."""
    dev = str(getattr(mm, "device", "cpu"))
    free = None
    if dev.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(mm.device)
    dtype = getattr(mm, "dtype", None)
    return dev, free, (dtype.itemsize if dtype is not None else 4)


def resolve_step_batch(mm, value, cpu_tokens: int, cpu_rows: int, row_bytes: int = 0) -> tuple[int, int]:
    """`step_batch` for this model on its device."""
    dev, free, elem = device_memory(mm)
    return step_batch(dev, value, cpu_tokens, cpu_rows, free, d=mm.d, d_m=mm.d_m, n_layers=mm.n_layers,
                      elem_bytes=elem, row_bytes=row_bytes)
