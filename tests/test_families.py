"""Every supported family, one row each, on a tiny random model built from its config:

- what the FFN adds to the residual stream, read from the model's own states (the residual after
  the block minus the residual before its FFN; for parallel blocks minus the block's input and the
  attention's output), equals Σ_i m_i·v_i + b rebuilt from ffkv's coefficients and values, and so
  does ffkv's own capture of y;
- the norm lens reproduces the model's own logits at the last layer (soft-caps and logit scales
  included);
- mining's top-1 trigger of a few keys equals a brute force that runs every sentence alone and
  reads m with plain hooks on the model's own modules (for a post-FFN norm: the value
  projection's input over the token's norm scale, computed here from the projection's output);
- suppressing a memory at the last position moves the logits as a brute-force hook does.

Family facts used here are written out per family (module paths of the model's own code),
not read from ffkv's architecture table, so that a wrong entry fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from conftest import wikitext_sentences


@dataclass
class Family:
    config: callable  # vocab -> config
    value: str = "mlp.down_proj"  # the value projection, inside a block
    # sequential blocks: the module whose input is the residual stream entering the FFN
    resid: str | None = "post_attention_layernorm"
    attn: str | None = None  # parallel blocks: the attention module (its output is added too)
    post_norm: str | None = None  # an RMSNorm after the FFN, before the residual add
    multiplier: str | None = None  # block attribute scaling the FFN's output (Granite)
    gated: bool = True
    extra: dict = field(default_factory=dict)


def _common(vocab):
    return dict(vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _llama_shape(vocab):
    return dict(hidden_size=32, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2,
                **_common(vocab))


def _gemma(vocab):
    import transformers as tf
    return tf.GemmaConfig(**_llama_shape(vocab), head_dim=8, hidden_act="gelu_pytorch_tanh")


def _gemma2(vocab):
    import transformers as tf
    return tf.Gemma2Config(**_llama_shape(vocab), head_dim=8, query_pre_attn_scalar=8,
                           hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                           final_logit_softcapping=2.0, attn_logit_softcapping=5.0)


def _gemma3_text(vocab):
    import transformers as tf
    return tf.Gemma3TextConfig(**_llama_shape(vocab), head_dim=8, query_pre_attn_scalar=8,
                               hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                               final_logit_softcapping=2.0)


def _gemma3(vocab):
    import transformers as tf
    text = _gemma3_text(vocab).to_dict()
    text["final_logit_softcapping"] = None
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=16, patch_size=8)
    return tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                           boi_token_index=vocab - 3, eoi_token_index=vocab - 2, image_token_index=vocab - 1)


def _olmo2(vocab):
    import transformers as tf
    return tf.Olmo2Config(**_llama_shape(vocab), tie_word_embeddings=False)


def _olmo(vocab):
    import transformers as tf
    return tf.OlmoConfig(**_llama_shape(vocab), tie_word_embeddings=False)


def _phi3(vocab):
    import transformers as tf
    return tf.Phi3Config(**_llama_shape(vocab), tie_word_embeddings=False)


def _phi(vocab):
    import transformers as tf
    return tf.PhiConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=128, initializer_range=0.2, hidden_act="gelu_new",
                        **_common(vocab))


def _gptj(vocab):
    import transformers as tf
    return tf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=128, n_inner=96,
                         initializer_range=0.2, **_common(vocab))


def _stablelm(vocab, parallel=False):
    import transformers as tf
    return tf.StableLmConfig(**_llama_shape(vocab), use_parallel_residual=parallel)


def _starcoder2(vocab):
    import transformers as tf
    return tf.Starcoder2Config(hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               initializer_range=0.2, use_bias=True, hidden_act="gelu_pytorch_tanh",
                               **_common(vocab))


def _granite(vocab):
    import transformers as tf
    return tf.GraniteConfig(**_llama_shape(vocab), residual_multiplier=0.5, logits_scaling=4.0,
                            embedding_multiplier=3.0, attention_multiplier=0.3, tie_word_embeddings=False)


def _falcon(vocab, **kw):
    import transformers as tf
    kw = {"parallel_attn": True, "new_decoder_architecture": False, **kw}
    return tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=96,
                           max_position_embeddings=128, initializer_range=0.2, bias=True, **kw,
                           **_common(vocab))


def _bloom(vocab):
    import transformers as tf
    return tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, initializer_range=0.2, **_common(vocab))


FAMILIES = {
    "gemma": Family(_gemma),
    "gemma2": Family(_gemma2, resid="pre_feedforward_layernorm", post_norm="post_feedforward_layernorm"),
    "gemma3_text": Family(_gemma3_text, resid="pre_feedforward_layernorm",
                          post_norm="post_feedforward_layernorm"),
    "gemma3": Family(_gemma3, resid="pre_feedforward_layernorm", post_norm="post_feedforward_layernorm"),
    "olmo2": Family(_olmo2, resid="mlp", post_norm="post_feedforward_layernorm"),
    "olmo": Family(_olmo),
    "phi3": Family(_phi3),
    "phi": Family(_phi, value="mlp.fc2", resid=None, attn="self_attn", gated=False),
    "gptj": Family(_gptj, value="mlp.fc_out", resid=None, attn="attn", gated=False),
    "stablelm": Family(_stablelm),
    "stablelm-parallel": Family(lambda v: _stablelm(v, parallel=True), resid=None, attn="self_attn"),
    "starcoder2": Family(_starcoder2, value="mlp.c_proj", gated=False),
    "granite": Family(_granite, multiplier="residual_multiplier"),
    "falcon": Family(_falcon, value="mlp.dense_4h_to_h", resid=None, attn="self_attention", gated=False),
    "falcon-sequential": Family(lambda v: _falcon(v, parallel_attn=False), value="mlp.dense_4h_to_h",
                                gated=False),
    "falcon-new": Family(lambda v: _falcon(v, new_decoder_architecture=True, num_kv_heads=2),
                         value="mlp.dense_4h_to_h", resid=None, attn="self_attention", gated=False),
    "bloom": Family(_bloom, value="mlp.dense_4h_to_h", gated=False),
}


def _supported():
    from ffkv.model.arch import ARCHITECTURES

    return [f for f in FAMILIES if f.split("-")[0] in ARCHITECTURES]  # "-…": a variant of the family


def _blocks(hf):
    from ffkv.model.arch import ARCHITECTURES, get_path

    return get_path(hf, ARCHITECTURES[hf.config.model_type].layers)


_BUILT: dict = {}


def open_tiny(name: str, config, folder, tok_dir, built: dict):
    """A tiny random model of `config` (seeded; norm gains and biases randomised too, so that they
    are exercised), saved and reopened by ffkv; built once per session in `built`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ffkv.model.memories import open_model

    if name not in built:
        tok = AutoTokenizer.from_pretrained(tok_dir)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(len(tok)))
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.3)
        path = folder() / name
        model.save_pretrained(path)
        tok.save_pretrained(path)
        mm = open_model(str(path), device="cpu")
        assert mm.arch.name == name.split("-")[0]
        built[name] = mm
    return name, built[name]


@pytest.fixture
def family_model(request, tmp_path_factory, tok_dir):
    """The family's tiny model, saved and reopened by ffkv (built once per session)."""
    name = request.param
    return open_tiny(name, FAMILIES[name].config, lambda: tmp_path_factory.mktemp("family"), tok_dir, _BUILT)


def _texts_batch(mm, n=4, length=20):
    ids = [mm.tok(t)["input_ids"][:length] for t in wikitext_sentences(n)]
    return mm.batch(ids)


def _hidden(x):
    return x[0] if isinstance(x, tuple) else x


def _own_ffn_writes(mm, fam: Family, ids, mask):
    """Per layer, what the FFN added to the residual stream, from the model's own modules only,
    and the model's own logits."""
    from ffkv.model.arch import get_path

    blocks = _blocks(mm.hf)
    got: dict = {l: {} for l in range(len(blocks))}
    hooks = []
    for l, blk in enumerate(blocks):
        def on_in(mod, args, kwargs, l=l):
            got[l]["in"] = args[0] if args else kwargs["hidden_states"]
        hooks.append(blk.register_forward_pre_hook(on_in, with_kwargs=True))
        hooks.append(blk.register_forward_hook(lambda mod, a, out, l=l: got[l].__setitem__("out", _hidden(out))))
        if fam.resid:
            hooks.append(get_path(blk, fam.resid).register_forward_pre_hook(
                lambda mod, a, l=l: got[l].__setitem__("resid", a[0])))
        else:
            hooks.append(get_path(blk, fam.attn).register_forward_hook(
                lambda mod, a, out, l=l: got[l].__setitem__("attn", _hidden(out))))
    try:
        with torch.no_grad():
            logits = mm.hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    writes = {}
    for l, g in got.items():
        writes[l] = g["out"] - g["resid"] if fam.resid else g["out"] - g["in"] - g["attn"]
    return writes, logits


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family_model", _supported(), indirect=True)
def test_ffn_is_sum_of_memories(family_model):
    name, mm = family_model
    fam = FAMILIES[name]
    assert mm.gated == fam.gated
    ids, mask = _texts_batch(mm)
    writes, logits = _own_ffn_writes(mm, fam, ids, mask)
    cap = mm.capture(ids, mask, what=("x", "m", "y", "o"), logits=True)
    assert torch.allclose(cap.logits, logits, atol=1e-5)
    valid = mask.bool()
    for l in range(mm.n_layers):
        c = cap[l]
        m = mm.coefficients(l, c["x"])
        assert _rel(m[valid], c["m"][valid]) < 1e-5, (name, l)
        y = torch.einsum("btm,md->btd", m, mm.values(l))  # Σ_i m_i v_i, by hand
        if mm.value_bias(l) is not None:
            y = y + mm.value_bias(l)
        assert _rel(y[valid], writes[l][valid]) < 1e-4, (name, l)  # the model's own residual stream
        assert _rel(y[valid], c["y"][valid]) < 1e-4, (name, l)  # ffkv's capture of y
        assert _rel(mm.ffn_from_memories(l, c["m"])[valid], writes[l][valid]) < 1e-4


@pytest.mark.parametrize("family_model", _supported(), indirect=True)
def test_norm_lens_reproduces_logits(family_model):
    from ffkv.model.memories import lens_for

    name, mm = family_model
    ids, mask = _texts_batch(mm)
    cap = assert_norm_lens_logits(mm, ids, mask, name)
    cfg = getattr(mm.hf.config, "text_config", None) or mm.hf.config
    cap_at = getattr(cfg, "final_logit_softcapping", None)
    if cap_at and name != "gemma3":  # the soft-cap bites: logits stay within it
        assert cap.logits.abs().max() < cap_at
        assert not torch.allclose(lens_for(mm, "norm").logits(cap[mm.n_layers - 1]["o"]),
                                  mm.lens.final_norm(cap[mm.n_layers - 1]["o"]) @ mm.lens.E.T, atol=1e-3)
    # the gain the direction lens applies is the final norm's own: for a centred h,
    # norm(h) − norm(0) = gain ⊙ h / scale(h), with one scale per row (RMSNorm and LayerNorm alike)
    h = torch.randn(3, mm.d, dtype=mm.dtype)
    h = h - h.mean(-1, keepdim=True)
    ratio = (mm.lens.final_norm(h) - mm.lens.final_norm(torch.zeros_like(h))) / h / mm.lens.gain
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-3), name


def assert_norm_lens_logits(mm, ids, mask, label):
    """The norm lens at the last layer's output equals the model's own logits; returns the capture."""
    from ffkv.model.memories import lens_for

    cap = mm.capture(ids, mask, what=("o",), logits=True)
    z = lens_for(mm, "norm").logits(cap[mm.n_layers - 1]["o"])
    assert torch.allclose(z, cap.logits, rtol=1e-5, atol=1e-5), label
    return cap


def _brute_m(mm, fam: Family, token_lists):
    """coefs[(sid, pos)] (L, d_m): every sentence run alone (no padding, no packing; the model is
    causal, so position j sees only its prefix), m read with plain hooks on the model's own value
    projection (over the post-FFN norm's scale, where there is one)."""
    from ffkv.model.arch import get_path

    blocks = _blocks(mm.hf)
    got = {}

    def hook(l, blk):
        def f(mod, args, out):
            a = args[0].reshape(-1, args[0].shape[-1]).detach().clone()  # (T, d_m)
            if fam.post_norm:
                norm = get_path(blk, fam.post_norm)
                eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
                u = out.reshape(-1, out.shape[-1]).double()
                a = (a.double() / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + eps)).float()
            got[l] = a
        return f

    hs = [get_path(b, fam.value).register_forward_hook(hook(l, b)) for l, b in enumerate(blocks)]
    coefs = {}
    try:
        with torch.no_grad():
            for sid, ids in enumerate(token_lists):
                mm.hf(input_ids=torch.tensor([ids]), use_cache=False)
                for j in range(len(ids)):
                    coefs[(sid, j)] = torch.stack([got[l][j] for l in range(len(blocks))])
    finally:
        for h in hs:
            h.remove()
    return coefs


def assert_mined_top1(mm, fam: Family, n_sentences: int, label, near_tol: float = 1e-5) -> None:
    """Mining's top-1 of four dims per layer and sign equals the brute force on the model's own
    modules (`_brute_m`); a different prefix only on a float near-tie. Shared by the MoE and the
    real-Gemma tests."""
    from ffkv.corpus.batching import pack
    from ffkv.mine.engine import mine_batches, new_state
    from ffkv.steps.mine import MineSettings

    token_lists = [mm.tok(x)["input_ids"][:16] for x in wikitext_sentences(n_sentences)]
    coefs = _brute_m(mm, fam, token_lists)
    s = MineSettings(top_k=1, negative=True, batch_tokens=60)
    st = mine_batches(mm, new_state(mm, s), token_lists, list(range(len(token_lists))),
                      list(enumerate(pack([len(t) for t in token_lists], 60))))
    checked = 0
    for (sg, l), v in st.topk.lists.items():
        for i in (0, 7, mm.d_m // 2, mm.d_m - 1):
            cands = [(sg * float(c[l, i]), sid, j) for (sid, j), c in coefs.items()]
            best = max(c[0] for c in cands)
            top = min((sid, j) for sc, sid, j in cands if sc == best)
            got_score = float(v.score[i, 0])  # the list keeps sign·m
            assert abs(got_score - best) < 1e-4 * max(1.0, abs(best)), (label, sg, l, i)
            if (int(v.sid[i, 0]), int(v.pos[i, 0])) != top:  # only a float near-tie may swap
                near = [c for c in cands if abs(c[0] - best) < near_tol * max(1.0, abs(best))]
                assert len(near) >= 2, (label, sg, l, i)
            checked += 1
    assert checked == 2 * mm.n_layers * 4


@pytest.mark.parametrize("family_model", _supported(), indirect=True)
def test_mined_top1_equals_brute_force(family_model):
    name, mm = family_model
    assert_mined_top1(mm, FAMILIES[name], 12, name)


@pytest.mark.parametrize("family_model", _supported(), indirect=True)
def test_packed_mining_equals_brute_force(family_model, monkeypatch, capsys):
    """FFKV_PACK=40: several sentences share a row (position ids restarting, no mask), and the
    mined top-1 still equals each sentence run alone. A family whose forward mixes packed
    sentences fails `refusal`'s check (run on the model), says so once and mines padded rows,
    with the same result; without the check, those families' results differ (seen for BLOOM and
    the three Falcon layouts)."""
    name, mm = family_model
    monkeypatch.setenv("FFKV_PACK", "40")
    mm.__dict__.pop("_pack_refusal", None)
    refused = name.split("-")[0] in ("bloom", "falcon")  # ALiBi, or masks of their own: the check finds them
    from ffkv import errors

    errors._said.clear()  # said once a process: this test's model must say it again
    assert_mined_top1(mm, FAMILIES[name], 12, name)
    assert (mm.__dict__["_pack_refusal"] is not None) == refused, mm.__dict__["_pack_refusal"]
    assert ("ffkv: FFKV_PACK: padded rows for this model" in capsys.readouterr().err) == refused


@pytest.mark.parametrize("family_model", _supported(), indirect=True)
def test_suppressing_a_memory_matches_a_hook(family_model):
    """ffkv's intervention vs. a hand-written hook: memory (ℓ, i) removed at the last position is
    m_i·v_i taken out of what the FFN adds (a post-FFN norm keeps the token's scale)."""
    from ffkv.model.arch import get_path

    name, mm = family_model
    fam = FAMILIES[name]
    ids = torch.tensor([mm.tok(wikitext_sentences(1)[0])["input_ids"][:12]])
    layer, dim = mm.n_layers - 1, 5
    with torch.no_grad(), mm.intervene([(layer, dim, "scale", 0.0)]):
        got = mm.hf(input_ids=ids, use_cache=False).logits
    blk = _blocks(mm.hf)[layer]
    vmod = get_path(blk, fam.value)
    seen = {}
    if fam.post_norm:
        norm = get_path(blk, fam.post_norm)

        def keep(mod, args, out):
            seen["a"], seen["u"] = args[0], out

        def take_out(mod, args, out):
            eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
            s = torch.sqrt(seen["u"][0, -1].pow(2).mean() + eps)
            gain = norm.weight + (1.0 if name.startswith("gemma") else 0.0)
            out = out.clone()
            out[0, -1] -= seen["a"][0, -1, dim] / s * vmod.weight[:, dim] * gain
            return out
        hs = [vmod.register_forward_hook(keep), norm.register_forward_hook(take_out)]
    else:
        def zero(mod, args):
            a = args[0].clone()
            a[0, -1, dim] = 0
            return (a,)
        hs = [vmod.register_forward_pre_hook(zero)]
    try:
        with torch.no_grad():
            ref = mm.hf(input_ids=ids, use_cache=False).logits
    finally:
        for h in hs:
            h.remove()
    with torch.no_grad():
        plain = mm.hf(input_ids=ids, use_cache=False).logits
    assert torch.allclose(got, ref, atol=1e-5), name
    assert not torch.allclose(got[0, -1], plain[0, -1], atol=1e-4)  # the edit did something
    assert torch.allclose(got[0, :-1], plain[0, :-1], atol=1e-6)  # and only at the last position


def test_unknown_type_is_one_line_with_the_supported_ones():
    from ffkv.errors import FfkvError
    from ffkv.model.arch import ARCHITECTURES, find

    class Cfg:
        model_type = "gemma4"

    with pytest.raises(FfkvError) as e:
        find(Cfg())
    msg = str(e.value)
    assert "\n" not in msg and "'gemma4'" in msg and "closest" in msg
    assert all(a in msg for a in ARCHITECTURES)


def test_unknown_type_with_a_known_layout_names_it():
    """CodeGen is not supported, but its modules have GPT-J's paths: the error says so."""
    import transformers as tf

    from ffkv.errors import FfkvError
    from ffkv.model.arch import find

    cfg = tf.CodeGenConfig(n_embd=32, n_layer=1, n_head=4, rotary_dim=4, vocab_size=600, n_positions=64,
                           bos_token_id=0, eos_token_id=0)
    with pytest.raises(FfkvError) as e:
        find(cfg)
    assert "'codegen'" in str(e.value) and "layout of 'gptj'" in str(e.value) and "\n" not in str(e.value)


def assert_replace_ffn(mm, fam: Family, ids, mask, l: int, label, atol: float = 1e-5) -> None:
    """`MemoryModel.replace_ffn` at layer l: rebuilding from m keeps the model's logits; zero makes
    the model's own residual stream receive nothing from it. Shared with the MoE tests."""
    shape = list(ids.shape)
    _, plain = _own_ffn_writes(mm, fam, ids, mask)
    seen = {}

    def rebuild(x, m):
        seen["m_ok"] = torch.allclose(mm.coefficients(l, x), m, atol=atol)
        return mm.ffn_from_memories(l, m)

    hs = mm.replace_ffn(l, rebuild, shape)
    try:
        _, same = _own_ffn_writes(mm, fam, ids, mask)
    finally:
        for h in hs:
            h.remove()
    assert seen["m_ok"] and torch.allclose(same, plain, atol=1e-4), label
    hs = mm.replace_ffn(l, lambda x, m: torch.zeros(*m.shape[:-1], mm.d), shape)
    try:
        writes, zeroed = _own_ffn_writes(mm, fam, ids, mask)
    finally:
        for h in hs:
            h.remove()
    assert writes[l].abs().max() < atol, label
    assert not torch.allclose(zeroed, plain, atol=1e-3)


@pytest.mark.parametrize("family_model", _supported(), indirect=True)
def test_replace_ffn(family_model):
    """`MemoryModel.replace_ffn`: the FFN adds what `replace(x, m)` returns."""
    name, mm = family_model
    ids, mask = _texts_batch(mm, n=2, length=10)
    assert_replace_ffn(mm, FAMILIES[name], ids, mask, mm.n_layers - 2, name)

@pytest.mark.parametrize("family_model", ["gemma2", "phi3", "granite"], indirect=True)
def test_coefficients_with_another_activation(family_model):
    """m under ReLU in place of the layer's activation: by hand from the raw weights (and, after a
    post-FFN norm, over the scale of the ReLU FFN's own output)."""
    from ffkv.model.arch import get_path

    name, mm = family_model
    fam = FAMILIES[name]
    blk = _blocks(mm.hf)[0]
    x = torch.randn(4, mm.d)
    if name == "phi3":
        gate, up = (x @ blk.mlp.gate_up_proj.weight.T).chunk(2, -1)
    else:
        gate, up = x @ blk.mlp.gate_proj.weight.T, x @ blk.mlp.up_proj.weight.T
    a = torch.relu(gate) * up
    if fam.post_norm:
        norm = get_path(blk, fam.post_norm)
        a = a / torch.sqrt((a @ blk.mlp.down_proj.weight.T).pow(2).mean(-1, keepdim=True) + norm.eps)
    assert torch.allclose(mm.coefficients(0, x, act=torch.relu), a, atol=1e-5)
    assert not torch.allclose(mm.coefficients(0, x), a, atol=1e-3)


@pytest.mark.parametrize("family_model", _supported(), indirect=True)
def test_normalize_substitution_is_the_models_own(family_model):
    """`ffkv normalize`'s one-layer substitution and loss go through the family's own seams: the
    identity substitution (m rebuilt as it is) gives the model's own final state, and the loss
    per token equals −log softmax of the model's own logits (Gemma 2's soft-cap, Granite's
    divisor). Before they did, the identity substitution on Gemma 2 was off by 1.5."""
    from ffkv.steps.normalize.tail import Targets, intact, tail, token_nll

    name, mm = family_model
    ids, mask = _texts_batch(mm)
    with torch.no_grad():
        cache = intact(mm, ids, mask)
        logits = mm.hf(input_ids=ids, attention_mask=mask).logits.float()
        tg = Targets.of(ids, mask)
        want = torch.logsumexp(logits[tg.rows, tg.pos], -1) - logits[tg.rows, tg.pos, tg.target]
        assert _rel(token_nll(mm, cache.final, tg), want) < 1e-4
        for layer in range(mm.n_layers):
            h = tail(mm, cache, layer, lambda x, m, l=layer: mm.ffn_from_memories(l, m))
            assert _rel(h, cache.final) < 1e-4, (name, layer)
            h0 = tail(mm, cache, layer, lambda x, m: torch.zeros(*m.shape[:-1], mm.d, dtype=m.dtype))
            assert _rel(h0, cache.final) > 1e-3  # the seam is live: removing the FFN changes the state
