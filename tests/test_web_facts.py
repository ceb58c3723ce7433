"""The browser's facts page: traced facts as heatmaps (checked against the table), a fact's
memories (against the library's ranking), an edit before and after (against a plain generate)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import mine_tiny, run_cli


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_dirs):
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    run = mine_tiny(tmp_path_factory.mktemp("webfacts") / "run", tiny_dirs["llama"], 20, 3)
    for args in (["trace", run, "--prompt", "{} is in the city of", "--subject", "The tower", "--samples", "2"],
                 ["edit", run, "--prompt", "{} is in", "--subject", "The tower", "--new", " the", "--method",
                  "values", "--layer", "1", "--top", "4", "--steps", "3", "--prefixes", "1", "--tokens", "0",
                  "--name", "tower"]):
        res = run_cli("facts", *args)
        assert res.returncode == 0, res.stderr
    return TestClient(create_app(run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000"), run


def test_page_shows_the_traced_fact_and_roms_average(client):
    from ffkv.store import query
    from ffkv.store.run import Run

    c, run = client
    page = c.get("/facts")
    assert page.status_code == 200 and "The tower is in the city of" in page.text and "/facts/edit/tower" in page.text
    d = c.get("/api/facts", params={"kind": "ffn"}).json()
    t = query.table(Run(run), "fact_traces").to_pandas()
    t = t[(t["kind"] == "ffn") & (t["grp"] >= 0)]
    for (g, l), v in t.groupby(["grp", "layer"])["effect"].mean().items():
        assert d["traces"]["average"]["ffn"][g][l]["v"] == pytest.approx(v, abs=1e-7)
    grid = d["traces"]["facts"][0]["grids"]["ffn"]
    assert len(grid) == len(d["traces"]["facts"][0]["tokens"]) and len(grid[0]) == d["traces"]["layers"]
    assert max(c["a"] for row in grid for c in row) == 1.0  # shaded by the grid's own largest effect


def test_locate_lists_the_librarys_ranking(client, tiny_models):
    from ffkv.steps.facts.locate import rank

    c, _ = client
    d = c.get("/api/facts/locate", params={"prompt": "{} is in the city of", "subject": "The tower",
                                           "target": " London", "method": "grad", "at": "last", "top": "6"}).json()
    mm = tiny_models["llama"]
    ids = mm.tok("The tower is in the city of")["input_ids"]
    want = rank(mm, ids, mm.tok(" London", add_special_tokens=False)["input_ids"][0], -1, "grad").top(6)
    assert [(m["layer"], m["dim"]) for m in d["memories"]] == [(l, dd) for l, dd, _ in want]
    assert [a["k"] for a in d["ablation"]] == [1, 5, 6]
    page = c.get("/facts/locate", params={"prompt": "{} is in the city of", "subject": "The tower"})
    assert page.status_code == 200 and page.text.count('href="/memory/') == 20


def test_edit_before_and_after(client, tiny_models):
    c, _ = client
    d = c.get("/api/facts/edit/tower", params={"tokens": "6"}).json()
    row = d["rows"][0]
    mm = tiny_models["llama"]
    ids = torch.tensor([mm.tok("The tower is in")["input_ids"]])
    with torch.no_grad():
        out = mm.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert row["before"] == mm.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert row["logp_after"] > row["logp_before"]
    assert d["method"] == "values" and d["layers"] == [1]


def test_the_explorer_applies_a_kept_edit(client):
    c, _ = client
    d = c.get("/api/explore", params={"text": "The tower is in", "edit": "tower", "continue": "6"}).json()
    page = c.get("/api/facts/edit/tower", params={"tokens": "6"}).json()["rows"][0]
    assert d["fact_edit"]["name"] == "tower" and d["fact_edit"]["method"] == "values"
    assert d["continuation"]["original"]["text"] == page["before"]
    assert d["continuation"]["edited"]["text"] == page["after"]
    plain = c.get("/api/explore", params={"text": "The tower is in", "continue": "6"}).json()
    assert plain["fact_edit"] is None and plain["continuation"]["original"]["text"] == page["before"]
    html = c.get("/explore", params={"text": "The tower is in", "edit": "tower", "continue": "6"}).text
    assert 'id="fact-edit"' in html and "without the fact edit" in html
    assert c.get("/api/explore", params={"text": "x", "edit": "nope"}).status_code == 422


@pytest.mark.parametrize("url, status", [("/facts/edit/nope", 404), ("/api/facts/edit/.hidden", 404),
                                         ("/api/facts/locate?prompt=no+slot&subject=x", 422),
                                         ("/api/facts/locate?prompt=%7B%7D&subject=x&top=0", 422),
                                         ("/api/facts?kind=mlp", 422)])
def test_bad_requests(client, url, status):
    c, _ = client
    r = c.get(url)
    assert r.status_code == status and "Traceback" not in r.text
