"""What a step adds to the browser comes through the registry, built-in or not: a step registered
here (its partial in its own package, nothing of ffkv edited) draws its memory-page panel with that
partial and adds an overview column to the page, /api/overview and the layer table's CSV; a step
whose column or partial fails shows why, and a run with no such step answers as before."""
from __future__ import annotations

import csv
import io
import shutil
from dataclasses import dataclass

import pytest

from conftest import browser_client

PKG = "ffkv_web_probe_pkg"


@dataclass(frozen=True)
class ProbeSettings:
    pass


@pytest.fixture(scope="module")
def run(reference_mine, tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("webstep") / "run"
    shutil.copytree(reference_mine(tiny_dirs["llama"], 60, 8), out)
    return out


@pytest.fixture()
def steps(tmp_path, monkeypatch):
    from ffkv.steps import Panel, Step, register, registry

    pkg = tmp_path / PKG
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "panel.html").write_text('<p class="probe">{{ p.title }}: {{ p.rows[0][1] }} of layer {{ m.layer }}</p>\n')
    (pkg / "broken.html").write_text("{{ p.no_such_key.deeper }}\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def col(run):
        return {"probe <b>": {0: 1.5, 1: float("nan")}}

    def bad(run):
        raise RuntimeError("column broke")

    def panels(run, layer, dim):
        return [Panel("Probe <i>", ("layer", "dim"), ((layer, "<dim>"),), note="from the probe")]

    made = [Step("web_probe", ProbeSettings, requires=("mine",), tables=(), compute=lambda ctx: {},
                 panels=panels, panel_template=f"{PKG}:panel.html", overview=col),
            Step("web_broken", ProbeSettings, requires=("mine",), tables=(), compute=lambda ctx: {},
                 panels=panels, panel_template=f"{PKG}:broken.html", overview=bad)]
    for s in made:
        register(s)
    yield made
    for s in made:
        registry._registered.pop(s.name, None)


client = browser_client


def test_a_run_without_such_steps_answers_as_before(run):
    ov = client(run).get("/api/overview").json()
    assert "step_columns" not in ov and all("steps" not in r for r in ov["rows"])
    head = client(run).get("/?format=csv").text.splitlines()[0]
    assert head.endswith("patterns_per_key,annotated")


def test_a_steps_partial_and_column_reach_the_browser(run, steps):
    from ffkv.steps import execute
    from ffkv.store.run import Run

    for s in steps:
        execute(Run(run), s.name, ProbeSettings(), log=lambda m: None)
    c = client(run)
    ov = c.get("/api/overview").json()
    assert [(x["step"], x["title"]) for x in ov["step_columns"]] == [("web_probe", "probe <b>"),
                                                                      ("web_broken", "web_broken")]
    assert "column broke" in ov["step_columns"][1]["error"]
    assert ov["rows"][0]["steps"]["web_probe"]["probe <b>"] == 1.5
    assert ov["rows"][1]["steps"]["web_probe"]["probe <b>"] is None  # NaN: no number
    page = c.get("/").text
    assert 'data-step="web_probe">probe &lt;b&gt;' in page and ">1.5<" in page and "column broke" in page
    rows = list(csv.DictReader(io.StringIO(c.get("/?format=csv").text)))
    assert rows[0]["web_probe.probe <b>"] == "1.5" and "web_broken.web_broken" in rows[0]

    api = c.get("/api/memory/1/0").json()
    assert [p["step"] for p in api["panels"]] == ["web_probe", "web_broken"]
    assert set(api["panels"][0]) == {"step", "title", "columns", "rows", "note"}
    html = c.get("/memory/1/0").text
    assert '<p class="probe">Probe &lt;i&gt;: &lt;dim&gt; of layer 1</p>' in html  # the step's own partial, escaped
    assert "this panel&#39;s template failed: UndefinedError" in html  # the broken partial: the page still stands
