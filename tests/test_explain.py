"""The prediction explorer's engine (`ffkv.web.explain`), its interventions
(`MemoryModel.intervene`), their parser (`ffkv.parse.parse_interventions`) and `ffkv explain`.

The exactness tests check the engine against forward hooks written here, independently of
`MemoryModel.intervene`: hooks on the value projection's input found by module name.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ARCHS, run_cli
from ffkv.errors import FfkvError
from ffkv.web.explain import explain
from ffkv.parse import Intervention, format_interventions, parse_interventions

TEXT = "The cat sat on the mat because it was"
LONG = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
        "It is named after the engineer Gustave Eiffel. The tower is in the city of")

# The value projection (its input is m) of every architecture, by module name: kept apart
# from ffkv's own adapter table on purpose.
VALUE_PROJ = {"gpt2": "transformer.h.{}.mlp.c_proj", "gpt_neox": "gpt_neox.layers.{}.mlp.dense_4h_to_h",
              "opt": "model.decoder.layers.{}.fc2", "llama": "model.layers.{}.mlp.down_proj"}


# ---- the parser ----------------------------------------------------------------------------------
def test_parse_forms():
    assert parse_interventions("3:17, 5:2*0.5,,7:9=1.25", 10, 20) == [
        Intervention(3, 17, "scale", 0.0), Intervention(5, 2, "scale", 0.5), Intervention(7, 9, "set", 1.25)]
    assert parse_interventions("1:2", scale=2.0) == [Intervention(1, 2, "scale", 2.0)]
    assert parse_interventions("1:2,1:2") == [Intervention(1, 2, "scale", 0.0)]
    assert parse_interventions("") == [] and parse_interventions(None) == []


@pytest.mark.parametrize("text, msg", [
    ("3", "is not LAYER:DIM"), ("3:", "is not LAYER:DIM"), ("a:b", "is not LAYER:DIM"),
    ("1:2:3", "is not LAYER:DIM"), ("-1:2", "is not LAYER:DIM"), ("3-5", "is not LAYER:DIM"),
    ("1:2*x", "is not a number"), ("1:2=nan", "not a finite number"), ("1:2*inf", "not a finite"),
    ("30:1", "layer 30 out of range 0..29"), ("2:1536", "dim 1536 out of range 0..1535"),
    ("1:2,1:2=3", "given twice"), ("1:٣", "is not LAYER:DIM"),
])
def test_parse_errors(text, msg):
    with pytest.raises(FfkvError, match=msg):
        parse_interventions(text, 30, 1536)


item = st.builds(Intervention, st.integers(0, 40), st.integers(0, 5000), st.sampled_from(["scale", "set"]),
                 st.floats(allow_nan=False, allow_infinity=False))


@given(st.lists(item, max_size=8, unique_by=lambda iv: (iv.layer, iv.dim)))
@settings(max_examples=200, deadline=None)
def test_parse_round_trip(ivs):
    assert parse_interventions(format_interventions(ivs), 41, 5001) == ivs


@given(st.text(alphabet=st.sampled_from(list("0123456789:,*=.-e+ xn")), max_size=30), st.integers(1, 40),
       st.integers(1, 3000))
@settings(max_examples=400, deadline=None)
def test_parse_never_crashes(text, n_layers, d_m):
    """Any string parses into valid interventions or raises FfkvError, never anything else."""
    try:
        out = parse_interventions(text, n_layers, d_m)
    except FfkvError as e:
        assert "--suppress" in str(e)
        return
    assert all(0 <= iv.layer < n_layers and 0 <= iv.dim < d_m and math.isfinite(iv.value) for iv in out)
    assert len({(iv.layer, iv.dim) for iv in out}) == len(out)


# ---- exactness ------------------------------------------------------------------------------------
def hooked_logits(mm, arch, text, layer, dim, at="last"):
    """Final-position logits with coefficient `dim` of `layer` zeroed by a hand-written hook."""
    ids = torch.tensor([mm.tok(text)["input_ids"]])
    T = ids.shape[1]
    mod = mm.hf.get_submodule(VALUE_PROJ[arch].format(layer))

    def zero(module, args):
        m = args[0].clone()
        if m.dim() == 2:  # OPT: (B*T, d_m)
            if at == "last":
                m[T - 1, dim] = 0
            else:
                m[:, dim] = 0
        elif at == "last":
            m[:, -1, dim] = 0
        else:
            m[..., dim] = 0
        return (m,)

    h = mod.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            return mm.hf(input_ids=ids, use_cache=False).logits[0, -1].float()
    finally:
        h.remove()


def check_suppress_top_last(mm, arch, text, tol):
    """Suppress the last layer's top memory at the last position: the naive-lens logit of w at
    the last layer moves by exactly its contribution, and the model's output equals a hooked pass."""
    res = explain(mm, text, 3, lens="naive")
    L = mm.n_layers - 1
    top = res["layers"][L]["memories"][0]
    assert top["layer"] == L and top["contrib"] == max(m["contrib"] for m in res["layers"][L]["memories"])
    ed = explain(mm, text, 3, [Intervention(L, top["dim"], "scale", 0.0)], lens="naive")
    before = res["layers"][L]["lenses"]["naive"]["o"]["logit"]
    after = ed["intervened"]["layers"][L]["lenses"]["naive"]["o"]["logit"]
    assert after - before == pytest.approx(-top["contrib"], rel=tol, abs=tol)
    # nothing before the last layer moves
    assert ed["intervened"]["layers"][L - 1] == res["layers"][L - 1]
    assert ed["interventions"][0]["coef"] == top["coef"] and ed["interventions"][0]["coef_after"] == 0
    ref = hooked_logits(mm, arch, text, L, top["dim"])
    new = ed["intervened"]
    assert new["prediction_id"] == int(ref.argmax())
    probs = torch.softmax(ref, -1)
    logp = torch.log_softmax(ref.double(), -1)
    for row in new["top"]:
        assert row["logit"] == pytest.approx(float(ref[row["id"]]), rel=tol, abs=tol)
        assert row["p"] == pytest.approx(float(probs[row["id"]]), rel=tol, abs=tol)
        assert row["logp"] == pytest.approx(float(logp[row["id"]]), rel=tol, abs=tol)
    assert new["p_original"] == pytest.approx(float(probs[res["prediction_id"]]), rel=tol, abs=tol)
    return res, ed


def check_all_positions(mm, arch, text, layer, tol):
    res = explain(mm, text, 3)
    dim = res["layers"][layer]["memories"][0]["dim"]
    ed = explain(mm, text, 3, [Intervention(layer, dim, "scale", 0.0)], at="all")
    ref = hooked_logits(mm, arch, text, layer, dim, at="all")
    new = ed["intervened"]
    assert new["prediction_id"] == int(ref.argmax())
    for row in new["top"]:
        assert row["logit"] == pytest.approx(float(ref[row["id"]]), rel=tol, abs=tol)
    # at every position is not at the last one: the layers after it see other attention inputs
    last = explain(mm, text, 3, [Intervention(layer, dim, "scale", 0.0)], at="last")["intervened"]
    assert [r["logit"] for r in last["top"]] != [r["logit"] for r in new["top"]]


@pytest.mark.parametrize("arch", ARCHS)
def test_suppress_top_memory_exact_tiny(tiny_models, arch):
    check_suppress_top_last(tiny_models[arch], arch, TEXT, 1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_suppress_at_all_positions_tiny(tiny_models, arch):
    check_all_positions(tiny_models[arch], arch, TEXT, 0, 1e-4)


def _numbers(r: dict) -> dict:
    """What a read of one forward pass shows (without the run-specific prediction keys)."""
    return {k: r[k] for k in ("top", "contrast", "layers", "top_memories", "contrast_memories")}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_scale_one_and_zero(tiny_models, arch):
    mm = tiny_models[arch]
    res = explain(mm, TEXT, 3, contrast=" the")
    picks = [(m["layer"], m["dim"]) for m in res["top_memories"]["up"][:3]]
    for at in ("last", "all"):
        one = explain(mm, TEXT, 3, [Intervention(l, d, "scale", 1.0) for l, d in picks], at=at, contrast=" the")
        assert _numbers(one["intervened"]) == _numbers(res) and one["changed"] is False
        assert one["intervened"]["p_original"] == res["p"] and one["intervened"]["prediction"] == res["prediction"]
        assert _numbers(one) == _numbers(res)
        spec = ",".join(f"{l}:{d}" for l, d in picks)
        outs = [explain(mm, TEXT, 3, parse_interventions(s, mm.n_layers, mm.d_m, scale=sc), at=at,
                        contrast=" the")["intervened"]
                for s, sc in ((spec, 0.0), (spec.replace(",", "*0,") + "*0", 1.0),
                              (spec.replace(",", "=0,") + "=0", 1.0))]
        assert outs[0] == outs[1] == outs[2]
        assert _numbers(outs[0]) != _numbers(res)


def test_set_and_scale_values(tiny_models):
    mm = tiny_models["llama"]
    res = explain(mm, TEXT, 3)
    t = res["top_memories"]["up"][0]
    l, d = t["layer"], t["dim"]
    d2 = (d + 1) % mm.d_m  # same layer: the edits do not reach each other's inputs
    ed = explain(mm, TEXT, 3, parse_interventions(f"{l}:{d}*0.5,{l}:{d2}=2.5", mm.n_layers, mm.d_m))
    rows = {(e["layer"], e["dim"]): e for e in ed["interventions"]}
    assert rows[(l, d)]["coef_after"] == pytest.approx(0.5 * t["coef"], rel=1e-6)
    assert rows[(l, d2)]["coef_after"] == 2.5 and rows[(l, d2)]["edit"] == f"{l}:{d2}=2.5"


@pytest.mark.parametrize("at", ["last", "all"])
def test_unedited_layers_are_reused_exactly(tiny_models, at):
    """The edited pass takes the layers before the first edited one from the original pass:
    the same numbers as reading them again."""
    from ffkv.web.explain import _public, _read, tokenize

    mm = tiny_models["llama"]
    ids = tokenize(mm, TEXT)
    base = _read(mm, ids, None, 5, "norm", 3)
    edits = [Intervention(2, 5, "scale", 0.0), Intervention(1, 7, "set", 1.5)]
    fast = _read(mm, ids, base["prediction_id"], 5, "norm", 3, edits, at, base=base)
    # the contributions of both are read at the unedited pass's frozen norm scale
    full = _read(mm, ids, base["prediction_id"], 5, "norm", 3, edits, at, scale=base["_scale"])
    assert _public(fast) == _public(full)
    assert torch.equal(fast["_m"], full["_m"]) and torch.equal(fast["_contrib"], full["_contrib"])
    assert fast["layers"][0] is base["layers"][0] and fast["layers"][1] is not base["layers"][1]


def test_intervene_padded_batch_and_cleanup(tiny_models):
    """`intervene(last=...)` edits each row's own last token; hooks are gone after the block."""
    mm = tiny_models["opt"]
    texts = ["The cat sat on the mat", "A dog"]
    seqs = [mm.tok(t)["input_ids"] for t in texts]
    ids, mask = mm.batch(seqs)
    edits = [Intervention(1, 5, "scale", 0.0), Intervention(0, 2, "set", 3.0)]
    lengths = mask.sum(1)
    with mm.intervene(edits, at="last", last=lengths - 1):
        cap = mm.capture(ids, mask, what=("m",), logits=True)
    for b, s in enumerate(seqs):
        one, m1 = mm.batch([s])
        with mm.intervene(edits, at="last"):
            ref = mm.capture(one, m1, what=("m",), logits=True)
        n = len(s)
        assert torch.allclose(cap.logits[b, n - 1], ref.logits[0, -1], atol=1e-4)
        assert cap[1]["m"][b, n - 1, 5] == 0 and cap[0]["m"][b, n - 1, 2] == 3.0
        assert cap[1]["m"][b, : n - 1, 5].abs().sum() > 0
    plain = mm.capture(ids, mask, what=("m",))
    assert plain[0]["m"][0, -1, 2] != 3.0
    assert all(not m._forward_pre_hooks for m in mm.hf.modules())
    with pytest.raises(FfkvError, match="out of range"):
        with mm.intervene([(9, 0, "scale", 0.0)]):
            pass


def test_contrast_and_limits(tiny_models):
    mm = tiny_models["gpt2"]
    res = explain(mm, TEXT, 2, contrast=" the")
    c = res["contrast"]
    assert c["token"] == " the" and c["rank"] >= 0
    assert len(res["contrast_memories"]["up"]) == 6 and len(res["layers"][0]["memories_down"]) == 2
    # the contrast's contributions are the same memories read against another token
    up = res["contrast_memories"]["up"]
    assert all(a["contrib_contrast"] >= b["contrib_contrast"] for a, b in zip(up, up[1:]))
    assert explain(mm, TEXT, 2, contrast=c["id"])["contrast"] == c
    with pytest.raises(FfkvError, match="tokens"):
        explain(mm, TEXT, contrast=" the cat sat")
    with pytest.raises(FfkvError, match="at most 4"):
        explain(mm, TEXT, max_tokens=4)
    with pytest.raises(FfkvError, match="out of range"):
        explain(mm, TEXT, interventions=[(0, mm.d_m, "scale", 0.0)])
    # the contribution is m_i·(v_i·e_w) under the naive lens; under the norm lens its share of the
    # logit through GPT-2's final LayerNorm: v centred, times its gain, over its scale at the last
    # position's final residual (read here from ln_f's own input)
    ln_f = mm.hf.transformer.ln_f
    seen = {}
    hook = ln_f.register_forward_pre_hook(lambda mod, args: seen.__setitem__("h", args[0][0, -1]))
    try:
        with torch.no_grad():
            mm.hf(input_ids=torch.tensor([mm.tok(TEXT)["input_ids"]]), use_cache=False)
    finally:
        hook.remove()
    for lens in ("naive", "norm"):
        r = explain(mm, TEXT, 2, lens=lens)
        m = r["layers"][1]["memories"][0]
        v = mm.values(1)[m["dim"]]
        g, k = 1.0, 1.0
        if lens == "norm":
            v, g = v - v.mean(), ln_f.weight
            k = float(1 / torch.sqrt(seen["h"].var(unbiased=False) + ln_f.eps))
        assert r["contrib_scale"] == pytest.approx(k, rel=1e-5)
        with torch.no_grad():
            want = m["coef"] * float((v * g) @ mm.hf.lm_head.weight[r["prediction_id"]]) * k
        assert m["contrib"] == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_cli_suppress(tiny_dirs):
    res = run_cli("explain", TEXT, "--model", tiny_dirs["llama"], "--suppress", "2:3,1:4*0.5",
                  "--contrast", " the", "--at", "all", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [e["edit"] for e in out["interventions"]] == ["2:3*0.0", "1:4*0.5"]
    assert out["at"] == "all" and out["contrast"]["token"] == " the" and out["intervened"]["layers"]
    assert len(out["layers"]) == 3 and out["layers"][-1]["top_o"] == out["prediction"]


def test_cli_suppress_errors(tiny_dirs, capsys):
    """In process (the entry point's own error handling): one line, exit code 2."""
    from ffkv.cli import main

    for args, msg in ((["--suppress", "7:1"], "layer 7 out of range 0..2"),
                      (["--suppress", "1:x"], "is not LAYER:DIM"), (["--at", "first"], "choose last or all"),
                      (["--contrast", "the cat sat"], "not one")):
        with pytest.raises(SystemExit) as e:
            main(["explain", TEXT, "--model", str(tiny_dirs["llama"]), *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_smollm2_exact(smollm2):
    mm = smollm2
    res, ed = check_suppress_top_last(mm, "llama", LONG, 1e-3)
    check_all_positions(mm, "llama", LONG, 20, 1e-3)


# ---- the web explorer (`ffkv.web.explore`), through HTTP ----------------------------------------
def build_explore_run(root: Path, model: Path) -> Path:
    """A run with the mine step only (the explorer needs just the model)."""
    from typer.testing import CliRunner

    from conftest import wikitext_sentences
    from ffkv.cli import app

    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(wikitext_sentences(40)) + "\n", encoding="utf-8")
    run = root / "run"
    res = CliRunner().invoke(app, ["mine", "--out", str(run), "--model", str(model), "--corpus", str(corpus),
                                   "--top-k", "5"])
    assert res.exit_code == 0, f"{res.exception!r}\n{res.output[-2000:]}"
    return run


@pytest.fixture(scope="module")
def explore_run(tmp_path_factory, tiny_dirs):
    return build_explore_run(tmp_path_factory.mktemp("explore"), tiny_dirs["llama"])


@pytest.fixture(scope="module")
def client(explore_run):
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    return TestClient(create_app(explore_run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")


def test_api_is_the_engine(client, tiny_models):
    mm = tiny_models["llama"]
    q = {"text": TEXT, "suppress": "2:3,1:4*0.5", "at": "all", "contrast": " the", "lens": "naive"}
    got = client.get("/api/explore", params=q)
    assert got.status_code == 200, got.text
    api = got.json()
    want = explain(mm, TEXT, 3, parse_interventions("2:3,1:4*0.5", 3, mm.d_m), at="all", contrast=" the",
                   lens="naive")
    assert {k: api[k] for k in want} == json.loads(json.dumps(want))
    assert api["query"]["interventions"] == ["2:3*0.0", "1:4*0.5"]
    page = client.get(api["url"])
    assert page.status_code == 200 and 'id="prediction-after"' in page.text
    assert f'data-id="{api["intervened"]["prediction_id"]}"' in page.text


@pytest.mark.parametrize("params, msg", [
    ({"text": "a", "suppress": "3:1"}, "layer 3 out of range 0..2"),
    ({"text": "a", "suppress": "1:80"}, "dim 80 out of range 0..79"),
    ({"text": "a", "suppress": "1;2"}, "is not LAYER:DIM"),
    ({"text": "a", "suppress": "1:2*"}, "is not a number"),
    ({"text": "a", "scale": "x"}, "scale 'x' is not a number"),
    ({"text": "a", "at": "first"}, "choose last"),
    ({"text": "a", "lens": "tuned"}, "choose naive or norm"),
    ({"text": "a", "top": "0"}, "between 1 and 20"),
    ({"text": "a", "top": "9" * 5000}, "too large"),
    ({"text": "a", "continue": "9" * 5000}, "too large"),
    ({"text": "a", "contrast_id": "9" * 5000}, "too large"),
    ({"text": "a", "suppress": "0:" + "9" * 5000}, "too large"),
    ({"text": "a", "suppress": "9" * 5000 + ":0"}, "too large"),
    ({"text": "a", "contrast": "the cat sat"}, "not one"),
    ({"text": "a", "contrast_id": "999999"}, "out of range"),
    ({"text": "word " * 300}, "at most 256"),
    ({"text": "x" * 9000}, "at most 8,000 characters"),
    ({}, "text is required"),
])
def test_api_errors_are_422(client, params, msg):
    r = client.get("/api/explore", params=params)
    assert r.status_code == 422 and msg in r.json()["detail"], r.text
    if params:
        page = client.get("/explore", params=params)
        assert page.status_code == 422 and 'id="error"' in page.text and "Traceback" not in page.text


def test_page_links_and_escaping(client, explore_run):
    r = client.get("/explore", params={"text": 'The <script>window.__x=1</script> "cat" sat on the'})
    assert r.status_code == 200
    assert "<script>window.__x" not in r.text and "&lt;script&gt;" in r.text
    assert "Content-Security-Policy" in r.headers and client.get("/explore.css").status_code == 200
    assert re.search(r'href="/memory/\d+/\d+"', r.text)  # the memory pages (the browser's)
    # the next-token table: rank, p and log p (from the logits: no underflow to log 0) per row
    j = client.get("/api/explore", params={"text": 'The <script>window.__x=1</script> "cat" sat on the'}).json()
    rows = re.findall(r'<tr data-id="(\d+)"><td class="num">(\d+)</td><td class="tok">.*?</td><td class="num">'
                      r'([^<]+)</td><td class="num">([^<]+)</td>', r.text)
    assert [(int(i), int(k)) for i, k, _, _ in rows] == [(t["id"], n + 1) for n, t in enumerate(j["top"])]
    assert [float(lp) for _, _, _, lp in rows] == [round(t["logp"], 2) for t in j["top"]]
    # a suppress link adds that memory to the URL's edits, and the result has it zeroed
    link = re.search(r'<a class="small suppress" href="([^"]+)"', r.text).group(1).replace("&amp;", "&")
    api = client.get(link.replace("/explore?", "/api/explore?")).json()
    e = api["interventions"][0]
    assert e["coef_after"] == 0 and (e["layer"], e["dim"]) == (api["top_memories"]["up"][0]["layer"],
                                                               api["top_memories"]["up"][0]["dim"])
    assert client.get("/explore").status_code == 200  # the empty form


def test_busy_beyond_the_queue(explore_run):
    """One model call at a time, `queue` more waiting; the next request gets 503 at once."""
    import threading
    import time

    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app
    from ffkv.web.explore import Explorer

    app = create_app(explore_run, log_fn=lambda m: None)
    ex = app.state.explorer = Explorer(queue=1)
    c = TestClient(app, base_url="http://127.0.0.1:8000")
    codes = []
    with ex.run_lock:  # the model is busy
        ts = [threading.Thread(target=lambda t=t: codes.append(c.get("/api/explore", params={"text": t}).status_code))
              for t in ("one", "two")]
        for t in ts:
            t.start()
        for _ in range(200):
            if ex.pending == 2:
                break
            time.sleep(0.05)
        assert ex.pending == 2
        r = c.get("/api/explore", params={"text": "three"})
        assert r.status_code == 503 and "busy" in r.json()["detail"] and r.headers["retry-after"] == "2"
        assert c.get("/explore", params={"text": "three"}).status_code == 503
    for t in ts:
        t.join(60)
    assert codes == [200, 200] and ex.pending == 0
    # answered from the cache: no admission needed
    with ex.run_lock:
        assert c.get("/api/explore", params={"text": "one"}).status_code == 200


def test_api_refuses_text_past_the_context(client, tiny_models):
    """Under the explorer's own cap (256 tokens) but past the model's context (128): refused, as
    `ffkv explain` refuses it (one rule, `ffkv.model.context.fit_context`), not cut silently; the
    web offers no --truncate, so its message names none."""
    text = "word " * 90
    assert 128 < len(tiny_models["llama"].tok(text)["input_ids"]) <= 256
    r = client.get("/api/explore", params={"text": text})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "the model's context (128 tokens) takes at most 128" in detail and "--truncate" not in detail
