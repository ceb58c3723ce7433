"""A gated memory's examples per sign regime on its page (issue 46, item 1: GLUScope's four
(gate sign, input sign) combinations), served by the census step's later panels: the memory page
links to /memory/L/D/later-panels (fetched by its script after the colours), which draws them, and
the JSON twin holds them with the others.

Tiny Llama and GPT-2 runs (30 WikiText-2 sentences, top 3, `reference_mine`), each censused in
process. Every expected value is a brute force here: a hooked forward of the Llama's own
gate_proj and up_proj over the sentences the panel says it searched, read from sentences.parquet
with pyarrow."""
from __future__ import annotations

import re
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import browser_client

CODES = ("pp", "pn", "np", "nn")


def _censused(tmp_path_factory, reference_mine, model_dir, mm, name):
    from ffkv.steps.census.compute import compute_census
    from ffkv.store.run import Run

    run = tmp_path_factory.mktemp(name) / "run"
    shutil.copytree(reference_mine(model_dir, 30, 3), run)
    compute_census(Run(run), mm, show_progress=False)
    return run


_client = browser_client


@pytest.fixture(scope="module")
def llama(tmp_path_factory, reference_mine, tiny_dirs, tiny_models):
    return _censused(tmp_path_factory, reference_mine, tiny_dirs["llama"], tiny_models["llama"], "regimes-llama")


@pytest.fixture(scope="module")
def memory(llama):
    """(layer, dim) of the mined memory of layer 1 with the most triggers of both signs (ties: lowest dim)."""
    t = pq.read_table(llama / "triggers.parquet", columns=["layer", "dim"]).to_pandas()
    t = t[t.layer == 1]
    n = t.groupby("dim").size()
    return 1, int(n[n == n.max()].index.min())


@pytest.fixture(scope="module")
def page(llama, memory):
    c = _client(llama)
    j = c.get(f"/api/memory/{memory[0]}/{memory[1]}").json()
    html = c.get(f"/memory/{memory[0]}/{memory[1]}").text
    later = c.get(f"/memory/{memory[0]}/{memory[1]}/later-panels")
    assert later.status_code == 200
    return {p["title"]: p for p in j["panels"]}, html, later.text


def _brute(model_dir, layer: int, seqs: list[list[int]]):
    """Per sequence, (gate, up) (T, d_m) from forward hooks on the Llama's gate_proj and up_proj."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    mlp = hf.model.layers[layer].mlp
    got = {}
    hooks = [mlp.gate_proj.register_forward_hook(lambda m, a, o: got.__setitem__("g", o[0].detach())),
             mlp.up_proj.register_forward_hook(lambda m, a, o: got.__setitem__("u", o[0].detach()))]
    out = []
    with torch.no_grad():
        for s in seqs:  # one sentence at a time: no padding
            hf(torch.tensor([s]))
            out.append((got["g"].numpy().astype(np.float64), got["u"].numpy().astype(np.float64)))
    for h in hooks:
        h.remove()
    return out


def _regime(g: float, u: float) -> str:
    return ("p" if g > 0 else "n") + ("p" if u > 0 else "n")


def test_examples_and_shares_equal_a_hooked_forward(llama, memory, page, tiny_dirs):
    from ffkv.steps.census import regimes as R

    layer, dim = memory
    panels, _, _ = page
    shares = panels["Sign regimes over the searched tokens"]
    ex = panels["Sign regimes: strongest examples"]
    # the searched sentences, as the panel's note states them: the top-trigger ones, then the sample
    note = shares["note"]
    n_top, n_sample = map(int, re.search(r"this memory's (\d+) top-trigger .*? and (\d+) more", note).groups())
    trig = pq.read_table(llama / "triggers.parquet").to_pandas()
    trig = trig[(trig.layer == layer) & (trig.dim == dim) & (trig["rank"] <= R.TOP_RANK)]
    top = list(dict.fromkeys(trig.sort_values(["sign", "rank"], ascending=[False, True]).sentence_id.tolist()))
    assert len(top) == n_top > 0
    sents = pq.read_table(llama / "sentences.parquet", columns=["sentence_id", "token_ids"]).to_pandas()
    ids = np.sort(sents.sentence_id.to_numpy())
    sample = np.sort(ids[np.random.default_rng(R.SEED).choice(len(ids), min(R.SAMPLE, len(ids)), replace=False)])
    searched = top + [int(s) for s in sample if int(s) not in top]
    assert len(searched) == n_top + n_sample
    toks = dict(zip(sents.sentence_id, sents.token_ids))
    seqs = [list(toks[s])[:R.MAX_TOKENS] for s in searched]
    brute = dict(zip(searched, _brute(tiny_dirs["llama"], layer, seqs)))

    # the shares over the searched tokens: the brute force's mass by regime, summing to 1
    mass = dict.fromkeys(CODES, 0.0)
    count = dict.fromkeys(CODES, 0)
    for g, u in brute.values():
        gd, ud = g[:, dim], u[:, dim]
        m = torch.nn.functional.silu(torch.tensor(gd)).numpy() * ud
        for gi, ui, mi in zip(gd, ud, m):
            if mi != 0:
                mass[_regime(gi, ui)] += abs(mi)
                count[_regime(gi, ui)] += 1
    rows = {r[0]: r for r in shares["rows"]}
    assert [r[0] for r in shares["rows"]] == list(CODES)
    assert sum(r[3] for r in shares["rows"]) == pytest.approx(1.0, abs=1e-9)
    total = sum(mass.values())
    for k in CODES:
        assert rows[k][2] == count[k]
        assert rows[k][3] == pytest.approx(mass[k] / total, rel=1e-4, abs=1e-6)

    # each shown example: its regime and its gate, input and m at every token shown, as hooked
    assert ex["rows"], "the tiny memory shows examples"
    cols = ex["columns"]
    shown: dict = {}
    for r in ex["rows"]:
        r = dict(zip(cols, r))
        g, u = brute[r["sentence_id"]]
        gi, ui = g[r["i"], dim], u[r["i"], dim]
        assert r["gate"] == pytest.approx(gi, rel=1e-4, abs=1e-5)
        assert r["input"] == pytest.approx(ui, rel=1e-4, abs=1e-5)
        assert r["m"] == pytest.approx(float(torch.nn.functional.silu(torch.tensor(gi))) * ui, rel=1e-4, abs=1e-5)
        if r["i"] == r["position"]:
            assert _regime(gi, ui) == r["regime"]
            shown.setdefault(r["regime"], []).append((abs(r["m"]), r["sentence_id"]))
    for k, xs in shown.items():  # strongest first, one per sentence, as many as the shares panel says
        assert [x[0] for x in xs] == sorted((x[0] for x in xs), reverse=True)
        assert len({x[1] for x in xs}) == len(xs) == rows[k][4]
        # none of the searched tokens in this regime beats the weakest shown by more than rounding
        best = sorted((max(abs(float(torch.nn.functional.silu(torch.tensor(g[i, dim]))) * u[i, dim])
                           for i in range(len(g)) if _regime(g[i, dim], u[i, dim]) == k
                           and g[i, dim] * u[i, dim] != 0) for sid, (g, u) in brute.items()
                       if any(_regime(g[i, dim], u[i, dim]) == k for i in range(len(g)))), reverse=True)
        assert [x[0] for x in xs] == pytest.approx(best[:len(xs)], rel=1e-4)


def test_the_later_panels_draw_tinted_examples(page):
    panels, _, later = page
    n = sum(1 for r in panels["Sign regimes: strongest examples"]["rows"] if r[5] == r[4])
    assert later.count('data-regime="') == n
    assert re.search(r'<mark class="tk m[pn][1-8]" data-i="\d+" data-m="[^"]+" title="m = [^"]+ · gate = ', later)
    assert "Searched: this memory" in later
    assert "this panel's template failed" not in later and "could not recompute" not in later
    # the census partial found the shares panel among the later ones: a heading per regime
    assert all(f'id="regime-{k}"' in later for k in CODES)


def test_the_page_waits_for_no_forward_and_links_to_the_later_panels(page, memory):
    """The memory page itself holds the census panel but not the regimes' (they need a forward):
    a placeholder links to the later panels, and only that page draws them, in the page's markup."""
    panels, html, later = page
    url = f"/memory/{memory[0]}/{memory[1]}/later-panels"
    assert 'data-step="census"' in html and "excess kurtosis" in html
    assert "Sign regimes" not in html and 'data-regime="' not in html and "Searched: this memory" not in html
    assert re.search(rf'<section class="step-panel later-panels" id="later-panels" data-later-src="{url}"', html)
    assert re.search(rf'<a href="{url}"[^>]*>Compute the sign-regime panels…</a>', html)
    body = later[later.index("<div data-later-panels>"):]
    sections = re.findall(r'<section class="step-panel" data-step="([^"]+)">\s*<h2>([^<]+) <span', body)
    assert sections == [("census", "Sign regimes over the searched tokens"),
                        ("census", "Sign regimes: strongest examples")]
    assert "excess kurtosis" not in later and "data-later-src" not in later
    # the JSON twin keeps every panel, the census's own first
    assert list(panels) == ["Census", "Sign regimes over the searched tokens", "Sign regimes: strongest examples"]


def test_later_panels_refuse_what_the_page_refuses(llama):
    c = _client(llama)
    for url in ("/memory/99/0", "/memory/0/999999", "/memory/0/x", "/memory/-1/0", "/memory/0/-1", "/memory/x/0",
                "/memory/1.5/0", "/memory/0/99999999999999999999999", "/memory/%20/0"):
        page, later = c.get(url), c.get(url + "/later-panels")
        assert page.status_code == later.status_code and page.status_code in (404, 422), url
        got = [re.search(r'<p class="detail">([^<]*)</p>', r.text) for r in (page, later)]
        assert got[0] and got[1] and got[0].group(1) == got[1].group(1), url
        assert got[0].group(1).strip() and "\n" not in got[0].group(1), url  # one line


def test_no_regime_panel_for_an_ungated_ffn(tmp_path_factory, reference_mine, tiny_dirs, tiny_models):
    run = _censused(tmp_path_factory, reference_mine, tiny_dirs["gpt2"], tiny_models["gpt2"], "regimes-gpt2")
    dim = int(pq.read_table(run / "triggers.parquet", columns=["dim"]).column("dim")[0].as_py())
    c = _client(run)
    titles = [p["title"] for p in c.get(f"/api/memory/0/{dim}").json()["panels"]]
    assert "Census" in titles and not any(t.startswith("Sign regimes") for t in titles)
    html = c.get(f"/memory/0/{dim}").text
    assert 'data-regime="' not in html and "data-later-src" not in html  # nothing to compute later
    later = c.get(f"/memory/0/{dim}/later-panels")
    assert later.status_code == 200 and 'data-regime="' not in later.text and 'class="step-panel" data-step' not in later.text


def test_a_memory_page_reads_its_census_row_once(llama, memory, tmp_path, monkeypatch, tiny_models):
    """Issue 48: `panels` and `later_label` (and the later panels) share one read of the memory's
    census row, read again once the census is run again (a new file), so the page is never stale.
    Reads are counted by a wrapper of the real `query.table`; the census panel is compared with
    one drawn from a direct pyarrow read of the table."""
    from ffkv.steps.census import CensusSettings
    from ffkv.steps.census.compute import compute_census
    from ffkv.steps.census.report import _census_panel
    from ffkv.store import query
    from ffkv.store.run import Run

    run = tmp_path / "run"
    shutil.copytree(llama, run)
    layer, dim = memory
    reads = []
    real = query.table

    def counted(r, name, *a, **k):
        if name == "census":
            reads.append(name)
        return real(r, name, *a, **k)

    monkeypatch.setattr(query, "table", counted)

    c = _client(run)

    def direct():  # the census panel's rows from this memory's row, read with pyarrow (the thresholds
        # named in the text are the server's manifest's: its Run reads the manifest once)
        rows = [r for r in pq.read_table(run / "census.parquet").to_pylist() if (r["layer"], r["dim"]) == memory]
        assert len(rows) == 1
        return rows[0], [list(x) for x in _census_panel(c.app.state.browser.run, rows[0]).rows]

    reads.clear()  # the browser's own copy of the whole table (its class filters), read at its start
    url = f"/memory/{layer}/{dim}"
    first = c.get(url)
    assert first.status_code == 200 and len(reads) == 1  # panels and later_label: one read
    assert 'data-step="census"' in first.text and "Compute the sign-regime panels…" in first.text
    def steps(html):  # the steps' panels and the later panels' placeholder
        return re.findall(r'<section class="step-panel.*?</section>', html, re.S)

    assert steps(first.text) and steps(c.get(url).text) == steps(first.text) and len(reads) == 1  # from the kept row
    assert c.get(url + "/later-panels").status_code == 200 and len(reads) == 1
    old, want = direct()
    got = {p["title"]: p for p in c.get(f"/api/memory/{layer}/{dim}").json()["panels"]}
    assert got["Census"]["rows"] == want and len(reads) == 1

    # the census run again with another threshold writes a new table: the page reads it again
    compute_census(Run(run), tiny_models["llama"], CensusSettings(eps=2 ** -3), show_progress=False, force=True)
    new, want = direct()
    assert (new["active"], new["dead"]) != (old["active"], old["dead"])
    got = {p["title"]: p for p in c.get(f"/api/memory/{layer}/{dim}").json()["panels"]}
    assert got["Census"]["rows"] == want and len(reads) == 2
    page = c.get(url).text
    assert len(reads) == 2 and f"active on {new['active']:,} of" in page
