"""One step, one unit: the example step in tests/plugins (a package of its own, registered by one
entry-point line, no ffkv file edited) appears in `ffkv --help`, runs as a generated command
with its settings checked before any model loads, joins `reproduce`'s plan after the steps it
requires, adds a report section and a panel on each memory page. Its table is checked against a
brute-force count read straight from the Parquet files."""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT, WT2, run_cli

PLUGINS = Path(__file__).parent / "plugins"
ENV = {"PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture()
def plugin_registry(monkeypatch):
    """The registry of this process, seeing the example package's entry point."""
    from ffkv.steps import registry

    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setattr(registry, "_plugins", None)
    yield registry
    registry._plugins = None
    registry._loaded.pop("distinct_tokens", None)


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
    assert plain.returncode == 0 and "distinct-tokens" not in plain.stdout
    r = run_cli("--help", env=ENV)
    assert r.returncode == 0 and "distinct-tokens" in r.stdout
    h = run_cli("distinct-tokens", "--help", env={**ENV, "COLUMNS": "200"})
    assert h.returncode == 0, h.stderr
    for opt in ("--top", "-t", "--sign", "--force", "--json", "--model", "Trigger ranks read per key."):
        assert opt in h.stdout, opt


@pytest.mark.parametrize("args, msg", [(["--top", "0"], "--top must be at least 1 (got 0)"),
                                       (["--sign", "2"], "--sign must be 1 or -1 (got 2)")])
def test_a_bad_setting_is_one_line_before_anything_opens(tmp_path, args, msg):
    r = run_cli("distinct-tokens", tmp_path / "no-such-run", *args, env=ENV)
    assert r.returncode == 2 and r.stderr.strip() == f"ffkv: error: {msg}", r.stderr
    assert not (tmp_path / "no-such-run").exists()


def test_it_runs_skips_and_matches_a_brute_force_count(mined):
    for sign in (1, -1):
        r = run_cli("distinct-tokens", mined, "-t", "7", "--sign", str(sign), "--json", env=ENV)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["status"] == "done"
        got = {(x["layer"], x["dim"]): (x["triggers"], x["distinct"], (x["top_token"], x["top_count"]))
               for x in pq.read_table(mined / "distinct_tokens.parquet").to_pylist()}
        want = brute_force(mined, 7, sign)
        assert got == want and len(got) > 100
    again = run_cli("distinct-tokens", mined, "-t", "7", "--sign", "-1", env=ENV)
    assert again.returncode == 0 and "already done" in again.stderr
    man = json.loads((mined / "manifest.json").read_text())
    assert man["settings"]["distinct_tokens"] == {"top": 7, "sign": -1}


def test_report_and_memory_page_show_it(mined, plugin_registry):
    r = run_cli("distinct-tokens", mined, env=ENV)
    assert r.returncode == 0, r.stderr
    rep = run_cli("report", mined, env=ENV)
    assert rep.returncode == 0, rep.stderr
    html = (mined / "report" / "index.html").read_text()
    assert 'id="distinct_tokens"' in html and "Distinct trigger tokens per key" in html
    vs = {v["id"]: v for v in json.loads((mined / "report" / "verdicts.json").read_text())}
    mean = pq.read_table(mined / "distinct_tokens.parquet").column("distinct").to_numpy().mean()
    assert vs["distinct_tokens"]["measured"] == f"{mean:.2f} on average"

    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    c = TestClient(create_app(mined, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")
    row = pq.read_table(mined / "distinct_tokens.parquet").to_pylist()[5]
    api = c.get(f"/api/memory/{row['layer']}/{row['dim']}").json()
    panel = [p for p in api["panels"] if p["step"] == "distinct_tokens"][0]
    assert panel["rows"][0][:3] == [1, row["triggers"], row["distinct"]]
    page = c.get(f"/memory/{row['layer']}/{row['dim']}").text
    assert 'data-step="distinct_tokens"' in page and "Distinct trigger tokens" in page


def test_reproduce_plans_it_after_the_steps_it_requires(tiny_models, plugin_registry):
    from ffkv.reproduce import ReproduceSettings, plan_steps

    plan = [name for name, _ in plan_steps(ReproduceSettings(), tiny_models["llama"])]
    assert plan == ["mine", "values", "compose", "mutate", "patterns", "normalize", "distinct_tokens"]


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
    """DEVELOPING's list is what the example did: one package, one registration line, and no
    file of ffkv names the step."""
    text = (ROOT / "DEVELOPING.md").read_text()
    section = text.split("### How to add a step", 1)[1].split("\n#", 1)[0]
    items = re.findall(r"^\d+\. ", section, flags=re.M)
    assert 1 <= len(items) <= 4
    eps = (PLUGINS / "ffkv_distinct_tokens-0.1.dist-info" / "entry_points.txt").read_text().split("\n")
    assert [l for l in eps if "=" in l] == ["distinct_tokens = ffkv_distinct_tokens:STEP"]
    assert "ffkv.steps" in section and "entry point" in section
    named = [p for p in (ROOT / "src").rglob("*.*") if p.suffix in (".py", ".html", ".js", ".css", ".toml")
             and re.search(r"distinct[_-]tokens", p.read_text(errors="ignore"))]
    assert named == []
