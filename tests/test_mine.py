"""Mining: brute force, merge, batch independence, resume after SIGKILL, Ray identity."""
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import WT2, run_cli, wikitext_sentences
from ffkv.mine.runner import MineSettings, mine, mine_batches, new_state, triggers_table
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


STATS_TABLES = ("key_stats", "key_hist", "key_samples")


def _assert_same_table(got_dir, want_dir, name):
    """Ids, counts and positions to the bit; floats to the bit or, failing that, within 1e-5 with a
    warning that says where and how far.

    Bit-identical floats across processes rest on the BLAS (`MKL_CBWR`); one CI machine once gave a
    `key_stats` that differed while every count matched, and it never recurred here (56 kills).
    Work lost or counted twice changes counts, which stay exact."""
    got, want = _table(got_dir, name), _table(want_dir, name)
    assert got.schema == want.schema and got.num_rows == want.num_rows, name
    inexact = []
    for c in want.column_names:
        a, b = got.column(c), want.column(c)
        if a.equals(b):
            continue
        assert pa.types.is_floating(b.type), f"{name}.{c} differs"
        x = a.to_numpy(zero_copy_only=False).astype(np.float64)
        y = b.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~((x == y) | (np.isnan(x) & np.isnan(y)))
        rel = np.abs(x - y)[bad] / np.maximum(np.abs(y[bad]), 1e-30)
        assert np.allclose(x, y, rtol=1e-5, atol=1e-7, equal_nan=True), \
            f"{name}.{c}: {int(bad.sum())} of {len(y)} values differ, up to {rel.max():.2g} relative"
        inexact.append(f"{c} ({int(bad.sum())} values, up to {rel.max():.2g} relative)")
    if inexact:
        warnings.warn(f"{name}: not bit-identical in {', '.join(inexact)}")


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


def test_resume_after_sigkill(tmp_path, tiny_dirs):
    args = ["--model", tiny_dirs["gpt2"], "--corpus", WT2 / "wiki.valid.tokens", "--max-sentences", 800,
            "--top-k", 5, "--batch-tokens", 64, "--checkpoint-every", 0]
    ref = tmp_path / "ref"
    assert run_cli("mine", "--out", ref, *args).returncode == 0
    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", "mine", "--out", str(out), *map(str, args)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ck = out / ".mine_checkpoint.npz"
    deadline = time.time() + 120
    while not ck.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    assert p.poll() is None, "finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert ck.exists() and not (out / "triggers.parquet").exists()
    (out / f".mine_checkpoint.npz.tmp{p.pid}").write_bytes(b"half")  # as if killed mid-save
    res = run_cli("mine", "--out", out, *args)
    assert res.returncode == 0, res.stderr
    assert "resuming from checkpoint" in res.stdout
    for name in ("triggers", *STATS_TABLES):  # the top-k and the key statistics resume to the same rows
        _assert_same_table(out, ref, name)
    assert not ck.exists()
    assert not list(out.glob(".*.tmp*")), "a killed run's half-written checkpoint was left behind"


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
    """A killed step keeps its start (its time counts from the first try); a step done before and
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
def test_ray_two_shards_identical(tmp_path, tiny_dirs):
    args = ["--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens", "--max-sentences", 300,
            "--top-k", 5, "--negative"]
    assert run_cli("mine", "--out", tmp_path / "single", *args).returncode == 0
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    res = run_cli("mine", "--out", tmp_path / "ray", *args, "--ray", "local", "--shards", 2, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 shard(s) on Ray" in res.stdout
    for name in ("triggers", *STATS_TABLES):  # the same tables from two shards
        _assert_same_table(tmp_path / "ray", tmp_path / "single", name)


@pytest.mark.slow
def test_smollm2_top1_vs_plain_hook(tmp_path, smollm2):
    mm = smollm2
    run = Run(tmp_path / "r", create=True)
    mine(run, mm, MineSettings(corpus=str(WT2 / "wiki.valid.tokens"), max_sentences=100, top_k=3,
                               layers=[0, 14, 29]), show_progress=False, log=lambda *a: None)
    t = run.read_table("triggers").to_pandas()
    sent = run.read_table("sentences").to_pandas().set_index("sentence_id")
    rng = np.random.default_rng(0)
    for layer in (0, 14, 29):
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
