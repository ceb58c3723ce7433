"""Mining: brute force, merge, batch independence, resume after SIGKILL, Ray identity."""
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import WT2, kill_mine_when, mine_tiny, run_cli, wikitext_sentences
from ffkv.mine.engine import mine_batches, new_state
from ffkv.mine.topk import triggers_table
from ffkv.steps.mine import MineSettings
from ffkv.steps.mine.compute import mine
from ffkv.store.run import Run


def _brute_force(mm, token_lists, t, negative):
    """Each prefix on its own, coefficient read by a plain hook at the value projection."""
    blocks = mm.blocks
    got = {}

    def hook(l):
        def f(mod, args):
            got[l] = args[0].reshape(-1, args[0].shape[-1])[-1].detach().clone()
        return f

    if mm.arch.name == "opt":
        mods = [b.fc2 for b in blocks]
    elif mm.arch.name == "llama":
        mods = [b.mlp.down_proj for b in blocks]
    else:
        raise ValueError
    hs = [m.register_forward_pre_hook(hook(l)) for l, m in enumerate(mods)]
    coefs = {}  # (sid, pos) -> (L, d_m)
    with torch.no_grad():
        for sid, ids in enumerate(token_lists):
            for j in range(len(ids)):
                mm.hf(input_ids=torch.tensor([ids[: j + 1]]))
                coefs[(sid, j)] = torch.stack([got[l] for l in range(len(blocks))])
    for h in hs:
        h.remove()
    rows = {}
    for s in ((1, -1) if negative else (1,)):
        for l in range(len(blocks)):
            for i in range(mm.d_m):
                best = []
                for sid, ids in enumerate(token_lists):
                    vals = [(s * float(coefs[(sid, j)][l, i]), j) for j in range(len(ids))]
                    top = max(v for v, _ in vals)
                    j = min(j for v, j in vals if v == top)
                    best.append((-top, sid, j))
                best.sort()
                rows[(l, i, s)] = [(sid, j, -sc * s) for sc, sid, j in best[:t]]
    return rows


@pytest.mark.parametrize("arch,negative", [("opt", False), ("llama", True)])
def test_brute_force(tiny_models, arch, negative):
    mm = tiny_models[arch]
    texts = wikitext_sentences(30)
    token_lists = [mm.tok(x)["input_ids"][:24] for x in texts]
    ref = _brute_force(mm, token_lists, 5, negative)
    s = MineSettings(top_k=5, negative=negative, batch_tokens=100)
    from ffkv.corpus.batching import pack

    st = mine_batches(mm, new_state(mm, s), token_lists, list(range(30)),
                      list(enumerate(pack([len(t) for t in token_lists], 100))))
    mismatches = 0
    for (sg, l), v in st.topk.lists.items():
        for i in range(mm.d_m):
            exp = ref[(l, i, sg)]
            got = [(int(v.sid[i, r]), int(v.pos[i, r]), sg * float(v.score[i, r])) for r in range(5)]
            for (es, ep, ec), (gs, gp, gc) in zip(exp, got):
                assert abs(ec - gc) < 1e-4
                if (es, ep) != (gs, gp):
                    mismatches += 1  # only a float near-tie may swap
                    assert any(abs(ec - c) < 1e-5 for _, _, c in got)
    assert mismatches <= 2


def _mine_api(mm, token_lists, sids, batch_tokens, t=4, negative=True, per_prefix=False):
    from ffkv.corpus.batching import pack

    s = MineSettings(top_k=t, negative=negative, per_prefix=per_prefix, batch_tokens=batch_tokens)
    return mine_batches(mm, new_state(mm, s), token_lists, sids,
                        list(enumerate(pack([len(x) for x in token_lists], batch_tokens))))


def _same(a, b, near_ties_ok: bool = False):
    for k in a.topk.lists:
        x, y = a.topk.lists[k], b.topk.lists[k]
        assert torch.allclose(x.score, y.score, atol=1e-5)
        same = (x.sid == y.sid) & (x.pos == y.pos)
        if not near_ties_ok:
            assert same.all()
        else:
            # batches of another shape may differ in the last float bits: only near-ties may swap
            for key, r in (~same).nonzero().tolist():
                assert ((x.score[key] - x.score[key, r]).abs() < 1e-5).sum() >= 2


@pytest.mark.parametrize("per_prefix", [False, True])
def test_merge_halves_and_batch_independence(tiny_models, per_prefix):
    from ffkv.corpus.batching import pack

    mm = tiny_models["gpt2"]
    token_lists = [mm.tok(x)["input_ids"][:40] for x in wikitext_sentences(120)]
    sids = list(range(1000, 1120))
    whole = _mine_api(mm, token_lists, sids, 512, per_prefix=per_prefix)
    # two halves of the corpus (along the batch plan, so each batch is computed identically)
    s = MineSettings(top_k=4, negative=True, per_prefix=per_prefix, batch_tokens=512)
    plan = list(enumerate(pack([len(x) for x in token_lists], 512)))
    a = mine_batches(mm, new_state(mm, s), token_lists, sids, plan[: len(plan) // 2])
    b = mine_batches(mm, new_state(mm, s), token_lists, sids, plan[len(plan) // 2:])
    merged = b.merge(a)
    _same(whole, merged)
    _same_stats(whole, merged)  # key statistics: identical tables from merged halves
    # another batch size: identical up to float near-ties
    _same(whole, _mine_api(mm, token_lists, sids, 64, per_prefix=per_prefix), near_ties_ok=True)


def _same_stats(a, b):
    ta, tb = a.stats.finish(), b.stats.finish()
    for name in ("key_stats", "key_hist", "key_samples"):
        assert ta[name].equals(tb[name]), name


def _table(run_dir, name="triggers"):
    return pq.read_table(os.path.join(run_dir, f"{name}.parquet"))


WOBBLE = 1e-5  # relative: the same work rounded differently, far below any real change of a coefficient


def _few(n_units: int) -> int:
    """How many units a float rounding may move: a handful, or 0.1% of a large table."""
    return 3 + n_units // 1000


def _assert_same_mine(got_dir, want_dir, other_kernels: bool = False):
    """The same mining, checked to the bit or, failing that, up to a different float rounding.

    `other_kernels`: the two ran through different kernels (a compiled forward), which round
    every value a little differently, so every near-tie may swap, not only a handful (GELU's
    negative side is one long plateau of ties); a swap still needs a near-tie.

    Bit-identical floats across processes rest on the BLAS (`MKL_CBWR`), but a fresh process's first
    forward sometimes rounds differently (~2e-6; DEVELOPING.md), so a value near an octave edge can
    change histogram bin. Lost or repeated work cannot hide in that
    allowance: token and sentence totals, per key and in all, stay exact, no list holds a prefix
    twice, and only a handful of near-tied or near-edge values may move."""
    notes, moved = [], set()  # (layer, dim) of the keys whose histogram differs
    triggers = (lambda g, w, m: _triggers_wobble(g, w, m, cap=False)) if other_kernels else _triggers_wobble
    for name, check in (("triggers", triggers), ("key_hist", _hist_wobble),
                        ("key_stats", _stats_wobble), ("key_samples", _samples_wobble)):
        got, want = _table(got_dir, name), _table(want_dir, name)
        assert got.schema == want.schema, name
        if not got.equals(want):
            notes.append(check(got.to_pandas(), want.to_pandas(), moved))
    if notes:
        warnings.warn("not bit-identical, within a float rounding: " + "; ".join(notes))


def _close(x, y):
    """Within a rounding: WOBBLE of the value or of the column's largest (near-zero values come from
    cancellation, so their error follows the scale of the inputs, not their own)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    scale = np.nanmax(np.abs(y), initial=0.0)
    return (np.abs(x - y) <= WOBBLE * (np.abs(y) + scale)) | (np.isnan(x) & np.isnan(y))


def _allclose(name, g, w):
    close = _close(g, w)
    assert close.all(), f"{name}: {int((~close).sum())} of {len(close)} values differ beyond a rounding"
    return int((~np.isclose(g, w, rtol=0, atol=0, equal_nan=True)).sum())  # how many rounded at all


def _triggers_wobble(g, w, _, cap: bool = True):
    lst, ids = ["layer", "sign", "dim"], ["sentence_id", "position", "next_token"]
    assert len(g) == len(w) and (g[[*lst, "rank"]].values == w[[*lst, "rank"]].values).all(), \
        "triggers: other lists or ranks"
    assert not g.duplicated([*lst, "sentence_id", "position"]).any(), "triggers: a prefix twice in a list"
    n = _allclose("triggers.coef", g.coef, w.coef)
    moved = (g[ids].fillna(-1).values != w[ids].fillna(-1).values).any(1)
    # a prefix may trade places only with a near-tie: a neighbour in its list, or the first one
    # left out (past the last rank)
    c, keys = w.coef.to_numpy(np.float64), w[lst].values
    tie = np.zeros(len(w), bool)
    near = (np.abs(c[1:] - c[:-1]) <= 2 * WOBBLE * (np.abs(c[1:]) + np.abs(c).max())) \
        & (keys[1:] == keys[:-1]).all(1)
    tie[1:] |= near
    tie[:-1] |= near
    tie |= w["rank"].to_numpy() == w["rank"].max()
    assert not (moved & ~tie).any(), "triggers: a prefix changed where no near-tie explains it"
    assert not cap or moved.sum() <= _few(len(w)), f"triggers: {int(moved.sum())} prefixes changed"
    return f"triggers: {n} coef rounded, {int(moved.sum())} near-tied prefixes swapped"


def _dense_hist(t, keys):
    """(key, bin) counts, zeros included, so a move between bins is measured in bins."""
    from ffkv.mine.stats import NB

    h = np.zeros((len(keys), NB), np.int64)
    row = keys.get_indexer(pd.MultiIndex.from_frame(t[["layer", "dim"]]))
    np.add.at(h, (row, t["bin"].to_numpy()), t["count"].to_numpy())
    return h


def _hist_wobble(g, w, moved):
    keys = pd.MultiIndex.from_frame(pd.concat([g, w])[["layer", "dim"]].drop_duplicates())
    hg, hw = _dense_hist(g, keys), _dense_hist(w, keys)
    assert (hg.sum(1) == hw.sum(1)).all(), "key_hist: a key's token total differs (work lost or counted twice)"
    # earth mover's distance: a value rounded across a bin edge moves one count by one bin
    moves = int(np.abs(np.cumsum(hg - hw, axis=1)).sum())
    assert moves <= _few(int(hw.sum()) // 100), f"key_hist: {moves} bin moves"
    moved.update(keys[(hg != hw).any(1)])
    return f"key_hist: {moves} value(s) moved to a neighbouring bin"


def _stats_wobble(g, w, moved):
    for c in ("layer", "dim", "sign", "count", "sentences"):
        assert (g[c].values == w[c].values).all(), f"key_stats.{c} differs (work lost or counted twice)"
    pg, pw = np.stack(g.pos_hist.to_numpy()), np.stack(w.pos_hist.to_numpy())
    assert (pg.sum(1) == pw.sum(1)).all(), "key_stats.pos_hist: a key's sentence total differs"
    shifted = int(np.abs(pg - pw).sum() // 2)  # a sentence's best position, near-tied with another
    assert shifted <= _few(int(pw.sum())), f"key_stats.pos_hist: {shifted} sentences moved"
    n = sum(_allclose(f"key_stats.{c}", g[c], w[c]) for c in ("mean", "std", "max"))
    tok, sen = w["count"].to_numpy(), w["sentences"].to_numpy()
    for c, per in (("frac_active", tok), ("first_share", sen)):  # shares: a few units may move
        x, y = g[c].to_numpy(np.float64), w[c].to_numpy(np.float64)
        assert (np.abs(x - y) * per <= 3.5).all(), f"key_stats.{c} moved by more than a rounding"
    # read from the histogram (interpolated within a bin): other only where the histogram is
    hist_same = ~pd.MultiIndex.from_frame(w[["layer", "dim"]]).isin(list(moved))
    for c in ("frac_strong", "p50", "p90", "p99"):
        off = ~_close(g[c], w[c]) & hist_same
        assert not off.any(), f"key_stats.{c}: {int(off.sum())} keys differ though their histogram does not"
    return f"key_stats: {n} mean/std/max rounded, {shifted} best positions moved"


def _samples_wobble(g, w, _):
    grp = ["layer", "dim", "sign", "bin"]
    assert not g.duplicated([*grp, "sentence_id"]).any(), "key_samples: a sentence twice in a bin"
    both = g.merge(w, on=[*grp, "sentence_id"], how="outer", suffixes=("_g", "_w"), indicator=True)
    swapped = int((both._merge != "both").sum())
    # a sentence whose best coefficient rounds across a bin edge leaves one bin's sample for another's
    assert swapped <= _few(len(w)), f"key_samples: {swapped} rows differ"
    kept = both[both._merge == "both"]
    n = _allclose("key_samples.coef", kept.coef_g, kept.coef_w)
    repos = int((kept.position_g != kept.position_w).sum())
    assert repos <= _few(len(w)), f"key_samples: {repos} positions differ"
    return f"key_samples: {n} coef rounded, {swapped} rows swapped between bins, {repos} near-tied positions"


def test_cli_mine_and_show(tmp_path, tiny_dirs):
    out = tmp_path / "run"
    res = run_cli("mine", "--out", out, "--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens",
                  "--max-sentences", 60, "--top-k", 5, "--negative")
    assert res.returncode == 0, res.stderr
    t = _table(out)
    assert t.num_rows == 3 * 80 * 5 * 2
    assert set(t.column_names) >= {"layer", "dim", "rank", "coef", "sentence_id", "position", "next_token", "sign"}
    # next_token is the token after the prefix, null at the end of a sentence
    sent = pq.read_table(out / "sentences.parquet").to_pandas().set_index("sentence_id")
    for r in t.slice(0, 200).to_pylist():
        ids = list(sent.loc[r["sentence_id"], "token_ids"])
        assert r["next_token"] == (ids[r["position"] + 1] if r["position"] + 1 < len(ids) else None)
    neg = t.filter(t.column("sign").to_numpy() == -1).column("coef").to_numpy()
    assert (neg[neg != 0] < 0).mean() > 0.9
    res = run_cli("show", out, "--layer", 1, "--dim", 3, "--json", "--top", 3)
    rows = __import__("json").loads(res.stdout)
    assert [r["rank"] for r in rows] == [1, 2, 3, 1, 2, 3]
    # a second mine with other settings refuses; the same settings is a no-op
    res = run_cli("mine", "--out", out, "--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens",
                  "--max-sentences", 60, "--top-k", 6, "--negative")
    assert res.returncode == 2 and "other settings" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("show", out, "--layer", 9, "--dim", 0)
    assert res.returncode == 2 and "no triggers" in res.stderr


def test_rebuild_flags_type_back_the_record():
    """The flags a rebuild command names (`ffkv.steps.settings.flags`), parsed by the generated `ffkv mine`,
    give the very record they came from: for settings away from every default, and none for the
    defaults. Every check of the settings runs before a model loads (the CLI's usage errors)."""
    import typer

    from ffkv.errors import FfkvError
    from ffkv.steps.cli import build, command
    from ffkv.steps.settings import flags
    from ffkv.steps.mine import STEP

    app = typer.Typer()
    app.command()(command(STEP))
    parse = typer.main.get_command(app)
    s = MineSettings(corpus="c.txt", max_sentences=7, seed=3, field="body", layers=[0, 2, 3], dims=[5],
                     top_k=9, negative=True, per_prefix=True, stats=False, samples_per_bin=2)
    args = flags(MineSettings, s.record())
    assert "--no-stats" in args and "--negative" in args and args[args.index("--layers") + 1] == "0,2,3"
    back = build(MineSettings, parse.make_context("mine", ["--out", "x", *args]).params)
    assert back.record() == s.record()
    assert flags(MineSettings, MineSettings(corpus="wikipedia:train").record()) == []
    assert build(MineSettings, parse.make_context("mine", ["--out", "x"]).params).record() == \
        MineSettings(corpus="wikipedia:train").record()
    for bad in (["--top-k", "0"], ["--batch-tokens", "8"], ["--samples-per-bin", "1001"], ["--dims", "3-1"]):
        with pytest.raises(FfkvError, match=bad[0]):
            build(MineSettings, parse.make_context("mine", ["--out", "x", *bad]).params)


def test_resume_after_sigkill(tmp_path, tiny_dirs):
    args = ["--model", tiny_dirs["gpt2"], "--corpus", WT2 / "wiki.valid.tokens", "--max-sentences", 300,
            "--top-k", 5, "--batch-tokens", 64, "--checkpoint-every", 0, "--covariance", "0,1"]
    ref = tmp_path / "ref"
    assert run_cli("mine", "--out", ref, *args).returncode == 0
    out = tmp_path / "killed"
    ck = out / ".mine_checkpoint.npz"
    p = kill_mine_when(out, args, ck.exists, settle=0.5)
    assert ck.exists() and not (out / "triggers.parquet").exists()
    (out / f".mine_checkpoint.npz.tmp{p.pid}").write_bytes(b"half")  # as if killed mid-save
    res = run_cli("mine", "--out", out, *args)
    assert res.returncode == 0, res.stderr
    assert "resuming from checkpoint" in res.stdout
    _assert_same_mine(out, ref)  # the top-k and the key statistics resume to the same rows
    from ffkv.store import query  # and the keys' second moment to the same C (issue 47)
    for l in (0, 1):
        (m0, c0, n0), (m1, c1, n1) = (query.key_covariance(Run(d), l) for d in (out, ref))
        assert n0 == n1 > 0
        np.testing.assert_allclose(c0, c1, rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(m0, m1, rtol=1e-5, atol=1e-9)
    assert not ck.exists()
    assert not list(out.glob(".*.tmp*")), "a killed run's half-written checkpoint was left behind"


def test_same_mine_check_allows_a_rounding_not_lost_work(tmp_path, tiny_dirs):
    """The resume and Ray tests' check: another rounding of the same work passes (with a warning);
    a sentence lost, a prefix changed, a count dropped or a coefficient off by 0.1% fails."""
    import shutil

    args = ["--model", tiny_dirs["gpt2"], "--corpus", WT2 / "wiki.valid.tokens", "--top-k", 5,
            "--batch-tokens", 64]
    ref = tmp_path / "ref"
    assert run_cli("mine", "--out", ref, *args, "--max-sentences", 120).returncode == 0
    # the same work in other kernels (no AVX): every float may round differently
    other_isa = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    assert run_cli("mine", "--out", tmp_path / "isa", *args, "--max-sentences", 120, env=other_isa).returncode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its warning is expected here
        _assert_same_mine(tmp_path / "isa", ref)
    assert run_cli("mine", "--out", tmp_path / "short", *args, "--max-sentences", 119).returncode == 0
    with pytest.raises(AssertionError, match="work lost|differ"):
        _assert_same_mine(tmp_path / "short", ref)

    def altered(tag, name, change):
        d = tmp_path / tag
        shutil.copytree(ref, d)
        t = _table(ref, name)
        df = change(t.to_pandas())
        pq.write_table(pa.Table.from_pandas(df, schema=t.schema, preserve_index=False), d / f"{name}.parquet")
        return d

    def ulps(df, col="coef"):
        df[col] = (df[col] * np.float32(1 + 3e-7)).astype(np.float32)
        return df

    def to_next_bin(df):  # one value rounded across an octave edge
        i = df.index[(df["count"] > 1)][0]
        df.loc[i, "count"] -= 1
        return pd.concat([df, df.loc[[i]].assign(bin=df.loc[i, "bin"] + 1, count=1)]) \
            .groupby(["layer", "dim", "bin"], as_index=False)["count"].sum()

    rounded = [altered("r1", "triggers", ulps), altered("r2", "key_hist", to_next_bin),
               altered("r3", "key_samples", ulps), altered("r4", "key_stats", lambda df: ulps(df, "mean"))]
    for d in rounded:
        with pytest.warns(UserWarning, match="within a float rounding"):
            _assert_same_mine(d, ref)

    def other_prefix(df):
        df.loc[0, "sentence_id"] = (df.loc[0, "sentence_id"] + 1) % 120
        return df

    def drop_count(df):
        df.loc[0, "count"] -= 1
        return df

    def twice(df):
        return pd.concat([df.iloc[:1], df]).sort_values(["layer", "dim", "sign", "bin"], kind="stable")

    broken = {"no near-tie explains": altered("b1", "triggers", other_prefix),
              "token total differs": altered("b2", "key_hist", drop_count),
              "beyond a rounding": altered("b3", "triggers",
                                           lambda df: df.assign(coef=(df.coef * 1.001).astype(np.float32))),
              "a sentence twice": altered("b4", "key_samples", twice)}
    for why, d in broken.items():
        with pytest.raises(AssertionError, match=why):
            _assert_same_mine(d, ref)


def test_stale_temps_of_dead_writers_are_swept(tmp_path):
    """A SIGKILL skips `finally`: the next step on the run deletes what dead writers staged, and
    nothing else (a live writer's file, a user's file that merely looks alike)."""
    from ffkv.store.run import sweep_temps, tmp_path as staged

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    made = {f".triggers.parquet.tmp{dead.pid}": False, f".mine_checkpoint.npz.tmp{dead.pid}": False,
            staged(tmp_path / "key_stats.parquet").name: True, f"notes.tmp{dead.pid}": True,
            f".manifest.json.tmp{dead.pid}x": True}
    for name in made:
        (tmp_path / name).write_bytes(b"half")
    (tmp_path / f".abc123.tmp{dead.pid}").mkdir()  # a half-saved model copy in the cache
    (tmp_path / f".abc123.tmp{dead.pid}" / "model.safetensors").write_bytes(b"half")
    gone = {p.name for p in sweep_temps(tmp_path)}
    assert gone == {n for n, keep in made.items() if not keep} | {f".abc123.tmp{dead.pid}"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, keep in made.items() if keep)


def test_step_record_resumes_a_killed_step_and_renews_a_redone_one(tmp_path):
    """A killed step keeps its start (its wall time counts from the first try); a step done before and
    run again (new settings, --force) gets a new record: its own start, none of the old figures."""
    run = Run(tmp_path / "r", create=True)
    run.start_step("compose", {"prefixes": 10})
    first = run.step("compose")["started"]
    run.start_step("compose", {"prefixes": 10})  # the same step after a kill
    assert run.step("compose")["started"] == first
    run.finish_step("compose", prefixes=10, old_figure=1)
    run.manifest["steps"]["compose"]["started"] -= 1000  # as if done long ago
    run.start_step("compose", {"prefixes": 20})
    time.sleep(0.01)
    run.finish_step("compose", prefixes=20)
    st = Run(tmp_path / "r").step("compose")
    assert "old_figure" not in st and st["prefixes"] == 20
    assert 0 <= st["seconds"] < 100 and st["seconds"] == pytest.approx(st["finished"] - st["started"], abs=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("pack", ["48", "auto"])
def test_ray_two_shards_identical(tmp_path, tiny_dirs, reference_mine, pack):
    """Two shards give one process's tables; the driver's FFKV_PACK reaches the actors (a
    cluster's workers do not inherit the driver's environment) and their packing is recorded.
    With auto, each actor times packed and padded rows on its own first batches. (Padded rows, a
    CPU's default, are the Ray runs of `test_ray_actors_prepare_their_own_rows_of_token_ids`.)"""
    args = ["--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens", "--max-sentences", 300,
            "--top-k", 5, "--negative"]
    single = reference_mine(tiny_dirs["llama"], 300, 5, "--negative")  # the same args: one process
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "FFKV_PACK": pack}
    res = run_cli("mine", "--out", tmp_path / "ray", *args, "--ray", "local", "--shards", 2, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 shard(s) on Ray" in res.stdout
    _assert_same_mine(tmp_path / "ray", single)  # the same tables from two shards
    info = json.loads((tmp_path / "ray" / "manifest.json").read_text())["steps"]["mine"]
    assert info["packed_rows"] in ((None, 128, 256) if pack == "auto" else (48 if pack == "48" else None,))
    assert info["fused_trackers"] is False and info["compiled_forward"] is False and info["tuning"] is None
    if pack == "auto":  # each actor timed the arms on its own first batches
        assert all([a["arm"] for a in t["arms"]] == ["padded", "packed128", "packed256"]
                   for t in info["shards_tuning"] or [])


@pytest.mark.slow
def test_ray_actors_prepare_their_own_rows_of_token_ids(tmp_path, tiny_dirs):
    """A pre-tokenized corpus on Ray (issue 24 item 4): the driver plans from the file's row
    offsets alone, each actor decodes and writes its own chunks, and the joined `sentences`, the
    corpus record and the mined tables equal one process's (rows cut to the context included)."""
    from transformers import AutoTokenizer

    from ffkv.corpus.tokens import write_parquet

    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    lines = [l for l in (WT2 / "wiki.valid.tokens").read_text().split("\n") if len(l) > 40][:130]
    rows = [tok(l)["input_ids"] for l in lines] + [[]] * 3  # a few longer than the context; empty rows
    assert any(len(r) > 128 for r in rows)
    corpus = write_parquet(tmp_path / "ids.parquet", rows, tok)
    args = ["--model", tiny_dirs["llama"], "--corpus", corpus, "--max-sentences", 120, "--top-k", 5,
            "--negative", "--chunk-sentences", 20, "--batch-tokens", 512]
    assert run_cli("mine", "--out", tmp_path / "single", *args).returncode == 0
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    ray_args = ["mine", "--out", tmp_path / "ray", *args, "--ray", "local", "--shards", 3]
    # a pass that dies once every shard is mined, before the driver joins the parts
    crash = ("import sys, ffkv.steps.mine.distributed as d\n"
             "def join(*a): raise SystemExit('died before the join')\n"
             "d.Prepared.join = join\nfrom ffkv.cli import main\nmain(sys.argv[1:])")
    p = subprocess.run([sys.executable, "-c", crash, *map(str, ray_args)], capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, timeout=600)
    assert "died before the join" in p.stderr, p.stderr[-2000:]
    left = tmp_path / "ray" / ".mine_shards"
    assert len(list(left.glob("*.npz"))) == 4 and len(list(left.glob("*.sentences.parquet"))) == 3  # + plan.npz
    next(left.glob("*_0_of_3.npz")).unlink()               # killed before its state was saved
    next(left.glob("*_2_of_3.sentences.parquet")).unlink()  # a part lost: its shard is redone too
    assert not (tmp_path / "ray" / "sentences.parquet").exists()
    res = run_cli(*ray_args, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 shard(s) on Ray" in res.stdout and "each preparing its own rows" in res.stdout
    assert _table(tmp_path / "ray", "sentences").equals(_table(tmp_path / "single", "sentences"))
    man = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("ray", "single")]
    assert man[0]["corpora"]["sentences"] == man[1]["corpora"]["sentences"]
    assert man[0]["corpora"]["sentences"]["counts"]["truncated"] > 0
    _assert_same_mine(tmp_path / "ray", tmp_path / "single")
    assert not (tmp_path / "ray" / ".mine_shards").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the actors would mine on this machine's GPUs")
def test_ray_gives_each_gpu_an_actor_and_says_why_one_failed(tmp_path, tiny_dirs, monkeypatch):
    """A Ray cluster that lists 2 GPUs (declared, on this CPU): --shards defaults to the GPU
    count, one actor a GPU, each on cuda. Their torch sees no CUDA here, so the run fails in one
    line with the actor's own reason rather than Ray's wrapper (actor id, pid, the traceback)."""
    ray = pytest.importorskip("ray")
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}.items():
        monkeypatch.setenv(k, v)  # niceness: as ffkv's own private instance has it (`_init_ray`)
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        res = run_cli("mine", "--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens",
                      "--max-sentences", 40, "--top-k", 3, "--out", tmp_path / "r", "--ray", "local")
    finally:
        ray.shutdown()
    assert res.returncode == 2
    assert "2 shard(s) on Ray (2 CPU, 2 GPU), 2 actor(s)" in res.stdout
    assert "this driver runs on the cpu, and the GPU actors mine in its dtype (float32)" in res.stdout
    assert res.stderr.strip().splitlines() == [
        "ffkv: error: a shard failed on Ray: --device cuda asked for, but no CUDA device is available"]


def test_ray_reason_is_the_remote_error_in_one_line():
    from ffkv.steps.mine.distributed import ray_reason

    wrapped = ("The actor died because of an error raised in its creation task, \x1b[36mray::A.__init__()"
               "\x1b[39m (pid=1, ip=127.0.0.1)\n  File \"x.py\", line 3, in f\n    raise E\n"
               "ffkv.errors.FfkvError: --model nowhere: no such folder\n")
    assert ray_reason(RuntimeError(wrapped)) == "--model nowhere: no such folder"
    assert ray_reason(RuntimeError(wrapped.replace("ffkv.errors.FfkvError", "torch.OutOfMemoryError"))) \
        == "OutOfMemoryError: --model nowhere: no such folder"
    assert ray_reason(RuntimeError("a node died")) == "a node died"
    assert ray_reason(RuntimeError("")) == "RuntimeError"


@given(st.text())
def test_ray_reason_of_any_text_is_one_line(text):
    from ffkv.steps.mine.distributed import ray_reason

    out = ray_reason(ValueError(text))
    assert out and "\n" not in out and "\x1b[" not in out and len(out) <= 300


@pytest.mark.slow
def test_smollm2_top1_vs_plain_hook(tmp_path, smollm2_cut):
    """The real SmolLM2's weights, its first layers (`conftest.smollm2_cut`): the first, a middle
    and the last layer mined, each top-1 against a plain hook on the model's own down_proj."""
    mm = smollm2_cut
    layers = [0, mm.n_layers // 2, mm.n_layers - 1]
    run = Run(tmp_path / "r", create=True)
    mine(run, mm, MineSettings(corpus=str(WT2 / "wiki.valid.tokens"), max_sentences=100, top_k=3,
                               layers=layers), show_progress=False, log=lambda *a: None)
    t = run.read_table("triggers").to_pandas()
    sent = run.read_table("sentences").to_pandas().set_index("sentence_id")
    rng = np.random.default_rng(0)
    for layer in layers:
        for dim in rng.choice(mm.d_m, 5, replace=False):
            r = t[(t.layer == layer) & (t.dim == dim) & (t["rank"] == 1)].iloc[0]
            ids = list(sent.loc[int(r.sentence_id), "token_ids"])[: int(r.position) + 1]
            got = {}
            def grab(mod, a):
                got["m"] = a[0][0, -1, dim].item()

            h = mm.hf.model.layers[layer].mlp.down_proj.register_forward_pre_hook(grab)
            with torch.no_grad():
                mm.hf(input_ids=torch.tensor([ids]))
            h.remove()
            assert abs(got["m"] - r.coef) <= 1e-3 * max(1.0, abs(r.coef)), (layer, dim, got["m"], r.coef)


@pytest.mark.parametrize("per_prefix", [False, True])
def test_checkpoint_round_trip_at_every_batch(tiny_models, per_prefix):
    """Saving the state after any batch and continuing from the saved arrays changes nothing."""
    from ffkv.corpus.batching import pack

    mm = tiny_models["gpt2"]
    token_lists = [mm.tok(x)["input_ids"][:30] for x in wikitext_sentences(80)]
    sids = list(range(len(token_lists)))
    s = MineSettings(top_k=4, negative=True, per_prefix=per_prefix, batch_tokens=64)
    batches = list(enumerate(pack([len(x) for x in token_lists], 64)))
    ref = mine_batches(mm, new_state(mm, s), token_lists, sids, batches)
    for cut in range(1, len(batches), 3):
        st = mine_batches(mm, new_state(mm, s), token_lists, sids, batches[:cut])
        arrs = {k: np.array(v) for k, v in st.arrays().items()}
        resumed = mine_batches(mm, new_state(mm, s).load_arrays(arrs), token_lists, sids, batches[cut:])
        _same(ref, resumed)
        _same_stats(ref, resumed)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 999), min_size=0, max_size=6), min_size=1, max_size=12),
       st.integers(1, 5), st.randoms(use_true_random=False))
def test_next_tokens_batch_by_batch_equal_a_lookup(sents, rows, rnd):
    """`next_tokens` over the sentences in batches of any size, in any row order, equals a dict
    lookup: the token after the position, none at a sentence's end (or for an absent sentence)."""
    import pyarrow as pa

    from ffkv.mine.topk import next_tokens

    sids = rnd.sample(range(100), len(sents))
    tbl = pa.table({"sentence_id": pa.array(sids, pa.int64()), "token_ids": pa.array(sents, pa.list_(pa.int32()))})
    by = dict(zip(sids, sents))
    req = [(s, p) for s, t in by.items() for p in range(len(t))] + [(1000, 0)]  # 1000: in no batch
    rnd.shuffle(req)
    want = [(t[p + 1], True) if s in by and p + 1 < len(t) else (0, False) for s, p in req
            for t in [by.get(s, [])]]
    batches = [tbl.slice(a, rows) for a in range(0, len(tbl), rows)]
    tok, has = next_tokens(np.array([s for s, _ in req], np.int64), np.array([p for _, p in req], np.int32), batches)
    assert list(zip(tok.tolist(), has.tolist())) == want


def test_ray_plan_is_the_chunked_plan_read_chunk_by_chunk(tmp_path, tiny_dirs):
    """The --ray driver plans as the one-process pass does (packed within each chunk), reading
    the table's lengths chunk by chunk; a shard's batches then span one stretch of rows (the
    stretches of two shards share at most one chunk), so each reads its own part of the table."""
    from ffkv.corpus.batching import pack
    from ffkv.steps.mine.compute import _ray_plan
    from ffkv.steps.mine.distributed import shard_bounds

    out = mine_tiny(tmp_path / "r", tiny_dirs["llama"], 300, 2, "--no-stats")
    lengths = pq.read_table(out / "sentences.parquet", columns=["n_tokens"]).column("n_tokens").to_numpy()
    for chunk, bt in ((50, 128), (64, 400), (1024, 256)):
        batches, plan, chunks = _ray_plan(Run(out), MineSettings(chunk_sentences=chunk), bt)
        want = [b + a for a in range(0, len(lengths), chunk) for b in pack(lengths[a:a + chunk], bt)]
        assert [x.tolist() for x in batches] == [x.tolist() for x in want]
        sizes = [len(pack(lengths[a:a + chunk], bt)) for a in range(0, len(lengths), chunk)]
        assert chunks == [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]  # each chunk's first batch, count
        assert plan.tokens == int(lengths.sum()) and plan.n == len(want)
        spans = []
        for a, b in shard_bounds(len(batches), 3):
            rows = np.concatenate(batches[a:b])
            spans.append((rows.min(), rows.max()))
        for (_, hi), (lo, _) in zip(spans, spans[1:]):
            assert hi - lo < chunk, (chunk, spans)


def test_ctrl_c_during_a_checkpoint_write_lands_after_it(tmp_path):
    """A SIGINT (from any thread) while a checkpoint is written is acted on once the file is
    whole: np.savez interrupted midway left a half-closed zip writer behind, whose second close
    raised a ValueError traceback instead of the one-line "interrupted"."""
    code = f"""
import os, signal, threading, time, numpy as np
from pathlib import Path
from ffkv.mine.engine import save_npz
import ffkv.store.run
p = Path({str(tmp_path / 'ck.npz')!r})
a = np.arange(40_000_000)  # 320 MB: the write takes a good part of a second
seen = []
def kill_once_writing():  # the temp file appears inside the held block: no timing to lose under load
    while not (names := os.listdir(p.parent)):
        time.sleep(0.001)
    seen.extend(names)
    os.kill(os.getpid(), signal.SIGINT)
killer = threading.Thread(target=kill_once_writing, daemon=True)
killer.start()
try:
    save_npz(p, {{"a": a}})
    killer.join(120)  # a loaded machine may run the thread only after the write: it kills then
    for _ in range(600):  # a signal that came after the write is acted on here, in the same way
        time.sleep(0.05)
    print("not interrupted; the thread saw", seen, "alive", killer.is_alive())
except KeyboardInterrupt:
    print("interrupted", np.array_equal(np.load(p)["a"], a))
"""
    # SIGINT's default disposition in the child: a suite started in the background of a
    # non-interactive shell inherits SIG_IGN, and Python then installs no KeyboardInterrupt handler
    import signal

    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.returncode == 0 and p.stdout.strip() == "interrupted True", p.stdout + p.stderr[-2000:]
