"""A run's folder is its manifest's (issue 49, item 1, and the hint of item 2).

A file with a table's name that the manifest does not vouch for (another run's, copied in; or
written by a step that a kill left "running") is named in one line and never drawn: the report
skips its sections, saying why, and `ffkv repair` does not record a step done from another run's
tables or from tables of two passes. Real tiny runs, no mocks: one run mined per module, the
foreign one with more sentences, each test on a copy.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import WT2, run_cli

VALID = WT2 / "wiki.valid.tokens"
COMPOSE = ["--corpus", VALID, "--prefixes", "5"]
VALUES_SECTIONS = ("fig4", "fig5", "fig6", "table2")
COMPOSE_SECTIONS = ("fig7", "fig8", "fig9", "fig10", "fig11")


def _mine(out: Path, model: Path, sentences: int) -> Path:
    res = run_cli("mine", "--out", out, "--model", model, "--corpus", VALID, "--max-sentences", str(sentences),
                  "--top-k", "3")
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="module")
def runs(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """`mined`: this run, mine only; `own`: the same run with values and compose done; `other`:
    another run of the same model (30 sentences, not 20) with values and compose done; own and
    other with their reports (whose measured numbers must not show up where their tables are not drawn)."""
    root = tmp_path_factory.mktemp("trust")
    mined = _mine(root / "mined", tiny_dirs["gpt2"], 20)
    own = copy(mined, root / "own")
    other = _mine(root / "other", tiny_dirs["gpt2"], 30)
    for run in (own, other):
        assert run_cli("values", run).returncode == 0
        assert run_cli("compose", run, *COMPOSE).returncode == 0
    for run in (own, other):
        assert run_cli("report", run).returncode == 0
    return {"mined": mined, "own": own, "other": other}


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock-*", "report"))
    return dst


def bring(src: Path, dst: Path, *patterns: str) -> list[str]:
    """Copy the tables matching `patterns` from run `src` into run `dst` (replacing its own)."""
    names = []
    for pat in patterns:
        for p in sorted(src.glob(pat)):
            shutil.copy2(p, dst / p.name)
            names.append(p.stem)
    assert names
    return names


def verdicts(run: Path) -> dict[str, dict]:
    return {r["id"]: r for r in json.loads((run / "report" / "verdicts.json").read_text())}


def measured(run: Path, ids) -> list[str]:
    got = [verdicts(run)[i]["measured"] for i in ids]
    assert all(got), got  # the other run's sections were drawn, with numbers
    return got


def report_skipping(run: Path, needle: str) -> tuple[str, list[str]]:
    """`ffkv report RUN`: exit 0, the ignored tables named in one line each reason; (html, lines)."""
    res = run_cli("report", run)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    said = [l for l in res.stderr.splitlines() if l.startswith("report: ignored")]
    assert said and all(needle in l for l in said), res.stderr
    return (run / "report" / "index.html").read_text(), said


# ---- the report draws only what the manifest vouches for ------------------------------------------------
@pytest.mark.parametrize("what", ["values", "compose"])
def test_report_skips_another_runs_tables(runs, tmp_path, what):
    """Another run's values tables (or, the variant, its compose tables) copied into a mined run:
    the report used to show them as this run's figures, exit 0. Now each is named, and its sections
    say why they are skipped; none of the other run's measured numbers is in the page."""
    run = copy(runs["mined"], tmp_path / "run")
    patterns, ids = (("values*.parquet", "value_*.parquet"), VALUES_SECTIONS) if what == "values" else \
        (("compose_*.parquet",), COMPOSE_SECTIONS)
    names = bring(runs["other"], run, *patterns)
    html, said = report_skipping(run, "is not one this run wrote")
    assert all(f"`{n}`" in " ".join(said) for n in names), said
    v = verdicts(run)
    for i in ids:
        assert v[i]["verdict"] == "not comparable" and "This section is skipped: the `" in v[i]["missing"], v[i]
        assert "is not one this run wrote" in v[i]["missing"], v[i]
    for text in measured(runs["other"], ids):
        assert text not in html


def test_report_skips_one_table_copied_beside(runs, tmp_path):
    """Variant: one table of another run (values_layers) beside this run's own tables: not drawn."""
    run = copy(runs["mined"], tmp_path / "run")
    bring(runs["other"], run, "values_layers.parquet")
    html, said = report_skipping(run, "is not one this run wrote")
    assert len(said) == 1 and "`values_layers`" in said[0], said
    assert "This section is skipped" in verdicts(run)["fig4"]["missing"]
    assert measured(runs["other"], ["fig4"])[0] not in html


def test_report_refuses_another_runs_table_over_a_done_steps(runs, tmp_path):
    """Over a done step's own table, another run's is damage: one line, exit 2, the rebuild named,
    no report written."""
    run = copy(runs["own"], tmp_path / "run")
    bring(runs["other"], run, "values_fig6.parquet")
    res = run_cli("report", run)
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "the `values_fig6` table of" in lines[0] and "is not the table this run wrote" in lines[0], lines
    assert not (run / "report" / "index.html").exists()


def killed(run: Path, step: str) -> None:
    """What a kill of `step` leaves in the manifest: its record "running", as `start_step` wrote
    it, with its tables recorded as they were written (the process never reached `finish_step`)."""
    p = run / "manifest.json"
    m = json.loads(p.read_text())
    st = m["steps"][step]
    for k in ("finished", "seconds"):
        st.pop(k, None)
    st.update(status="running", attempt_started=st["started"])
    p.write_text(json.dumps(m))


@pytest.mark.parametrize("step", ["values", "compose"])
def test_report_skips_a_step_left_running_by_a_kill(runs, tmp_path, step):
    """Values (or compose) killed on its second pass: the tables on disk are its own, recorded,
    whole, but of a pass that never finished: the report skips them, naming the step."""
    run = copy(runs["own"], tmp_path / "run")
    killed(run, step)
    html, said = report_skipping(run, f"was written by `{step}`, which is not done")
    ids = VALUES_SECTIONS if step == "values" else COMPOSE_SECTIONS
    v = verdicts(run)
    for i in ids:
        assert "This section is skipped" in v[i]["missing"] and "stopped or killed" in v[i]["missing"], v[i]
    for text in measured(runs["own"], ids):
        assert text not in html
    if step == "values":  # the value_tops cache compose also declares stays: compose is still drawn
        assert verdicts(run)["fig7"]["missing"] is None


def test_the_server_ignores_another_runs_tables(runs, tmp_path):
    """The browser's reads go through the same check: another run's values are absent to it."""
    from fastapi.testclient import TestClient

    from ffkv.web.app import create_app

    run = copy(runs["mined"], tmp_path / "run")
    bring(runs["other"], run, "values*.parquet", "value_*.parquet")
    c = TestClient(create_app(run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")
    m = c.get("/api/memory/0/0")
    assert m.status_code == 200, m.text[:500]
    assert m.json()["values"] == {} and m.json()["agreement"] is None


# ---- repair restores a step only from one pass that read this run's upstream ------------------------------
def repaired(run: Path) -> tuple[dict, str]:
    (run / "manifest.json").unlink()
    res = run_cli("repair", run)
    assert res.returncode == 0, res.stderr
    return json.loads((run / "manifest.json").read_text()), res.stdout


def test_repair_restores_a_runs_own_steps(runs, tmp_path):
    m, out = repaired(copy(runs["own"], tmp_path / "run"))
    assert {k for k, v in m["steps"].items() if v["status"] == "done"} >= {"mine", "values", "compose"}, out


@pytest.mark.parametrize("what", ["values+compose", "compose"])
def test_repair_does_not_take_another_runs_tables(runs, tmp_path, what):
    """Another run's values and compose tables (variant: compose alone) in a mined run of the same
    model, manifest deleted: repair used to record them done. They read another mine: each step is
    left not done, with one line saying why."""
    run = copy(runs["mined"], tmp_path / "run")
    steps = what.split("+")
    bring(runs["other"], run, *(["values*.parquet", "value_*.parquet"] if "values" in steps else
                                ["value_tops.parquet"]), "compose_*.parquet")  # compose declares value_tops
    m, out = repaired(run)
    assert m["steps"]["mine"]["status"] == "done"
    for step in steps:
        assert step not in m["steps"], out
        line = next(l for l in out.splitlines() if l.startswith(f"repair: step {step} not restored"))
        assert "another `mine` pass than this run's" in line, line
    res = run_cli("report", run)
    assert res.returncode == 0, res.stderr
    html = (run / "report" / "index.html").read_text()
    for text in measured(runs["other"], COMPOSE_SECTIONS):
        assert text not in html


def test_repair_does_not_take_tables_of_two_passes(runs, tmp_path):
    """One values table of another run among this run's own values tables: not one pass."""
    run = copy(runs["own"], tmp_path / "run")
    bring(runs["other"], run, "values_fig6.parquet")
    m, out = repaired(run)
    assert "values" not in m["steps"] and m["steps"]["compose"]["status"] == "done", out
    line = next(l for l in out.splitlines() if l.startswith("repair: step values not restored"))
    assert "2 different passes" in line, line


# ---- a hint names only the failing command's options ------------------------------------------------------
@pytest.mark.parametrize("cmd, has", [("corpus", False), ("mine", True)])
def test_out_of_memory_hint_names_only_the_commands_options(tiny_dirs, tmp_path, monkeypatch, cmd, has):
    """`ffkv corpus` running out of memory (a line that never ends) was told to pass a smaller
    --batch-tokens, which it does not take; `ffkv mine`, which does, still is."""
    from ffkv.corpus import sources

    def out_of_memory(*a, **kw):
        raise MemoryError()

    monkeypatch.setattr(sources, "open_corpus", out_of_memory)
    args = [VALID, "--model", tiny_dirs["gpt2"]] if cmd == "corpus" else \
        ["--out", tmp_path / "run", "--model", tiny_dirs["gpt2"], "--corpus", VALID]
    res = run_cli(cmd, *args)
    said = [l for l in res.stderr.splitlines() if l.startswith("ffkv: error")]
    assert res.returncode == 2 and len(said) == 1 and "out of host memory" in said[0], res.stderr[-2000:]
    assert ("--batch-tokens" in said[0]) == has, said[0]
