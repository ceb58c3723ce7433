"""`ffkv report RUN` on a small real run (tiny Llama, every step), and in headless Debian chromium.

The run is built once per session through the real CLI (in-process, to pay the torch import once).
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from conftest import WT2, run_cli

from conftest import CHROMIUM
FIGURES = ["fig2", "fig3", "fig4", "fig5", "fig6", "fig7", "fig8", "fig9", "fig10", "fig11"]
SECTIONS = ["fig2", "fig2_human", "table1", "fig3", "fig4", "fig5", "fig6", "table2", "fig7", "fig8", "fig9",
            "fig10", "fig11", "cases"]
STEP_TIMES: dict[str, float] = {}


def cli(*args) -> str:
    from typer.testing import CliRunner

    from ffkv.cli import app

    t = time.time()
    res = CliRunner().invoke(app, [str(a) for a in args])
    STEP_TIMES[str(args[0])] = round(time.time() - t, 1)
    assert res.exit_code == 0, f"ffkv {args[0]} failed: {res.exception!r}\n{res.output[-2000:]}"
    return res.output


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_dirs) -> Path:
    """Every step on the tiny Llama (3 layers × 80 memories, gated SiLU), small settings."""
    d = tmp_path_factory.mktemp("report") / "run"
    m = tiny_dirs["llama"]
    cli("mine", "--out", d, "--model", m, "--corpus", WT2 / "wiki.valid.tokens", "--max-sentences", 200,
        "--top-k", 25)
    cli("values", d, "--model", m, "--permutations", 20)
    cli("compose", d, "--model", m, "--prefixes", 100, "--corpus", WT2 / "wiki.test.tokens",
        "--max-sentences", 400)
    cli("mutate", d, "--keys-per-layer", 2, "--examples", 10)
    cli("patterns", d, "--semantic-keys-per-layer", 2, "--background", 50)
    return d


@pytest.fixture(scope="session")
def report(tiny_run) -> Path:
    r = run_cli("report", tiny_run)
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr, r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path == tiny_run / "report" / "index.html"
    return path


def verdicts_in(page: str) -> dict[str, str]:
    """section id -> the verdict printed under it."""
    out = {}
    for m in re.finditer(r'<section id="([a-z0-9_]+)" class="figure-section".*?data-verdict="([^"]+)"', page, re.S):
        out[m.group(1)] = m.group(2)
    return out


# ---- the HTML file ------------------------------------------------------------------------------------
def test_report_has_every_section_figure_and_verdict(report, tiny_run):
    page = report.read_text()
    v = verdicts_in(page)
    assert list(v) == SECTIONS
    assert set(v.values()) <= {"same trend", "differs", "inconclusive", "not comparable"}
    assert v["fig2_human"] == "not comparable"  # no annotations in this run
    # gated SiLU: m > 0 is ~50% by symmetry, so Fig 7 is judged by the scale-free n90
    assert v["fig7"] != "not comparable" and "n90" in page[page.index('id="fig7"'):page.index('id="fig8"')]
    figs = report.parent / "figures"
    for f in FIGURES:
        for ext in ("png", "svg"):
            p = figs / f"{f}.{ext}"
            assert p.stat().st_size > 1000, p
        assert f'href="figures/{f}.svg"' in page
    assert (figs / "fig2.svg").read_text().lstrip().startswith("<?xml")
    # the paper's figures, then the key-statistics section's two (density, histograms)
    assert page.count('<img src="data:image/png;base64,') == len(FIGURES) + 2
    assert 'id="keystats"' in page and (figs / "keystats_density.svg").exists()
    assert 'class="error"' not in page and "class=error" not in page
    assert len(page.encode()) < 5_000_000
    # self-contained: nothing external is linked or loaded
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<script" not in page and "<link" not in page and "@import" not in page and "url(" not in page


def test_report_verdicts_are_those_of_the_run_tables(report, tiny_run):
    """The verdicts printed are the verdict functions applied to the run's own tables."""
    from ffkv.steps.compose import verdicts as compose
    from ffkv.steps.mutate import verdicts as mutate
    from ffkv.steps.patterns import verdicts as patterns
    from ffkv.steps.values import verdicts as values

    t = {n: pq.read_table(tiny_run / f"{n}.parquet").to_pandas()
         for n in ("patterns_fig2", "mutations_layers", "values_layers", "values_fig6", "values_table2",
                   "compose_layers")}
    man = json.loads((tiny_run / "manifest.json").read_text())
    L = man["model"]["layers"]
    expect = {
        "fig2": patterns.fig2(t["patterns_fig2"], L), "fig3": mutate.fig3(t["mutations_layers"], L),
        "fig4": values.fig4(t["values_layers"], L), "fig5": values.fig5(t["values_layers"], L),
        "fig6": values.fig6(t["values_fig6"]), "table2": values.table2(t["values_table2"], L),
        "fig8": compose.fig8(t["compose_layers"], gated=True, lens="norm"),
        "fig9": compose.fig9(t["compose_layers"], L, lens="norm"), "fig10": compose.fig10(t["compose_layers"], L, lens="norm"),
        "fig11": compose.fig11(t["compose_layers"], lens="norm"),
    }
    page = report.read_text()
    got = verdicts_in(page)
    vj = {r["id"]: r for r in json.loads((report.parent / "verdicts.json").read_text())}
    assert list(vj) == SECTIONS
    assert {k: r["verdict"] for k, r in vj.items()} == got
    for sid, v in expect.items():
        assert (vj[sid]["verdict"], vj[sid]["criterion"], vj[sid]["measured"]) == tuple(v), sid
        assert got[sid] == v.verdict, sid
        assert v.measured.split(";")[0].replace("&", "&amp;").replace(">", "&gt;") in page, sid
    # numbers from the tables: Table 2's first value, the last-layer cases, the step timings
    t2 = t["values_table2"].sort_values("position").iloc[0]
    assert f"{t2['max_prob']:.3g}" in page
    for step in ("mine", "values", "compose", "mutate", "patterns"):
        secs = man["steps"][step]["seconds"]
        assert f"<td>{step}</td><td>done</td><td class=\"num\">{secs:.3g}</td>" in page
    cases = pq.read_table(tiny_run / "compose_cases.parquet").to_pandas()
    n_cases = int((cases["lens"] == "norm").sum())
    assert f"{n_cases} last-layer cases" in page


def test_verdicts_json_has_each_lens_verdict(report, tiny_run):
    """`lenses` in verdicts.json is the verdict function under each lens the tables hold, and
    `ffkv verdicts` reads it back; a run compared with itself changes nothing."""
    from ffkv.steps.compose import verdicts as compose
    from ffkv.steps.values import verdicts as values

    L = json.loads((tiny_run / "manifest.json").read_text())["model"]["layers"]
    vl = pq.read_table(tiny_run / "values_lenses.parquet").to_pandas()
    cl = pq.read_table(tiny_run / "compose_layers.parquet").to_pandas()
    vj = {r["id"]: r for r in json.loads((report.parent / "verdicts.json").read_text())}
    for ln in ("norm", "naive"):
        assert vj["fig4"]["lenses"][ln] == values.fig4(vl, L, lens=ln).verdict
        assert vj["fig5"]["lenses"][ln] == values.fig5(vl, L, lens=ln).verdict
        assert vj["fig9"]["lenses"][ln] == compose.fig9(cl, L, lens=ln).verdict
        assert vj["fig11"]["lenses"][ln] == compose.fig11(cl, lens=ln).verdict
    assert vj["fig4"]["lenses"]["norm"] == vj["fig4"]["verdict"] and vj["fig3"]["lenses"] is None
    overview = report.read_text().split('<section id="overview">')[1].split("</section>")[0]
    assert "<th>verdict (norm lens)</th><th>naive lens (the paper&#x27;s)</th>" in overview
    row = overview.split('href="#fig9"')[1].split("</tr>")[0]
    assert row.count('class="chip') == 2 and f'>{vj["fig9"]["lenses"]["naive"]}</span>' in row.split("</td>")[2]
    r = run_cli("verdicts", tiny_run, tiny_run, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [v["id"] for v in out["verdicts"]] == list(vj) and not any(v["changed"] for v in out["verdicts"])
    assert out["verdicts"][list(vj).index("fig9")]["runs"][0]["lenses"] == vj["fig9"]["lenses"]


def test_report_model_differences(report):
    page = report.read_text()
    i = page.index('id="model"')
    sec = page[i:page.index("</section>", i)]
    assert "gated silu" in sec and "<td>3</td>" in sec and "<td>16</td>" in sec
    assert "relative depth" in sec
    # and the Fig 7 section says why it is not comparable
    j = page.index('id="fig7"')
    assert "symmetric" in page[j:page.index("</section>", j)]


def test_decoder_matches_the_tokenizer(tiny_run, tok_dir):
    from transformers import AutoTokenizer

    from ffkv.store.decode import Decoder

    tok = AutoTokenizer.from_pretrained(tok_dir)
    dec = Decoder.of_frame(pq.read_table(tiny_run / "vocab.parquet").to_pandas())
    assert dec.mode == "bytelevel"
    sents = pq.read_table(tiny_run / "sentences.parquet").to_pandas().head(50)
    for ids in sents["token_ids"]:
        ids = list(ids)
        assert dec.decode(ids) == tok.decode(ids)
        head, last = dec.marked(ids, len(ids) // 2)
        assert head + last == tok.decode(ids[: len(ids) // 2 + 1])


def test_decoder_keeps_multibyte_characters_whole(tok_dir):
    """Hebrew and emoji split over byte-level tokens: every decoded prefix equals the original
    text's prefix (tokens one at a time give "��לו��"), and the pieces join to the decoding."""
    from transformers import AutoTokenizer

    from ffkv.steps.mine.compute import vocab_table
    from ffkv.store.decode import Decoder

    tok = AutoTokenizer.from_pretrained(tok_dir)
    dec = Decoder.of_frame(vocab_table(tok, len(tok)).to_pandas())
    text = "Shalom שלום עולם, and a cat 🐈 named Ω — naïve café 日本"
    ids = tok(text)["input_ids"]
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)  # the bug: one token at a time breaks it
    assert dec.decode(ids) == text
    pieces = dec.pieces(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    for k in range(1, len(ids) + 1):
        head, last = dec.marked(ids, k - 1)
        full = tok.decode(ids[:k])
        assert head + last == full == dec.decode(ids[:k])
        if "\ufffd" not in full:
            assert text.startswith(full)


def test_show_decodes_prefixes_with_the_run_decoder(tiny_run, tok_dir):
    """`ffkv show` (query.key_triggers) decodes whole prefixes, not token by token."""
    from transformers import AutoTokenizer

    from ffkv.store import query
    from ffkv.store.run import Run

    tok = AutoTokenizer.from_pretrained(tok_dir)
    run = Run(tiny_run)
    sents = pq.read_table(tiny_run / "sentences.parquet").to_pandas().set_index("sentence_id")
    for r in query.key_triggers(run, 1, 3, top=5):
        ids = list(sents.loc[r["sentence_id"], "token_ids"])[: r["position"] + 1]
        assert r["prefix"] == tok.decode(ids) == "".join(r["prefix_tokens"])
        assert len(r["prefix_tokens"]) == len(ids) and r["trigger_token"] == r["prefix_tokens"][-1]


def test_report_escapes_control_characters():
    from ffkv.report.html import esc, tok

    assert esc("a\x00b\u202ec<") == "a\\x00b\\u202ec&lt;"
    assert "\u202e" not in tok("\u202eevil") and "\x00" not in tok("\x00")


# ---- partial runs, annotations, errors ----------------------------------------------------------------
def copy_run(src: Path, dst: Path, tables: list[str], steps: list[str]) -> Path:
    dst.mkdir(parents=True)
    for t in tables:
        shutil.copy(src / f"{t}.parquet", dst / f"{t}.parquet")
    man = json.loads((src / "manifest.json").read_text())
    man["steps"] = {k: v for k, v in man["steps"].items() if k in steps}
    # the records of the tables left out go too, as in a run that never wrote them (a damaged
    # run keeps them, and the report refuses it)
    man["tables"] = {k: v for k, v in (man.get("tables") or {}).items() if k in tables}
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def test_report_of_a_run_with_only_mine(tiny_run, tmp_path):
    from ffkv.report.build import build

    run = copy_run(tiny_run, tmp_path / "run", ["sentences", "triggers", "vocab"], ["mine"])
    out, problems = build(run, tmp_path / "out.html")
    assert out == tmp_path / "out.html" and problems == []
    page = out.read_text()
    v = verdicts_in(page)
    assert list(v) == SECTIONS and set(v.values()) == {"not comparable"}
    assert f"<code>ffkv values {run}</code>" in page
    assert f"<code>ffkv compose {run}</code>" in page
    assert f"<code>ffkv mutate {run}</code>" in page
    assert f"<code>ffkv patterns {run}</code>" in page
    assert "<img" not in page


def test_report_wires_the_normalize_section(tiny_run, tmp_path):
    """A run whose normalize step is done gets the section and five records in verdicts.json
    (here without its tables: each claim says which command makes them)."""
    from ffkv.report.build import build

    run = copy_run(tiny_run, tmp_path / "run", ["sentences", "triggers", "vocab"], ["mine"])
    man = json.loads((run / "manifest.json").read_text())
    man["steps"]["normalize"] = {"status": "done", "seconds": 1.0}
    (run / "manifest.json").write_text(json.dumps(man))
    out, problems = build(run, tmp_path / "out.html")
    page = out.read_text()
    assert problems == [] and 'id="normalize"' in page and "ffkv normalize" in page
    recs = json.loads((tmp_path / "verdicts.json").read_text())
    assert [r["id"] for r in recs][-5:] == ["norm_c1", "norm_c2", "norm_c3", "norm_c4", "norm_c5"]
    assert [r["id"] for r in recs][:len(SECTIONS)] == SECTIONS


def test_figures_are_written_atomically(tmp_path, monkeypatch):
    """A save that dies half-way leaves the previous figure whole and no temp file."""
    from ffkv.report import figures as F

    fig, ax = F.new_figure()
    ax.plot([0, 1], [0, 1])
    F.save(fig, tmp_path, "f")
    before = (tmp_path / "f.svg").read_bytes()

    def broken(buf, format=None, **kw):
        buf.write(b"<?xml trunc")
        raise KeyboardInterrupt

    monkeypatch.setattr(fig, "savefig", broken)
    with pytest.raises(KeyboardInterrupt):
        F.save(fig, tmp_path, "f")
    assert (tmp_path / "f.svg").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.png", "f.svg"]


def annotate(run: Path, kinds: dict[int, str]) -> None:
    from ffkv.store.annotations import AnnotationStore

    st = AnnotationStore(run)
    for layer, kind in kinds.items():
        for dim in (1, 2):
            st.add_annotation("ann", layer, dim, [{"description": f"{kind} thing", "kind": kind,
                                                   "prefixes": list(range(0, 20))}])


def test_report_fig2_from_human_annotations(tiny_run, tmp_path):
    """Shallow labels in layer 0 and semantic ones in layer 2 are the paper's trend; the reverse differs."""
    from ffkv.report.build import Builder, build
    from ffkv.steps.patterns.report import fig2_human
    from ffkv.store.run import Run

    runs = {}
    for trend, kinds in (("paper", {0: "shallow", 2: "semantic"}), ("reversed", {0: "semantic", 2: "shallow"})):
        runs[trend] = tmp_path / trend
        shutil.copytree(tiny_run, runs[trend], ignore=shutil.ignore_patterns("report", "annotations.sqlite*"))
        annotate(runs[trend], kinds)
    out, problems = build(runs["paper"])
    assert problems == []
    page = out.read_text()
    assert verdicts_in(page)["fig2_human"] == "same trend"
    assert (out.parent / "figures" / "fig2_human.png").exists()
    assert "prefixes covered" in page
    sec = fig2_human(Builder(Run(runs["reversed"]), tmp_path / "figs"))
    assert sec.verdict.verdict == "differs"


def test_every_builtin_step_declares_its_report_sections():
    """The report's sections are the steps' own (steps/<name>/report.py), loaded only when a report
    is built: asking the registry for the steps imports neither pandas nor matplotlib."""
    import subprocess
    import sys

    code = ("import sys, ffkv; from ffkv.steps import registry as r; "
            "print([n for n in r.BUILTIN if r.get(n).sections is None], "
            "[m for m in ('pandas', 'matplotlib', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []"


def test_report_cli_errors(tmp_path):
    r = run_cli("report", tmp_path / "nope")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "does not exist" in r.stderr and "ffkv mine" in r.stderr
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "manifest.json").write_text(json.dumps({"steps": {"mine": {"status": "running"}}}))
    r = run_cli("report", tmp_path / "half")
    assert r.returncode == 2 and "no finished `mine` step" in r.stderr
    assert "Traceback" not in r.stderr


def test_report_cli_out_folder(tiny_run, tmp_path):
    out = cli("report", tiny_run, "--out", tmp_path / "site")
    assert out.strip() == str(tmp_path / "site" / "index.html")
    assert (tmp_path / "site" / "verdicts.json").exists()
    assert (tmp_path / "site" / "figures" / "fig4.svg").exists()


# ---- the browser -----------------------------------------------------------------------------------------
@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed (/usr/bin/chromium); "
                                                  "`apt-get install -y chromium`")
def test_report_in_headless_chromium(report, tmp_path):
    from playwright.sync_api import sync_playwright

    from ffkv.report.screenshot import BROWSER_ARGS

    requests, failed = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("request", lambda r: requests.append(r.url))
            page.on("requestfailed", lambda r: failed.append(r.url))
            page.goto(report.resolve().as_uri(), wait_until="load")
            imgs = page.eval_on_selector_all(
                "img", "els => els.map(e => ({w: e.naturalWidth, h: e.naturalHeight, done: e.complete, "
                       "section: e.closest('section').id}))")
            svgs = page.eval_on_selector_all(
                "svg", "els => els.map(e => { const r = e.getBoundingClientRect(); return r.width * r.height; })")
            sections = page.eval_on_selector_all(
                "section.figure-section", "els => els.map(e => ({id: e.id, verdicts: "
                "Array.from(e.querySelectorAll('p.verdict')).map(v => v.innerText)}))")
            page.screenshot(path=str(tmp_path / "report.png"))
        finally:
            browser.close()
    assert requests and all(u.startswith(("file:", "data:")) for u in requests), requests
    assert not failed, failed
    assert sorted(i["section"] for i in imgs) == sorted(FIGURES + ["keystats", "keystats"])
    assert all(i["done"] and i["w"] > 0 and i["h"] > 0 for i in imgs), imgs
    assert all(a > 0 for a in svgs)
    assert [s["id"] for s in sections] == SECTIONS + ["keystats"]  # beyond the paper: no verdict
    for s in sections[:len(SECTIONS)]:
        assert len(s["verdicts"]) == 1, s
        assert re.match(r"Verdict: (same trend|differs|inconclusive|not comparable)\.", s["verdicts"][0]), s
        assert "Criterion:" in s["verdicts"][0] and "Measured:" in s["verdicts"][0]
    assert (tmp_path / "report.png").stat().st_size > 10_000
