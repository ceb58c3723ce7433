"""Mixture-of-experts families on tiny random models (3 layers, 4 experts, top-2, and a top-1
variant): a memory is (expert, dim), flattened as dim = expert·d_expert + i, a shared expert
after the routed ones.

- the MoE block's own output (a hook on the block) and what it adds to the residual stream equal
  Σ_i m_i·v_i rebuilt from ffkv's coefficients and values;
- the norm lens reproduces the model's logits;
- token by token, the coefficients of experts the model's own router did not pick are exactly 0,
  and the routed ones equal the router weight times the expert's gated MLP, both written here
  from the raw fused weights (gate_up_proj, down_proj) and the config's routing rule;
- mining's top-1 trigger equals that brute force run on every sentence alone;
- suppressing one memory equals a hand-written hook on the block's output.

Family facts (module names, routing rule) are written out here, not read from ffkv's table.
"""
from __future__ import annotations

import pytest
import torch

from conftest import wikitext_sentences
from test_families import Family, _own_ffn_writes, _rel, assert_norm_lens_logits, assert_replace_ffn, open_tiny


def _moe_shape(vocab, top_k=2):
    return dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                num_experts_per_tok=top_k, max_position_embeddings=128, initializer_range=0.2,
                vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _mixtral(vocab, top_k=2):
    import transformers as tf
    return tf.MixtralConfig(**_moe_shape(vocab, top_k), intermediate_size=24, num_local_experts=4)


def _qwen2_moe(vocab):
    import transformers as tf
    return tf.Qwen2MoeConfig(**_moe_shape(vocab), intermediate_size=40, moe_intermediate_size=24,
                             shared_expert_intermediate_size=40, num_experts=4, norm_topk_prob=False)


def _qwen3_moe(vocab):
    import transformers as tf
    return tf.Qwen3MoeConfig(**_moe_shape(vocab), intermediate_size=40, moe_intermediate_size=24,
                             num_experts=4, head_dim=8, norm_topk_prob=True)


def _olmoe(vocab, top_k=2):
    import transformers as tf
    return tf.OlmoeConfig(**_moe_shape(vocab, top_k), intermediate_size=24, num_experts=4,
                          norm_topk_prob=False)


# name -> (config, top-k weights renormalised?, shared expert?)
MOE = {
    "mixtral": (_mixtral, True, False),
    "qwen2_moe": (_qwen2_moe, False, True),
    "qwen3_moe": (_qwen3_moe, True, False),
    "olmoe": (_olmoe, False, False),
    "mixtral-top1": (lambda v: _mixtral(v, top_k=1), True, False),
    "olmoe-top1": (lambda v: _olmoe(v, top_k=1), False, False),
}
FAM = Family(config=None, value="", resid="post_attention_layernorm")


def _supported():
    from ffkv.model.arch import ARCHITECTURES

    return [f for f in MOE if f.split("-")[0] in ARCHITECTURES]


_BUILT: dict = {}


@pytest.fixture
def moe_model(request, tmp_path_factory, tok_dir):
    """The family's tiny model, saved and reopened by ffkv (built once per session)."""
    name = request.param
    return open_tiny(name, MOE[name][0], lambda: tmp_path_factory.mktemp("moe"), tok_dir, _BUILT)


def _batch(mm, n=4, length=20):
    return mm.batch([mm.tok(t)["input_ids"][:length] for t in wikitext_sentences(n)])


@torch.no_grad()
def _brute_coefficients(name, mlp, x, f=torch.nn.functional.silu):
    """m (N, d_m) for MoE-block inputs x (N, d), token by token from the raw weights: softmax of
    the router's logits, top-k, renormalised where the family does; for each routed expert e,
    weight · silu(x·G_e)·(x·U_e) from gate_up_proj[e] (gate rows first); 0 elsewhere; a shared
    expert's dims last, times sigmoid of its gate."""
    _, renorm, shared = MOE[name]
    gu, dn = mlp.experts.gate_up_proj, mlp.experts.down_proj  # (E, 2·de, d), (E, d, de)
    E, de = dn.shape[0], dn.shape[2]
    k = mlp.gate.top_k
    ds = mlp.shared_expert.down_proj.weight.shape[1] if shared else 0
    out = torch.zeros(x.shape[0], E * de + ds)
    for t in range(x.shape[0]):
        xt = x[t].double()
        p = torch.softmax(xt @ mlp.gate.weight.double().T, -1)
        chosen = sorted(range(E), key=lambda e: -float(p[e]))[:k]
        w = {e: p[e] / (sum(p[c] for c in chosen) if renorm else 1.0) for e in chosen}
        for e in chosen:
            g, u = gu[e, :de].double() @ xt, gu[e, de:].double() @ xt
            out[t, e * de:(e + 1) * de] = (w[e] * f(g) * u).float()
        if shared:
            s = mlp.shared_expert
            a = f(s.gate_proj.weight.double() @ xt) * (s.up_proj.weight.double() @ xt)
            out[t, E * de:] = (torch.sigmoid(mlp.shared_expert_gate.weight.double() @ xt) * a).float()
    return out


def _brute_values(name, mlp):
    """V (d_m, d): expert e's down projection's columns, then the shared expert's."""
    dn = mlp.experts.down_proj
    V = dn.transpose(1, 2).reshape(-1, dn.shape[1])
    return torch.cat([V, mlp.shared_expert.down_proj.weight.T]) if MOE[name][2] else V


def _run_blocks(mm, ids, mask=None):
    """Per layer, the MoE block's own input and output, and the router's own choice."""
    got = {l: {} for l in range(mm.n_layers)}
    hs = []
    for l, blk in enumerate(mm.hf.model.layers):
        hs.append(blk.mlp.register_forward_pre_hook(lambda mod, a, l=l: got[l].__setitem__("x", a[0])))
        hs.append(blk.mlp.register_forward_hook(lambda mod, a, o, l=l: got[l].__setitem__("y", o)))
        hs.append(blk.mlp.gate.register_forward_hook(lambda mod, a, o, l=l: got[l].__setitem__("idx", o[2])))
    try:
        with torch.no_grad():
            logits = mm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        for h in hs:
            h.remove()
    return got, logits


@pytest.mark.parametrize("moe_model", _supported(), indirect=True)
def test_moe_block_is_sum_of_memories(moe_model):
    name, mm = moe_model
    ids, mask = _batch(mm)
    own, logits = _run_blocks(mm, ids, mask)
    writes, _ = _own_ffn_writes(mm, FAM, ids, mask)
    cap = mm.capture(ids, mask, what=("x", "m", "y", "o"), logits=True)
    assert torch.allclose(cap.logits, logits, atol=1e-5)
    valid = mask.bool()
    for l in range(mm.n_layers):
        c = cap[l]
        mlp = mm.hf.model.layers[l].mlp
        assert torch.equal(c["x"], own[l]["x"])
        assert torch.equal(mm.values(l), _brute_values(name, mlp))
        assert _rel(mm.coefficients(l, c["x"])[valid], c["m"][valid]) < 1e-6
        y = torch.einsum("btm,md->btd", c["m"], _brute_values(name, mlp))  # Σ_i m_i v_i, by hand
        assert _rel(y[valid], own[l]["y"][valid]) < 1e-5, (name, l)  # the block's own output
        assert _rel(y[valid], writes[l][valid]) < 1e-5, (name, l)  # the model's residual stream
        assert _rel(c["y"][valid], own[l]["y"][valid]) < 1e-6
        assert _rel(mm.ffn_from_memories(l, c["m"])[valid], writes[l][valid]) < 1e-5


@pytest.mark.parametrize("moe_model", _supported(), indirect=True)
def test_norm_lens_reproduces_logits(moe_model):
    name, mm = moe_model
    assert_norm_lens_logits(mm, *_batch(mm), name)


@pytest.mark.parametrize("moe_model", _supported(), indirect=True)
def test_coefficients_follow_the_router(moe_model):
    """Non-routed experts' coefficients are exactly 0, on the experts the model's own router left
    out; the routed ones equal router weight × the expert's MLP, by hand from the fused weights."""
    name, mm = moe_model
    ids, mask = _batch(mm)
    own, _ = _run_blocks(mm, ids, mask)
    k = mm.info()["experts_per_token"]
    E, de = mm.info()["experts"], mm.info()["d_expert"]
    assert (E, k) == (4, 2 if "top1" not in name else 1)
    for l in range(mm.n_layers):
        mlp = mm.hf.model.layers[l].mlp
        x = own[l]["x"].reshape(-1, mm.d)
        m = mm.coefficients(l, x)
        want = _brute_coefficients(name, mlp, x)
        routed = torch.zeros(x.shape[0], E, dtype=torch.bool)
        routed[torch.arange(x.shape[0])[:, None], own[l]["idx"]] = True  # the model's own choice
        per_expert = m[:, :E * de].reshape(-1, E, de)
        assert torch.equal(per_expert[~routed], torch.zeros_like(per_expert[~routed]))  # exactly 0
        assert torch.equal(want[:, :E * de].reshape(-1, E, de)[~routed], per_expert[~routed])
        assert (per_expert[routed] != 0).any(-1).all()  # every routed expert contributes
        assert torch.allclose(m, want, atol=1e-5, rtol=1e-4), (name, l)
        assert routed.sum(-1).eq(k).all() and routed.any(0).sum() >= 2  # several experts in use
        if MOE[name][2]:
            assert (m[:, E * de:] != 0).all()  # the shared expert: every token


@pytest.mark.parametrize("moe_model", _supported(), indirect=True)
def test_expert_of_and_info(moe_model):
    name, mm = moe_model
    inf = mm.info()
    E, de = inf["experts"], inf["d_expert"]
    ds = inf["d_shared_expert"] or 0
    assert mm.d_m == E * de + ds and inf["memories"] == mm.n_layers * mm.d_m
    assert inf["memories_per_token"] == inf["experts_per_token"] * de + ds
    assert mm.expert_of(0) == (0, 0) and mm.expert_of(de + 3) == (1, 3)
    assert mm.expert_of(E * de - 1) == (E - 1, de - 1)
    if ds:
        assert mm.expert_of(E * de) == (E, 0) and mm.expert_of(mm.d_m - 1) == (E, ds - 1)


def test_dense_layers_among_moe_ones_are_refused():
    import transformers as tf

    from ffkv.errors import FfkvError
    from ffkv.model.arch import find

    for cfg in (tf.Qwen2MoeConfig(**_moe_shape(600), num_experts=4, decoder_sparse_step=2),
                tf.Qwen3MoeConfig(**_moe_shape(600), num_experts=4, mlp_only_layers=[1])):
        with pytest.raises(FfkvError, match="dense layers"):
            find(cfg)


def _brute_m(mm, name, token_lists):
    """coefs[(sid, pos)] (L, d_m): every sentence run alone, m by hand from the block's input."""
    coefs = {}
    for sid, ids in enumerate(token_lists):
        own, _ = _run_blocks(mm, torch.tensor([ids]))
        per_layer = [_brute_coefficients(name, mm.hf.model.layers[l].mlp, own[l]["x"][0])
                     for l in range(mm.n_layers)]
        for j in range(len(ids)):
            coefs[(sid, j)] = torch.stack([p[j] for p in per_layer])
    return coefs


@pytest.mark.parametrize("packed", ["0", "40"])
@pytest.mark.parametrize("moe_model", ["mixtral", "qwen2_moe", "olmoe-top1"], indirect=True)
def test_mined_top1_equals_brute_force(moe_model, packed, monkeypatch):
    """Padded rows, and (FFKV_PACK=40) several sentences to a row: routing is per token."""
    from ffkv.corpus.batching import pack
    from ffkv.mine.engine import mine_batches, new_state
    from ffkv.steps.mine import MineSettings

    name, mm = moe_model
    monkeypatch.setenv("FFKV_PACK", packed)
    token_lists = [mm.tok(x)["input_ids"][:16] for x in wikitext_sentences(12)]
    coefs = _brute_m(mm, name, token_lists)
    s = MineSettings(top_k=1, negative=True, batch_tokens=60)
    st = mine_batches(mm, new_state(mm, s), token_lists, list(range(len(token_lists))),
                      list(enumerate(pack([len(t) for t in token_lists], 60))))
    de = mm.info()["d_expert"]
    dims = (0, 7, de + 5, 3 * de + 1, mm.d_m - 1)  # several experts (and the shared one, last)
    checked = 0
    for (sg, l), v in st.topk.lists.items():
        for i in dims:
            cands = [(sg * float(c[l, i]), sid, j) for (sid, j), c in coefs.items()]
            best = max(c[0] for c in cands)
            top = min((sid, j) for sc, sid, j in cands if sc == best)
            assert abs(float(v.score[i, 0]) - best) < 1e-4 * max(1.0, abs(best)), (name, sg, l, i)
            if (int(v.sid[i, 0]), int(v.pos[i, 0])) != top:  # only a float near-tie may swap
                near = [c for c in cands if abs(c[0] - best) < 1e-5 * max(1.0, abs(best))]
                assert len(near) >= 2, (name, sg, l, i)
            checked += 1
    assert checked == 2 * mm.n_layers * len(dims)


@pytest.mark.parametrize("moe_model", _supported(), indirect=True)
def test_suppressing_a_memory_matches_a_hook(moe_model):
    """Memory (ℓ, e·d_e + i) removed at the last position: a hand-written hook on the MoE block's
    output takes m·v out there (m by hand, v the expert's down-projection column)."""
    name, mm = moe_model
    ids = torch.tensor([mm.tok(wikitext_sentences(1)[0])["input_ids"][:12]])
    layer = mm.n_layers - 1
    own, plain = _run_blocks(mm, ids)
    E, de = mm.info()["experts"], mm.info()["d_expert"]
    e = int(own[layer]["idx"][-1, 0])  # an expert the last token is routed to
    dims = [e * de + 5] + ([E * de + 2] if MOE[name][2] else [])
    mlp = mm.hf.model.layers[layer].mlp
    V = _brute_values(name, mlp)
    for dim in dims:
        with torch.no_grad(), mm.intervene([(layer, dim, "scale", 0.0)]):
            got = mm.hf(input_ids=ids, use_cache=False).logits
        seen = {}

        def keep(mod, args):
            seen["m"] = _brute_coefficients(name, mod, args[0][0, -1:])[0, dim]

        def take_out(mod, args, out):
            out = out.clone()
            out[0, -1] -= seen["m"] * V[dim]
            return out

        hs = [mlp.register_forward_pre_hook(keep), mlp.register_forward_hook(take_out)]
        try:
            with torch.no_grad():
                ref = mm.hf(input_ids=ids, use_cache=False).logits
        finally:
            for h in hs:
                h.remove()
        assert seen["m"] != 0
        assert torch.allclose(got, ref, atol=1e-5), (name, dim)
        assert not torch.allclose(got[0, -1], plain[0, -1], atol=1e-4)  # the edit did something
        assert torch.allclose(got[0, :-1], plain[0, :-1], atol=1e-6)  # and only at the last position


@pytest.mark.parametrize("moe_model", ["mixtral", "qwen2_moe"], indirect=True)
def test_setting_a_non_routed_memory_adds_its_value(moe_model):
    """Setting m of an expert the token was not routed to adds value·v at the block's output."""
    name, mm = moe_model
    ids = torch.tensor([mm.tok(wikitext_sentences(1)[0])["input_ids"][:12]])
    layer = 0
    own, _ = _run_blocks(mm, ids)
    de = mm.info()["d_expert"]
    e = next(x for x in range(mm.info()["experts"]) if x not in own[layer]["idx"][-1].tolist())
    dim = e * de + 3
    with torch.no_grad(), mm.intervene([(layer, dim, "set", 2.0)]):
        got, _ = _run_blocks(mm, ids)
    V = _brute_values(name, mm.hf.model.layers[layer].mlp)
    want = own[layer]["y"].clone()
    want[0, -1] += 2.0 * V[dim]
    assert torch.allclose(got[layer]["y"], want, atol=1e-5)


@pytest.mark.parametrize("moe_model", ["mixtral", "qwen2_moe", "olmoe"], indirect=True)
def test_replace_ffn(moe_model):
    """Rebuilding from m keeps the model's logits; zero makes the block add nothing."""
    name, mm = moe_model
    ids, mask = _batch(mm, n=2, length=10)
    assert_replace_ffn(mm, FAM, ids, mask, 1, name, atol=1e-6)

@pytest.mark.parametrize("moe_model", ["mixtral", "qwen2_moe"], indirect=True)
def test_normalize_substitution_and_another_activation(moe_model):
    """`ffkv normalize`'s seams on a mixture of experts: the identity substitution gives the
    model's own final state, removing the block changes it, and m under ReLU (routing kept) is the
    brute force with ReLU in place of SiLU."""
    from ffkv.steps.normalize.tail import intact, tail

    name, mm = moe_model
    ids, mask = _batch(mm)
    own, _ = _run_blocks(mm, ids, mask)
    with torch.no_grad():
        cache = intact(mm, ids, mask)
        for layer in range(mm.n_layers):
            h = tail(mm, cache, layer, lambda x, m, l=layer: mm.ffn_from_memories(l, m))
            assert _rel(h, cache.final) < 1e-5, (name, layer)
            h0 = tail(mm, cache, layer, lambda x, m: torch.zeros(*m.shape[:-1], mm.d, dtype=m.dtype))
            assert _rel(h0, cache.final) > 1e-3
    x = own[0]["x"].reshape(-1, mm.d)
    want = _brute_coefficients(name, mm.hf.model.layers[0].mlp, x, f=torch.relu)
    assert torch.allclose(mm.coefficients(0, x, act=torch.relu), want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(mm.coefficients(0, x), want, atol=1e-3)


@pytest.mark.parametrize("moe_model", ["mixtral", "qwen2_moe", "olmoe-top1"], indirect=True)
def test_report_counts_all_experts_and_those_a_token_reaches(moe_model):
    """The report's model table and Fig 7 note: d_m counts every expert; a token reaches its
    top-k experts' memories (and the shared expert's), numbers from the config written here."""
    from ffkv.report.build import experts_text, model_differences, notes_for
    from ffkv.steps.compose.paper import FIG7

    name, mm = moe_model
    cfg = mm.hf.config
    E = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    de = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    ds = getattr(cfg, "shared_expert_intermediate_size", 0) if name == "qwen2_moe" else 0
    k = cfg.num_experts_per_tok
    manifest = {"model": mm.info()}
    text = experts_text(manifest["model"])
    assert text.startswith(f"{E} experts × {de}" + (f" + a shared expert of {ds}" if ds else "")
                           + f" = {E * de + ds} memories per layer")
    assert f"; {k * de + ds} active per token ({k} routed expert{'s' if k > 1 else ''}" in text
    rows, notes = model_differences(manifest, "norm")
    assert ["mixture of experts", "no (one dense FFN per layer)", text] == next(r for r in rows if r[0] == "mixture of experts")[:3]
    assert any(f"reaches {k * de + ds} of a layer's {E * de + ds} memories" in n
               for n in notes_for(FIG7, notes, manifest["model"], "norm"))
    # a dense model has neither
    dense = {"model": {k_: v for k_, v in mm.info().items() if k_ not in ("experts", "d_expert", "experts_per_token",
                                                                        "memories_per_token", "d_shared_expert")}}
    assert experts_text(dense["model"]) is None
    assert not any(r[0] == "mixture of experts" for r in model_differences(dense, "norm")[0])
