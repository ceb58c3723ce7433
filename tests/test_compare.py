"""`ffkv verdicts`: runs' verdicts side by side (ffkv.report.compare), on hand-made records."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffkv.errors import FfkvError
from ffkv.report import compare as C


def rec(vid, verdict, lenses=None, title=None):
    return {"id": vid, "title": title or vid.upper(), "verdict": verdict, "lenses": lenses}


def write(run, recs):
    (run / "report").mkdir(parents=True, exist_ok=True)
    (run / "report" / "verdicts.json").write_text(json.dumps(recs))
    return run


def verdicts(*args, env=None):
    """`ffkv verdicts ARGS` through the CLI app."""
    from typer.testing import CliRunner

    from ffkv.cli import app

    return CliRunner().invoke(app, ["verdicts", *map(str, args)], env=env)


def verdicts_json(*runs):
    res = verdicts(*runs, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_side_by_side_marks_verdict_and_lens_changes():
    a = [rec("fig4", "same trend", {"norm": "same trend", "naive": "same trend"}),
         rec("fig5", "inconclusive", {"norm": "inconclusive", "naive": "same trend"}),
         rec("fig8", "inconclusive"), rec("only_a", "differs")]
    b = [rec("fig4", "same trend", {"norm": "same trend", "naive": "differs"}),
         rec("fig5", "inconclusive", {"norm": "inconclusive", "naive": "same trend"}),
         rec("fig8", "same trend"), rec("only_b", "same trend")]
    rows = {r["id"]: r for r in C.side_by_side([a, b])}
    assert [r["id"] for r in C.side_by_side([a, b])] == ["fig4", "fig5", "fig8", "only_a", "only_b"]
    assert rows["fig4"]["changed"]  # same main verdict, the naive lens changed
    assert not rows["fig5"]["changed"]
    assert rows["fig8"]["changed"]
    # a verdict only one run has is not a change
    assert not rows["only_a"]["changed"] and rows["only_a"]["readings"][1] is None
    assert C.cell(rows["fig5"]["readings"][0]) == "inconclusive (naive: same trend)"
    assert C.cell(rows["fig4"]["readings"][0]) == "same trend"
    assert C.cell(None) == "—"


def test_a_lens_only_one_run_read_is_not_a_change():
    a = [rec("fig9", "same trend", {"norm": "same trend", "naive": "differs"})]
    b = [rec("fig9", "same trend")]
    assert not C.side_by_side([a, b])[0]["changed"]


@given(st.lists(st.sampled_from(["same trend", "differs", "inconclusive", "not comparable"]), min_size=1, max_size=5))
def test_changed_iff_the_runs_disagree(verdicts):
    runs = [[rec("fig3", v)] for v in verdicts]
    assert C.side_by_side(runs)[0]["changed"] == (len(set(verdicts)) > 1)


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(FfkvError, match="not a run directory"):
        C.load(tmp_path / "nope")
    (tmp_path / "r").mkdir()
    with pytest.raises(FfkvError, match="no report yet.*ffkv report"):
        C.load(tmp_path / "r")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=200),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                              lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                              max_leaves=12).map(lambda x: json.dumps(x).encode())))
def test_load_on_any_file_returns_records_or_one_line(tmp_path, data):
    run = tmp_path / "run"
    (run / "report").mkdir(parents=True, exist_ok=True)
    (run / "report" / "verdicts.json").write_bytes(data)
    try:
        recs = C.load(run)
    except FfkvError as e:
        assert str(e) and "\n" not in str(e)
        return
    rows = C.side_by_side([recs, recs])
    assert not any(r["changed"] for r in rows)


def test_verdicts_cli(tmp_path):
    a = write(tmp_path / "default", [rec("fig4", "same trend", {"norm": "same trend", "naive": "same trend"}),
                                     rec("fig8", "inconclusive")])
    b = write(tmp_path / "full", [rec("fig4", "same trend", {"norm": "same trend", "naive": "same trend"}),
                                  rec("fig8", "differs")])
    out = verdicts_json(a, b)
    assert [(v["id"], v["changed"]) for v in out["verdicts"]] == [("fig4", False), ("fig8", True)]
    assert out["verdicts"][1]["runs"] == [{"verdict": "inconclusive", "lenses": {}}, {"verdict": "differs", "lenses": {}}]
    res = verdicts(a, b, "--changed")
    assert res.exit_code == 0 and "fig8" in res.output and "fig4" not in res.output
    assert "1 of 2 verdicts differ" in res.output


def test_verdicts_cli_errors_are_one_line(tmp_path, capsys):
    from ffkv.cli import main

    (tmp_path / "mined").mkdir()
    for argv, want in ((["verdicts", str(tmp_path / "nope")], "not a run directory"),
                       (["verdicts", str(tmp_path / "mined")], "no report yet"),
                       (["verdicts"], "Missing argument")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and err.count("\n") == 1, err


def test_holds_on_each_run_and_lens():
    names = ["default", "gemma"]
    a = [rec("fig4", "same trend", {"norm": "same trend", "naive": "differs"}), rec("fig3", "same trend"),
         rec("fig8", "differs"), rec("only_a", "same trend")]
    b = [rec("fig4", "differs", {"norm": "differs", "naive": "differs"}), rec("fig3", "same trend"),
         rec("fig8", "inconclusive")]
    rows = {r["id"]: r for r in C.side_by_side([a, b])}
    assert C.lenses_read(list(rows.values())) == ["norm", "naive"]
    assert C.holds_on(rows["fig4"], names) == "default only"
    assert C.holds_on(rows["fig4"], names, "norm") == "default only"
    assert C.holds_on(rows["fig4"], names, "naive") == "neither"
    # a figure read under one lens has one verdict whatever the lens
    assert C.holds_on(rows["fig3"], names) == C.holds_on(rows["fig3"], names, "naive") == "both"
    assert C.under(rows["fig3"]["readings"][0], "naive") == "same trend"
    assert C.holds_on(rows["fig8"], names) == "neither"
    assert C.holds_on(rows["only_a"], names) == "default only"  # gemma lacks it: not "both"
    assert C.under(rows["only_a"]["readings"][1], "norm") is None
    three = C.side_by_side([a, a, b])
    assert C.holds_on(three[1], ["x", "y", "z"]) == "all" and C.holds_on(three[2], ["x", "y", "z"]) == "none"
    assert C.holds_on(three[0], ["x", "y", "z"]) == "x+y only"


def test_verdicts_cli_two_models_by_lens(tmp_path):
    a = write(tmp_path / "default", [rec("fig4", "same trend", {"norm": "same trend", "naive": "same trend"}),
                                     rec("fig3", "same trend")])
    b = write(tmp_path / "gemma", [rec("fig4", "same trend", {"norm": "same trend", "naive": "differs"}),
                                   rec("fig3", "inconclusive")])
    out = verdicts_json(a, b)
    assert out["names"] == ["default", "gemma"] and out["lenses"] == ["norm", "naive"]
    v = {x["id"]: x for x in out["verdicts"]}
    assert v["fig4"]["holds_on"] == "both" and v["fig3"]["holds_on"] == "default only"
    assert v["fig4"]["by_lens"]["naive"] == {"verdicts": ["same trend", "differs"], "holds_on": "default only"}
    assert v["fig4"]["by_lens"]["norm"] == {"verdicts": ["same trend", "same trend"], "holds_on": "both"}
    res = verdicts(a, b, "--by-lens", env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    lines = [l for l in res.output.splitlines() if l.startswith("│")]
    assert len(lines) == 3  # fig4 under norm and naive, fig3 once (its verdict is the same under any lens)
    assert "naive" in lines[1] and "differs" in lines[1] and "default only" in lines[1]
    assert "any" in lines[2] and "inconclusive" in lines[2]
    # one run: unchanged (no holds-on column, no by-lens keys)
    one = verdicts_json(a)
    assert set(one) == {"runs", "verdicts"} and set(one["verdicts"][0]) == {"id", "title", "changed", "runs"}
    assert "holds on" not in verdicts(a, env={"COLUMNS": "200"}).output
