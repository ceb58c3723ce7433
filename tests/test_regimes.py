"""Sign regimes of a gated FFN from the mining pass (`ffkv mine --regimes`): shares that sum to 1,
masses against a brute force from the raw gate and input projections, exact merges in any order,
a killed pass that resumes to the same table, and one-line refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import WT2, kill_mine_when, merges_bit_for_bit, mine_tiny, run_cli
from ffkv.mine import regimes as R
from ffkv.mine.regimes import REGIMES, SignRegimes
from ffkv.mine.trackers import Batch, LayerCapture

NAMES = list(REGIMES)  # pp, pn, np, nn: (gate, input) = (+,+), (+,−), (−,+), (−,−)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, tok_dir):
    """A tiny Phi-3: its gate and up projections fused in one gate_up_proj."""
    import transformers as tf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = tf.Phi3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        initializer_range=0.2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                        tie_word_embeddings=False)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("phi3") / "m"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mined(tmp_path_factory, tiny_dirs):
    return mine_tiny(tmp_path_factory.mktemp("reg") / "run", tiny_dirs["llama"], 60, 3, "--regimes",
                     "--batch-tokens", "256")


def _brute(hf, layer_mods, ids, split=None):
    """Per layer: mass (4, d_m) and tokens (4, d_m) by (sign of x·g, sign of x·u), from the FFN's
    input x and the raw gate and input weights, one sentence at a time."""
    out = {}
    for l, mlp in layer_mods.items():
        xs = []
        h = mlp.register_forward_pre_hook(lambda mod, args: xs.append(args[0].detach()[0].double()))
        try:
            with torch.no_grad():
                for seq in ids:
                    hf(input_ids=torch.tensor([seq]), use_cache=False)
        finally:
            h.remove()
        x = torch.cat(xs)
        Wg, Wu = (w.detach() for w in split(mlp))
        g, u = x @ Wg.double().T, x @ Wu.double().T
        m = torch.nn.functional.silu(g) * u
        mass, cnt = np.zeros((4, g.shape[1])), np.zeros((4, g.shape[1]), np.int64)
        for r, (gs, us) in enumerate(((1, 1), (1, -1), (-1, 1), (-1, -1))):
            sel = (torch.sign(g) == gs) & (torch.sign(u) == us)
            mass[r] = (m.abs() * sel).sum(0).numpy()
            cnt[r] = sel.sum(0).numpy()
        out[l] = (mass, cnt, x.shape[0])
    return out


def _check_table(t, brute, layers):
    import pyarrow.compute as pc

    for l in layers:
        rows = t.filter(pc.equal(t["layer"], l)).sort_by("dim")
        mass, cnt, n = brute[l]
        assert rows.num_rows == mass.shape[1]
        assert set(rows.column("tokens").to_pylist()) == {n}
        got = np.stack([rows.column(f"mass_{r}").to_numpy() for r in NAMES])
        np.testing.assert_allclose(got, mass, rtol=1e-4, atol=1e-6 * mass.sum() / mass.size)
        gotc = np.stack([rows.column(f"tokens_{r}").to_numpy() for r in NAMES])
        # a token whose x·g or x·u is within rounding of 0 may fall on the other side: rare
        assert np.abs(gotc - cnt).sum() <= 1e-3 * cnt.sum(), np.abs(gotc - cnt).sum()
        assert (gotc.sum(0) <= n).all()
        shares = np.stack([rows.column(f"share_{r}").to_numpy(zero_copy_only=False) for r in NAMES])
        assert np.isfinite(shares).all()
        np.testing.assert_allclose(shares.sum(0), 1.0, rtol=1e-12)
        np.testing.assert_allclose(shares, mass / mass.sum(0), rtol=1e-4, atol=1e-7)
        # the four regimes are all there on a random model
        assert (mass.sum(1) > 0).all()


def test_shares_sum_to_one_and_masses_equal_a_brute_force(mined, tiny_models):
    from ffkv.store import query
    from ffkv.store.run import Run

    run = Run(mined)
    mm = tiny_models["llama"]
    ids = query.table(run, "sentences", columns=["token_ids"]).column("token_ids").to_pylist()
    t = query.sign_regimes(run)
    assert t.column_names == ["layer", "dim", "tokens", *(f"tokens_{r}" for r in NAMES),
                              *(f"mass_{r}" for r in NAMES), *(f"share_{r}" for r in NAMES)]
    assert str(t.schema.field("layer").type) == "int16" and str(t.schema.field("dim").type) == "int32"
    assert t.num_rows == mm.n_layers * mm.d_m
    mlps = {l: mm.hf.model.layers[l].mlp for l in range(mm.n_layers)}
    brute = _brute(mm.hf, mlps, ids, lambda mlp: (mlp.gate_proj.weight, mlp.up_proj.weight))
    _check_table(t, brute, range(mm.n_layers))
    assert query.sign_regimes(run, layer=1).num_rows == mm.d_m
    assert run.step("mine")["regimes"]["tables"] == ["sign_regimes"]
    assert run.settings("mine").get("regimes") is True


def test_compiled_blocks_give_way_to_the_eager_forward(tmp_path, mined, tiny_dirs):
    """FFKV_COMPILE=1 taps m only: a pass with --regimes runs eagerly, and mines the same table."""
    from ffkv.store import query
    from ffkv.store.run import Run

    res = run_cli("mine", "--out", tmp_path / "c", "--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens",
                  "--max-sentences", "60", "--top-k", "3", "--regimes", "--batch-tokens", "256",
                  env={"FFKV_COMPILE": "1"})
    assert res.returncode == 0, res.stderr
    run = Run(tmp_path / "c")
    assert run.step("mine")["compiled_forward"] is False
    a, b = query.sign_regimes(run), query.sign_regimes(Run(mined))
    for c in a.column_names:
        np.testing.assert_allclose(a.column(c).to_numpy(zero_copy_only=False),
                                   b.column(c).to_numpy(zero_copy_only=False), rtol=1e-12)


def test_fused_gate_up_and_dims(tmp_path, phi3_dir):
    """Phi-3's gate pre-activations are the first half of its fused gate_up_proj; --dims keeps its
    dims' rows, packed rows mine the same."""
    from ffkv.model.memories import open_model
    from ffkv.store import query
    from ffkv.store.run import Run

    out = mine_tiny(tmp_path / "r", phi3_dir, 30, 3, "--regimes", "--dims", "3-20", "--batch-tokens", "128",
                    "--pack", "64")
    mm = open_model(str(phi3_dir), device="cpu")
    run = Run(out)
    ids = query.table(run, "sentences", columns=["token_ids"]).column("token_ids").to_pylist()
    d = mm.d_m

    def split(mlp):
        w = mlp.gate_up_proj.weight
        return w[:d][3:21], w[d:][3:21]

    mlps = {l: mm.hf.model.layers[l].mlp for l in range(mm.n_layers)}
    t = query.sign_regimes(run)
    assert t.column("dim").to_pylist()[:18] == list(range(3, 21))
    _check_table(t, _brute(mm.hf, mlps, ids, split), range(mm.n_layers))


def _fed(batches, n=6, layers=(0, 1)):
    t = SignRegimes(list(layers), None, n)
    for m, g, lengths in batches:
        mask = torch.arange(m.shape[1])[None, :] < torch.tensor(lengths)[:, None]
        b = Batch.from_lengths(lengths, list(range(len(lengths))), mask)
        for i, l in enumerate(layers):
            t.update(b, LayerCapture(l, m[..., i * n:(i + 1) * n].clone(), b,
                                     aux={"g": [g[..., i * n:(i + 1) * n].clone()]}))
    return t


def _batch(B, T, seed):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(B, T, 12, generator=gen) * torch.exp(torch.randn(1, 1, 12, generator=gen) * 3)
    m[torch.rand(B, T, 12, generator=gen) < 0.2] = 0.0
    g = torch.randn(B, T, 12, generator=gen)
    return m, g, [int(x) for x in torch.randint(1, T + 1, (B,), generator=gen)]


batches = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(0, 2 ** 31)), min_size=3, max_size=3)


@settings(max_examples=25, deadline=None)
@given(batches)
def test_merge_is_associative_and_order_free_bit_for_bit(spec):
    a, b, c = ([_batch(*s)] for s in spec)
    first = merges_bit_for_bit(_fed, a, b, c)
    whole = _fed(a + b + c)
    merged = SignRegimes([0, 1], None, 6).load_arrays(first)
    for l in (0, 1):
        (m0, c0), (m1, c1) = whole.masses(l), merged.masses(l)
        np.testing.assert_allclose(m0, m1, rtol=1e-12, atol=1e-300)
        assert np.array_equal(c0, c1)
    back = SignRegimes([0, 1], None, 6).load_arrays(_fed(a).arrays())
    assert all(np.array_equal(back.arrays()[k], v) for k, v in _fed(a).arrays().items())


def test_portable_path_equals_the_compiled_one(monkeypatch):
    """The torch path (CUDA, or no numba) and numba's on a CPU: the same counts, masses to rounding,
    padded rows and an arbitrary mask alike."""
    bs = [_batch(3, 7, 1), _batch(2, 4, 2), _batch(4, 9, 3)]
    fast = _fed(bs)
    monkeypatch.setattr(R, "_numba_here", lambda device: False)
    slow = _fed(bs)
    for l in (0, 1):
        (m0, c0), (m1, c1) = fast.masses(l), slow.masses(l)
        np.testing.assert_allclose(m0, m1, rtol=1e-6)
        assert np.array_equal(c0, c1)
        # and a brute force over the valid tokens
        n = 6
        mass = np.zeros((4, n))
        for m, g, lengths in bs:
            for row, L in enumerate(lengths):
                mm_ = m[row, :L, l * n:(l + 1) * n].double().numpy()
                gg = g[row, :L, l * n:(l + 1) * n].double().numpy()
                gate, inp = gg > 0, (mm_ > 0) == (gg > 0)
                for r, (gs, us) in enumerate(((True, True), (True, False), (False, True), (False, False))):
                    mass[r] += (np.abs(mm_) * ((gate == gs) & (inp == us) & (mm_ != 0))).sum(0)
        np.testing.assert_allclose(m0, mass, rtol=1e-12)
    t = slow.finish()["sign_regimes"]
    assert t.num_rows == 12
    # a mask that is not right-padding (LayerCapture.blocks' other case)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    m, g = torch.randn(2, 3, 6), torch.randn(2, 3, 6)
    for fn in (lambda device: False, lambda device: True):
        monkeypatch.setattr(R, "_numba_here", fn)
        t = SignRegimes([0], None, 6)
        b = Batch.from_mask(mask, [0, 1])
        t.update(b, LayerCapture(0, m, b, aux={"g": [g]}))
        want = (m.abs() * mask[..., None]).sum((0, 1)).double().numpy()
        np.testing.assert_allclose(t.masses(0)[0].sum(0), want, rtol=1e-6)
        assert t.tokens == 4


def test_resumed_pass_gives_the_same_table(tmp_path, tiny_dirs):
    from ffkv.store import query
    from ffkv.store.run import Run

    args = ["--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens", "--max-sentences", 200,
            "--top-k", 3, "--batch-tokens", 64, "--checkpoint-every", 0, "--regimes", "--no-stats"]
    ref = tmp_path / "ref"
    assert run_cli("mine", "--out", ref, *args).returncode == 0
    out = tmp_path / "killed"
    ck = out / ".mine_checkpoint.npz"
    kill_mine_when(out, args, ck.exists, settle=0.3)
    assert ck.exists() and not (out / "sign_regimes.parquet").exists()
    res = run_cli("mine", "--out", out, *args)
    assert res.returncode == 0, res.stderr
    assert "resuming from checkpoint" in res.stdout
    a, b = (query.sign_regimes(Run(d)) for d in (out, ref))
    assert a.num_rows == b.num_rows > 0
    for c in a.column_names:
        x, y = a.column(c).to_numpy(zero_copy_only=False), b.column(c).to_numpy(zero_copy_only=False)
        if c.startswith(("mass_", "share_")):
            np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-300)
        else:
            assert np.array_equal(x, y), c


def _mixtral(path, tok_dir, **kw):
    import transformers as tf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = tf.MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_experts_per_tok=2, max_position_embeddings=128, vocab_size=len(tok),
                           bos_token_id=0, eos_token_id=0, pad_token_id=0, intermediate_size=24,
                           num_local_experts=4, **kw)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("arch, says", [
    ("gpt2", "--regimes: gpt2 needs a gated FFN"),
    # a mixture of experts has sign regimes (test_regimes_moe), but its experts' activation must keep
    # its input's sign too
    ("mixtral", "--regimes: mixtral's activation sigmoid (layer 0) does not keep its input's sign")])
def test_ungated_model_or_sign_losing_activation_is_refused_in_one_line(tmp_path, tiny_dirs, tok_dir, arch, says):
    model = tiny_dirs[arch] if arch in tiny_dirs else _mixtral(tmp_path / arch, tok_dir, hidden_act="sigmoid")
    res = run_cli("mine", "--out", tmp_path / "r", "--model", model, "--corpus",
                  WT2 / "wiki.valid.tokens", "--max-sentences", "3", "--regimes")
    assert res.returncode == 2 and says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "r" / "sentences.parquet").exists()


def test_activation_must_keep_its_input_sign():
    assert R.keeps_sign(torch.nn.SiLU()) and R.keeps_sign(torch.nn.GELU()) and R.keeps_sign(torch.nn.ReLU())
    assert R.keeps_sign(torch.nn.GELU(approximate="tanh"), (torch.float32, torch.bfloat16))
    assert not R.keeps_sign(torch.nn.Sigmoid()) and not R.keeps_sign(torch.nn.Softplus())
