"""`ffkv.model.onednn.fast_products`: oneDNN products equal MKL's up to float32 rounding, a row's
result does not depend on its batch, and whatever it does not handle runs as before."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS
from ffkv.model.onednn import _OneDNN, fast_products


def _close(a, b, scale):
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * scale), float((a - b).abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_and_captures_match_mkl(tiny_models, arch):
    mm = tiny_models[arch]
    ids, mask = mm.batch([[5, 9, 17, 3, 44, 12], [7, 7, 1], [100, 200, 300, 400]])
    with torch.no_grad():
        ref = mm.hf(input_ids=ids, attention_mask=mask).logits
        cref = mm.capture(ids, mask, what=("x", "m", "y"))
        with fast_products("cpu") as mode:
            got = mm.hf(input_ids=ids, attention_mask=mask).logits
            cap = mm.capture(ids, mask, what=("x", "m", "y"))
            # m from the definition (brute force), inside the mode: the same as the capture's
            for l in range(mm.n_layers):
                _close(mm.coefficients(l, cap[l]["x"]), cap[l]["m"], 1.0)
    assert isinstance(mode, _OneDNN) and mode.copies  # it did route something
    v = mask.bool()
    _close(got[v], ref[v], float(ref.abs().max()))
    for l in range(mm.n_layers):
        for q in ("m", "y"):
            _close(cap[l][q][v], cref[l][q][v], float(cref[l][q].abs().max()))


def test_rows_do_not_depend_on_the_batch(smollm2):
    mm = smollm2
    seqs = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((9, 4, 13, 6, 11, 2, 8))]
    with torch.no_grad(), fast_products("cpu"):
        ids, mask = mm.batch(seqs)
        full = mm.hf(input_ids=ids, attention_mask=mask).logits
        for a, b in ((0, 1), (2, 4), (5, 7)):  # the same padded width, fewer rows (as MKL)
            part = mm.hf(input_ids=ids[a:b], attention_mask=mask[a:b]).logits
            assert torch.equal(part[mask[a:b].bool()], full[a:b][mask[a:b].bool()])


def test_vocabulary_projections_and_fallbacks(smollm2):
    mm = smollm2
    E = mm.lens.E
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, mm.d, generator=g)
    ref = h @ E.T
    plain = torch.randn(mm.vocab_size, mm.d, generator=g)  # no parameter: runs as before
    with torch.no_grad(), fast_products("cpu") as mode:
        z = h @ E.T
        out = torch.empty(37, mm.vocab_size)
        torch.matmul(h, E.T, out=out)
        assert torch.equal(out, z)
        assert torch.equal(torch.matmul(h[:5], E.T)[3], z[3])  # a row alone, as in the batch
        assert torch.equal(h @ plain.T, torch.matmul(h, plain.T))
        assert torch.equal(h.double() @ E.double().T, ref.double() * 0 + h.double() @ E.double().T)
    _close(z, ref, float(ref.abs().max()))
    assert list(mode.copies) == [id(E)]
    with torch.enable_grad(), fast_products("cpu"):
        x = torch.randn(3, mm.d, requires_grad=True)
        (x @ E.T).sum().backward()  # autograd runs as before
    assert x.grad is not None


def test_an_edited_weight_is_copied_again(tiny_models):
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with torch.no_grad(), fast_products("cpu"):
        a = lin(x)
        lin.weight.mul_(2)
        b = lin(x)
    _close(b - lin.bias, 2 * (a - lin.bias), 10.0)


def test_an_owner_keeps_its_packed_weights_across_contexts():
    """Per-request and per-batch contexts (`products_of`, the explorer, the sentence encoder) pack
    a weight once, and again only after it is edited."""
    from ffkv.model.onednn import products_of

    class Owner:
        device = "cpu"

    owner, lin = Owner(), torch.nn.Linear(8, 4)  # weights that require grad, as AutoModel loads them: routed under no_grad
    x = torch.randn(3, 8)
    packed = []
    with torch.no_grad():
        for _ in range(2):
            with products_of(owner) as _:
                a = lin(x)
            packed.append(owner._ffkv_onednn_copies[id(lin.weight)][2])
        assert packed[0] is packed[1]
        lin.weight.mul_(2)
        with fast_products("cpu", owner=owner):
            b = lin(x)
        assert owner._ffkv_onednn_copies[id(lin.weight)][2] is not packed[0]
    _close(b - lin.bias, 2 * (a - lin.bias), 10.0)
    with fast_products("cpu") as mode:  # no owner: a context's own copies
        lin(x)
    assert mode.copies is not owner._ffkv_onednn_copies


def test_off_switch(monkeypatch):
    monkeypatch.setenv("FFKV_ONEDNN", "0")
    assert not isinstance(fast_products("cpu"), _OneDNN)
    monkeypatch.setenv("FFKV_ONEDNN", "1")
    assert not isinstance(fast_products("cuda"), _OneDNN)
