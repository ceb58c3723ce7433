"""Mining's choice of forward and trackers by timing them on its first batches (`ffkv.mine.tune`,
FFKV_PACK / FFKV_TRITON = auto, the default on CUDA): every arm timed alike, the fastest kept, and
the tables those of a run without tuning."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from conftest import WT2, mine_tiny, run_cli
from test_mine import _assert_same_mine
from ffkv.mine.tune import ROUNDS, Arm, Tuner


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 60), min_size=1, max_size=6), st.data())
def test_the_trial_spreads_its_blocks_and_keeps_the_fastest(n, chunks, data):
    """Over calls of any sizes (a pass's chunks): every arm is mined once untimed and ROUNDS times
    timed, the trial's blocks whole and in order; in a call with room for them, the first block
    starts it and the timed blocks sit one in each share of the rest (spread over the lengths);
    every other batch mines with the first arm until the trial ends, then with the arm of fewest
    seconds per token (the first of equals)."""
    arms = [Arm(p, f) for p, f in [(None, False), (128, False), (256, False), (None, True), (128, True),
                                    (256, True)][:n]]
    tu = Tuner(arms)
    secs = {a: data.draw(st.integers(1, 9), label=f"seconds per token of {a.name}") for a in arms}  # exact sums
    best = min(arms, key=lambda a: (secs[a], arms.index(a)))
    need = n * (1 + ROUNDS) if n > 1 else 0
    trial, done = [], 0
    for size in chunks:
        fresh = done == 0
        slots = tu.plan(size)
        assert len(slots) == size
        for j, slot in enumerate(slots):
            arm, timed, in_trial = tu.take(slot)
            assert in_trial == (slot is not None)
            if in_trial:
                trial.append((arm, timed))
            elif done < need:
                assert arm == arms[0] and not timed  # the trial is not over
            else:
                assert arm == best and not timed
            ntok = data.draw(st.integers(1, 5000))
            tu.add(arm, ntok, secs[arm] * ntok if timed else None, in_trial)
            done += in_trial
        if fresh and n > 1 and size > need:  # room: the blocks spread over the call
            starts = [j for j, s in enumerate(slots) if s is not None and (j == 0 or slots[j - 1] is None)]
            assert starts[0] == 0 and len(starts) >= 2
            if size >= 2 * need:
                share = (size - n) / ROUNDS
                at = [j for j, s in enumerate(slots) if s is not None and s[1]][::n]  # each timed block's start
                assert all(n + r * share <= j and j + n <= n + (r + 1) * share + 1 for r, j in enumerate(at)), (at, share)
    blocks = [arms] + [arms if r % 2 == 0 else arms[::-1] for r in range(ROUNDS)] if n > 1 else []
    want = [(a, b > 0) for b, blk in enumerate(blocks) for a in blk]
    assert trial == want[:len(trial)]  # whole blocks, in order (a short pass ends inside one)
    if len(trial) == len(want):
        assert tu.take(None)[0] == best and tu.chosen == best
        rec = tu.record()
        if n > 1:
            assert rec["chosen"] == best.name
            assert sum(r["batches"] for r in rec["arms"]) == sum(chunks)
    elif n > 1:
        assert tu.chosen is None


def test_settings_default_by_device(monkeypatch):
    """Unset: auto on CUDA, off on a CPU; 0 is off, a number a fixed row length."""
    from ffkv.mine import fused_cuda, packing

    monkeypatch.delenv("FFKV_PACK", raising=False)
    monkeypatch.delenv("FFKV_TRITON", raising=False)
    assert packing.setting("cuda") == "auto" and packing.setting("cpu") is None and packing.setting() is None
    assert fused_cuda.setting("cuda:0") == "auto" and fused_cuda.setting("cpu") == "0"
    assert packing.rows_tokens() is None
    for raw, want in (("0", None), ("AUTO", "auto"), (" 256 ", 256)):
        monkeypatch.setenv("FFKV_PACK", raw)
        assert packing.setting("cuda") == want and packing.setting("cpu") == want
    assert packing.rows_tokens() == 256
    monkeypatch.setenv("FFKV_PACK", "auto")
    assert packing.rows_tokens() is None  # auto is the tuner's: padded rows without one
    monkeypatch.setenv("FFKV_TRITON", "auto")
    assert not fused_cuda.available("cuda")  # likewise: the portable path without a tuner


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_auto_mines_the_same_tables(tiny_dirs, tmp_path, monkeypatch, arch):
    """FFKV_PACK=auto on a CPU: padded rows and rows of 128 and 256 tokens each mine some of the
    first batches, the fastest the rest; the tables equal a padded run's, and the manifest holds
    each arm's timed throughput and the choice. OPT cannot take packed rows (its check refuses
    them): nothing to time, padded rows."""
    args = ["--max-sentences", "120", "--top-k", "5", "--negative", "--batch-tokens", "128"]
    want = mine_tiny(tmp_path / "padded", tiny_dirs[arch], 120, 5, "--negative", "--batch-tokens", "128")
    monkeypatch.setenv("FFKV_PACK", "auto")
    res = run_cli("mine", "--out", tmp_path / "auto", "--model", tiny_dirs[arch], "--corpus",
                  WT2 / "wiki.valid.tokens", *args)
    assert res.returncode == 0, res.stderr
    _assert_same_mine(tmp_path / "auto", want)
    rec = json.loads((tmp_path / "auto" / "manifest.json").read_text())["steps"]["mine"]
    t = rec["tuning"]
    if arch == "opt":
        assert t is None and rec["packed_rows"] is None and "FFKV_PACK: padded rows" in res.stderr
        return
    assert [a["arm"] for a in t["arms"]] == ["padded", "packed128", "packed256"]
    batches = rec["batches"]["batches"]
    assert sum(a["batches"] for a in t["arms"]) == batches
    assert all(a["batches"] >= 1 + ROUNDS and a["timed_tokens"] > 0 for a in t["arms"])
    best = max(t["arms"], key=lambda a: a["tokens_per_s"])
    assert t["chosen"] == best["arm"] and rec["packed_rows"] == best["packed_rows"]
    others = [a for a in t["arms"] if a is not best and a["arm"] != "padded"]
    assert all(a["batches"] == 1 + ROUNDS for a in others)  # their trial's only
    assert rec["fused_trackers"] is False
    assert f"{best['arm']} chosen on the first batches" in res.stdout


def test_a_short_corpus_ends_while_timing(tiny_dirs, tmp_path, monkeypatch):
    """Fewer batches than the timing needs: each mined by its arm, nothing chosen, and the run
    says so; the tables are still right."""
    want = mine_tiny(tmp_path / "padded", tiny_dirs["llama"], 20, 5)
    monkeypatch.setenv("FFKV_PACK", "auto")
    res = run_cli("mine", "--out", tmp_path / "auto", "--model", tiny_dirs["llama"], "--corpus",
                  WT2 / "wiki.valid.tokens", "--max-sentences", "20", "--top-k", "5")
    assert res.returncode == 0, res.stderr
    _assert_same_mine(tmp_path / "auto", want)
    rec = json.loads((tmp_path / "auto" / "manifest.json").read_text())["steps"]["mine"]
    assert rec["tuning"]["chosen"] is None and rec["packed_rows"] is None
    assert "the corpus ended while timing" in res.stdout
