"""Issue 50: compose reads top(o) of o = r + y from r's and y's logits (`Lens.sum_top`), projecting o
only where the derived logits leave a near tie.

- On every family's tiny model, under both lenses, at every layer and position of real sentences:
  where `sum_top` is sure, its top equals the direct `logits(o).argmax(-1)`; most rows are sure, so
  the derived path is what runs. A soft-capped head (Gemma 2's) is not affine: the norm lens says
  it cannot, and compose projects o as before.
- An exact tie (two equal unembedding rows, on top) is never called sure, and compose's fallback
  then gives the direct argmax (the lower token id).
- A wrong sum (o ≠ r + y) changes the derived top, so the comparison can fail.
compose's own tables are held to brute force in tests/test_compose.py, which now runs this path.
"""
from __future__ import annotations

import copy

import torch

from test_families import FAMILIES, _supported, open_tiny

_BUILT: dict = {}


def _every(tmp_path_factory, tok_dir, tiny_models):
    out = {n: open_tiny(n, FAMILIES[n].config, lambda: tmp_path_factory.mktemp("sumtop"), tok_dir, _BUILT)[1]
           for n in _supported()}
    return {**out, **tiny_models}


def _ryo(mm):
    from conftest import wikitext_sentences

    texts = wikitext_sentences(3)
    ids, mask = mm.batch([mm.tok(t)["input_ids"][:n] for t, n in zip(texts, (17, 9, 13))])
    cap = mm.capture(ids, mask, what=("r", "y", "o"))
    real = mask.bool()
    return [(cap[l]["r"][real], cap[l]["y"][real], cap[l]["o"][real]) for l in range(mm.n_layers)]


def _softcapped(mm) -> bool:
    return mm.arch.cap(mm.hf.config) is not None


def test_the_derived_top_of_a_sum_is_the_direct_one_on_every_family(tmp_path_factory, tok_dir, tiny_models):
    from ffkv.model.memories import lens_for

    for name, mm in _every(tmp_path_factory, tok_dir, tiny_models).items():
        states = _ryo(mm)
        for ln in ("naive", "norm"):
            lens = lens_for(mm, ln)
            if ln == "norm" and _softcapped(mm):
                assert not lens.sums_exactly(), f"{name}: a soft-capped head is not affine"
                assert lens.sum_top([states[0][0]], [lens.logits(states[0][0])], states[0][0]) is None
                continue
            assert lens.sums_exactly(), f"{name} {ln}"
            n = sure_n = 0
            for r, y, o in states:
                top, sure = lens.sum_top([r, y], [lens.logits(r), lens.logits(y)], o)
                direct = lens.logits(o).argmax(-1)
                assert torch.equal(top[sure], direct[sure]), f"{name} {ln}: a sure top differs"
                # o as the model computes it, not r + y in float: the bound covers that rounding too
                n, sure_n = n + len(top), sure_n + int(sure.sum())
            assert sure_n >= 0.5 * n, f"{name} {ln}: only {sure_n} of {n} rows derived"


def test_a_wrong_sum_changes_the_derived_top(tiny_models):
    from ffkv.model.memories import lens_for

    mm = tiny_models["llama"]
    lens = lens_for(mm, "norm")
    r, y, o = _ryo(mm)[-1]
    top, sure = lens.sum_top([r, -y], [lens.logits(r), lens.logits(-y)], o)  # parts that do not sum to o
    direct = lens.logits(o).argmax(-1)
    assert not torch.equal(top[sure], direct[sure])


def test_an_exact_tie_is_never_sure_and_compose_projects_it(tiny_models):
    from ffkv.model.memories import MemoryModel
    from ffkv.steps.compose.compute import _tops_and_final

    base = tiny_models["llama"]
    hf = copy.deepcopy(base.hf)
    mm = MemoryModel(hf, base.tok)
    E = mm.lens.unembed.weight
    a, b = 5, 11
    with torch.no_grad():
        E[b] = E[a]  # tokens a and b tie for every state
    states = _ryo(mm)
    for ln in ("naive", "norm"):
        from ffkv.model.memories import lens_for

        lens = lens_for(mm, ln)
        big = 50 * lens.E[a].detach().float() / lens.E[a].detach().float().norm()  # a (and b) on top
        noise = torch.randn(4, mm.d, generator=torch.Generator().manual_seed(0))
        r, y = big + noise, big - noise
        o = r + y
        direct = lens.logits(o).argmax(-1)
        assert set(direct.tolist()) == {a}, "the first of the tied maxima"
        top, sure = lens.sum_top([r, y], [lens.logits(r), lens.logits(y)], o)
        assert not sure.any(), f"{ln}: an exact tie was called sure"
        # compose: these rows in every layer; r, y, o as (L, 3, B, d)
        L = mm.n_layers
        ryo = torch.stack([torch.stack([r, y, o])] * L)
        tops, w, _, _ = _tops_and_final(lens, ryo)
        assert (tops[2] == a).all()
        r0, y0, o0 = states[1]
        ryo = torch.stack([torch.stack([r0, y0, o0])] * L)
        tops, w, _, _ = _tops_and_final(lens, ryo)
        assert torch.equal(tops[2, 0], lens.logits(o0).argmax(-1))
