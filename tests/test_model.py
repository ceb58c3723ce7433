"""Exactness of the memory view: FFN output rebuilt from memories, lens vs logits."""
import pytest
import torch

from conftest import ARCHS, wikitext_sentences


def _batch(mm, texts):
    ids = [mm.tok(t)["input_ids"][:60] for t in texts]
    return mm.batch(ids)


def _check_exact(mm, texts):
    ids, mask = _batch(mm, texts)
    cap = mm.capture(ids, mask, what=("r", "x", "m", "y", "o"), logits=True)
    for l in range(mm.n_layers):
        c = cap[l]
        # m as the definition computes it from x, vs m as the model computed it
        m_def = mm.coefficients(l, c["x"])
        assert torch.allclose(m_def, c["m"], rtol=1e-4, atol=1e-5)
        # y = sum_i m_i v_i + b, built by hand from the exposed keys and values
        y = torch.einsum("btm,md->btd", m_def, mm.values(l))
        if mm.value_bias(l) is not None:
            y = y + mm.value_bias(l)
        rel = ((y - c["y"]).norm() / c["y"].norm()).item()
        assert rel < 1e-4, (l, rel)
        assert torch.allclose(c["r"] + c["y"], c["o"], atol=1e-5)
    # the lens through the final norm reproduces the logits
    lens_logits = mm.lens.logits(cap[mm.n_layers - 1]["o"])
    assert torch.allclose(lens_logits, cap.logits, rtol=1e-4, atol=1e-4)
    assert (lens_logits.argmax(-1) == cap.logits.argmax(-1)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_tiny(tiny_models, arch):
    mm = tiny_models[arch]
    _check_exact(mm, wikitext_sentences(6))


@pytest.mark.parametrize("arch", ARCHS)
def test_keys_values_from_raw_weights(tiny_models, arch):
    """Brute force: the FFN module's own output equals f(x K^T + b) V + b from raw weights."""
    mm = tiny_models[arch]
    x = torch.randn(5, mm.d)
    K, V = mm.keys(0), mm.values(0)
    assert K.shape == (mm.d_m, mm.d) and V.shape == (mm.d_m, mm.d)
    m = mm.coefficients(0, x)
    y = mm.ffn_from_memories(0, m)
    # run the real modules of layer 0 on x
    blk = mm.blocks[0]
    if arch == "opt":
        ref = blk.fc2(blk.activation_fn(blk.fc1(x)))
    else:
        ref = blk.mlp(x)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-5)
    assert mm.gated == (arch == "llama")


def test_capture_only_requested(tiny_models):
    mm = tiny_models["llama"]
    ids, mask = _batch(mm, ["The cat sat on the mat."])
    cap = mm.capture(ids, mask, layers=[1], what=("m",))
    assert set(cap.layers) == {1} and set(cap[1]) == {"m"} and cap.logits is None
    # stopping early: layer 2's hooks never fire
    fired = []
    h = mm.blocks[2].register_forward_hook(lambda *a: fired.append(1))
    mm.capture(ids, mask, layers=[0], what=("m",))
    h.remove()
    assert fired == []


def test_naive_lens_is_plain_unembedding(tiny_models):
    from ffkv.model.memories import lens_for

    mm = tiny_models["gpt2"]
    h = torch.randn(3, mm.d)
    naive = lens_for(mm, "naive")
    assert torch.allclose(naive.logits(h), h @ mm.hf.lm_head.weight.T, atol=1e-5)
    g = mm.hf.transformer.ln_f.weight
    assert torch.allclose(lens_for(mm, "norm").direction_logits(h), (h * g) @ mm.hf.lm_head.weight.T, atol=1e-5)


def test_lens_for_gives_one_lens_per_name(tiny_models):
    """Each public name is one class; the model's own lens is the one `lens_for` gives for its name,
    and a bad name is the one-line error of `check_lens`."""
    from ffkv.errors import FfkvError
    from ffkv.model.memories import LENS_TYPES, NaiveLens, NormLens, lens_for

    mm = tiny_models["gpt2"]
    assert lens_for(mm, mm.lens.name) is mm.lens and lens_for(mm, "naive") is lens_for(mm, "naive")
    assert (type(lens_for(mm, "naive")), type(lens_for(mm, "norm"))) == (NaiveLens, NormLens)
    assert tuple(LENS_TYPES) == ("naive", "norm")
    with pytest.raises(FfkvError, match="unknown lens"):
        lens_for(mm, "tuned")


def test_rank_of_counts_logits_above():
    from ffkv.model.memories import rank_of

    logits = torch.randn(4, 1000)
    target = torch.randint(0, 1000, (4,))
    r = rank_of(logits, target)
    ref = [int((torch.argsort(logits[i], descending=True) == target[i]).nonzero()) for i in range(4)]
    assert r.tolist() == ref


def test_rank_of_below_is_the_rank_in_the_negated_row():
    """`below` counts from the low end without negating: rank_of(−z) exactly, ties included."""
    from ffkv.model.memories import rank_of

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (6, 50), generator=g).float()  # ties everywhere
    target = torch.randint(0, 50, (6,), generator=g)
    below = torch.tensor([True, False, True, True, False, False])
    r = rank_of(logits, target, below=below)
    for i in range(6):
        z = -logits[i] if below[i] else logits[i]
        assert int(r[i]) == int((z > z[target[i]]).sum())


@pytest.mark.slow
def test_exact_smollm2(smollm2):
    mm = smollm2
    assert (mm.n_layers, mm.d, mm.d_m, mm.vocab_size) == (30, 576, 1536, 49152)
    assert mm.gated and mm.n_layers * mm.d_m == 46080
    _check_exact(mm, wikitext_sentences(3))


def test_family_checks_refuse_what_the_memory_view_cannot_read():
    """Each family's own checks (its entry in ffkv.model.arch), one line each."""
    import transformers as tf

    from ffkv.errors import FfkvError
    from ffkv.model.arch import find
    from ffkv.model.memories import MemoryModel

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    for cfg, needle in [
        (tf.OPTConfig(**small, ffn_dim=64, do_layer_norm_before=False), "post-norm OPT"),
        (tf.OPTConfig(**small, ffn_dim=64, word_embed_proj_dim=16), "project_out"),
        (tf.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=64, pretraining_tp=2,
                        slow_but_exact=True), "slow_but_exact"),
    ]:
        with pytest.raises(FfkvError, match=needle):
            find(cfg)
    find(tf.OPTConfig(**small, ffn_dim=64))  # the plain ones pass
    find(tf.BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=64, pretraining_tp=2))
    # a post-FFN norm family whose value projection has a bias: only the modules tell
    torch.manual_seed(0)
    hf = tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, intermediate_size=48, head_dim=8,
                                              num_key_value_heads=2))
    blk = hf.model.layers[0]
    blk.mlp.down_proj = torch.nn.Linear(48, 32, bias=True)
    with pytest.raises(FfkvError, match="bias"):
        MemoryModel(hf, None)


def test_capture_and_intervention_share_m_on_a_post_norm_family():
    """Gemma 2: a capture inside an intervention sees the edited m (set), and the FFN then adds
    exactly the rebuilt Σ m_i v_i of the edited m, the token's norm scale kept."""
    import transformers as tf

    from ffkv.model.memories import MemoryModel

    torch.manual_seed(0)
    cfg = tf.Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                          intermediate_size=48, head_dim=8, num_key_value_heads=2, query_pre_attn_scalar=8)
    hf = tf.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    mm = MemoryModel(hf, None)
    ids = torch.randint(0, 64, (2, 7))
    plain = mm.capture(ids, what=("m", "y"), layers=[1])
    with mm.intervene([(1, 3, "set", 2.5), (1, 4, "scale", 0.0)], at="all"):
        cap = mm.capture(ids, what=("m", "y"), layers=[1])
    m, m0 = cap[1]["m"], plain[1]["m"]
    assert torch.allclose(m[..., 3], torch.full_like(m[..., 3], 2.5)) and (m[..., 4] == 0).all()
    others = [i for i in range(mm.d_m) if i not in (3, 4)]
    assert torch.allclose(m[..., others], m0[..., others])  # the scale stayed: other m unchanged
    assert torch.allclose(cap[1]["y"], mm.ffn_from_memories(1, m), atol=1e-5)
    assert torch.allclose(cap[1]["y"] - plain[1]["y"],
                          (2.5 - m0[..., 3:4]) * mm.values(1)[3] - m0[..., 4:5] * mm.values(1)[4], atol=1e-5)
    assert all(not st for st in mm._state)  # nothing kept after the forward passes


def test_values_follow_the_weights(tiny_models):
    """`values` may keep a layer's V, but never past a change of the block's weights."""
    mm = tiny_models["llama"]
    v0 = mm.values(1).clone()
    w = mm.blocks[1].mlp.down_proj.weight
    with torch.no_grad():
        w.mul_(2.0)
    try:
        assert torch.allclose(mm.values(1), 2 * v0)
    finally:
        with torch.no_grad():
            w.div_(2.0)
    assert torch.allclose(mm.values(1), v0)


def test_quiet_hf_leaves_a_library_callers_warnings_alone():
    """Loading a model for a library caller (a step's context, the web app) silences the model
    libraries' warnings only: the caller's own still show (the CLI silences the rest itself)."""
    import warnings

    from ffkv.model.load import quiet_hf

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        quiet_hf()
        warnings.warn("the caller's own", UserWarning)
        for mod in ("transformers.modeling_utils", "torch.nn.modules.module", "huggingface_hub", "gguf.gguf_reader",
                    "transformers_extra.x", "mytorch"):
            warnings.warn_explicit(f"from {mod}", UserWarning, "x.py", 1, module=mod)
    assert [str(w.message) for w in got] == ["the caller's own", "from transformers_extra.x", "from mytorch"]


def test_a_gguf_is_parsed_once_per_load(tmp_path):
    """transformers opens a GGUF's header once for the tokenizer, config and weights each, and ffkv's
    cached copy once more (17 s a parse for Gemma 3's vocabulary): while loading, one reader per
    file, the same object each time, and the reader class is back after."""
    import gguf
    import numpy as np

    from ffkv.model.load import _one_gguf_parse

    p = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_token_list([f"tok{i}" for i in range(50)])
    w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    made = []
    orig = gguf.GGUFReader

    class Counting(orig):
        def __init__(self, *a, **k):
            made.append(a)
            super().__init__(*a, **k)

    gguf.GGUFReader = Counting
    try:
        with _one_gguf_parse():
            a, b = gguf.GGUFReader(p), gguf.GGUFReader(str(p))
            assert a is b and len(made) == 1
            assert np.array_equal(a.tensors[0].data, np.arange(6, dtype=np.float32).reshape(2, 3))
        assert gguf.GGUFReader is Counting
        assert gguf.GGUFReader(p) is not a and len(made) == 2  # outside a load: a fresh parse
    finally:
        gguf.GGUFReader = orig
