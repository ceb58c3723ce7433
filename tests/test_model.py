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
    from ffkv.model.memories import Lens

    mm = tiny_models["gpt2"]
    h = torch.randn(3, mm.d)
    naive = Lens(mm, "naive")
    assert torch.allclose(naive.logits(h), h @ mm.hf.lm_head.weight.T, atol=1e-5)
    g = mm.hf.transformer.ln_f.weight
    assert torch.allclose(Lens(mm, "norm").direction_logits(h), (h * g) @ mm.hf.lm_head.weight.T, atol=1e-5)


def test_rank_of_counts_logits_above():
    from ffkv.model.memories import rank_of

    logits = torch.randn(4, 1000)
    target = torch.randint(0, 1000, (4,))
    r = rank_of(logits, target)
    ref = [int((torch.argsort(logits[i], descending=True) == target[i]).nonzero()) for i in range(4)]
    assert r.tolist() == ref


@pytest.mark.slow
def test_exact_smollm2(smollm2):
    mm = smollm2
    assert (mm.n_layers, mm.d, mm.d_m, mm.vocab_size) == (30, 576, 1536, 49152)
    assert mm.gated and mm.n_layers * mm.d_m == 46080
    _check_exact(mm, wikitext_sentences(3))
