"""One step, one unit: the example step in tests/plugins (a package of its own, registered by one
entry-point line, no ffkv file edited) appears in `ffkv --help`, runs as a generated command
with its settings checked before any model loads, joins `reproduce`'s plan after the steps it
requires and adds a `reproduce` option, adds a paper-style report section (its own paper entry,
verdict and figure), a panel on each memory page drawn by its own partial and an overview column.
Its table is checked against a brute-force count read straight from the Parquet files. This file
reads the step's name from its one registration line, so that nothing outside its folder names it."""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT, WT2, run_cli, browser_client

PLUGINS = Path(__file__).parent / "plugins"
ENV = {"PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
DIST = next(PLUGINS.glob("*.dist-info"))
REGISTRATION = [l for l in (DIST / "entry_points.txt").read_text().split("\n") if "=" in l]
NAME, TARGET = (x.strip() for x in REGISTRATION[0].split("="))  # the step's name, "module:STEP"
MODULE = TARGET.split(":")[0]
CMD = NAME.replace("_", "-")


@pytest.fixture()
def plugin_registry(monkeypatch):
    """The registry of this process, seeing the example package's entry point."""
    from ffkv.steps import registry

    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setattr(registry, "_plugins", None)
    yield registry
    registry._plugins = None
    registry._loaded.pop(NAME, None)


@pytest.fixture(scope="module")
def mined(tmp_path_factory, tiny_dirs) -> Path:
    run = tmp_path_factory.mktemp("plugin") / "run"
    r = run_cli("mine", "--out", run, "--model", tiny_dirs["llama"], "--corpus", WT2 / "wiki.valid.tokens",
                "--max-sentences", 120, "--top-k", 12, "--negative")
    assert r.returncode == 0, r.stderr[-2000:]
    return run


def brute_force(run: Path, top: int, sign: int) -> dict:
    trig = pq.read_table(run / "triggers.parquet").to_pylist()
    sents = {r["sentence_id"]: r["token_ids"] for r in pq.read_table(run / "sentences.parquet").to_pylist()}
    per: dict = {}
    for r in trig:
        if r["sign"] == sign and r["rank"] <= top:
            per.setdefault((r["layer"], r["dim"]), Counter())[sents[r["sentence_id"]][r["position"]]] += 1
    return {k: (sum(c.values()), len(c), min(c.items(), key=lambda kv: (-kv[1], kv[0]))) for k, c in per.items()}


def test_the_command_is_generated_from_the_settings():
    plain = run_cli("--help")
    assert plain.returncode == 0 and CMD not in plain.stdout
    r = run_cli("--help", env=ENV)
    assert r.returncode == 0 and CMD in r.stdout
    h = run_cli(CMD, "--help", env={**ENV, "COLUMNS": "200"})
    assert h.returncode == 0, h.stderr
    for opt in ("--top", "-t", "--sign", "--force", "--json", "--model", "Trigger ranks read per key."):
        assert opt in h.stdout, opt


@pytest.mark.parametrize("args, msg", [(["--top", "0"], "--top must be at least 1 (got 0)"),
                                       (["--sign", "2"], "--sign must be 1 or -1 (got 2)")])
def test_a_bad_setting_is_one_line_before_anything_opens(tmp_path, args, msg):
    r = run_cli(CMD, tmp_path / "no-such-run", *args, env=ENV)
    assert r.returncode == 2 and r.stderr.strip() == f"ffkv: error: {msg}", r.stderr
    assert not (tmp_path / "no-such-run").exists()


def test_it_runs_skips_and_matches_a_brute_force_count(mined):
    for sign in (1, -1):
        r = run_cli(CMD, mined, "-t", "7", "--sign", str(sign), "--json", env=ENV)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["status"] == "done"
        got = {(x["layer"], x["dim"]): (x["triggers"], x["distinct"], (x["top_token"], x["top_count"]))
               for x in pq.read_table(mined / f"{NAME}.parquet").to_pylist()}
        want = brute_force(mined, 7, sign)
        assert got == want and len(got) > 100
    again = run_cli(CMD, mined, "-t", "7", "--sign", "-1", env=ENV)
    assert again.returncode == 0 and "already done" in again.stderr
    man = json.loads((mined / "manifest.json").read_text())
    assert man["settings"][NAME] == {"top": 7, "sign": -1}


client = browser_client


def test_report_shows_its_paper_section_verdict_and_figure(mined, plugin_registry):
    """Its section is one of the paper's: its own entry's text beside the run's figure, placed by the
    entry among the paper's sections, and its verdict (from the shared statistics) in verdicts.json."""
    import importlib

    r = run_cli(CMD, mined, env=ENV)
    assert r.returncode == 0, r.stderr
    rep = run_cli("report", mined, env=ENV)
    assert rep.returncode == 0, rep.stderr
    html = (mined / "report" / "index.html").read_text()
    mod = importlib.import_module(f"{MODULE}.report")
    entry = mod.PAPER
    sec = html[html.index(f'<section id="{NAME}" class="figure-section"'):]
    sec = sec[:sec.index("</section>")]
    assert entry.title.replace("'", "&#x27;") in sec and entry.result.replace("'", "&#x27;") in sec
    assert f'href="figures/{NAME}.svg"' in sec and (mined / "report" / "figures" / f"{NAME}.png").exists()
    assert "relative depth" in sec  # the depth note its entry is read under (3 layers, not the paper's 16)
    recs = json.loads((mined / "report" / "verdicts.json").read_text())
    ids = [v["id"] for v in recs]
    assert ids.index("table1") < ids.index(NAME) < ids.index("fig3")  # place 2.5: after Fig 2's, before Fig 3
    got = recs[ids.index(NAME)]
    L = json.loads((mined / "manifest.json").read_text())["model"]["layers"]
    want = mod.verdict(pq.read_table(mined / f"{NAME}.parquet").to_pandas(), L)
    assert (got["title"], got["verdict"], got["criterion"], got["measured"]) == (entry.title, *want)
    assert got["figure"] == f"{NAME}.png"
    overview = html.split('<section id="overview">')[1].split("</section>")[0]
    assert f'href="#{NAME}"' in overview


def query_vocab(run: Path) -> list[str]:
    from ffkv.store import query
    from ffkv.store.run import Run

    return query.vocab_texts(Run(run))


def test_memory_page_and_overview_show_it(mined, plugin_registry):
    """Its panel is drawn by its own partial, its later panel too (on the page it links to), and its
    overview column reaches the page and the API."""
    r = run_cli(CMD, mined, env=ENV)
    assert r.returncode == 0, r.stderr
    c = client(mined)
    row = pq.read_table(mined / f"{NAME}.parquet").to_pylist()[5]
    api = c.get(f"/api/memory/{row['layer']}/{row['dim']}").json()
    panel = [p for p in api["panels"] if p["step"] == NAME][0]
    assert panel["rows"][0][:3] == [1, row["triggers"], row["distinct"]]
    page = c.get(f"/memory/{row['layer']}/{row['dim']}").text
    assert f'data-step="{NAME}"' in page and "Distinct trigger tokens" in page
    assert 'class="example-step-panel"' in page  # the step's own partial, not the default table
    assert f"{row['distinct']} distinct last tokens among {row['triggers']} prefixes" in page
    # its later panel (the other list's count, from the triggers when asked): in the JSON, a link on
    # the page, drawn by the same partial on the later-panels page; as a brute force counts it
    n, distinct, (tok, count) = brute_force(mined, 25, -1)[(row["layer"], row["dim"])]
    later = [p for p in api["panels"] if p["title"] == "Distinct trigger tokens of the other list"]
    assert later[0]["rows"] == [[-1, n, distinct, query_vocab(mined)[tok], count]]
    assert "of the other list" not in page and "Compute the other list&#39;s distinct tokens…</a>" in page
    lp = c.get(f"/memory/{row['layer']}/{row['dim']}/later-panels").text
    assert 'class="example-step-panel"' in lp and f"Most negative triggers: {distinct} distinct last tokens among {n}" in lp
    ov = c.get("/api/overview").json()
    col = [x for x in ov["step_columns"] if x["step"] == NAME]
    assert [x["title"] for x in col] == ["distinct last tokens"]
    t = pq.read_table(mined / f"{NAME}.parquet").to_pandas()
    want = t.groupby("layer")["distinct"].mean()
    got = {i: r["steps"][NAME]["distinct last tokens"] for i, r in enumerate(ov["rows"])}
    assert got == pytest.approx(want.to_dict())
    assert "distinct last tokens" in c.get("/").text


def test_every_steps_panels_reach_the_page_through_one_call(mined, plugin_registry):
    """The memory page's panels are `ffkv.web.panels.step_panels`' answer, built-in or plugin, in the
    registry's order: every registered step that declares panels and has run is there, and nothing
    else is."""
    from ffkv.steps.registry import BUILTIN, ordered
    from ffkv.store.run import Run
    from ffkv.web.panels import step_panels

    r = run_cli(CMD, mined, env=ENV)
    assert r.returncode == 0, r.stderr
    run = Run(mined)
    row = pq.read_table(mined / f"{NAME}.parquet").to_pylist()[3]
    api = client(mined).get(f"/api/memory/{row['layer']}/{row['dim']}").json()
    assert api["panels"] == step_panels(run, row["layer"], row["dim"])
    with_panels = [s.name for s in ordered() if (s.panels or s.later_panels) is not None and run.step_done(s.name)]
    assert NAME in with_panels and set(BUILTIN) | {NAME} >= set(with_panels)
    assert list(dict.fromkeys(p["step"] for p in api["panels"])) == with_panels
    # the page's (no forward) and the later ones (Step.later_panels) split that one answer
    now, later = (step_panels(run, row["layer"], row["dim"], w) for w in ("now", "later"))
    assert later and [p for p in api["panels"] if p not in later] == now
    assert [p for p in api["panels"] if p in later] == later


def test_reproduce_plans_it_after_the_steps_it_requires_with_its_option(tiny_models, plugin_registry):
    from ffkv.reproduce import ReproduceSettings, options, plan_steps, preset

    plan = [name for name, _ in plan_steps(ReproduceSettings(), tiny_models["llama"])]
    assert plan == ["mine", "values", "compose", "mutate", "patterns", "normalize", "census", NAME]
    own = [o for o in options() if o.dest == "distinct_top"]
    assert [o.decls for o in own] == [("--distinct-top",)] and own[0].default == 25
    mine = dict(plan_steps(preset("full", distinct_top=3), tiny_models["llama"]))
    assert mine[NAME].top == 3 and mine["compose"].n_prefixes == 4000
    h = run_cli("reproduce", "--help", env={**ENV, "COLUMNS": "200"})
    assert h.returncode == 0 and "--distinct-top" in h.stdout and "Trigger ranks the example step reads" in h.stdout
    assert "--distinct-top" not in run_cli("reproduce", "--help", env={"COLUMNS": "200"}).stdout
    bad = run_cli("reproduce", "r", "--model", "x", "--distinct-top", "0", env=ENV)
    assert bad.returncode == 2 and bad.stderr.strip() == "ffkv: error: --distinct-top must be at least 1 (got 0)"


def test_the_registry_refuses_circles_clashes_and_unknown_requirements(plugin_registry):
    from ffkv.errors import FfkvError
    from ffkv.steps import Step, register

    reg = plugin_registry
    a = Step("t_a", dict, requires=("t_b",), tables=(), compute=lambda ctx: {})
    b = Step("t_b", dict, requires=("t_a",), tables=(), compute=lambda ctx: {})
    try:
        register(a)
        register(b)
        with pytest.raises(FfkvError, match="circle: t_a -> t_b -> t_a"):
            reg.ordered(["t_a", "t_b"])
        with pytest.raises(FfkvError, match="already registered"):
            register(Step("t_a", dict, requires=(), tables=(), compute=lambda ctx: {}))
        with pytest.raises(FfkvError, match="built-in step"):
            register(Step("values", dict, requires=(), tables=(), compute=lambda ctx: {}))
        c = register(Step("t_c", dict, requires=("nope",), tables=(), compute=lambda ctx: {}))
        with pytest.raises(FfkvError, match="requires 'nope'"):
            reg.ordered([c.name])
    finally:
        for n in ("t_a", "t_b", "t_c"):
            reg._registered.pop(n, None)


def test_adding_a_step_is_the_short_list_in_developing():
    """DEVELOPING's list is what the example did: one package, one registration line."""
    text = (ROOT / "DEVELOPING.md").read_text()
    section = text.split("### How to add a step", 1)[1].split("\n#", 1)[0]
    items = re.findall(r"^\d+\. ", section, flags=re.M)
    assert 1 <= len(items) <= 4
    assert "ffkv.steps" in section and "entry point" in section


def test_the_step_is_named_only_in_its_folder_and_its_registration_line():
    """The example's name (either spelling) appears in no file of the repository outside its own
    folder and the one line that registers it: no file of ffkv, no other test, no template knows
    it. (The docs may point at its folder by path.)"""
    import subprocess

    assert len(REGISTRATION) == 1 and TARGET == f"{MODULE}:STEP"
    folder = PLUGINS / MODULE
    assert folder.is_dir() and (folder / "__init__.py").is_file()
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    pattern = re.compile(re.escape(NAME).replace("_", "[_-]"), re.I)
    named = []
    for f in files:
        p = ROOT / f
        if folder in p.parents or DIST in p.parents or p.suffix == ".md" or not p.is_file():
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if pattern.search(text) or pattern.search(f):
            named.append(f)
    assert named == []
    named_in_dist = [f.name for f in DIST.iterdir() if pattern.search(f.read_text())]
    assert named_in_dist == ["entry_points.txt", "METADATA"] or sorted(named_in_dist) == ["METADATA", "entry_points.txt"]


def test_each_builtin_step_may_register_itself_again():
    """A built-in's STEP names its computation in a module beneath its package (`lazy`), and
    `register()` of that very step is accepted: only another step taking its name is refused."""
    from ffkv.steps import registry
    for name in registry.BUILTIN:
        step = registry.get(name)
        assert registry.register(step) is step
        registry._registered.pop(name, None)
