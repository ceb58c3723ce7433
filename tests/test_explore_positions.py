"""The explorer at any position (issue 48, item 4): `pos=` makes a token position the one explained,
and "memories that fire hardest here" lists the largest |m| of all layers there.

Every number is held to a hand-written hooked forward of the raw tiny Llama over the WHOLE text,
read at the chosen position (the explorer reads the prefix up to it; a causal model makes the two
equal): the prediction and its top logits, each memory's coefficient (down_proj's input) and its
direct logit attribution m_i·(v_i·(g⊙e_w))/rms (v_i down_proj's column i, g the final norm's gain, rms
its scale at the final residual there), an edit "at last" zeroing m at the chosen position only, and
the hardest list as a brute-force top-|m| over all layers. Positions outside the text are one line.
"""
from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest
import torch

TEXT = "The cat sat on the mat because it was"
POS = 3  # a middle position of the text's 16 tokens
TOL = dict(rel=1e-4, abs=1e-4)


@pytest.fixture(scope="module")
def app(tmp_path_factory, tiny_dirs, tiny_models, reference_mine):
    import shutil

    from ffkv.web.app import create_app

    run = tmp_path_factory.mktemp("explore-positions") / "run"  # a copy: the browser may write to its run
    shutil.copytree(reference_mine(tiny_dirs["llama"], 30, 3), run)
    app = create_app(run, log_fn=lambda m: None)
    app.state.explore_model = tiny_models["llama"]  # the model the references below read
    return app


@pytest.fixture(scope="module")
def client(app):
    from fastapi.testclient import TestClient

    return TestClient(app, base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def hooked(tiny_models):
    """A forward of the whole text through the raw model: logits (T, V), m (L, T, d_m) at down_proj's
    input, the final residual (T, d) at the final norm's input."""
    mm = tiny_models["llama"]
    hf = mm.hf
    ids = torch.tensor([mm.tok(TEXT)["input_ids"]])
    ms, hooks, final = {}, [], {}
    for l, layer in enumerate(hf.model.layers):
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda mod, args, l=l: ms.__setitem__(l, args[0][0].detach().clone())))
    hooks.append(hf.model.norm.register_forward_pre_hook(lambda mod, args: final.__setitem__("h", args[0][0].clone())))
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return {"ids": ids[0].tolist(), "logits": logits, "m": torch.stack([ms[l] for l in range(len(ms))]).float(),
            "h": final["h"].float()}


@torch.no_grad()
def dla(hf, m_at: torch.Tensor, h: torch.Tensor, w: int) -> torch.Tensor:
    """(L, d_m) contributions to token w's logit under the norm lens, by hand."""
    norm = hf.model.norm
    rms = torch.sqrt(h.pow(2).mean() + norm.variance_epsilon)
    ge = norm.weight.float() * hf.lm_head.weight[w].float()  # g ⊙ e_w
    dirs = torch.stack([layer.mlp.down_proj.weight.float().T @ ge for layer in hf.model.layers])  # (L, d_m)
    return m_at * dirs / rms


def _api(client, **params) -> dict:
    r = client.get("/api/explore", params={"text": TEXT, "lens": "norm", **params})
    assert r.status_code == 200, r.text
    return r.json()


def test_position_equals_a_hooked_forward(client, tiny_models, hooked):
    hf = tiny_models["llama"].hf
    T = len(hooked["ids"])
    for pos in (POS, POS - T):  # 0-based, and the same position counted from the end
        api = _api(client, pos=pos)
        assert api["pos"] == POS and api["n_tokens"] == T and len(api["tokens"]) == T
        assert api["token"] == api["tokens"][POS] and api["query"]["pos"] == pos
        logits = hooked["logits"][POS]
        w = int(logits.argmax())
        assert api["prediction_id"] == w
        logp = torch.log_softmax(logits.double(), -1)
        assert [t["id"] for t in api["top"]] == logits.topk(len(api["top"])).indices.tolist()
        for t in api["top"]:
            assert t["logit"] == pytest.approx(float(logits[t["id"]]), **TOL)
            assert t["logp"] == pytest.approx(float(logp[t["id"]]), **TOL)
        assert api["logit"] == pytest.approx(float(logits[w]), **TOL)
        # the lens table: the norm lens of the last layer's output is the model's own head
        assert api["layers"][-1]["lenses"]["norm"]["o"]["logit"] == pytest.approx(float(logits[w]), **TOL)
        # contributions: each listed memory's m and share of w's logit, and the top lists themselves
        m_at = hooked["m"][:, POS]
        c = dla(hf, m_at, hooked["h"][POS], w)
        k = len(api["top_memories"]["up"])
        flat = c.flatten()
        assert [(x["layer"], x["dim"]) for x in api["top_memories"]["up"]] == [
            divmod(j, c.shape[1]) for j in flat.topk(k).indices.tolist()]
        assert [(x["layer"], x["dim"]) for x in api["top_memories"]["down"]] == [
            divmod(j, c.shape[1]) for j in (-flat).topk(k).indices.tolist()]
        for x in api["top_memories"]["up"] + api["top_memories"]["down"]:
            assert x["coef"] == pytest.approx(float(m_at[x["layer"], x["dim"]]), **TOL)
            assert x["contrib"] == pytest.approx(float(c[x["layer"], x["dim"]]), **TOL)
    # not the last position's answer: the default explains the last token
    last = _api(client)
    assert last["pos"] == T - 1 and last["logit"] == pytest.approx(
        float(hooked["logits"][-1][last["prediction_id"]]), **TOL)


def test_an_edit_at_last_edits_the_chosen_position(client, tiny_models, hooked):
    """`at=last` with pos=P zeroes m at P alone: the model's logits at P equal a hooked forward of
    the whole text with m[P, dim] of that layer zeroed (later tokens cannot reach P)."""
    hf = tiny_models["llama"].hf
    api = _api(client, pos=POS)
    top = api["top_memories"]["up"][0]
    l, d = top["layer"], top["dim"]
    ed = _api(client, pos=POS, suppress=f"{l}:{d}")
    assert ed["interventions"][0]["coef"] == pytest.approx(top["coef"], **TOL)
    assert ed["interventions"][0]["coef_after"] == 0

    def zero(mod, args):
        x = args[0].clone()
        x[0, POS, d] = 0
        return (x,)

    h = hf.model.layers[l].mlp.down_proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([hooked["ids"]]), use_cache=False).logits[0, POS].float()
    finally:
        h.remove()
    new = ed["intervened"]
    assert new["prediction_id"] == int(ref.argmax())
    for row in new["top"]:
        assert row["logit"] == pytest.approx(float(ref[row["id"]]), **TOL)
    assert new["p_original"] == pytest.approx(float(torch.softmax(ref, -1)[api["prediction_id"]]), **TOL)


def test_hardest_is_a_brute_force_top_abs_m(client, tiny_models, hooked):
    hf = tiny_models["llama"].hf
    for pos, k in ((POS, None), (0, 7), (-1, 50)):
        api = _api(client, pos=pos, **({} if k is None else {"hardest": k}))
        p = api["pos"]
        m_at = hooked["m"][:, p]
        c = dla(hf, m_at, hooked["h"][p], api["prediction_id"])
        a = m_at.abs().flatten().double().numpy()
        d_m = m_at.shape[1]
        want = [divmod(int(j), d_m) for j in np.lexsort((np.arange(a.size), -a))[:k or 20]]
        got = api["hardest"]
        assert [(x["layer"], x["dim"]) for x in got] == want
        assert {x["layer"] for x in got} != {0} or m_at.shape[0] == 1  # over all layers, not one
        for x in got:
            assert x["coef"] == pytest.approx(float(m_at[x["layer"], x["dim"]]), **TOL)
            assert x["contrib"] == pytest.approx(float(c[x["layer"], x["dim"]]), **TOL)
        assert [abs(x["coef"]) for x in got] == sorted((abs(x["coef"]) for x in got), reverse=True)


def test_page_links_every_position(client):
    r = client.get("/explore", params={"text": TEXT, "pos": str(POS), "suppress": "1:4", "lens": "naive"})
    assert r.status_code == 200, r.text
    links = re.findall(r'<a class="tok( xp-at| xp-after)?" href="([^"]+)" data-pos="(\d+)"', r.text)
    T = len(links)
    assert T > POS + 1 and [int(p) for _, _, p in links] == list(range(T))
    assert [cls for cls, _, _ in links].count(" xp-at") == 1 and links[POS][0] == " xp-at"
    for _, href, p in links:
        q = parse_qs(urlsplit(href.replace("&amp;", "&")).query)
        # every other parameter kept; the last token is the default (no pos=)
        assert q["text"] == [TEXT] and q["suppress"] == ["1:4"] and q["lens"] == ["naive"]
        assert q.get("pos") == (None if int(p) == T - 1 else [p])
    # following a link explains that position
    api = client.get(links[1][1].replace("&amp;", "&").replace("/explore?", "/api/explore?")).json()
    assert api["pos"] == 1 and api["query"]["suppress"] == "1:4"
    assert 'id="hardest-table"' in r.text and 'name="pos"' in r.text and 'value="3"' in r.text
    hard = re.findall(r'<tr data-layer="(\d+)" data-dim="(\d+)" data-coef', r.text)
    j = client.get("/api/explore", params={"text": TEXT, "pos": str(POS), "suppress": "1:4", "lens": "naive"}).json()
    assert [(int(a), int(b)) for a, b in hard] == [(x["layer"], x["dim"]) for x in j["hardest"]]
    assert "the explained position" in r.text  # the form says what "at last" now means


@pytest.mark.parametrize("pos, msg", [
    ("99", "pos 99 is outside the text"), ("-99", "pos -99 is outside the text"), ("16", "positions 0..15 (or -16..-1"),
    ("x", "pos (the token position explained) must be a whole number"), ("9" * 5000, "too large"),
])
def test_positions_outside_the_text_are_one_line(client, tiny_models, pos, msg):
    assert len(tiny_models["llama"].tok(TEXT)["input_ids"]) == 16  # the messages above name its range
    r = client.get("/api/explore", params={"text": TEXT, "pos": pos})
    assert r.status_code == 422 and msg in r.json()["detail"] and "\n" not in r.json()["detail"], r.text
    page = client.get("/explore", params={"text": TEXT, "pos": pos})
    assert page.status_code == 422 and 'id="error"' in page.text and "Traceback" not in page.text
    assert client.get("/api/explore", params={"text": TEXT, "hardest": "0"}).status_code == 422


def test_odd_positions_never_500(client):
    for v in ("0", "-0", "+1", "-16", "15", "1e3", "1.5", " 1 ", "", "١", "𝟙", "²", "-", "0x10", "-" + "9" * 5000):
        for name in ("pos", "hardest"):
            r = client.get("/api/explore", params={"text": TEXT, name: v})
            assert r.status_code in (200, 422), (name, v, r.text)


@pytest.mark.browser
def test_click_a_token_in_a_browser(app, client, browser):
    """In chromium: clicking a token explains its position (the page's numbers are the API's), its
    text reaches WCAG AA in both colour schemes, and a long text's token strip wraps inside the page
    at 390 px."""
    from conftest import serving
    from test_web_bugs import CONTRAST_JS

    b = browser  # conftest's: Debian's chromium, skipped where it is missing
    with serving(app, access_log=False) as url:
        page = b.new_page(viewport={"width": 390, "height": 800})
        problems = []
        page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(f"{url}/explore?text={TEXT.replace(' ', '+')}")
        page.wait_for_selector("#prediction")
        page.click(f'#tokens a[data-pos="{POS}"]')
        page.wait_for_selector(f'#tokens a.xp-at[data-pos="{POS}"]')
        assert f"pos={POS}" in page.url
        j = client.get(page.url.replace(url, "").replace("/explore?", "/api/explore?")).json()
        assert j["pos"] == POS and page.get_attribute("#prediction", "data-id") == str(j["prediction_id"])
        rows = [(int(tr.get_attribute("data-layer")), int(tr.get_attribute("data-dim")))
                for tr in page.query_selector_all("#hardest-table tbody tr")]
        assert rows == [(x["layer"], x["dim"]) for x in j["hardest"]]
        assert not page.evaluate(CONTRAST_JS)  # the chosen token and those after it: WCAG AA, as every page
        dark = b.new_page(viewport={"width": 1280, "height": 800}, color_scheme="dark")
        dark.goto(page.url)
        assert not dark.evaluate(CONTRAST_JS)
        page.goto(f"{url}/explore?text=" + "+".join(["cat"] * 40))  # ~120 tokens, past one line at 390 px
        page.wait_for_selector("#prediction")
        strip = page.eval_on_selector("#tokens", "e => [e.scrollWidth, e.clientWidth, e.getBoundingClientRect().height]")
        assert strip[0] <= strip[1] and strip[2] > 40, strip  # wrapped onto several lines, nothing cut
        assert not problems, problems
        page.close()
        dark.close()


def test_cli_explain_takes_the_same_position(tiny_dirs, hooked):
    """`ffkv explain --pos`: the same position's prediction as the hooked forward; outside the
    text, one line and exit 2."""
    import json

    from conftest import run_cli

    T = len(hooked["ids"])
    res = run_cli("explain", TEXT, "--model", str(tiny_dirs["llama"]), "--pos", str(POS - T), "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout)
    w = int(hooked["logits"][POS].argmax())
    assert (got["pos"], got["prediction_id"], got["n_tokens"]) == (POS, w, T)
    assert got["logit"] == pytest.approx(float(hooked["logits"][POS][w]), **TOL)
    bad = run_cli("explain", TEXT, "--model", str(tiny_dirs["llama"]), "--pos", str(T))
    assert bad.returncode == 2 and "outside the text" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
