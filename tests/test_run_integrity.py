"""A run knows what it holds, is one model's, and is never made in a folder that is not ours
(issue 27, items 1-3 and 8).

Every probe runs the real entry point in a subprocess, as a user meets it: a damaged table is
named in one line (exit 2) with the command that rebuilds it, and that command works.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import WT2, build_tiny, run_cli
from test_cli_errors import one_line_error

VALID = WT2 / "wiki.valid.tokens"
MINE_TABLES = ("sentences", "triggers", "vocab", "key_stats", "key_hist", "key_samples")


def mine_args(out: Path, model: Path, *extra) -> list:
    return ["mine", "--out", out, "--model", model, "--corpus", VALID, "--max-sentences", "20", "--top-k", "3",
            *extra]


@pytest.fixture(scope="module")
def mined(tiny_dirs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("integrity") / "run"
    res = run_cli(*mine_args(out, tiny_dirs["gpt2"]))
    assert res.returncode == 0, res.stderr
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock-*"))
    return dst


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".lock-")}


def damage(run: Path, table: str, how: str) -> None:
    p = run / f"{table}.parquet"
    if how == "delete":
        p.unlink()
    elif how == "truncate":
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    else:  # another table's file in its place: a whole, readable Parquet file of the wrong schema
        other = "key_hist" if table != "key_hist" else "triggers"
        shutil.copyfile(run / f"{other}.parquet", p)


def rebuild_command(line: str) -> list[str]:
    m = re.search(r"rebuild it with `ffkv ([^`]+)`", line)
    assert m, line
    return shlex.split(m.group(1))


def mine_manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


# ---- 1. a run knows what it holds ---------------------------------------------------------------
def test_manifest_records_every_table(mined):
    m = mine_manifest(mined)
    for t in MINE_TABLES:
        rec = m["tables"][t]
        assert rec["bytes"] == (mined / f"{t}.parquet").stat().st_size
        assert rec["rows"] > 0 and len(rec["footer_sha256"]) == 64 and rec["step"] == "mine"


@pytest.mark.parametrize("how", ["delete", "truncate", "replace"])
@pytest.mark.parametrize("table", MINE_TABLES)
def test_damaged_table_is_named_with_the_command_that_rebuilds_it(mined, tiny_dirs, tmp_path, table, how):
    run = copy_run(mined, tmp_path / "run")
    damage(run, table, how)
    line = one_line_error(run_cli("show", run, "-l", "0", "-d", "0"), needle=f"`{table}` table")
    assert "rebuild it with `ffkv mine --out" in line and "--force`" in line, line
    # a later step says the same before any work, and does not say "already done"
    assert one_line_error(run_cli("values", run)) == line
    # mine itself does not answer "nothing to do" on its damaged run: the named command rebuilds it
    res = run_cli(*rebuild_command(line))
    assert res.returncode == 0, res.stderr
    assert "nothing to do" not in res.stdout
    res = run_cli("show", run, "-l", "0", "-d", "0")
    assert res.returncode == 0, res.stderr
    m = mine_manifest(run)
    assert m["steps"]["mine"]["status"] == "done"
    assert m["tables"][table]["bytes"] == (run / f"{table}.parquet").stat().st_size


def test_mine_without_force_redoes_a_damaged_run(mined, tiny_dirs, tmp_path):
    """Rerunning `mine` with the run's settings on a half-truncated sentences table re-mines
    (it used to answer "nothing to do" and leave it corrupt)."""
    run = copy_run(mined, tmp_path / "run")
    damage(run, "sentences", "truncate")
    res = run_cli(*mine_args(run, tiny_dirs["gpt2"]))
    assert res.returncode == 0, res.stderr
    assert "nothing to do" not in res.stdout
    assert run_cli("show", run, "-l", "0", "-d", "0").returncode == 0


def test_mine_force_mines_again_from_scratch(mined, tiny_dirs, tmp_path):
    run = copy_run(mined, tmp_path / "run")
    before = mine_manifest(run)["steps"]["mine"]["finished"]
    res = run_cli(*mine_args(run, tiny_dirs["gpt2"]))
    assert "nothing to do" in res.stdout
    (run / ".mine_shards").mkdir()  # a killed Ray pass's shards: --force does not resume them either
    (run / ".mine_shards" / "x_0_of_2.npz").write_bytes(b"")
    res = run_cli(*mine_args(run, tiny_dirs["gpt2"], "--force"))
    assert res.returncode == 0, res.stderr
    assert "nothing to do" not in res.stdout and mine_manifest(run)["steps"]["mine"]["finished"] > before
    assert not (run / ".mine_shards").exists()
    # other settings stay refused, --force or not
    one_line_error(run_cli("mine", "--out", run, "--model", tiny_dirs["gpt2"], "--corpus", VALID,
                           "--max-sentences", "20", "--top-k", "4", "--force"), needle="other settings")


def test_foreign_triggers_are_noticed_by_a_done_values_step(mined, tmp_path):
    """`values` done, then triggers replaced by a table of another schema: values names the
    damage (it used to say "already done; pass --force"), and the rebuild makes values redo."""
    run = copy_run(mined, tmp_path / "run")
    res = run_cli("values", run)
    assert res.returncode == 0, res.stderr
    damage(run, "triggers", "replace")
    line = one_line_error(run_cli("values", run), needle="`triggers` table")
    assert run_cli(*rebuild_command(line)).returncode == 0
    res = run_cli("values", run)
    assert res.returncode == 0, res.stderr
    assert "already" not in res.stdout + res.stderr


def test_older_runs_without_table_records_still_count_as_done(mined, tiny_dirs, tmp_path):
    run = copy_run(mined, tmp_path / "run")
    m = mine_manifest(run)
    del m["tables"]
    (run / "manifest.json").write_text(json.dumps(m))
    res = run_cli(*mine_args(run, tiny_dirs["gpt2"]))
    assert res.returncode == 0 and "nothing to do" in res.stdout, (res.stdout, res.stderr)
    assert run_cli("show", run, "-l", "0", "-d", "0").returncode == 0
    # ... and their footer is read: a cut-short table is not done
    damage(run, "triggers", "truncate")
    res = run_cli(*mine_args(run, tiny_dirs["gpt2"]))
    assert res.returncode == 0 and "nothing to do" not in res.stdout, (res.stdout, res.stderr)
    assert run_cli("show", run, "-l", "0", "-d", "0").returncode == 0


# ---- 1b. every step's tables, damaged: serve names them, the named command repairs them ---------------
LATER_STEPS = ("values", "compose", "mutate", "patterns", "normalize")
SMALL_STEPS = {"values": [], "compose": ["--corpus", VALID, "--prefixes", "5"], "mutate": ["--keys-per-layer", "1"],
               "patterns": ["--semantic-keys-per-layer", "0"],
               "normalize": ["--tokens", "200", "--fit-tokens", "100", "--sweep-tokens", "100"]}


@pytest.fixture(scope="module")
def full(mined, tmp_path_factory) -> Path:
    """The mined run with every later step done, small."""
    run = copy_run(mined, tmp_path_factory.mktemp("full") / "run")
    for step in LATER_STEPS:
        res = run_cli(step, run, *SMALL_STEPS[step])
        assert res.returncode == 0, (step, res.stderr)
    return run


def tables_of(run: Path, step: str) -> list[str]:
    return sorted(t for t, r in mine_manifest(run)["tables"].items() if r["step"] == step)


def serve_error(run: Path) -> str:
    """What `ffkv serve` meets first, in process: the app refuses to load a damaged run (FfkvError)."""
    from ffkv.errors import FfkvError
    from ffkv.web.app import create_app

    with pytest.raises(FfkvError) as e:
        create_app(run)
    return str(e.value)


def step_is_done(run: Path, step: str) -> bool:
    from ffkv.steps.lifecycle import get, is_done
    from ffkv.store.run import Run

    r = Run(run)
    return is_done(r, get(step), r.settings(step))


@pytest.mark.parametrize("how", ["delete", "truncate", "replace"])
@pytest.mark.parametrize("step", ("mine", *LATER_STEPS))
def test_every_table_damaged_is_named_by_serve(full, tmp_path, step, how):
    """Each table of each step, damaged: serve refuses in one line naming it and the rebuild with
    the run's own settings, and the step that wrote it no longer counts as done (so rerunning it
    redoes it instead of answering "already done"). Serve used to start on a cut values table and
    fail at the first page, and took a missing one for a step never run."""
    from ffkv.steps.lifecycle import rebuild_command as expected
    from ffkv.store.run import Run

    tables = tables_of(full, step)
    assert tables
    want = expected(Run(full), step)
    for table in tables:
        run = copy_run(full, tmp_path / table)
        damage(run, table, how)
        line = serve_error(run)
        assert "\n" not in line and f"the `{table}` table of" in line, line
        assert line.endswith(f"rebuild it with `{want.replace(str(full), str(run))}`"), line
        assert not step_is_done(run, step), table
        shutil.rmtree(run)


@pytest.mark.parametrize("how", ["delete", "truncate", "replace"])
def test_serve_command_refuses_a_damaged_run_in_one_line(full, tmp_path, how):
    run = copy_run(full, tmp_path / "run")
    damage(run, {"delete": "values", "truncate": "compose_layers", "replace": "mutations"}[how], how)
    res = run_cli("serve", run, "--port", "0", fresh=True, timeout=120)
    assert "rebuild it with `ffkv" in one_line_error(res, needle="table of")


@pytest.mark.parametrize("how", ["delete", "truncate", "replace"])
def test_report_refuses_a_damaged_run_in_one_line(full, tmp_path, how):
    """A report drawn from a damaged table was written with exit 0 (a cut triggers table gave no
    word at all); it is refused like serve, naming the table and its rebuild, and writes nothing."""
    run = copy_run(full, tmp_path / "run")
    shutil.rmtree(run / "report", ignore_errors=True)
    damage(run, {"delete": "triggers", "truncate": "values", "replace": "compose_layers"}[how], how)
    res = run_cli("report", run)
    assert "rebuild it with `ffkv" in one_line_error(res, needle="table of")
    assert not (run / "report" / "index.html").exists()


@pytest.mark.parametrize("step", LATER_STEPS)
def test_the_named_command_repairs_each_step(full, tmp_path, step):
    """The command serve names rebuilds the step with the settings it ran with (not the
    command's defaults), and the run serves again."""
    run = copy_run(full, tmp_path / "run")
    tables = tables_of(run, step)
    how = ("delete", "truncate", "replace")[LATER_STEPS.index(step) % 3]
    damage(run, tables[0], how)
    line = serve_error(run)
    before = mine_manifest(run)["settings"][step]
    res = run_cli(*rebuild_command(line))
    assert res.returncode == 0, res.stderr
    assert "already" not in res.stdout + res.stderr
    assert mine_manifest(run)["settings"][step] == before
    assert step_is_done(run, step)
    from ffkv.web.app import create_app

    create_app(run)


@pytest.mark.parametrize("how", ["delete", "truncate", "replace"])
def test_a_damaged_value_tops_cache_is_made_again(full, tmp_path, how):
    """compose reads the value_tops cache the values step filled: a damaged one is computed again
    and rewritten (a cut one used to stop compose, and its rerun, with "rerun the step that writes it")."""
    from ffkv.store.run import Run

    run = copy_run(full, tmp_path / "run")
    damage(run, "value_tops", how)
    res = run_cli("compose", run, *SMALL_STEPS["compose"])
    assert res.returncode == 0, res.stderr
    assert Run(run).table_problem("value_tops") is None and step_is_done(run, "compose")


# ---- 1c. a step checks its own outputs before it says done -----------------------------------------
@dataclass(frozen=True)
class NoSettings:
    pass


@pytest.fixture
def plugin_steps():
    """Steps registered in this process for one test (then forgotten)."""
    from ffkv.steps import registry
    from ffkv.steps import Step, register

    made = []

    def make(name, compute, tables=()):
        made.append(name)
        return register(Step(name, NoSettings, requires=("mine",), tables=tables, compute=compute))

    yield make
    for n in made:
        registry._registered.pop(n, None)


def lost_half(ctx):  # the write returns, the disk keeps half of it
    p = ctx.run.write_table("t_out", {"x": list(range(5000))})
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def swapped(ctx):  # another table's file lands in its place after the write
    p = ctx.run.write_table("t_out", {"x": list(range(100))})
    shutil.copyfile(ctx.run.table_path("key_hist"), p)


def miscounted(ctx):  # the record says other rows than the file holds
    ctx.run.write_table("t_out", {"x": list(range(100))})
    ctx.run.manifest["tables"]["t_out"]["rows"] = 99


def never_written(ctx):  # declares t_out, writes nothing
    return {}


@pytest.mark.parametrize("compute, says", [
    (lost_half, "is unreadable"), (swapped, "is not the table this run wrote"),
    (miscounted, "holds 100 rows, not the 99 written"), (never_written, "is missing")])
def test_a_step_checks_its_tables_before_done(mined, tmp_path, plugin_steps, compute, says):
    from ffkv.errors import FfkvError
    from ffkv.steps.lifecycle import execute, get, is_done
    from ffkv.store.run import Run

    name = f"t_{compute.__name__}"
    plugin_steps(name, compute, tables=("t_out",))
    run = Run(copy_run(mined, tmp_path / "run"))
    with pytest.raises(FfkvError) as e:
        execute(run, name, NoSettings(), log=lambda m: None)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"`{name}` did not finish: the `t_out` table of") and says in line, line
    assert line.endswith(f"rerun `ffkv {name.replace('_', '-')} {run.path} --force`"), line
    again = Run(run.path)  # what the manifest on disk says
    assert again.step(name)["status"] == "failed" and says in again.step(name)["error"]
    assert not is_done(again, get(name), {})


def test_a_step_checks_its_inputs_before_it_starts(mined, tmp_path, plugin_steps):
    from ffkv.errors import FfkvError
    from ffkv.steps.lifecycle import execute
    from ffkv.store.run import Run

    called = []
    plugin_steps("t_reads", lambda ctx: called.append(1) or {}, tables=())
    run = copy_run(mined, tmp_path / "run")
    damage(run, "key_samples", "truncate")
    with pytest.raises(FfkvError, match="the `key_samples` table of .* rebuild it with `ffkv mine --out"):
        execute(Run(run), "t_reads", NoSettings(), log=lambda m: None)
    assert not called
    assert execute(Run(copy_run(mined, tmp_path / "whole")), "t_reads", NoSettings(), log=lambda m: None).status == "done"
    assert called == [1]


# ---- 2. a run is one model's ----------------------------------------------------------------------
def test_another_model_is_refused_naming_both(mined, tok_dir, tmp_path):
    other = build_tiny("gpt2", tmp_path / "other_gpt2", tok_dir, seed=1)
    run = copy_run(mined, tmp_path / "run")
    before = snapshot(run)
    line = one_line_error(run_cli(*mine_args(run, other)), needle="model")
    assert str(other) in line and "gpt2" in line.replace(str(other), ""), line
    assert "nothing to do" not in line
    assert snapshot(run) == before


def test_a_fine_tune_with_the_same_embeddings_is_refused(mined, tiny_dirs, tmp_path):
    """Same shape, vocabulary and unembedding (embeddings frozen), one FFN weight of one layer
    moved: another model. It was taken for the run's own (only E was digested)."""
    import json as _json

    import torch
    from safetensors.torch import load_file, save_file

    src = Path(tiny_dirs["gpt2"])
    tuned = tmp_path / "tuned"
    shutil.copytree(src, tuned)
    w = load_file(str(src / "model.safetensors"))
    name = next(k for k in sorted(w) if "mlp.c_proj.weight" in k)  # a value matrix of one layer
    w[name] = w[name].clone()
    w[name][0] += 0.5
    save_file(w, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    assert _json.loads((tuned / "config.json").read_text()) == _json.loads((src / "config.json").read_text())
    run = copy_run(mined, tmp_path / "run")
    before = snapshot(run)
    line = one_line_error(run_cli(*mine_args(run, tuned)), needle="model mismatch")
    assert "FFN weights" in line and "nothing to do" not in line, line
    assert snapshot(run) == before
    assert torch.equal(load_file(str(tuned / "model.safetensors"))["transformer.wte.weight"],
                       w["transformer.wte.weight"])


# ---- 3. never write into what is not ours ---------------------------------------------------------
def test_a_folder_that_is_not_a_run_is_refused(tiny_dirs, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "sentences.parquet").write_text("my own notes, not a table\n")
    (d / "notes.txt").write_text("keep me\n")
    before = snapshot(d)
    for args in (mine_args(d, tiny_dirs["gpt2"]), mine_args(d, tiny_dirs["gpt2"], "--overwrite"),
                 ["compose", d, "--model", tiny_dirs["gpt2"], "--corpus", VALID, "--prefixes", "5"]):
        one_line_error(run_cli(*args), needle="not an ffkv run")
        assert snapshot(d) == before
        assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".lock-")) == ["notes.txt",
                                                                                          "sentences.parquet"]


def test_an_empty_folder_is_fine(tiny_dirs, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    assert run_cli(*mine_args(d, tiny_dirs["gpt2"])).returncode == 0


def test_missing_manifest_is_refused_and_repair_restores_it(mined, tiny_dirs, tmp_path):
    run = copy_run(mined, tmp_path / "run")
    (run / "manifest.json").unlink()
    before = snapshot(run)
    for args in (["compose", run, "--model", tiny_dirs["gpt2"], "--corpus", VALID, "--prefixes", "5"],
                 mine_args(run, tiny_dirs["gpt2"]), ["show", run, "-l", "0", "-d", "0"], ["values", run]):
        line = one_line_error(run_cli(*args), needle="repair")
        assert "manifest" in line, line
        assert snapshot(run) == before  # nothing written, nothing deleted
    res = run_cli("repair", run)
    assert res.returncode == 0, res.stderr
    m = mine_manifest(run)
    assert m["steps"]["mine"]["status"] == "done" and m["model"]["model_id"] == str(Path(tiny_dirs["gpt2"]).resolve())
    assert m["settings"]["mine"]["top_k"] == 3
    res = run_cli("show", run, "-l", "0", "-d", "0")
    assert res.returncode == 0, res.stderr
    res = run_cli(*mine_args(run, tiny_dirs["gpt2"]))  # the same settings: done, not mined again
    assert res.returncode == 0 and "nothing to do" in res.stdout, (res.stdout, res.stderr)
    assert run_cli("values", run).returncode == 0


def test_repair_leaves_what_it_cannot_verify(mined, tmp_path):
    run = copy_run(mined, tmp_path / "run")
    (run / "manifest.json").write_text("{ not json")
    damage(run, "key_hist", "truncate")
    cut = (run / "key_hist.parquet").read_bytes()
    res = run_cli("repair", run)
    assert res.returncode == 0, res.stderr
    assert "key_hist" in res.stdout and (run / "manifest.json.damaged").read_text() == "{ not json"
    assert (run / "key_hist.parquet").read_bytes() == cut
    m = mine_manifest(run)
    assert "mine" not in m["steps"]  # one of its tables could not be verified
    assert "key_hist" not in m["tables"] and "triggers" in m["tables"]


def test_overwrite_starts_afresh_in_a_damaged_run(mined, tiny_dirs, tmp_path):
    run = copy_run(mined, tmp_path / "run")
    (run / "manifest.json").unlink()
    (run / "notes.txt").write_text("not ours")  # a run with a user's file beside it
    one_line_error(run_cli(*mine_args(run, tiny_dirs["gpt2"], "--overwrite")), needle="not an ffkv run")
    (run / "notes.txt").unlink()
    res = run_cli(*mine_args(run, tiny_dirs["gpt2"], "--top-k", "4", "--overwrite"))
    assert res.returncode == 0, res.stderr
    assert mine_manifest(run)["settings"]["mine"]["top_k"] == 4


# ---- 7. a parameter against its real limit, before work starts -------------------------------------
def test_min_cover_past_top_is_refused(mined):
    """A pattern covers at most --top prefixes: more was an IndexError in the semantic null
    (found by test_cli_properties)."""
    line = one_line_error(run_cli("patterns", mined, "--top", "5", "--min-cover", "6"), needle="--min-cover 6")
    assert "--top 5" in line


# ---- 8. text from a corpus is shown, never executed ---------------------------------------------
def test_show_escapes_terminal_controls(tiny_dirs, tmp_path):
    corpus = tmp_path / "evil.txt"
    corpus.write_text("The screen is \x1b[2J cleared here and it was a long day for all of us.\n"
                      "A reversed \u202e text goes here and then some more words follow it.\n"
                      "A bell \x07 and a C1 \x9b control sit in this quiet sentence about mills.\n")
    run = tmp_path / "run"
    res = run_cli("mine", "--out", run, "--model", tiny_dirs["gpt2"], "--corpus", corpus, "--top-k", "3")
    assert res.returncode == 0, res.stderr
    out = "".join(run_cli("show", run, "-l", str(layer), "-d", str(d)).stdout
                  for layer in (0, 1) for d in range(4))
    for raw in ("\x1b", "\u202e", "\x07", "\x9b"):
        assert raw not in out
    assert "\\x1b" in out or "\\u202e" in out or "\\x07" in out
    js = run_cli("show", run, "-l", "0", "-d", "0", "--json")
    assert js.returncode == 0 and "\u202e" not in js.stdout and "\x1b" not in js.stdout
    json.loads(js.stdout)
