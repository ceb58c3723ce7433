"""`facts trace` (causal tracing, Meng et al. 2022) against hand-written hooks on the HF modules.

- With no noise every restoration of every kind, at every token and layer, gives the clean P,
  on every family (tiny models of conftest, test_families and test_moe).
- Each indirect effect equals a forward pass hooked here by hand, one noise draw at a time, at the
  model's own modules (paths written out per family, not read from ffkv's table).
- Results do not depend on the batch; the subject's tokens are found; summary and verdict.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ffkv.errors import FfkvError
from ffkv.steps.facts.trace import (GROUPS, TraceResult, groups, rome_verdict, subject_span, summary, trace,
                                    trace_many)

PROMPT = "The Eiffel Tower is located in the city of"
SUBJECT = "Eiffel Tower"
SHORT = "Where is Rome located? In"


# ---- every family: no noise, every restoration is the clean run --------------------------------------------
def _family(name, tmp_path_factory, tok_dir):
    from test_families import _BUILT, FAMILIES, open_tiny
    from test_moe import MOE

    if name in MOE:
        cfg = MOE[name][0]
    else:
        cfg = FAMILIES[name].config
    return open_tiny(name, cfg, lambda: tmp_path_factory.mktemp("trace"), tok_dir, _BUILT)[1]


FAMILY_NAMES = ("gemma3_text", "gemma3", "gemma2", "olmo2", "phi3", "phi", "gptj", "stablelm-parallel",
                "starcoder2", "granite", "falcon", "falcon-new", "bloom", "mixtral", "qwen2_moe")


@pytest.mark.parametrize("name", ("llama", "gpt2", "opt", "gpt_neox"))
def test_no_noise_restores_the_clean_run(tiny_models, name):
    _assert_clean(tiny_models[name])


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_no_noise_restores_the_clean_run_every_family(name, tmp_path_factory, tok_dir):
    _assert_clean(_family(name, tmp_path_factory, tok_dir))


def _assert_clean(mm):
    r = trace(mm, SHORT, "Rome", " Italy", noise=0.0, samples=2, window=2)
    # the clean run is one row, the others rows of batches, where float32 matmuls differ from it in
    # the last bits (and by a row's place in the batch): equal up to float32 rounding. p is a softmax,
    # so its relative error is the logits' absolute error, a few float32 ulps of logits near 10
    # (1.5e-6 seen with one BLAS build): 1e-5, where any noise left in moves p by orders more
    assert r.p_corrupt == pytest.approx(r.p_clean, rel=1e-5, abs=0)
    for k in ("hidden", "ffn", "attn"):
        assert r.effect[k].shape == (len(r.tokens), mm.n_layers)
        np.testing.assert_allclose(r.restored(k), r.p_clean, rtol=1e-5, atol=0)


# ---- each effect against hand-written hooks ----------------------------------------------------------------
# family -> (embedding, blocks, ffn output, attention output), paths of the model's own modules
SITES = {
    "llama": ("model.embed_tokens", "model.layers", "mlp", "self_attn"),
    "gpt2": ("transformer.wte", "transformer.h", "mlp", "attn"),
    "gemma3_text": ("model.embed_tokens", "model.layers", "mlp", "self_attn"),  # both before their post-norms
}


def _get(obj, path):
    for p in path.split("."):
        obj = getattr(obj, p)
    return obj


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _hand_p(hf, sites, ids, target, noise=None, span=None, restore=None):
    """P(target) at the last token of one run (batch 1): `noise` (n, d) added to the embedding
    module's output on `span`; `restore` = (kind, token, layers, clean) sets that site's output at
    the token to clean[layer]. Returns P and every site's output (kind -> [layer] (T, d))."""
    emb, blocks, ffn, attn = sites
    blks = _get(hf, blocks)
    seen = {"hidden": {}, "ffn": {}, "attn": {}}
    hooks = []

    def site(kind, l):
        return blks[l] if kind == "hidden" else _get(blks[l], ffn if kind == "ffn" else attn)

    if noise is not None:
        def add(mod, args, out):
            out = out.clone()
            out[0, span[0]:span[1]] += noise
            return out
        hooks.append(_get(hf, emb).register_forward_hook(add))
    for kind in seen:
        for l in range(len(blks)):
            def h(mod, args, out, kind=kind, l=l):
                x = _first(out)
                if restore and restore[0] == kind and l in restore[2]:
                    x = x.clone()
                    x[0, restore[1]] = restore[3][l][restore[1]]
                    out = (x, *out[1:]) if isinstance(out, tuple) else x
                seen[kind][l] = _first(out)[0].detach().clone()
                return out
            hooks.append(site(kind, l).register_forward_hook(h))
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return float(torch.softmax(logits[0, -1].float(), -1)[target]), seen


@pytest.mark.parametrize("name", tuple(SITES))
def test_effects_equal_hand_hooks(name, tiny_models, tmp_path_factory, tok_dir):
    mm = tiny_models[name] if name in tiny_models else _family(name, tmp_path_factory, tok_dir)
    hf, sites = mm.hf, SITES[name]
    samples, window, noise, seed = 3, 2, 3.0, 7
    ids = torch.tensor([mm.tok(PROMPT)["input_ids"]])
    with torch.no_grad():  # the target: the clean run's top token, as ROME traces the model's own answer
        target = int(hf(input_ids=ids).logits[0, -1].argmax())
    r = trace(mm, PROMPT, SUBJECT, target, samples=samples, window=window, noise=noise, seed=seed, batch=50)
    L = mm.n_layers

    # σ: the std of the embedding module's output over the whole vocabulary
    with torch.no_grad():
        e = _get(hf, sites[0])(torch.arange(mm.vocab_size)[None])[0]
    assert r.sigma == pytest.approx(float(e.double().std()), rel=1e-9)

    s0, s1 = r.subject
    z = torch.randn(samples, s1 - s0, mm.d, generator=torch.Generator().manual_seed(seed)) * (noise * r.sigma)
    p_clean, clean = _hand_p(hf, sites, ids, target)
    assert r.p_clean == pytest.approx(p_clean, rel=1e-5)
    p_corrupt = np.mean([_hand_p(hf, sites, ids, target, z[s], (s0, s1))[0] for s in range(samples)])
    assert r.p_corrupt == pytest.approx(p_corrupt, rel=1e-5)
    T = ids.shape[1]
    for kind, t, l in [("hidden", s1 - 1, 0), ("hidden", T - 1, L - 1), ("ffn", s1 - 1, 1), ("ffn", s0, 0),
                       ("attn", T - 1, L - 1), ("attn", s1, 1)]:
        # ROME: a window of w layers about l: max(0, l - w//2) .. min(L, l - w//2 + w), hidden alone
        layers = [l] if kind == "hidden" else list(range(max(0, l - window // 2), min(L, l - window // 2 + window)))
        p = np.mean([_hand_p(hf, sites, ids, target, z[s], (s0, s1), (kind, t, layers, clean[kind]))[0]
                     for s in range(samples)])
        # P ~ 1e-2 here and effects ~1e-4..1e-3: float32 rounding is ~1e-9 of them
        assert r.effect[kind][t, l] == pytest.approx(p - p_corrupt, rel=1e-4, abs=1e-8), (kind, t, l)
    # noise that matters (a random model's P may rise or fall), and restorations that move P
    assert abs(r.p_corrupt - r.p_clean) > 0.05 * r.p_clean
    assert max(abs(r.effect[k]).max() for k in r.effect) > 0.1 * abs(r.p_clean - r.p_corrupt)


def test_batch_does_not_change_results(tiny_models):
    mm = tiny_models["llama"]
    a = trace(mm, SHORT, "Rome", " Italy", samples=2, window=2, batch=1)
    b = trace(mm, SHORT, "Rome", " Italy", samples=2, window=2, batch=10_000)
    c = trace(mm, SHORT, "Rome", " Italy", samples=2, window=2, batch=37)
    assert b.forwards == 2 and a.forwards == a.rows + 1 == 1 + (1 + 3 * len(a.tokens) * mm.n_layers) * 2
    for k in a.effect:
        np.testing.assert_allclose(a.effect[k], b.effect[k], rtol=0, atol=1e-8)
        np.testing.assert_allclose(c.effect[k], b.effect[k], rtol=0, atol=1e-8)
    assert a.p_corrupt == pytest.approx(b.p_corrupt, abs=1e-9)
    # and the same seed gives the same trace, another seed another
    d = trace(mm, SHORT, "Rome", " Italy", samples=2, window=2, seed=1)
    assert d.p_corrupt != pytest.approx(b.p_corrupt, abs=1e-9)


# ---- subject span ------------------------------------------------------------------------------------------
class _Slow:
    """The tokenizer without offsets: the span comes from decoded prefixes."""
    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def decode(self, *a, **kw):
        return self._tok.decode(*a, **kw)


@pytest.mark.parametrize("prompt,subject", [(PROMPT, SUBJECT), (SHORT, "Rome"),
                                            ("The mother tongue of Danielle Darrieux is", "Danielle Darrieux")])
@pytest.mark.parametrize("model", ("llama", "gpt2"))
def test_subject_span_decodes_to_the_subject(tiny_models, model, prompt, subject):
    tok = tiny_models[model].tok
    ids = tok(prompt)["input_ids"]
    for t in (tok, _Slow(tok)):
        s0, s1 = subject_span(t, prompt, subject)
        assert tok.decode(ids[s0:s1]).strip() == subject
    with pytest.raises(FfkvError, match="not in the prompt"):
        subject_span(tok, prompt, "Paris")


def test_subject_as_a_token_span(tiny_models):
    mm = tiny_models["gpt2"]
    a = trace(mm, PROMPT, SUBJECT, 123, kinds=("ffn",), samples=1, window=1)
    b = trace(mm, PROMPT, a.subject, 123, kinds=("ffn",), samples=1, window=1)
    np.testing.assert_array_equal(a.effect["ffn"], b.effect["ffn"])
    assert a.last_subject == a.subject[1] - 1 and set(a.effect) == {"ffn"}
    with pytest.raises(FfkvError):
        trace(mm, PROMPT, (3, 99), 123)
    with pytest.raises(FfkvError):
        trace(mm, PROMPT, SUBJECT, 123, kinds=("mlp",))


# ---- summary and verdict -----------------------------------------------------------------------------------
def _fake(span, T, L, peak_at_last: float, rng):
    e = rng.normal(0, 0.01, (T, L))
    e[span[1] - 1, L // 2] += peak_at_last
    return TraceResult(prompt="", tokens=["x"] * T, subject=span, target=0, p_clean=0.5, p_corrupt=0.1,
                       effect={"ffn": e, "hidden": e, "attn": e})


def test_summary_groups_as_rome():
    rng = np.random.default_rng(0)
    r = _fake((1, 4), 8, 6, 0.3, rng)
    assert groups(r) == [[1], [2], [3], [4], [5, 6], [7]]
    assert groups(dataclasses.replace(r, subject=(5, 7))) == [[5], [], [6], [], [], [7]]
    s = summary([r, _fake((2, 3), 8, 6, 0.3, rng)])
    assert s["effect"]["ffn"].shape == (len(GROUPS), 6)
    assert list(s["counts"]) == [2, 1, 2, 2, 2 + 3, 2]
    np.testing.assert_allclose(s["effect"]["ffn"][1], r.effect["ffn"][2])  # only r has a middle token
    assert s["effect"]["ffn"][2, 3] > 0.25


def test_rome_verdict():
    rng = np.random.default_rng(1)
    same = rome_verdict([_fake((1, 4), 8, 6, 0.3, rng) for _ in range(20)])
    assert same["verdict"] == "same trend" and same["peak_layer"] == 3 and same["middle"]
    assert same["low"] > 0 and same["facts_judged"] == 20
    differs = rome_verdict([_fake((1, 4), 8, 6, -0.3, rng) for _ in range(20)])
    assert differs["verdict"] == "differs" and differs["high"] < 0
    assert rome_verdict([_fake((1, 4), 8, 6, 0.0, rng) for _ in range(3)])["verdict"] in ("inconclusive", "differs",
                                                                                         "same trend")
    assert rome_verdict([_fake((1, 2), 8, 6, 0.3, rng)])["verdict"] == "inconclusive"  # one fact: no interval
    # a one-token subject is judged against the tokens after it (not the last, not those before it)
    one = rome_verdict([_fake((1, 2), 8, 6, 0.3, rng) for _ in range(20)])
    assert one["verdict"] == "same trend" and one["facts_judged"] == 20
    r = _fake((1, 2), 8, 6, 0.0, rng)
    r.effect["ffn"][:] = 0.0
    r.effect["ffn"][1] = 1.0  # the last subject token
    r.effect["ffn"][0] = 5.0  # before the subject: left out
    r.effect["ffn"][7] = 5.0  # the last token: left out
    r.effect["ffn"][2:7] = 0.5
    assert rome_verdict([r, r])["difference"] == pytest.approx(0.5)
    assert rome_verdict([_fake((5, 7), 8, 6, 0.3, rng)] * 2)["facts_judged"] == 2  # its first subject token
    assert rome_verdict([_fake((6, 7), 8, 6, 0.3, rng)] * 2)["facts_judged"] == 0  # nothing but the last token


def test_trace_many(tiny_models):
    mm = tiny_models["gpt2"]
    facts = [(PROMPT, SUBJECT, " Paris"), (SHORT, "Rome", " Italy")]
    rs = trace_many(mm, facts, show_progress=False, samples=1, window=1, kinds=("ffn",))
    assert [r.prompt for r in rs] == [f[0] for f in facts]
    assert summary(rs)["facts"] == 2
