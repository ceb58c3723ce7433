"""The browser on a mixture of experts (issue 25, in the browser of issue 26): a memory is
(layer, expert e, dim i), flattened as dim = e·d_expert + i, and the memory page, its JSON, the
search rows, the layer lists and the search downloads name its expert as the model itself does
(`MemoryModel.expert_of`, the oracle here; Qwen2-MoE's shared expert is expert E, after the E
routed ones). The tiny Mixtral and Qwen2-MoE runs are tests/test_moe_steps.py's."""
from __future__ import annotations

import csv
import html
import io
import re

import pytest

from test_moe_steps import NAMES, moe_model, moe_run  # noqa: F401  (fixtures)
from test_moe import MOE


def _client(run):
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    return TestClient(create_app(run.path, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")


def _label(mm, dim):
    e, i = mm.expert_of(dim)
    return f"expert {e}, dim {i}" + (" (shared expert)" if e == mm.info()["experts"] else "")


@pytest.mark.parametrize("moe_model", NAMES, indirect=True)
def test_memory_page_names_the_expert(moe_run):
    name, mm, run = moe_run
    client = _client(run)
    E, de = mm.info()["experts"], mm.info()["d_expert"]
    layer = mm.n_layers - 1
    dims = [0, de - 1, de, 3 * de + 7, E * de - 1]
    if MOE[name][2]:  # the shared expert's first and last dims
        dims += [E * de, mm.d_m - 1]
    for dim in dims:
        e, i = mm.expert_of(dim)
        j = client.get(f"/api/memory/{layer}/{dim}").json()
        assert (j["expert"]["expert"], j["expert"]["dim"]) == (e, i), (name, dim)
        assert j["expert"]["shared"] == (e == E)
        assert j["expert"]["label"] == _label(mm, dim)
        page = client.get(f"/memory/{layer}/{dim}")
        assert page.status_code == 200
        shown = re.search(r'id="expert"[^>]*>([^<]*)<', page.text)
        assert shown and html.unescape(shown.group(1)) == _label(mm, dim), (name, dim)
    if MOE[name][2]:
        assert "(shared expert)" in client.get(f"/memory/{layer}/{mm.d_m - 1}").text


@pytest.mark.parametrize("moe_model", ["qwen2_moe"], indirect=True)
def test_search_rows_layer_lists_and_downloads_name_the_expert(moe_run):
    _, mm, run = moe_run
    client = _client(run)
    seen = set()
    for q in ({"text": "the"}, {"layer": 1, "per_page": 500}):
        rows = client.get("/api/search", params=q).json()["results"]
        assert rows, q
        for r in rows:
            e, i = mm.expert_of(r["dim"])
            assert (r["expert"]["expert"], r["expert"]["dim"]) == (e, i)
            seen.add(r["expert"]["shared"])
        page = client.get("/search", params=q).text
        for r in rows[:20]:
            assert f'{r["layer"]}/{r["dim"]}</a> <span class="expert small muted">{html.escape(_label(mm, r["dim"]))}</span>' in page
    assert seen == {True, False}  # routed and shared experts both listed
    lay = client.get("/api/layer/1", params={"per_page": 1000}).json()
    for r in lay["memories"]["rows"]:
        assert r["expert"]["label"] == _label(mm, r["dim"])
    got = list(csv.DictReader(io.StringIO(client.get("/search", params={"layer": 1, "format": "csv"}).text)))
    assert got and all((int(r["expert"]), int(r["expert_dim"])) == mm.expert_of(int(r["dim"])) for r in got)
    assert {r["shared_expert"] for r in got} == {"true", "false"}


def test_a_dense_run_names_no_expert(client):  # noqa: F811 - test_web's tiny Llama
    assert client.get("/api/memory/1/5").json()["expert"] is None
    assert 'id="expert"' not in client.get("/memory/1/5").text
    assert all("expert" not in r for r in client.get("/api/search", params={"text": "the"}).json()["results"])


from test_web import client, llama, web_app, web_run  # noqa: E402,F401  (fixtures)
