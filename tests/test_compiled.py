"""Mining's forward through compiled blocks (`ffkv.mine.compiled`, FFKV_COMPILE=1): the same tables
as the eager forward, a model given back as it was, and families that cannot refused with a note
(a bad setting: tests/test_packing.py, `test_a_bad_switch_is_one_line`)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import WT2, mine_tiny, run_cli
from test_mine import _assert_same_mine


def _mine(out, model, *extra):
    res = run_cli("mine", "--out", out, "--model", model, "--corpus", WT2 / "wiki.valid.tokens",
                  "--max-sentences", "60", "--top-k", "5", "--negative", *extra)
    assert res.returncode == 0, res.stderr
    return res


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_mining_writes_the_eager_tables(tiny_dirs, tmp_path, monkeypatch, reference_mine, arch):
    """One compiled graph for every block and batch shape; the tables equal the eager pass's,
    also in packed rows; the manifest says the forward was compiled."""
    want = reference_mine(tiny_dirs[arch], 60, 5, "--negative")
    monkeypatch.setenv("FFKV_COMPILE", "1")
    res = _mine(tmp_path / "compiled", tiny_dirs[arch])
    assert "FFKV_COMPILE" not in res.stderr, res.stderr
    _assert_same_mine(tmp_path / "compiled", want, other_kernels=True)
    info = json.loads((tmp_path / "compiled" / "manifest.json").read_text())["steps"]["mine"]
    assert info["compiled_forward"] is True
    monkeypatch.setenv("FFKV_PACK", "48")
    _mine(tmp_path / "both", tiny_dirs[arch])
    _assert_same_mine(tmp_path / "both", want, other_kernels=True)


def test_the_model_is_given_back(tiny_models, monkeypatch):
    """After a compiled pass the blocks are the model's own again: captures equal those before,
    and no tap is left to hold coefficients."""
    from ffkv.corpus.batching import pack
    from ffkv.mine.compiled import _SINK
    from ffkv.mine.engine import mine_batches, new_state
    from ffkv.steps.mine import MineSettings

    mm = tiny_models["llama"]
    ids = torch.randint(0, mm.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    before = mm.capture(ids, None, what=("m", "y"))
    mods = [type(m).__name__ for m in mm.hf.modules()]
    monkeypatch.setenv("FFKV_COMPILE", "1")
    toks = [ids[i].tolist() for i in range(3)]
    mine_batches(mm, new_state(mm, MineSettings(top_k=2)), toks, [0, 1, 2], list(enumerate(pack([9] * 3, 64))))
    assert [type(m).__name__ for m in mm.hf.modules()] == mods and not _SINK
    assert all("forward" not in blk.__dict__ for blk in mm.blocks)
    after = mm.capture(ids, None, what=("m", "y"))
    for l in before.layers:
        for q in ("m", "y"):
            assert torch.equal(before[l][q], after[l][q]), (l, q)


@pytest.mark.parametrize("setting", ["1", "auto"])
def test_a_family_that_cannot_is_said_once(tmp_path, monkeypatch, tok_dir, setting):
    """A post-FFN norm's coefficients are read at the norm, not the value projection's input:
    such a model mines eagerly, with one line saying why, and the same tables; under auto the
    compiled arm leaves the tuner's trial at its first batch."""
    from test_families import FAMILIES, open_tiny
    from ffkv import errors

    name, mm = open_tiny("gemma2", FAMILIES["gemma2"].config, lambda: tmp_path, tok_dir, {})
    path = tmp_path / "gemma2"
    want = mine_tiny(tmp_path / "eager", path, 30, 3)
    monkeypatch.setenv("FFKV_COMPILE", setting)
    errors._said.clear()
    res = run_cli("mine", "--out", tmp_path / "c", "--model", path, "--corpus", WT2 / "wiki.valid.tokens",
                  "--max-sentences", "30", "--top-k", "3")
    assert res.returncode == 0, res.stderr
    said = [l for l in res.stderr.splitlines() if "FFKV_COMPILE" in l]
    assert len(said) == 1 and "the eager forward for this model" in said[0], res.stderr
    _assert_same_mine(tmp_path / "c", want)  # eager both times
    info = json.loads((tmp_path / "c" / "manifest.json").read_text())["steps"]["mine"]
    assert info["compiled_forward"] is False
    if setting == "auto":
        assert info["tuning"]["chosen"] == "padded"
        assert [(a["arm"], a["batches"]) for a in info["tuning"]["arms"]][1] == ("padded+compiled", 0)


def test_auto_times_the_compiled_twin(tiny_dirs, tmp_path, monkeypatch, reference_mine):
    """FFKV_COMPILE=auto: once the other paths are chosen (on a CPU, padded rows and the portable
    trackers: nothing to time), that choice and its twin through compiled blocks are each timed
    on every stratum after the twin's untimed first batch (the compile), and the faster mines the
    rest; the tables equal the eager pass's, the manifest holds both arms' figures, and the model
    is given back as it was."""
    from ffkv.mine.tune import STRATA

    want = reference_mine(tiny_dirs["llama"], 120, 5, "--negative", "--batch-tokens", "128")
    monkeypatch.setenv("FFKV_COMPILE", "auto")
    res = run_cli("mine", "--out", tmp_path / "auto", "--model", tiny_dirs["llama"], "--corpus",
                  WT2 / "wiki.valid.tokens", "--max-sentences", "120", "--top-k", "5", "--negative",
                  "--batch-tokens", "128")
    assert res.returncode == 0, res.stderr
    assert "FFKV_COMPILE" not in res.stderr, res.stderr
    _assert_same_mine(tmp_path / "auto", want, other_kernels=True)
    rec = json.loads((tmp_path / "auto" / "manifest.json").read_text())["steps"]["mine"]
    t = rec["tuning"]
    assert [(a["arm"], a["compiled"]) for a in t["arms"]] == [("padded", False), ("padded+compiled", True)]
    assert all(a["timed_tokens"] > 0 and a["tokens_per_s"] > 0 for a in t["arms"])
    assert sum(a["batches"] for a in t["arms"]) == rec["batches"]["batches"]
    best = max(t["arms"], key=lambda a: a["tokens_per_s"])
    assert t["chosen"] == best["arm"] and rec["compiled_forward"] is best["compiled"]
    loser = next(a for a in t["arms"] if a is not best)
    assert loser["batches"] == STRATA + (loser["compiled"])  # its trial's only (the twin: and its compile)


def test_the_self_check_tells_rounding_from_a_wrong_capture(tiny_models):
    """The faster forwards' check (`ffkv.mine.selfcheck.first_difference`) in a half type passes the
    captures rounded to it (what other kernels' arithmetic changes: on an H100 the compiled bf16
    forward sat 3.8e-2 from eager, 3e-2 was refused), and catches a capture of the wrong layer or
    of another batch; in float32 the same rounding is a difference."""
    from types import SimpleNamespace

    from ffkv.mine.selfcheck import first_difference, tolerance

    mm = tiny_models["llama"]
    g = torch.Generator().manual_seed(3)
    ids, other = (torch.randint(0, mm.vocab_size, (3, 9), generator=g) for _ in range(2))
    cap, cap2 = (mm.capture(x, None, what=("m",)) for x in (ids, other))
    layers = list(cap.layers)
    want = {l: cap[l]["m"] for l in layers}
    keep = torch.ones(3, 9, dtype=torch.bool)
    rounded = {l: want[l].to(torch.bfloat16).float() for l in layers}
    # three roundings' worth of error, the size of a deep bf16 forward's drift
    drift = {l: want[l] * (1 + 3 * 2.0 ** -7 * torch.randn(want[l].shape, generator=g).clamp(-1, 1)) for l in layers}
    half, full = SimpleNamespace(dtype=torch.bfloat16), SimpleNamespace(dtype=torch.float32)
    assert tolerance(torch.bfloat16) > 3.8e-2 and tolerance(torch.float32) == 1e-4
    assert first_difference(half, rounded, want, keep) is None
    assert first_difference(half, drift, want, keep) is None
    assert first_difference(full, rounded, want, keep) is not None
    shifted = {l: want[layers[(i + 1) % len(layers)]] for i, l in enumerate(layers)}
    assert first_difference(half, shifted, want, keep)[0] == layers[0]
    stale = {l: cap2[l]["m"] for l in layers}
    l, err = first_difference(half, stale, want, keep)
    assert l == layers[0] and err > 5 * tolerance(torch.bfloat16)


def _eager_and_compiled(tiny_dirs, tmp_path, monkeypatch, reference_mine, setting, *extra):
    want = reference_mine(tiny_dirs["llama"], 120, 5, "--negative", "--batch-tokens", "128", *extra)
    monkeypatch.setenv("FFKV_COMPILE", setting)
    res = run_cli("mine", "--out", tmp_path / "c", "--model", tiny_dirs["llama"], "--corpus",
                  WT2 / "wiki.valid.tokens", "--max-sentences", "120", "--top-k", "5", "--negative",
                  "--batch-tokens", "128", *extra)
    assert res.returncode == 0, res.stderr
    return want, res, json.loads((tmp_path / "c" / "manifest.json").read_text())["steps"]["mine"]


def test_a_recompile_that_fails_mid_pass_mines_on_eagerly(tiny_dirs, tmp_path, monkeypatch, reference_mine):
    """A compiler that fails after the start-up check (here dynamo refusing to recompile for the
    first one-row batch: sizes of 1 are specialized, so that batch needs a graph of its own) costs
    one line, not the run: that batch and the rest mine eagerly, and the tables are the eager
    pass's (every token counted once)."""
    import torch._dynamo

    torch._dynamo.reset()  # no graph of an earlier test may serve the one-row batch
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    from ffkv import errors

    errors._said.clear()
    want, res, info = _eager_and_compiled(tiny_dirs, tmp_path, monkeypatch, reference_mine, "1")
    said = [l for l in res.stderr.splitlines() if "FFKV_COMPILE" in l]
    assert len(said) == 1 and "failed mid-pass (RecompileError" in said[0], res.stderr
    assert "Traceback" not in res.stderr
    _assert_same_mine(tmp_path / "c", want, other_kernels=True)
    assert info["compiled_forward"] is False


@pytest.mark.parametrize("setting", ["1", "auto"])
def test_a_block_that_fails_midway_hands_each_layer_over_once(tiny_dirs, tmp_path, monkeypatch, reference_mine,
                                                              setting):
    """A failure after some layers' coefficients reached the trackers (injected at the last layer's
    block, in the second mining batch through compiled blocks): the eager forward that finishes
    the batch hands over only the layers still missing, so no token is counted twice or lost;
    under auto the compiled arm leaves the trial and the eager arm mines on."""
    from ffkv import errors
    from ffkv.mine.compiled import CompiledBlocks

    real, seen = CompiledBlocks._drain, []

    def drain(self, l):
        hook = real(self, l)

        def failing(mod, args, out):
            if l == self.last and self.callback is not None:
                seen.append(l)
                if len(seen) == 3:  # the check, the first batch, then this one
                    raise RuntimeError("injected: no kernel for this graph\nsecond line")
            return hook(mod, args, out)
        return failing

    monkeypatch.setattr(CompiledBlocks, "_drain", drain)
    errors._said.clear()
    want, res, info = _eager_and_compiled(tiny_dirs, tmp_path, monkeypatch, reference_mine, setting)
    said = [l for l in res.stderr.splitlines() if "FFKV_COMPILE" in l]
    assert len(said) == 1 and said[0].endswith("failed mid-pass (RuntimeError: injected: no kernel for this graph)"), \
        res.stderr
    assert len(seen) == 3  # never compiled again
    _assert_same_mine(tmp_path / "c", want, other_kernels=True)
    assert info["compiled_forward"] is False
    if setting == "auto":
        arms = {a["arm"]: a for a in info["tuning"]["arms"]}
        assert info["tuning"]["chosen"] == "padded" and arms["padded+compiled"]["batches"] == 1
        assert sum(a["batches"] for a in arms.values()) == info["batches"]["batches"]
