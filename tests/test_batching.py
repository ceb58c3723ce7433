"""`pack`: one packing function for mining (budget only) and re-scoring (budget and length ratio).

The two functions it replaced are kept here, verbatim, as references: the merged one must give
the identical batches, so mining stays bit-identical and `mutate` keeps its batches."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ffkv.corpus.batching import pack, padding_share


def old_pack(lengths, batch_tokens: int = 2048, max_batch: int = 64) -> list[np.ndarray]:
    """`ffkv.corpus.batching.pack` before the merge (used by mine, compose, benchmarks)."""
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


def old_pack_tight(lengths, batch_tokens: int = 2048, ratio: float = 1.5, max_batch: int = 256) -> list[np.ndarray]:
    """`ffkv.memories.rescore.pack_tight` (then mutate's) before the merge."""
    lengths = np.asarray(lengths)
    order = np.argsort(lengths, kind="stable")
    out, cur, lo, hi = [], [], 0, 0
    for i in order:
        L = int(lengths[i])
        if cur and (L > ratio * lo or max(hi, L) * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch):
            out.append(np.array(cur))
            cur = []
        if not cur:
            lo = hi = L
        cur.append(int(i))
        hi = max(hi, L)
    if cur:
        out.append(np.array(cur))
    return out


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


def test_pack_equals_both_old_functions_on_random_lengths():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(0, 400))
        lens = rng.integers(1, int(rng.choice([8, 60, 200, 3000])), n)
        bt = int(rng.choice([16, 64, 256, 512, 2048, 8192]))
        assert same(pack(lens, bt, max_batch=64), old_pack(lens, bt)), trial  # the old default cap
        assert same(pack(lens, bt), old_pack(lens, bt, max_batch=len(lens) + 1)), trial  # no cap now
        assert same(pack(lens, bt, max_batch=256, ratio=1.5), old_pack_tight(lens, bt)), trial
        mb = int(rng.integers(1, 300))
        assert same(pack(lens, bt, max_batch=mb), old_pack(lens, bt, mb)), trial
        assert same(pack(lens, bt, max_batch=mb, ratio=2.0), old_pack_tight(lens, bt, 2.0, mb)), trial


@settings(max_examples=300, deadline=None)
@given(lens=st.lists(st.integers(0, 600), max_size=200), bt=st.integers(1, 5000),
       mb=st.integers(1, 300), ratio=st.sampled_from([1.0, 1.25, 1.5, 3.0]))
def test_pack_property(lens, bt, mb, ratio):
    """Identical to the old functions (mining's budget-only plan, searched a batch at a time, too:
    zero lengths and rows over the budget included); every index once; each batch within its limits."""
    assert same(pack(lens, bt, max_batch=mb), old_pack(lens, bt, mb))
    assert same(pack(lens, bt), old_pack(lens, bt, len(lens) + 1))
    got = pack(lens, bt, max_batch=mb, ratio=ratio)
    assert same(got, old_pack_tight(lens, bt, ratio, mb))
    lens = np.asarray(lens, dtype=np.int64)
    assert sorted(int(i) for b in got for i in b) == list(range(len(lens)))
    for b in got:
        L = lens[b]
        assert len(b) <= mb
        assert L.max() * len(b) <= bt or len(b) == 1
        assert L.max() <= ratio * L.min() or len(b) == 1


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.integers(1, 60), max_size=120), bt=st.integers(1, 3000), slack=st.integers(0, 100))
def test_pack_slack_merges_only_what_a_little_padding_buys(lens, bt, slack):
    """With `slack`, a batch is cut by the ratio only where the next row adds more than `slack`
    padded tokens; no more batches than without it, every index once, the budget kept, and
    slack=0 is the plain ratio rule."""
    assert same(pack(lens, bt, 256, ratio=1.5, slack=0), pack(lens, bt, 256, ratio=1.5))
    got = pack(lens, bt, 256, ratio=1.5, slack=slack)
    L = np.asarray(lens, dtype=np.int64)
    assert sorted(int(i) for b in got for i in b) == list(range(len(L)))
    assert len(got) <= len(pack(lens, bt, 256, ratio=1.5))
    for b in got:
        assert L[b].max() * len(b) <= bt or len(b) == 1
    for prev, nxt in zip(got, got[1:]):  # a cut: the budget, the cap, or the ratio with more than slack
        n, hi, lo, first = len(prev), L[prev].max(), L[prev].min(), L[nxt[0]]
        assert (max(hi, first) * (n + 1) > bt or n >= 256
                or (first > 1.5 * lo and n * (first - hi) > slack))


def test_pack_defaults_and_padding_share():
    lens = [5, 3, 3, 9, 1]
    assert [b.tolist() for b in pack(lens, 9)] == [[4, 1, 2], [0], [3]]  # ties keep input order
    assert pack([], 64) == [] and pack([], 64, ratio=1.5) == []
    assert padding_share(lens, pack(lens, 9)) == 1 - 21 / (3 * 3 + 5 + 9)


def _cost(lengths, batches, fixed: int) -> int:
    return sum(fixed + len(b) * int(np.asarray(lengths)[b].max()) for b in batches)


@settings(max_examples=300, deadline=None)
@given(lens=st.lists(st.integers(1, 60), min_size=0, max_size=11), bt=st.integers(1, 400),
       mb=st.integers(1, 12), fixed=st.integers(0, 100))
def test_pack_cheapest_is_the_cheapest_split(lens, bt, mb, fixed):
    """Every index once, within the budget and the row cap (a sequence over the budget alone), and no
    split of the length-sorted order costs less (all 2^(n-1) of them, brute force); nor does
    `pack`'s greedy cut."""
    import itertools

    from ffkv.corpus.batching import pack_cheapest

    out = pack_cheapest(lens, bt, mb, fixed)
    assert sorted(np.concatenate(out).tolist() if out else []) == list(range(len(lens)))
    L = np.asarray(lens)
    for b in out:
        assert len(b) == 1 or (len(b) <= mb and len(b) * L[b].max() <= bt)
    order = np.argsort(L, kind="stable")
    n, best = len(L), None
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        parts, cur = [], [order[0]] if n else []
        for i, c in enumerate(cuts, 1):
            if c:
                parts.append(np.array(cur))
                cur = []
            cur.append(order[i])
        if cur:
            parts.append(np.array(cur))
        if all(len(b) == 1 or (len(b) <= mb and len(b) * L[b].max() <= bt) for b in parts):
            c = _cost(L, parts, fixed)
            best = c if best is None else min(best, c)
    assert _cost(L, out, fixed) == (best or 0)
    if n:
        assert _cost(L, out, fixed) <= _cost(L, pack(L, bt, max_batch=mb, ratio=1.5, slack=fixed), fixed)
