"""A step's recorded time is its working time: a killed and resumed step counts each try from its
start to its last heartbeat, not the time it lay dead between them (Gemma's values once recorded
9,524 s for 4,324 s of work)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time



# A step that works (sleeps) for argv[2] seconds, run through the real lifecycle in its own process.
_NAP = """
import dataclasses, sys, time
import ffkv.steps.lifecycle as lifecycle
from ffkv.steps import Step, execute, register
from ffkv.store.run import Run

lifecycle.HEARTBEAT_S = 0.1

@dataclasses.dataclass(frozen=True)
class Nap:
    n: int = 1

def compute(ctx):
    (ctx.run.path / "working").touch()
    time.sleep(float(sys.argv[2]))
    return {"napped": 1}

register(Step("nap", Nap, (), (), compute))
print(execute(Run(sys.argv[1], create=True), "nap", Nap()).status)
"""


def test_killed_and_resumed_step_records_its_working_time(tmp_path):
    """A real SIGKILL of a step 1 s into its work, 3 s dead, then a resume that works 1 s more."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", _NAP, str(out), "60"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (out / "working").exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    time.sleep(1.0)
    assert p.poll() is None, p.stderr.read()
    p.send_signal(signal.SIGKILL)
    killed = time.time()
    p.wait()
    st = json.loads((out / "manifest.json").read_text())["steps"]["nap"]
    assert st["status"] == "running"
    started = st["started"]
    first = killed - started  # the first try's work, at most
    assert first >= 1.0
    time.sleep(3.0)  # dead: this must not count
    resumed = time.time()
    r = subprocess.run([sys.executable, "-c", _NAP, str(out), "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr
    st = json.loads((out / "manifest.json").read_text())["steps"]["nap"]
    second = st["finished"] - resumed  # the second try's work, at most (it slept 1 s of it)
    assert st["status"] == "done" and st["napped"] == 1 and st["attempts"] == 2 and st["started"] == started
    assert abs(st["wall_seconds"] - (st["finished"] - started)) < 0.02
    # the first try up to its last beat (0.1 s apart, plus the kill's own latency), then the second
    assert first - 0.4 + 1.0 <= st["seconds"] <= first + second + 0.02, (st, first, second)
    assert st["seconds"] < st["wall_seconds"] - 2.9
    assert "worked" not in st and "attempt_started" not in st


def test_one_try_records_its_span_and_a_redone_step_starts_afresh(tmp_path):
    from ffkv.store.run import Run

    run = Run(tmp_path / "r", create=True)
    run.start_step("compose", {"prefixes": 10})
    run.finish_step("compose", prefixes=10)
    st = run.step("compose")
    assert st["seconds"] == round(st["finished"] - st["started"], 2) and "attempts" not in st
    assert "wall_seconds" not in st
    # a try killed with no heartbeat file (an older ffkv's run): nothing of it is counted
    run.start_step("compose", {"prefixes": 20})
    (tmp_path / "r" / ".lock-step-compose").unlink()
    run.manifest["steps"]["compose"]["started"] -= 500
    run.manifest["steps"]["compose"]["attempt_started"] -= 500
    run.start_step("compose", {"prefixes": 20})
    run.finish_step("compose", prefixes=20)
    st = Run(tmp_path / "r").step("compose")
    assert st["attempts"] == 2 and st["seconds"] < 5 and st["wall_seconds"] >= 500
