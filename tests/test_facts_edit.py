"""`facts edit`: ROME's closed form against an independent computation, the rank of an update, the
exported folder through plain `transformers`, and the weights restored after an edit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import mine_tiny
from ffkv.steps.facts.edit import Edit, Request, applied, export, rome, rome_factors, values_edit

# The subject ends the prompt: in a random tiny model an earlier token barely reaches the last one,
# so a rewrite there could not be told from no rewrite. Real models: `facts evaluate`.
REQ = Request("{}", "The tower is in", " the", " of")
HP = dict(steps=20, clamp=8.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dirs):
    from ffkv.store.run import Run

    return Run(mine_tiny(tmp_path_factory.mktemp("edit") / "run", tiny_dirs["llama"], 40, 3, "--covariance", "0,1"))


@pytest.fixture(scope="module")
def mm(tiny_dirs):
    from ffkv.model.memories import open_model

    return open_model(str(tiny_dirs["llama"]), device="cpu")


def _p(hf, tok, text, target):
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return torch.softmax(hf(input_ids=ids).logits[0, -1].float(), -1)[target].item()


def test_rome_factors_are_its_closed_form():
    """u = C⁻¹k̄/‖C⁻¹k̄‖ and r = (v* − y₀)/(u·k₀) in numpy, and the edited output at k₀ is v*."""
    g = np.random.default_rng(0)
    A = g.normal(size=(40, 12))
    C = A.T @ A / 40
    kbar, k0, vstar, y0 = g.normal(size=12), g.normal(size=12), g.normal(size=5), g.normal(size=5)
    u, r = rome_factors(C, kbar, k0, vstar, y0)
    left = np.linalg.solve(C, kbar)
    np.testing.assert_allclose(u, left / np.linalg.norm(left), rtol=1e-5)
    np.testing.assert_allclose(r, (vstar - y0) / (u @ k0), rtol=1e-4)
    V = g.normal(size=(12, 5))
    np.testing.assert_allclose((V + np.outer(u, r)).T @ k0, V.T @ k0 + (vstar - y0), rtol=1e-4, atol=1e-5)


def test_rome_edit_writes_the_new_object_and_exports(run, mm, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ffkv.steps.facts.data import target_ids
    from ffkv.steps.facts.edit import prefixes_from
    from ffkv.store import query

    new = target_ids(mm.tok, REQ.target_new)[0]
    text = REQ.text
    p_before = _p(mm.hf, mm.tok, text, new)
    w0 = mm.arch.value_param(mm.blocks[1]).detach().clone()
    _, C, _ = query.key_covariance(run, 1)
    templates = prefixes_from(run, mm.tok, n=4)
    assert templates[0] == "{}" and all(t.endswith(". {}") for t in templates[1:])
    e = rome(mm, 1, REQ, C, templates, HP)
    assert e.layers == [1] and e.rank(1) == 1
    assert torch.equal(mm.arch.value_param(mm.blocks[1]), w0)  # computing an edit changes nothing
    with applied(mm, e):
        p_edit = _p(mm.hf, mm.tok, text, new)
        top = int(torch.argmax(mm.hf(input_ids=mm.tok(text, return_tensors="pt")["input_ids"]).logits[0, -1]))
        ids = mm.tok(text, return_tensors="pt")["input_ids"]
        y = mm.capture(ids, layers=[1], what=("y",))[1]["y"][0, -1]
    assert torch.equal(mm.arch.value_param(mm.blocks[1]), w0)  # restored bit for bit
    np.testing.assert_allclose(y.numpy(), e.targets[1], rtol=1e-4, atol=1e-4)  # the FFN now gives v* at k₀
    assert p_edit > 10 * p_before and top == new
    # the change in the weights is exactly U Rᵀ on the value rows
    with applied(mm, e):
        dw = mm.arch.value_weight(mm.blocks[1]).detach() - w0.T
    np.testing.assert_allclose(dw.numpy(), e.delta(1).numpy(), atol=1e-6)

    out = export(mm, e, tmp_path / "edited")
    hf = AutoModelForCausalLM.from_pretrained(out)  # plain transformers: no ffkv hook anywhere
    tok = AutoTokenizer.from_pretrained(out)
    assert _p(hf, tok, text, new) == pytest.approx(p_edit, rel=1e-4)
    e.save(tmp_path / "saved")
    back = Edit.load(tmp_path / "saved")
    assert back.method == "rome" and np.array_equal(back.delta(1).numpy(), e.delta(1).numpy())


def test_values_edit_touches_only_the_located_rows(run, mm):
    from ffkv.steps.facts.edit import prefixes_from

    e = values_edit(mm, 1, REQ, prefixes_from(run, mm.tok, n=2), top=5, hp=HP)
    d = e.delta(1).numpy()
    rows = np.nonzero(np.abs(d).sum(1))[0]
    assert sorted(rows) == sorted(e.settings["dims"]) and len(rows) == 5 and e.rank(1) == 1


def test_memit_edits_a_batch_over_layers(run, mm):
    from ffkv.steps.facts.data import target_ids
    from ffkv.steps.facts.edit import memit
    from ffkv.store import query

    reqs = [REQ, Request("{}", "In the year", " of", " the")]
    covs = {l: query.key_covariance(run, l)[1] for l in (0, 1)}
    before = [_p(mm.hf, mm.tok, r.text, target_ids(mm.tok, r.target_new)[0]) for r in reqs]
    e = memit(mm, [0, 1], reqs, covs, ["{}"], HP, lam=1.0)
    assert e.layers == [0, 1] and all(e.rank(l) == 2 for l in e.layers)  # one direction a fact, a layer
    with applied(mm, e):
        after = [_p(mm.hf, mm.tok, r.text, target_ids(mm.tok, r.target_new)[0]) for r in reqs]
    assert all(a > 5 * b for a, b in zip(after, before)), (before, after)
    # the last layer's share in closed form: U = (λC + K Kᵀ)⁻¹ K, K its keys (m at each subject's
    # last token, read by a capture here) with the first layer's share already in the weights
    from ffkv.steps.facts.edit import Edit

    with applied(mm, Edit("memit", {0: e.factors[0]})):
        K = []
        for r in reqs:
            ids = mm.tok(r.text, return_tensors="pt")["input_ids"]
            K.append(mm.capture(ids, layers=[1])[1]["m"][0, -1].double().numpy())
    K = np.stack(K, 1)
    U = e.factors[1][0].astype(np.float64)
    np.testing.assert_allclose((covs[1] + K @ K.T) @ U, K, rtol=1e-3, atol=1e-4)


def test_refusals_are_one_line(run, mm, tmp_path):
    from ffkv.errors import FfkvError
    from ffkv.store import query

    _, C, _ = query.key_covariance(run, 1)
    with pytest.raises(FfkvError, match="--layer 7 out of range 0..2"):
        rome(mm, 7, REQ, C, ["{}"])
    with pytest.raises(FfkvError, match="not in the prompt"):
        rome(mm, 1, Request("{} is in", "Rome", " Italy").__class__("is in {}", "", " Italy"), C, ["{}"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FfkvError, match="not empty"):
        export(mm, Edit("rome", {}), tmp_path / "full")


def test_rome_factors_of_a_singular_covariance_use_its_pseudo_inverse():
    """A dead memory's zero row makes C singular: Cholesky fails and C⁺k̄ is taken, as numpy's pinv."""
    g = np.random.default_rng(1)
    A = g.normal(size=(40, 12))
    A[:, 3] = 0
    C = A.T @ A / 40
    kbar, k0, vstar, y0 = g.normal(size=12), g.normal(size=12), g.normal(size=5), g.normal(size=5)
    u, _ = rome_factors(C, kbar, k0, vstar, y0)
    left = np.linalg.pinv(C, hermitian=True) @ kbar
    np.testing.assert_allclose(u, left / np.linalg.norm(left), rtol=1e-4, atol=1e-6)


def _block_rows(m, layer):
    """A pre-hook recording the (rows, tokens) each forward feeds block `layer`, and its handle."""
    seen = []

    def pre(mod, args, kwargs):
        seen.append(tuple((args[0] if args else kwargs["hidden_states"]).shape[:2]))
    return seen, m.blocks[layer].register_forward_pre_hook(pre, with_kwargs=True)


@pytest.mark.parametrize("name", ["llama", "gpt2", "opt", "gpt_neox"])
def test_the_target_from_the_cached_lower_blocks_is_the_full_forwards(tiny_dirs, name):
    """v* found running only the blocks from the edited one on (their input recorded in the first
    step) equals v* found running every block at every step."""
    from ffkv.model.memories import open_model
    from ffkv.steps.facts import edit as E

    m = open_model(str(tiny_dirs[name]), device="cpu")
    tpl = ["{}", "Once upon a time. {}"]
    calls = []
    real = E._from_block

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    E._from_block = counted
    try:
        cached, _, _ = E.target_output(m, 1, REQ, tpl, {"steps": 6, "clamp": 8.0, "cache_prefix": False})
    finally:
        E._from_block = real
    full, _, _ = E.target_output(m, 1, REQ, tpl, {"steps": 6, "clamp": 8.0, "cache_below": False,
                                                  "cache_prefix": False})
    assert len(calls) >= 5  # the check, then every later step
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)


def _prefix_target_is_the_full_ones(m, shortcut: bool = True):
    """v*, ROME's and MEMIT's, found running only each row's tokens from the subject's last one on
    (on the cached keys and values of the tokens before it) equals v* found running every token at
    every step; and those later steps feed the edited block only those tokens, and block 0 none.
    shortcut=False: the model's forward cannot continue the cache, and every step runs whole rows."""
    from ffkv.steps.facts import edit as E

    req = Request("{} is in the city of", "The tower", " the", " of")  # tokens after the subject
    tpl = ["{}", "Once upon a time. {}", "It was a dark and stormy night. {}"]
    hp = {"steps": 6, "clamp": 8.0}
    for target in (lambda h: E.target_output(m, 1, req, tpl, h)[0], lambda h: E.memit_target(m, 1, req, tpl, h)):
        seen, handle = _block_rows(m, 1)
        seen0, handle0 = _block_rows(m, 0)
        try:
            cached = target(hp)
        finally:
            handle.remove()
            handle0.remove()
        full = target({**hp, "cache_below": False, "cache_prefix": False})
        torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
        widths = [t for _, t in seen]
        # the prompt's forwards, the first step's, the prefix pass, then the check and every later
        # step on the tokens from the subject's last on: shorter than any full row
        suffix = len(m.tok(" is in the city of")["input_ids"]) + 1
        full_width = max(widths)
        if not shortcut:
            assert widths[-5:] == [full_width] * 5 or widths[-6:-1] == [full_width] * 5, widths
            continue
        # (MEMIT's z behind a post-norm ends with one more forward of the bare prompt)
        i = widths.index(suffix)
        assert widths[i:i + 5] == [suffix] * 5 and full_width not in widths[i:], widths
        assert full_width > suffix
        assert len(seen0) < len(seen) - 3  # and the blocks below it are not run again


@pytest.mark.parametrize("name", ["llama", "gpt2", "opt", "gpt_neox"])
def test_the_target_from_cached_prefixes_is_the_full_forwards(tiny_dirs, name):
    from ffkv.model.memories import open_model

    _prefix_target_is_the_full_ones(open_model(str(tiny_dirs[name]), device="cpu"))


@pytest.mark.parametrize("window", [512, 8])
def test_the_target_from_cached_prefixes_behind_a_post_norm(tmp_path_factory, tok_dir, window):
    """Gemma 3: δ sought on the raw output before the post-FFN norm, its sliding-window layers
    continued from the cache. A window shorter than the rows (8 tokens) would count the cache's
    masked places in it, so the continuation would differ from the full forward: the shortcut is
    refused (`ffkv.model.prefix.fits`), and v* is still the full one."""
    from test_families import _BUILT, FAMILIES, open_tiny

    def config(n):
        c = FAMILIES["gemma3_text"].config(n)
        c.sliding_window = window
        return c

    m = open_tiny(f"gemma3_text-w{window}", config, lambda: tmp_path_factory.mktemp("g3p"), tok_dir, _BUILT)[1]
    _prefix_target_is_the_full_ones(m, shortcut=window > 24)


def test_memit_relative_lambda_is_free_of_the_keys_scale():
    """λ = λ_rel · mean kᵀC⁻¹k: scaling the keys by s (C by s²) gives the same λ and the same update
    at the keys (U scales by 1/s, UᵀK not at all); a lone key gets 1/(1 + λ_rel) of its share; an
    absolute λ is taken as given."""
    from ffkv.steps.facts.edit import memit_factors

    g = np.random.default_rng(2)
    A = g.normal(size=(200, 16))
    C = A.T @ A / 200
    K = g.normal(size=(16, 3))
    U, lam = memit_factors(C, K, lam_rel=0.5)
    for s in (1e-3, 7.0, 1e4):
        Us, lams = memit_factors(C * s * s, K * s, lam_rel=0.5)
        assert lams == pytest.approx(lam, rel=1e-9)
        np.testing.assert_allclose(Us.numpy() * s, U.numpy(), rtol=1e-7)
        np.testing.assert_allclose(Us.numpy().T @ (K * s), U.numpy().T @ K, rtol=1e-7, atol=1e-12)
    k = K[:, :1]
    U1, lam1 = memit_factors(C, k, lam_rel=0.5)
    assert float(U1.numpy()[:, 0] @ k[:, 0]) == pytest.approx(1 / 1.5, rel=1e-9)
    assert lam1 == pytest.approx(0.5 * k[:, 0] @ np.linalg.solve(C, k[:, 0]), rel=1e-9)
    U2, lam2 = memit_factors(C, K, lam=15000.0)
    assert lam2 == 15000.0
    np.testing.assert_allclose((15000.0 * C + K @ K.T) @ U2.numpy(), K, rtol=1e-6, atol=1e-9)


def test_a_zero_post_norm_gain_takes_no_change(tmp_path_factory, tok_dir):
    """Gemma 3's post-FFN norm gain (1 + w) is 0 in some dims of real checkpoints: the values are 0
    there, the raw change is 0 there (not inf), and the rest is delta / gain."""
    from test_families import _BUILT, FAMILIES, open_tiny

    mm = open_tiny("gemma3_text", FAMILIES["gemma3_text"].config, lambda: tmp_path_factory.mktemp("g3"), tok_dir,
                   _BUILT)[1]
    blk = mm.blocks[0]
    norm = blk.post_feedforward_layernorm
    w0 = norm.weight.detach().clone()
    try:
        with torch.no_grad():
            norm.weight[3] = -1.0  # gain 1 + w = 0
        delta = torch.randn(mm.d_m, mm.d)
        raw = mm.arch.raw_values(blk, delta)
        g = 1.0 + norm.weight.detach()
        assert torch.isfinite(raw).all() and (raw[:, 3] == 0).all()
        keep = torch.arange(mm.d) != 3
        torch.testing.assert_close(raw[:, keep], delta[:, keep] / g[keep])
        assert (mm.values(0)[:, 3] == 0).all()
    finally:
        with torch.no_grad():
            norm.weight.copy_(w0)


def test_a_post_norm_edit_gives_the_raw_output_it_optimised(tmp_path_factory, tok_dir):
    """Gemma 3 (a post-FFN RMSNorm caps what the FFN adds): the target is sought on the raw output
    u before the norm, and a ROME edit (any C) then gives exactly u₀ + δ at the prompt, so the
    forward the optimiser scored is the edited model's; the new object is likelier after it."""
    from test_families import _BUILT, FAMILIES, open_tiny

    from ffkv.steps.facts import edit as E
    from ffkv.steps.facts.evaluate import target_nll

    mm = open_tiny("gemma3_text", FAMILIES["gemma3_text"].config, lambda: tmp_path_factory.mktemp("g3e"), tok_dir,
                   _BUILT)[1]
    layer, tpl = 1, ["{}", "Once upon a time. {}"]
    blk = mm.blocks[layer]
    vstar, k0, y0 = E.target_output(mm, layer, REQ, tpl, {"steps": 8, "clamp": 8.0})
    u0 = E.raw_output_at(mm, layer, REQ.text, REQ.subject)
    s0 = 1.0 / mm.arch.inv_scale(blk, u0[None])[0, 0]
    g = mm.arch.norm_gain(blk.post_feedforward_layernorm).detach().float()
    delta = (vstar - y0) * s0 / g  # the raw δ the optimiser found (no zero gain in a tiny model)
    assert float(delta.norm()) > 0
    kbar = E.keys_at(mm, layer, [E.fill(t, REQ.text) for t in tpl], REQ.subject).mean(0)
    u, r = E.rome_factors(np.eye(mm.d_m), kbar, k0, vstar, y0)
    e = E.Edit("rome", {layer: (u[:, None], r[:, None])}, [REQ.as_dict()], {}, {layer: vstar.numpy()})
    text = REQ.text
    before = float(-target_nll(mm, [text], REQ.target_new)[0])
    with E.applied(mm, e):
        torch.testing.assert_close(E.raw_output_at(mm, layer, REQ.text, REQ.subject), u0 + delta,
                                   rtol=1e-4, atol=1e-4)
        after = float(-target_nll(mm, [text], REQ.target_new)[0])
    assert after > before


def test_saving_over_an_edit_replaces_it_whole(tmp_path, monkeypatch):
    """--name over an existing edit: the new one replaces it; a write that fails midway leaves the
    old one as it was and no staged folder behind."""
    a = Edit("rome", {1: (np.ones((4, 1), np.float32), np.ones((3, 1), np.float32))})
    b = Edit("values", {2: (np.full((4, 1), 2, np.float32), np.full((3, 1), 2, np.float32))})
    where = tmp_path / "edits" / "x"
    a.save(where)
    b.save(where)
    back = Edit.load(where)
    assert back.method == "values" and back.layers == [2] and np.array_equal(back.delta(2).numpy(), b.delta(2).numpy())
    assert sorted(p.name for p in where.parent.iterdir()) == ["x"]

    def broken(*args, **kw):
        raise OSError("disk full midway")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError):
        a.save(where)
    back = Edit.load(where)
    assert back.method == "values" and np.array_equal(back.delta(2).numpy(), b.delta(2).numpy())
    assert sorted(p.name for p in where.parent.iterdir()) == ["x"]


def test_memit_on_a_post_norm_family_writes_the_raw_target(tmp_path_factory, tok_dir):
    """Gemma 3: MEMIT's z is sought on the top layer's raw output, as ROME's target is. Over one
    layer with a negligible λ its edit gives exactly u₀ + δ at the prompt (δ the optimiser's); over
    two layers the new object gets likelier."""
    from test_families import _BUILT, FAMILIES, open_tiny

    from ffkv.steps.facts import edit as E
    from ffkv.steps.facts.evaluate import target_nll

    mm = open_tiny("gemma3_text", FAMILIES["gemma3_text"].config, lambda: tmp_path_factory.mktemp("g3m"), tok_dir,
                   _BUILT)[1]
    hp, tpl, top = {"steps": 8, "clamp": 8.0}, ["{}"], 1
    blk = mm.blocks[top]
    vstar, _, y0 = E.target_output(mm, top, REQ, tpl, hp)  # deterministic: the same δ as memit's
    u0 = E.raw_output_at(mm, top, REQ.text, REQ.subject)
    s0 = 1.0 / mm.arch.inv_scale(blk, u0[None])[0, 0]
    delta = (vstar - y0) * s0 / mm.arch.norm_gain(blk.post_feedforward_layernorm).detach().float()
    eye = {l: np.eye(mm.d_m) for l in (0, 1)}
    before = float(-target_nll(mm, [REQ.text], REQ.target_new)[0])
    e1 = E.memit(mm, [top], [REQ], eye, tpl, hp, lam=1e-9)
    with E.applied(mm, e1):
        torch.testing.assert_close(E.raw_output_at(mm, top, REQ.text, REQ.subject), u0 + delta, rtol=1e-3, atol=1e-3)
    e2 = E.memit(mm, [0, 1], [REQ], eye, tpl, hp, lam=1e-9)
    with E.applied(mm, e2):
        after = float(-target_nll(mm, [REQ.text], REQ.target_new)[0])
    assert after > before


def test_memit_targets_take_memits_own_clamp(mm):
    """MEMIT's z moves the residual by at most 0.75 × its norm (MEMIT's published
    clamp_norm_factor), unless told otherwise; ROME's 4 lets it go farther on this model."""
    from ffkv.steps.facts import edit as E

    h0 = E.hidden_at(mm, 1, REQ.text, REQ.subject)
    moved = float((E.memit_target(mm, 1, REQ, ["{}"], {"steps": 20}) - h0).norm() / h0.norm())
    assert moved <= 0.75 * (1 + 1e-5)
    far = float((E.memit_target(mm, 1, REQ, ["{}"], {"steps": 20, "clamp": 4.0}) - h0).norm() / h0.norm())
    assert far > 0.75 * 1.05, far


def test_behind_a_post_norm_memit_keeps_roms_raw_bound(tmp_path_factory, tok_dir):
    """Gemma 3: z is sought on the raw output, whose move the norm bounds far below MEMIT's
    0.75 × ‖h₀‖, so δ keeps ROME's 4 × ‖u₀‖ (and an edit records it); a Llama gets MEMIT's 0.75."""
    from test_families import _BUILT, FAMILIES, open_tiny

    from ffkv.steps.facts import edit as E

    g3 = open_tiny("gemma3_text", FAMILIES["gemma3_text"].config, lambda: tmp_path_factory.mktemp("g3c"), tok_dir,
                   _BUILT)[1]
    assert E.memit_hp(g3)["clamp"] == 4.0 and E.memit_hp(g3, {"clamp": 2.0})["clamp"] == 2.0
    e = E.memit(g3, [1], [REQ], {1: np.eye(g3.d_m)}, ["{}"], {"steps": 2}, lam=1e-3)
    assert e.settings["clamp"] == 4.0
