"""`facts locate`: every ranking against a hand-written computation on the HF modules, and the
ablation check on a tiny model with a planted fact."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import build_tiny
from ffkv.steps.facts.locate import ablate, rank

PROMPT = "The tower is in the city of"


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tok_dir):
    """A tiny Llama with one fact written into memory (1, 7): its key fires on the prompt's last
    token's FFN input, its value writes the target's unembedding direction."""
    from ffkv.model.memories import open_model

    mm = open_model(str(build_tiny("llama", tmp_path_factory.mktemp("planted") / "m", tok_dir, seed=3)), device="cpu")
    ids = mm.tok(PROMPT, return_tensors="pt")["input_ids"]
    target = int(mm.tok(" Paris")["input_ids"][0])
    x = mm.capture(ids, layers=[1], what=("x",))[1]["x"][0, -1]
    mlp = mm.hf.model.layers[1].mlp
    with torch.no_grad():
        u = x / x.norm()
        mlp.gate_proj.weight[7] = 0.5 * u
        mlp.up_proj.weight[7] = 0.5 * u
        e = mm.hf.lm_head.weight[target]
        e.mul_(2.2 / e.norm())  # the object's logit can outgrow the rest (P ≈ 0.7), unsaturated
        mlp.down_proj.weight[:, 7] = e / e.norm()
    return mm, ids, target


def _p(mm, ids, target, hooks=()):
    out = mm.hf(input_ids=ids, use_cache=False).logits
    return torch.softmax(out[:, -1].float(), -1)[:, target]


def _hand_grads(mm, ids, target, pos, layer=None, alphas=None):
    """∂P/∂m at pos for every layer (or, with alphas, per α row scaling `layer`'s m), by hooks
    on each down_proj's input (where a Llama computes m), written here without ffkv."""
    B = 1 if alphas is None else len(alphas)
    mlps = [blk.mlp for blk in mm.hf.model.layers]
    deltas, seen, hooks = [], [], []
    for l, mlp in enumerate(mlps):
        d = torch.zeros(B, mm.d_m, requires_grad=True)
        deltas.append(d)

        def pre(mod, args, l=l, d=d):
            a = args[0]
            seen.append((l, a[0, pos].detach().clone()))
            b = a.clone()
            row = a[:, pos]
            if alphas is not None and l == layer:
                row = row * alphas[:, None]
            b[:, pos] = row + d
            return (b,)
        hooks.append(mlp.down_proj.register_forward_pre_hook(pre))
    try:
        with torch.enable_grad():
            _p(mm, ids.expand(B, -1), target).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    m = dict(seen)
    return [d.grad for d in deltas], m


@pytest.mark.parametrize("pos", [-1, 2])
def test_grad_times_coefficient_equals_hand_hooks(planted, pos):
    mm, ids, target = planted
    r = rank(mm, ids[0], target, pos, "grad")
    p = pos % ids.shape[1]
    g, m = _hand_grads(mm, ids, target, p)
    want = np.stack([(g[l][0] * m[l]).numpy() for l in range(mm.n_layers)])
    np.testing.assert_allclose(r.scores, want, rtol=1e-4, atol=1e-7)
    assert r.position == p


def test_integrated_gradients_equal_hand_riemann_sum(planted):
    mm, ids, target = planted
    r = rank(mm, ids[0], target, -1, "ig", show_progress=False)
    alphas = torch.arange(1, 21, dtype=torch.float32) / 20
    for l in range(mm.n_layers):
        g, m = _hand_grads(mm, ids, target, ids.shape[1] - 1, layer=l, alphas=alphas)
        np.testing.assert_allclose(r.scores[l], (g[l].mean(0) * m[l]).numpy(), rtol=1e-4, atol=1e-7)
    # completeness, up to the Riemann sum's error: Σ_i IG_i ≈ P(m) − P(layer's m zeroed at the position)
    with torch.no_grad():
        p0 = float(_p(mm, ids, target)[0])
        with mm.intervene([(1, d, "scale", 0.0) for d in range(mm.d_m)], at="last"):
            pz = float(_p(mm, ids, target)[0])
    assert p0 - pz > 0.5
    assert abs(r.scores[1].sum() - (p0 - pz)) < 0.05 * (p0 - pz)


def test_direct_effect_equals_hand_dla(planted):
    mm, ids, target = planted
    r = rank(mm, ids[0], target, -1, "direct", lens="norm")
    seen, hooks = {}, []
    for l, blk in enumerate(mm.hf.model.layers):
        hooks.append(blk.mlp.down_proj.register_forward_pre_hook(
            lambda mod, a, l=l: seen.__setitem__(l, a[0][0, -1].detach())))
    hooks.append(mm.hf.model.norm.register_forward_pre_hook(lambda mod, a: seen.__setitem__("h", a[0][0, -1].detach())))
    with torch.no_grad():
        mm.hf(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    norm = mm.hf.model.norm
    s = torch.sqrt(seen["h"].pow(2).mean() + norm.variance_epsilon)
    e = mm.hf.lm_head.weight[target] * norm.weight
    for l, blk in enumerate(mm.hf.model.layers):
        want = seen[l] * (blk.mlp.down_proj.weight.T @ e) / s
        np.testing.assert_allclose(r.scores[l], want.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_planted_memory_is_found_and_ablating_it_beats_random(planted):
    mm, ids, target = planted
    for method in ("direct", "grad"):
        r = rank(mm, ids[0], target, -1, method)
        assert r.top(1)[0][:2] == (1, 7), method
    r = rank(mm, ids[0], target, -1, "direct")
    (a1, a5) = ablate(mm, ids[0], target, r, ks=(1, 5), draws=8)
    assert a1.p_clean > 0.5  # the plant holds: the model predicts its object
    assert a1.drop_top > 0.4
    assert a1.drop_top > a1.interval()[1] + 0.3
    assert a5.drop_top > a5.drop_random + 0.3
    # the check's own numbers: suppressing the top memory is an intervention on m at the last token
    with torch.no_grad(), mm.intervene([(1, 7, "scale", 0.0)], at="last"):
        assert float(_p(mm, ids, target)[0]) == pytest.approx(a1.p_top, abs=1e-6)


def test_bad_requests_are_one_line(planted):
    from ffkv.errors import FfkvError

    mm, ids, target = planted
    with pytest.raises(FfkvError, match="choose from"):
        rank(mm, ids[0], target, -1, "magic")
    with pytest.raises(FfkvError, match="outside the prompt"):
        rank(mm, ids[0], target, 99, "grad")
    with pytest.raises(FfkvError, match="outside the vocabulary"):
        rank(mm, ids[0], 10 ** 7, -1, "grad")


def test_ablation_refuses_a_k_whose_random_control_cannot_be_drawn():
    """k random memories are drawn from the layers of the top k, as many per layer, among the
    others: a top k that takes more than half of a layer leaves too few (a traceback from numpy's
    choice once, `facts locate --ablate 94` on a tiny model). Hand-made ranking: 2 layers of 4."""
    from ffkv.errors import FfkvError
    from ffkv.steps.facts.locate import Ranking, matchable

    # ranks: (0,0) (0,1) (1,0) (0,2) ...: the 4th would take 3 of layer 0's 4 memories, 1 left
    r = Ranking("direct", 0, np.array([[9.0, 8.0, 6.0, 1.0], [7.0, 2.0, 3.0, 4.0]]))
    assert [matchable(r, 4, k) for k in (1, 2, 3, 4, 8, 9)] == [1, 2, 3, 3, 3, 3]
    flat = Ranking("direct", 0, np.array([[4.0, 3.0], [2.0, 1.0], [0.5, 0.25]]))  # 3 layers of 2
    assert matchable(flat, 2, 6) == 1  # the 2nd, (0,1), would take both of layer 0's
    with pytest.raises(FfkvError, match="ablate at most 3"):
        ablate(None, [1, 2], 0, r, (1, 4))
