"""Issue 48 item 8: a deep memory's colours start from the run's stored residual stream at block K
(`ffkv.model.stream`, `ffkv.web.residuals`).

- On every family's tiny model, a pass started at block K from the stream gives every later
  layer's coefficients as a full pass does, and runs no module of the blocks below K; a wrong
  stream changes them (so the check can fail).
- On the tiny Llama run of tests/test_web.py, the colours' JSON of a memory above K, computed from
  the stream, equals an independent hooked forward of each sentence alone; blocks below K run no
  MLP for it; a memory below K still runs from the tokens.
- The stream is stored once (a second server reads it), rebuilt when the file is damaged, and
  left off with a reason when too big, turned off, or when the model does not resume there.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_families import FAMILIES, _supported, open_tiny
from test_web import llama, sentences, web_run  # noqa: F401
from test_web_tokens import check_against_hook, hf, some_keys  # noqa: F401

_BUILT: dict = {}


def _every(tmp_path_factory, tok_dir, tiny_models):
    out = {n: open_tiny(n, FAMILIES[n].config, lambda: tmp_path_factory.mktemp("stream"), tok_dir, _BUILT)[1]
           for n in _supported()}
    return {**out, **tiny_models}


def _m(mm, ids, mask, layers):
    cap = mm.capture(ids, mask, layers=layers, what=("m",))
    return {l: cap.layers[l]["m"] for l in layers}


def test_a_pass_from_the_stream_equals_a_full_pass_on_every_family(tmp_path_factory, tok_dir, tiny_models):
    from ffkv.model.stream import block_output, from_stream, resumes, stream
    from conftest import wikitext_sentences

    texts = wikitext_sentences(3)
    for name, mm in _every(tmp_path_factory, tok_dir, tiny_models).items():
        ids, mask = mm.batch([mm.tok(t)["input_ids"][:n] for t, n in zip(texts, (17, 9, 13))])
        real = mask.bool()
        for K in range(1, mm.n_layers):
            later = list(range(K, mm.n_layers))
            full = _m(mm, ids, mask, later)
            h = stream(mm, ids, mask, K)
            block_output(mm)  # learned once, from a pass through block 0
            called = []
            hooks = [m.register_forward_hook(lambda *a, j=j: called.append(j))
                     for j in range(K) for m in mm.blocks[j].modules() if m is not mm.blocks[j]]
            try:
                with from_stream(mm, K, h):
                    got = _m(mm, ids, mask, later)
            finally:
                for hk in hooks:
                    hk.remove()
            assert not called, f"{name}: blocks {sorted(set(called))} ran below K={K}"
            for l in later:
                a, b = full[l][real].float(), got[l][real].float()
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(a.abs().max()))), (name, K, l)
            with from_stream(mm, K, h + torch.randn(h.shape, generator=torch.Generator().manual_seed(K)) * h.std()):  # seen
                wrong = _m(mm, ids, mask, [mm.n_layers - 1])[mm.n_layers - 1][real]
            assert not torch.allclose(full[mm.n_layers - 1][real], wrong, atol=1e-3), name
            assert resumes(mm, K), (name, K)
            # the model is itself again afterwards
            again = _m(mm, ids, mask, later)
            assert all(torch.equal(again[l], full[l]) for l in later), name


def _browser(run):
    from ffkv.web.data import Browser

    return Browser(run, log=lambda msg: None)


class _State:
    pass


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FFKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FFKV_STREAM", raising=False)
    monkeypatch.delenv("FFKV_STREAM_MB", raising=False)
    return tmp_path / "cache"


def test_colours_from_the_stream_equal_a_hooked_forward(web_run, hf, cache):  # noqa: F811
    from ffkv.web import activations as A
    from ffkv.web.residuals import Streams

    model, _ = hf
    b = _browser(web_run)
    st = b._streams = Streams(b, start=1)
    st.wait()
    assert st.status == "ready", st.why
    assert st.arr.shape == (int(b.tok_offsets[-1]), b.model().d)
    sents = sentences(web_run)
    mm = b.model()
    keys = some_keys(web_run, 3)
    deep = [k for k in keys if k[0] >= 1]
    assert deep and any(k[0] == 0 for k in keys)
    for layer, dim in keys:
        ran = []
        hooks = [mm.blocks[0].mlp.register_forward_hook(lambda *a: ran.append(0))]
        try:
            j = A.activations(b, _State(), layer, dim, A.page_examples(b, layer, dim))
        finally:
            for hk in hooks:
                hk.remove()
        assert j["computed"] > 0
        assert bool(ran) == (layer == 0), (layer, ran)  # above K the blocks below it are skipped
        assert check_against_hook(model, sents, layer, dim, j["examples"]) > 20
    # the stream itself is the model's: block K's input of each sentence alone
    sid = next(iter(sents))
    row = b.sentence_row(sid)
    got = {}

    def keep(mod, args):
        got["h"] = args[0][0].clone()

    h = model.model.layers[1].register_forward_pre_hook(keep)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([sents[sid]]))
    finally:
        h.remove()
    np.testing.assert_allclose(st.rows(row, len(sents[sid])), got["h"].numpy(), rtol=1e-4, atol=1e-5)


def test_the_stream_is_stored_once_and_rebuilt_when_damaged(web_run, cache):  # noqa: F811
    from ffkv.web.residuals import Streams

    logs = []
    b = _browser(web_run)
    b.log = logs.append
    st = Streams(b, start=2)
    st.wait()
    assert st.status == "ready" and "computed" in logs[-1]
    files = list((cache / "streams").glob("*.npy"))
    assert len(files) == 1 and not list((cache / "streams").glob(".*"))  # no temp file left
    first = np.array(st.arr)
    again = Streams(b, start=2)
    again.wait()
    assert again.status == "ready" and "read from" in logs[-1]
    np.testing.assert_array_equal(np.asarray(again.arr), first)
    files[0].write_bytes(files[0].read_bytes()[:200])  # damaged: computed again
    third = Streams(b, start=2)
    third.wait()
    assert third.status == "ready" and "computed" in logs[-1]
    np.testing.assert_array_equal(np.asarray(third.arr), first)
    other = Streams(b, start=1)  # another block: another file
    other.wait()
    assert len(list((cache / "streams").glob("*.npy"))) == 2


def test_the_stream_is_left_off_with_a_reason(web_run, cache, monkeypatch):  # noqa: F811
    from ffkv.web.residuals import Streams, middle

    b = _browser(web_run)
    assert middle(3) is None and middle(30) == 15 and middle(18) == 9
    assert Streams(b).status == "off"  # 3 layers: too few to skip
    monkeypatch.setenv("FFKV_STREAM_MB", "0.001")
    st = Streams(b, start=1)
    st.wait()
    assert st.status == "off" and "FFKV_STREAM_MB" in st.why
    monkeypatch.delenv("FFKV_STREAM_MB")
    monkeypatch.setenv("FFKV_STREAM", "off")
    assert Streams(b, start=1).status == "off"
    monkeypatch.delenv("FFKV_STREAM")
    mm = b.model()
    mm._ffkv_resumes_2 = False  # as `resumes` remembers a model where starting there fails
    try:
        st = Streams(b, start=2)
        st.wait()
        assert st.status == "off" and "full pass" in st.why
    finally:
        del mm._ffkv_resumes_2
    assert not (cache / "streams").exists() or not list((cache / "streams").glob("*.npy"))
