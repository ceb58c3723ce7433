"""First-position memories (issue 48, item 5): the badge, and `?pos0=hide` on memory pages,
search and layer lists.

A tiny Llama gets one memory built to fire on a sentence's first token: its gate and up rows are
set to the FFN input at position 0 of a sentence that starts with "The" (position 0 attends only
to itself, so that input is the same in every such sentence). Mined on 60 WikiText-2 sentences
that start with "The" and 20 that do not (top-k 80: every sentence in each list), its best
position is 0 in most sentences. Every check
compares the browser with the run's Parquet tables read here (`key_stats.pos_hist`, `triggers`),
not through the browser's code."""
from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import build_tiny, run_cli, wikitext_sentences

LAYER, DIM = 1, 7  # the memory built to fire at position 0
THRESHOLD = 0.5  # over half of the sentences peak at position 0
BADGE = re.compile(r'class="chip first-pos"')


@pytest.fixture(scope="module")
def built(tmp_path_factory, tok_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("first-position")
    base = build_tiny("llama", root / "base", tok_dir)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(base)
    the = tok("The")["input_ids"]
    assert len(the) == 1
    got = []
    mlp = model.model.layers[LAYER].mlp
    h = mlp.register_forward_pre_hook(lambda mod, args: got.append(args[0][0, 0].detach().clone()))
    with torch.no_grad():
        model(torch.tensor([the]))
    h.remove()
    x0 = got[0] / got[0].norm()
    with torch.no_grad():
        mlp.gate_proj.weight[DIM] = 3 * x0
        mlp.up_proj.weight[DIM] = 3 * x0  # m = a²·σ(a) ≥ 0 with a = 3·x·x̂0: the + side dominates
    path = root / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)

    sents = wikitext_sentences(400)
    docs = [s for s in sents if s.startswith("The ")][:60] + [s for s in sents if not s.startswith("The ")][:20]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    run = root / "run"
    for args in (("mine", "--out", run, "--model", path, "--corpus", corpus, "--top-k", 80, "--negative"),
                 ("values", run, "--model", path, "--permutations", 2)):
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
    return run


@pytest.fixture(scope="module")
def client(built):
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    return TestClient(create_app(built, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def shares(built) -> dict[tuple[int, int, int], float]:
    """(layer, dim, sign) -> share of sentences whose best coefficient on that side is at position 0."""
    ks = pq.read_table(built / "key_stats.parquet", columns=["layer", "dim", "sign", "pos_hist", "sentences"]).to_pylist()
    return {(r["layer"], r["dim"], r["sign"]): r["pos_hist"][0] / r["sentences"] for r in ks}


def expected_first(shares) -> tuple[set, set]:
    """Memories certainly first-position (both sides over the threshold) and certainly not (neither
    side over it); which side dominates decides the rest, so they are left out here."""
    mems = {(l, d) for l, d, _ in shares}
    yes = {k for k in mems if all(shares.get((*k, s), 0) > THRESHOLD for s in (1, -1))}
    no = {k for k in mems if all(shares.get((*k, s), 0) <= THRESHOLD for s in (1, -1))}
    return yes, no


@pytest.fixture(scope="module")
def triggers(built):
    return pq.read_table(built / "triggers.parquet").to_pandas()


def rows_of(html: str) -> list[tuple[int, int, int]]:
    """(sign, rank, position) of every trigger row of a memory page."""
    out = []
    for sign, body in re.findall(r'<table class="triggers" data-sign="(-?1)">(.*?)</table>', html, re.S):
        for rank, pos in re.findall(r'<tr data-rank="(\d+)" data-sentence="\d+" data-position="(\d+)"', body):
            out.append((int(sign), int(rank), int(pos)))
    return out


# ---- the badge --------------------------------------------------------------------------------------
def test_badge_follows_the_position_histogram(client, shares):
    built_share = shares[(LAYER, DIM, 1)]
    assert built_share > 0.7  # the construction worked: mostly at position 0
    m = client.get(f"/api/memory/{LAYER}/{DIM}").json()
    assert m["dominant"] == 1
    assert m["first_position"]["first"] is True
    assert m["first_position"]["share"] == pytest.approx(built_share, rel=1e-6)
    assert BADGE.search(client.get(f"/memory/{LAYER}/{DIM}").text)

    yes, no = expected_first(shares)
    # a memory of the same layer that peaks at position 0 in the fewest sentences: no badge
    other = min((k for k in no if k[0] == LAYER), key=lambda k: shares[(*k, 1)] + shares.get((*k, -1), 0))
    assert max(shares[(*other, 1)], shares.get((*other, -1), 0)) < THRESHOLD
    mo = client.get(f"/api/memory/{other[0]}/{other[1]}").json()
    assert mo["first_position"]["first"] is False
    assert mo["first_position"]["share"] == pytest.approx(shares[(*other, mo["dominant"])], rel=1e-6)
    assert not BADGE.search(client.get(f"/memory/{other[0]}/{other[1]}").text)

    # every memory of every layer page: flagged where the histogram says so
    for layer in sorted({l for l, _ in yes | no}):
        rows = client.get(f"/api/layer/{layer}?per_page=1000").json()["memories"]["rows"]
        flags = {(r["layer"], r["dim"]): r["first_position"] for r in rows}
        assert {k for k in yes if k[0] == layer} <= {k for k, f in flags.items() if f}
        assert not any(flags[k] for k in no if k in flags)
        html = client.get(f"/layer/{layer}?per_page=1000").text
        listed = html[html.index('id="memories"'):]
        assert len(BADGE.findall(listed)) == sum(flags.values())


def test_summary_says_first_position_instead_of_a_pattern(client, shares):
    """A first-position memory's line leads with that, and the share read from `pos_hist` here;
    the pattern of its one-token position-0 prefixes is left out. Others read as before."""
    m = client.get(f"/api/memory/{LAYER}/{DIM}").json()
    want = f"first-position memory (peaks at a sentence's first token in {100 * shares[(LAYER, DIM, 1)]:.0f}% of sentences)"
    assert m["summary"].startswith(want), m["summary"]
    assert "pattern “" not in m["summary"]
    _, no = expected_first(shares)
    for layer, dim in sorted(no)[:20]:
        assert "first-position" not in client.get(f"/api/memory/{layer}/{dim}").json()["summary"]


# ---- the toggle -------------------------------------------------------------------------------------
def test_memory_page_toggle_removes_exactly_the_position_0_rows(client, triggers):
    t = triggers[(triggers.layer == LAYER) & (triggers.dim == DIM)]
    n0 = int((t.position == 0).sum())
    assert n0 >= 10  # the page was full of position-0 examples
    full = rows_of(client.get(f"/memory/{LAYER}/{DIM}?top=200").text)
    hidden = rows_of(client.get(f"/memory/{LAYER}/{DIM}?top=200&pos0=hide").text)
    assert len(full) == len(t)
    assert sorted(hidden) == sorted(r for r in full if r[2] != 0)
    assert {s for s, _, _ in hidden} == {1, -1}  # both lists keep rows past their position-0 ones
    assert len(full) - len(hidden) == n0
    assert sorted((s, k) for s, k, _ in hidden) == sorted(zip(t[t.position != 0].sign, t[t.position != 0]["rank"]))

    # the default page holds the 25 best of the rest, in rank order, per list
    page = rows_of(client.get(f"/memory/{LAYER}/{DIM}?pos0=hide").text)
    for s in (1, -1):
        want = sorted(t[(t.sign == s) & (t.position != 0)]["rank"])[:25]
        assert [k for sg, k, _ in page if sg == s] == want
    api = client.get(f"/api/memory/{LAYER}/{DIM}?top=200&pos0=hide").json()
    assert api["pos0"]["triggers"] == {"+": int(((t.sign == 1) & (t.position == 0)).sum()),
                                       "-": int(((t.sign == -1) & (t.position == 0)).sum())}
    assert all(r["position"] != 0 for side in api["triggers"].values() for r in side)
    assert all(int(s["position"]) != 0 for s in api["stats"]["samples"])


def test_no_parameter_reads_as_before(client):
    for url in (f"/api/memory/{LAYER}/{DIM}", f"/api/layer/{LAYER}", "/api/search?text=the"):
        assert client.get(url).json() == client.get(url + ("&" if "?" in url else "?") + "pos0=show").json()
    html = client.get(f"/memory/{LAYER}/{DIM}").text
    assert f'href="/memory/{LAYER}/{DIM}?pos0=hide#triggers"' in html


def test_lists_hide_first_position_memories(client, built):
    n = client.get(f"/api/layer/{LAYER}").json()
    first = {r["dim"] for r in client.get(f"/api/layer/{LAYER}?per_page=1000").json()["memories"]["rows"]
             if r["first_position"]}
    assert DIM in first and n["first_position"] == len(first)
    rows = client.get(f"/api/layer/{LAYER}?per_page=1000&pos0=hide").json()["memories"]["rows"]
    assert len(rows) == n["memories"]["total"] - len(first)
    assert not any(r["first_position"] for r in rows)
    assert 'pos0=hide' in client.get(f"/layer/{LAYER}").text
    best = client.get(f"/api/layer/{LAYER}?pos0=hide").json()["best"]
    for kind in ("agreement", "sharpness"):
        assert best[kind] and not any(r["first_position"] or r["dim"] in first for r in best[kind])

    everything = client.get("/api/search?per_page=500").json()
    kept = client.get("/api/search?per_page=500&pos0=hide").json()
    assert kept["total"] == everything["total"] - sum(r["first_position"] for r in everything["results"])
    assert not any(r["first_position"] for r in kept["results"])
    # token search (the run's value index): the built memory's value's top token finds it
    v = pq.read_table(built / "values.parquet").to_pandas()
    top = int(v[(v.layer == LAYER) & (v.dim == DIM) & (v.kind == "value")].top_tokens.iloc[0][0])
    full = client.get(f"/api/search?token=%23{top}&k=5&per_page=500").json()
    kept = client.get(f"/api/search?token=%23{top}&k=5&per_page=500&pos0=hide").json()
    assert any(r["first_position"] and (r["layer"], r["dim"]) == (LAYER, DIM) for r in full["results"])
    assert kept["total"] == full["total"] - sum(r["first_position"] for r in full["results"])
    assert not any(r["first_position"] for r in kept["results"])
    # text search: "The" starts most sentences, so the built memory matches, until hidden
    hits = client.get(f"/api/search?text=The&layer={LAYER}&per_page=500").json()["results"]
    assert any(r["dim"] == DIM for r in hits)
    hits = client.get(f"/api/search?text=The&layer={LAYER}&per_page=500&pos0=hide").json()["results"]
    assert hits and not any(r["first_position"] or r["dim"] == DIM for r in hits)


def test_colours_of_the_hidden_page_leave_position_0_out_of_the_scale(client):
    j = client.get(f"/api/memory/{LAYER}/{DIM}/activations?top=5&samples=none&pos0=hide").json()
    rest = [x for e in j["examples"].values() for x in (e["m"][1:] if e["start"] == 0 else e["m"]) if x is not None]
    assert j["scale_pos"] == pytest.approx(max(rest))
    full = client.get(f"/api/memory/{LAYER}/{DIM}/activations?top=5&samples=none").json()
    assert full["scale_pos"] > j["scale_pos"]  # position 0 holds the memory's largest m


@pytest.mark.parametrize("url", [f"/memory/{LAYER}/{DIM}", f"/api/memory/{LAYER}/{DIM}", f"/layer/{LAYER}",
                                 f"/api/layer/{LAYER}", "/search?text=the", "/api/search?text=the",
                                 f"/api/memory/{LAYER}/{DIM}/activations"])
def test_bad_pos0_is_a_one_line_422(client, url):
    r = client.get(url + ("&" if "?" in url else "?") + "pos0=yes please")
    assert r.status_code == 422
    assert "Traceback" not in r.text
    if url.startswith("/api/"):
        assert r.json()["detail"] == "pos0 must be show or hide (got 'yes please')"
    else:
        assert "pos0 must be show or hide (got &#39;yes please&#39;)" in r.text
