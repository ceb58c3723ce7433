"""Mining's choice of forward and trackers by timing them on its first batches (`ffkv.mine.tune`,
FFKV_PACK / FFKV_TRITON = auto, the default on CUDA): every arm timed alike, the fastest kept, and
the tables those of a run without tuning."""
from __future__ import annotations

import json

import pytest
from hypothesis import event, given, settings, strategies as st

from conftest import WT2, mine_tiny, run_cli
from test_mine import _assert_same_mine
from ffkv.mine.tune import STRATA, Arm, Tuner


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 40), min_size=1, max_size=12), st.data())
def test_every_arm_is_timed_on_every_stratum_and_the_fastest_kept(n, chunks, data):
    """Over chunks of any sizes: each arm's first batch is untimed, then it is timed once in every
    stratum (its place in its chunk: first quarter, second, ...), so every arm is timed on alike
    sentences; the arms of a stratum sit on neighbouring batches. Other batches mine with the first
    arm until the trial ends, then with the arm of fewest seconds per token (the first of equals)."""
    arms = [Arm(p, f) for p, f in [(None, False), (128, False), (256, False), (None, True), (128, True),
                                    (256, True)][:n]]
    tu = Tuner(arms)
    secs = {a: data.draw(st.integers(1, 9), label=f"seconds per token of {a.name}") for a in arms}  # exact sums
    best = min(arms, key=lambda a: (secs[a], arms.index(a)))
    warm, timed_at = [], {a: [] for a in arms}
    timed_tokens = {a: 0 for a in arms}
    S = None
    for size in chunks:
        slots = tu.plan(size)
        assert len(slots) == size
        if size and S is None and n > 1:
            S = min(STRATA, size)
        for q in range(S or 0):  # a stratum's trial batches are neighbours
            js = [j for j, s in enumerate(slots) if s is not None and s[1] and j * S // size == q]
            assert js == list(range(js[0], js[0] + len(js))) if js else True
        for j, slot in enumerate(slots):
            arm, timed, in_trial = tu.take(slot)
            assert in_trial == (slot is not None)
            if in_trial:
                if timed:
                    timed_at[arm].append(j * S // size)
                else:
                    assert all(not t for t in timed_at[arm])  # warm before timed
                    warm.append(arm)
            elif tu.chosen is None:
                assert arm == arms[0] and not timed  # the trial is not over
            else:
                assert arm == best and not timed
            ntok = data.draw(st.integers(1, 5000))
            tu.add(arm, ntok, secs[arm] * ntok if timed else None, in_trial)
            timed_tokens[arm] += ntok if timed else 0
    if n == 1:
        assert tu.chosen == arms[0] and tu.record() is None and not warm
        return
    assert warm == arms[:len(warm)]  # each arm's first batch, in order
    for a in arms:
        assert sorted(timed_at[a]) == sorted(set(timed_at[a])) and set(timed_at[a]) <= set(range(S or 0))
    for r, a in zip(tu.record()["arms"], arms):  # each arm's figures, from the batches fed here
        assert r["timed_tokens"] == timed_tokens[a]
        assert r["tokens_per_s"] == (round(1 / secs[a], 1) if timed_tokens[a] else None)
    if S and all(sorted(timed_at[a]) == list(range(S)) for a in arms):
        assert tu.take(None)[0] == best and tu.chosen == best
        assert tu.record()["chosen"] == best.name
        assert sum(r["batches"] for r in tu.record()["arms"]) == sum(chunks)
    else:
        assert tu.chosen is None and tu.record()["chosen"] is None


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


def test_compile_defaults_to_auto_on_cuda_after_it_can_pay(monkeypatch):
    """FFKV_COMPILE unset: auto on CUDA with its trial after PAYS_AFTER_S of mining, off on a CPU;
    set to auto, the trial comes at once; 1 and 0 have no trial (1 compiles every batch)."""
    from ffkv.mine import compiled

    monkeypatch.delenv("FFKV_COMPILE", raising=False)
    assert compiled.setting("cuda:0") == "auto" and compiled.setting("cpu") == "0" and compiled.setting() == "0"
    assert compiled.trial_after("cuda") == compiled.PAYS_AFTER_S > 0
    assert compiled.trial_after("cpu") is None and not compiled.enabled()
    for raw, want in (("auto", 0.0), (" AUTO", 0.0), ("1", None), ("0", None)):
        monkeypatch.setenv("FFKV_COMPILE", raw)
        assert compiled.trial_after("cuda") == want and compiled.trial_after("cpu") == want
    assert compiled.enabled() is False  # "0"


@pytest.mark.parametrize("after", [0.0, 20.0])
def test_the_compiled_trial_waits_until_the_pass_has_run_long_enough(after):
    """With compile_after set, the chosen arm mines on alone until that many seconds (a clock the
    test turns) have passed since the pass's first batch; the twin's trial starts at the next
    chunk after that, never inside one."""
    now = [100.0]
    arms = [Arm(None, False), Arm(128, False)]
    tu = Tuner(arms, then_compile=True, compile_after=after, clock=lambda: now[0])
    twin = Arm(None, False, True)

    def chunk(size, secs=1.0):
        got = []
        for s in tu.plan(size):
            arm, timed, trial = tu.take(s)
            got.append(arm)
            tu.add(arm, 10, (1 if arm == arms[0] else 9) if timed else None, trial)
            now[0] += secs
        return got

    chunk(16)  # the first trial; its 16 s are under 20
    assert tu.chosen == arms[0]
    second = chunk(8)
    if after:
        assert second == [arms[0]] * 8 and twin not in tu.arms  # 16 s at its start
        third = chunk(8)
        assert twin in third and third[0] == twin  # 24 s at its start: the trial, compile first
    else:
        assert second[0] == twin


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_auto_mines_the_same_tables(tiny_dirs, tmp_path, monkeypatch, reference_mine, arch):
    """FFKV_PACK=auto on a CPU: padded rows and rows of 128 and 256 tokens each mine some of the
    first batches, the fastest the rest; the tables equal a padded run's, and the manifest holds
    each arm's timed throughput and the choice. OPT cannot take packed rows (its check refuses
    them): nothing to time, padded rows."""
    args = ["--max-sentences", "120", "--top-k", "5", "--negative", "--batch-tokens", "128"]
    want = reference_mine(tiny_dirs[arch], 120, 5, "--negative", "--batch-tokens", "128")
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
    assert all(a["batches"] >= 1 + STRATA and a["timed_tokens"] > 0 for a in t["arms"])
    best = max(t["arms"], key=lambda a: a["tokens_per_s"])
    assert t["chosen"] == best["arm"] and rec["packed_rows"] == best["packed_rows"]
    others = [a for a in t["arms"] if a is not best and a["arm"] != "padded"]
    assert all(a["batches"] == 1 + STRATA for a in others)  # their trial's only
    assert rec["fused_trackers"] is False
    assert f"{best['arm']} chosen on the first batches" in res.stdout


@pytest.mark.parametrize("budget", ["2048", "96"])
def test_a_short_corpus_ends_while_timing(tiny_dirs, tmp_path, monkeypatch, budget):
    """Fewer batches than the timing needs: the trial's batches by their arms, the rest by the
    first (padded rows), nothing chosen; the run gives the figures it has (none for a single
    batch, which only warmed up), and the tables are still right."""
    want = mine_tiny(tmp_path / "padded", tiny_dirs["llama"], 20, 5, "--batch-tokens", budget)
    monkeypatch.setenv("FFKV_PACK", "auto")
    res = run_cli("mine", "--out", tmp_path / "auto", "--model", tiny_dirs["llama"], "--corpus",
                  WT2 / "wiki.valid.tokens", "--max-sentences", "20", "--top-k", "5", "--batch-tokens", budget)
    assert res.returncode == 0, res.stderr
    _assert_same_mine(tmp_path / "auto", want)
    rec = json.loads((tmp_path / "auto" / "manifest.json").read_text())["steps"]["mine"]
    t = rec["tuning"]
    assert t["chosen"] is None and rec["packed_rows"] is None
    timed = [a for a in t["arms"] if a["tokens_per_s"]]
    assert bool(timed) == (budget == "96") and ("the corpus ended while timing" in res.stdout) == bool(timed)
    assert "chosen" not in res.stdout


def test_flags_set_the_switches_and_win_over_the_environment(tiny_dirs, tmp_path, monkeypatch, reference_mine):
    """--pack, --fused-kernels and --compile give what their variables give, a flag wins over its
    variable for the pass's own thread only (a library caller's other threads, and the environment,
    keep theirs), Ray's actors get the flags, and a bad value is one line naming the flag, before
    any work."""
    import os

    from test_cli_errors import one_line_error

    common = ["--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens", "--max-sentences", "60",
              "--top-k", "5"]
    want = reference_mine(tiny_dirs["llama"], 60, 5)
    monkeypatch.setenv("FFKV_PACK", "0")
    res = run_cli("mine", "--out", tmp_path / "flag", *common, "--pack", "48", "--fused-kernels", "0")
    assert res.returncode == 0, res.stderr
    _assert_same_mine(tmp_path / "flag", want)
    man = json.loads((tmp_path / "flag" / "manifest.json").read_text())
    rec = man["steps"]["mine"]
    assert rec["packed_rows"] == 48 and rec["fused_trackers"] is False and rec["tuning"] is None
    assert man["settings"]["mine"] == json.loads((want / "manifest.json").read_text())["settings"]["mine"]
    assert "pack" not in man["settings"]["mine"]  # how the pass ran, not what it found: not recorded
    for flag, value in (("--pack", "x"), ("--pack", "-1"), ("--fused-kernels", "yes"), ("--compile", "2")):
        res = run_cli("mine", "--out", tmp_path / "bad", *common, flag, value)
        one_line_error(res, 2, flag)
        assert not (tmp_path / "bad" / "triggers.parquet").exists()

    import threading

    from ffkv.mine import packing, switches
    for_actors = switches.current  # what `mine_ray` puts in its actors' environment
    from ffkv.steps.mine.compute import switched
    from ffkv.steps.mine import MineSettings

    monkeypatch.delenv("FFKV_TRITON", raising=False)
    other = []
    with switched(MineSettings(pack="256", fused_kernels="auto")):
        assert packing.setting("cpu") == 256 and switches.read("FFKV_TRITON") == "auto"
        assert for_actors() == {"FFKV_PACK": "256", "FFKV_TRITON": "auto"}  # a Ray actor's environment
        t = threading.Thread(target=lambda: other.append((packing.setting("cpu"), switches.read("FFKV_TRITON"))))
        t.start()
        t.join()
        assert os.environ["FFKV_PACK"] == "0" and "FFKV_TRITON" not in os.environ  # the environment untouched
    assert other == [(None, "")]  # another thread of the caller sees the environment, not the pass's flags
    assert packing.setting("cpu") is None and switches.read("FFKV_TRITON") == ""


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=12), st.integers(-5, 5000).map(str), st.sampled_from(["auto", "AUTO ", " 0", "1"])))
def test_switch_parsers_take_their_values_and_refuse_the_rest(raw):
    """Any text: a value the parser gives back unchanged when parsed again, or one FfkvError line
    that names the flag."""
    from ffkv.errors import FfkvError
    from ffkv.mine import compiled, fused_cuda, packing

    for mod, name, ok in ((packing, "--pack", lambda v: v is None or v == "auto" or (isinstance(v, int) and v >= 1)),
                          (fused_cuda, "--fused-kernels", lambda v: v in ("0", "1", "auto")),
                          (compiled, "--compile", lambda v: v in ("0", "1", "auto"))):
        try:
            v = mod.parse(raw, name)
        except FfkvError as e:
            assert str(e).startswith(name + ":") and "\n" not in str(e)
            continue
        assert ok(v), (name, raw, v)
        assert mod.parse("0" if v is None else str(v), name) == v


@pytest.mark.parametrize("n_arms", [1, 2])
@pytest.mark.parametrize("twin_faster", [True, False])
def test_the_compiled_twin_is_timed_once_the_rest_is_chosen(n_arms, twin_faster):
    """FFKV_COMPILE=auto: from the chunk after the first choice (at once where there was nothing to
    choose), the chosen arm and its compiled twin are each timed on every stratum, the twin after
    one untimed batch (its compile); then the faster mines on. The record holds every arm."""
    arms = [Arm(None, False), Arm(128, False)][:n_arms]
    tu = Tuner(arms, then_compile=True)
    secs = {arms[0]: 5, Arm(None, False, True): 2 if twin_faster else 8}
    if n_arms == 2:
        secs[arms[1]] = 9

    def chunk(size):
        got = []
        for s in tu.plan(size):
            arm, timed, trial = tu.take(s)
            got.append((arm, timed, trial))
            tu.add(arm, 10, secs[arm] * 10 if timed else None, trial)
        return got

    if n_arms == 2:
        first = chunk(16)
        assert {a for a, _, trial in first if trial} == set(arms)
        assert tu.chosen == arms[0] and first[-1][0] == arms[0]  # the first trial's choice, within the chunk
        assert all(not a.compiled for a, _, _ in first)
    twin = Arm(None, False, True)
    second = chunk(16)
    trial = [(a, timed) for a, timed, t in second if t]
    assert trial[0] == (twin, False)  # the compile, untimed
    assert sorted(a.name for a, timed in trial if timed) == sorted([arms[0].name, twin.name] * STRATA)
    assert tu.take(None)[0] == (twin if twin_faster else arms[0])
    rec = tu.record()
    assert [a["arm"] for a in rec["arms"]] == [a.name for a in arms] + ["padded+compiled"]
    assert rec["chosen"] == ("padded+compiled" if twin_faster else "padded")
    assert [a for a, _, _ in chunk(8)] == [tu.chosen] * 8  # no third trial


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.lists(st.integers(0, 30), min_size=1, max_size=14), st.data())
def test_the_compiled_trial_over_any_chunks(n, chunks, data):
    """FFKV_COMPILE=auto over chunks of any sizes: the compiled twin appears only after the first
    choice and from a chunk after it, its first batch untimed and before any timed one; then it and
    that choice are timed once in each stratum, and every batch after the second choice is the
    faster's; until then the first choice mines the rest, never another arm."""
    arms = [Arm(None, False), Arm(128, False), Arm(256, False)][:n]
    tu = Tuner(arms, then_compile=True)
    secs = {a: data.draw(st.integers(1, 9), label=f"seconds per token of {a.name}")
            for a in arms + [Arm(p, False, True) for p in (None, 128, 256)]}
    first_choice, twin_seen_at, chunk_of_choice = None, None, None
    timed_twin = []
    for ci, size in enumerate(chunks):
        slots = tu.plan(size)
        for j, slot in enumerate(slots):
            arm, timed, trial = tu.take(slot)
            if first_choice is None and tu.chosen is not None and not arm.compiled:
                first_choice, chunk_of_choice = tu.chosen, ci
            if arm.compiled:
                assert first_choice is not None and ci > chunk_of_choice or (n == 1 and first_choice is None)
                assert arm == Arm((first_choice or arms[0]).pack, False, True)
                if twin_seen_at is None:
                    twin_seen_at = (ci, j)
                    assert trial and not timed  # the compile
                elif timed:
                    timed_twin.append(j * tu._strata // size)
            elif first_choice is not None and tu.base is not None and not trial:
                assert arm in (tu.base, tu.chosen)
            tu.add(arm, 10, secs[arm] * 10 if timed else None, trial)
        if n == 1 and first_choice is None:
            first_choice, chunk_of_choice = arms[0], -1
    assert sorted(timed_twin) == sorted(set(timed_twin))  # once a stratum at most
    event("the compiled trial ended" if tu.chosen is not None and tu.base is not None else "it did not")
    if tu.chosen is not None and tu.base is not None:  # the second trial ended
        twin = Arm(tu.base.pack, False, True)
        assert sorted(timed_twin) == list(range(tu._strata))
        want = min([tu.base, twin], key=lambda a: (secs[a], [tu.base, twin].index(a)))
        assert tu.chosen == want and tu.record()["chosen"] == want.name


def test_a_resumed_chunk_keeps_its_batches_strata():
    """A chunk resumed at its cursor: its batches are the chunk's last ones, and their strata are
    those of their place in the whole chunk (here its second half: strata 2 and 3 only), so the
    arms are still timed on alike sentences; the trial goes on in the next chunk."""
    arms = [Arm(None, False), Arm(128, False)]
    tu = Tuner(arms)
    slots = tu.plan(8, first=8, size=16)
    assert slots[:2] == [(arms[0], False), (arms[1], False)]  # each arm's untimed first batch
    timed = {j + 8: s for j, s in enumerate(slots) if s is not None and s[1]}
    assert {p * STRATA // 16 for p in timed} == {2, 3} and len(timed) == 4
    for s in slots:
        tu.add(*tu.take(s)[:1], 10, 1.0 if s is not None and s[1] else None, s is not None)
    assert tu.chosen is None and tu.take(None)[0] == arms[0]  # strata 0 and 1 still to time
    nxt = tu.plan(16)
    assert sum(s is not None for s in nxt) == 4 and all(s[1] for s in nxt if s is not None)
    assert {j * STRATA // 16 for j, s in enumerate(nxt) if s is not None} == {0, 1}


def test_the_shards_record_says_what_any_shard_did():
    """A Ray run's record from its shards' own (`how_of_shards`): the largest packed rows, fused
    kernels or compiled blocks where any shard ran them, each shard's tuning kept; no shard mined
    now (all were saved before): nothing known."""
    from ffkv.mine.tune import how_of_shards

    t = {"chosen": "packed128", "arms": []}
    hows = [{"packed_rows": None, "fused_trackers": False, "compiled_forward": False, "tuning": None},
            {"packed_rows": 256, "fused_trackers": True, "compiled_forward": False, "tuning": t},
            {"packed_rows": 128, "fused_trackers": False, "compiled_forward": True, "tuning": None}]
    assert how_of_shards(hows) == {"packed_rows": 256, "fused_trackers": True, "compiled_forward": True,
                                   "tuning": None, "shards_tuning": [t]}
    assert how_of_shards(hows[:1])["packed_rows"] is None and how_of_shards(hows[:1])["shards_tuning"] is None
    assert how_of_shards([]) == {"packed_rows": None, "fused_trackers": None, "compiled_forward": None,
                                 "tuning": None, "shards_tuning": None}
