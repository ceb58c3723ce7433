"""The streaming top-k's pieces against plain Python references: ties, padding, signs."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ffkv.mine.topk import TopKState, row_best
from ffkv.mine.trackers import feed


def _ref_row_best(m, lengths, sign):
    """First position of the best sign·m among each row's valid positions, by plain loops."""
    B, _, n = m.shape
    score = np.zeros((B, n), np.float32)
    pos = np.zeros((B, n), np.int32)
    for b in range(B):
        for i in range(n):
            vals = [sign * float(m[b, p, i]) for p in range(lengths[b])]
            best = max(vals)
            score[b, i], pos[b, i] = best, vals.index(best)
    return score, pos


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("layout", ["sorted", "shuffled", "one_long", "hole"])
def test_row_best_matches_loops(sign, layout):
    g = torch.Generator().manual_seed(7)
    B, T, n = 24, 300 if layout == "one_long" else 11, 9
    # small integers: many exact ties, including 0.0 vs -0.0
    m = torch.randint(-3, 4, (B, T, n), generator=g).float() * torch.where(
        torch.rand(B, T, n, generator=g) < 0.1, -1.0, 1.0)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if layout == "sorted":
        lengths = lengths.sort().values
    mask = torch.arange(T) < lengths.unsqueeze(1)
    if layout == "hole":  # not a right-padded mask: must take the masked path
        mask[0, 0] = False
        lengths = lengths.clone()
    score, pos = row_best(m, mask, sign)
    if layout == "hole":
        m = m.clone()
        m[0, 0] = -sign * float("inf")  # the reference simply never picks the hole
    ref_s, ref_p = _ref_row_best(m, lengths.tolist(), sign)
    np.testing.assert_array_equal(score.numpy(), ref_s)
    np.testing.assert_array_equal(pos.numpy(), ref_p)


def test_stream_equals_global_sort_with_ties():
    """Many small batches streamed give the global top-t by (score desc, sid, pos)."""
    g = torch.Generator().manual_seed(3)
    n, t, T = 6, 5, 7
    st = TopKState([0], None, n, t, negative=True)
    rows = []
    sid = 100
    for _ in range(9):
        B = int(torch.randint(1, 8, (1,), generator=g))
        m = torch.randint(-2, 3, (B, T, n), generator=g).float()
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T) < lengths.unsqueeze(1)
        sids = torch.arange(sid, sid + B)
        sid += B
        feed(st, 0, m, mask, sids)
        rows += [(int(s), m[b, : int(lengths[b])]) for b, s in enumerate(sids)]
    for sign in (1, -1):
        lst = st.lists[(sign, 0)]
        for i in range(n):
            cands = []
            for s, mm in rows:
                vals = (sign * mm[:, i]).tolist()
                best = max(vals)
                cands.append((-best, s, vals.index(best)))
            cands.sort()
            got = list(zip(lst.sid[i].tolist(), lst.pos[i].tolist(), (sign * lst.score[i]).tolist()))
            assert got == [(s, p, -sign * sc) for sc, s, p in cands[:t]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(width=32, allow_nan=False), st.integers(0, (1 << 31) - 1)), min_size=1,
                max_size=40))
def test_pack_key_orders_by_score_then_tie(pairs):
    """`pack_key` (the one definition torch and the fused CUDA kernel share): keys ascend as
    (−score, tie) does, −0.0 and 0.0 are one score, and each key gives its score back."""
    from ffkv.mine.topk import _desc_key, _key_score

    score = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    tie = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    key = _desc_key(score, tie)
    want = sorted(range(len(pairs)), key=lambda i: (-(pairs[i][0] + 0.0), pairs[i][1]))
    got = sorted(range(len(pairs)), key=lambda i: int(key[i]))
    assert [(-(pairs[i][0] + 0.0), pairs[i][1]) for i in got] == [(-(pairs[i][0] + 0.0), pairs[i][1]) for i in want]
    assert torch.equal(_key_score(key), score + 0.0) and bool((key >= 0).all())
    assert torch.equal(key & ((1 << 31) - 1), tie)
