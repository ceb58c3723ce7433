"""Every mistake a user can make ends in one line on stderr and exit code 2 (130 for Ctrl-C),
with no traceback, no temp file left behind, and every visible table readable.

Each probe runs the real entry point in a subprocess, as a user would meet it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import WT2, run_cli

VALID = WT2 / "wiki.valid.tokens"


def one_line_error(res, code: int = 2, needle: str | None = None) -> str:
    err = res.stderr.strip()
    assert res.returncode == code, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = [l for l in err.splitlines() if l.strip() and "unexpected operator" not in l]
    assert len(lines) == 1, err
    if needle is not None:
        assert needle in lines[0], lines[0]
    return lines[0]


def no_temp_files(folder: Path) -> None:
    left = [p.name for p in Path(folder).rglob("*") if ".tmp" in p.name]
    assert not left, left


def tables_readable(folder: Path) -> None:
    for p in Path(folder).glob("*.parquet"):
        pq.read_table(p)


@pytest.fixture(scope="module")
def mined(tiny_dirs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("errs") / "run"
    res = run_cli("mine", "--out", out, "--model", tiny_dirs["gpt2"], "--corpus", VALID,
                  "--max-sentences", "60", "--top-k", "5")
    assert res.returncode == 0, res.stderr
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock-*"))
    return dst


# ---- usage errors of every command ------------------------------------------------------------
COMMANDS = ["info", "explain", "corpus", "mine", "show", "values", "compose", "mutate", "patterns",
            "report", "reproduce", "annotate sample", "annotate add", "annotate list", "annotate export",
            "annotate import", "annotate stats"]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_unknown_option_of_every_command(cmd):
    one_line_error(run_cli(*cmd.split(), "--bogus"), needle="--bogus")


@pytest.mark.parametrize("args,needle", [
    (["nosuchcmd"], "nosuchcmd"),
    (["mine", "--top-k", "0", "--out", "x"], "--top-k"),
    (["annotate", "nosuch"], "nosuch"),
    (["values"], "RUN"),
    (["explain", "x", "--device", "tpu"], "tpu"),  # explain takes --device like the steps
    (["explain", "x", "--dtype", "float8"], "float8"),
])
def test_usage_errors(args, needle):
    one_line_error(run_cli(*args), needle=needle)


def test_reversed_and_bad_ranges(mined, tiny_dirs, tmp_path):
    for dims, needle in (("5-2", "reversed"), ("x", "not an integer"), ("0-99999", "out of range")):
        one_line_error(run_cli("mine", "--out", tmp_path / dims, "--model", tiny_dirs["gpt2"], "--corpus", VALID,
                               "--dims", dims), needle=needle)
        assert not (tmp_path / dims / "triggers.parquet").exists()


def test_huge_pattern_range_is_refused_at_once(mined):
    t0 = time.time()
    one_line_error(run_cli("annotate", "add", mined, "-a", "x", "-l", "0", "-d", "1",
                           "-p", "shallow:0-999999999999:x"), needle="longer than")
    assert time.time() - t0 < 60  # it did not build the range in memory


# ---- damaged run directories ------------------------------------------------------------------
@pytest.mark.parametrize("content", ["[]", '{"steps": 5}', '{"steps": {"mine": 3}}', "{", ""])
def test_manifest_of_the_wrong_shape(mined, tmp_path, content):
    run = copy_run(mined, tmp_path / "run")
    (run / "manifest.json").write_text(content)
    for args in (["show", run, "-l", "0", "-d", "0"], ["values", run], ["annotate", "list", run]):
        one_line_error(run_cli(*args), needle="manifest" if content.strip() not in ("{", "") else "JSON")


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_corrupt_table(mined, tmp_path, damage):
    run = copy_run(mined, tmp_path / "run")
    p = run / "triggers.parquet"
    data = p.read_bytes()
    p.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": os.urandom(4096)}[damage])
    one_line_error(run_cli("show", run, "-l", "0", "-d", "0"), needle="triggers")
    one_line_error(run_cli("values", run), needle="triggers")


# ---- corpora ----------------------------------------------------------------------------------
def test_binary_corpus(tiny_dirs, tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(bytes(range(256)) * 40)
    one_line_error(run_cli("mine", "--out", tmp_path / "r", "--model", tiny_dirs["gpt2"], "--corpus", f),
                   needle="binary")
    one_line_error(run_cli("corpus", f, "--model", tiny_dirs["gpt2"]), needle="binary")


@pytest.mark.parametrize("value", ["null", "5", '{"a": 1}', "[1]", "true"])
def test_jsonl_field_that_is_not_text(tiny_dirs, tmp_path, value):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "A fine sentence."}\n{"text": %s}\n' % value)
    one_line_error(run_cli("corpus", f, "--model", tiny_dirs["gpt2"]), needle="not text")


def test_failed_mine_does_not_block_its_out(tiny_dirs, tmp_path):
    out = tmp_path / "r"
    one_line_error(run_cli("mine", "--out", out, "--model", tiny_dirs["gpt2"], "--corpus", tmp_path / "nope.txt"),
                   needle="does not exist")
    res = run_cli("mine", "--out", out, "--model", tiny_dirs["gpt2"], "--corpus", VALID, "--max-sentences", "20",
                  "--top-k", "3")
    assert res.returncode == 0, res.stderr


def test_control_characters_are_shown_escaped(tiny_dirs, tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("Evil \x1b[31mred\x1b[0m text with a NUL\x00? no: a bell\x07 and \u202e reversed.\n")
    # NUL makes it binary; without it the escapes must be shown, not sent to the terminal
    f.write_text("Evil \x1b[31mred\x1b[0m text with a bell\x07 and \u202e reversed words here.\n")
    res = run_cli("corpus", f, "--model", tiny_dirs["gpt2"])
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\u202e" not in res.stdout and "\x07" not in res.stdout
    assert "\\x1b" in res.stdout and "\\u202e" in res.stdout


# ---- annotations ------------------------------------------------------------------------------
@pytest.mark.parametrize("line", [
    '{"annotator": "a", "layer": 0, "dim": 1, "patterns": [], "updated": NaN}',
    '{"annotator": "a", "layer": 0, "dim": 1, "patterns": [], "created": Infinity}',
    "[" * 100_000 + "]" * 100_000,
    '{"annotator": "a", "layer": 0, "dim": 1, "patterns": "x"}',
])
def test_annotation_import_of_bad_records(mined, tmp_path, line):
    run = copy_run(mined, tmp_path / "run")
    f = tmp_path / "in.jsonl"
    f.write_text(line + "\n")
    one_line_error(run_cli("annotate", "import", run, f))


def test_annotation_export_to_a_folder(mined, tmp_path):
    run = copy_run(mined, tmp_path / "run")
    d = tmp_path / "folder"
    d.mkdir()
    one_line_error(run_cli("annotate", "export", run, "-o", d), needle="directory")
    no_temp_files(tmp_path)


# ---- the run directory: lock, concurrency, read-only and full disks ---------------------------
def test_concurrent_steps_both_persist(mined, tmp_path):
    """Two processes save the manifest at once: each keeps its own step (the old last-save-wins lost one)."""
    run = copy_run(mined, tmp_path / "run")
    code = ("import sys, time; from ffkv.store.run import Run\n"
            "r = Run(sys.argv[1]); time.sleep(float(sys.argv[3]))\n"
            "r.start_step(sys.argv[2], {'who': sys.argv[2]}); r.finish_step(sys.argv[2], n=1)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(run), name, "0.5"]) for name in ("alpha", "beta")]
    assert all(p.wait(60) == 0 for p in procs)
    m = json.loads((run / "manifest.json").read_text())
    assert {"alpha", "beta", "mine"} <= set(m["steps"]) and m["settings"]["alpha"] == {"who": "alpha"}
    assert m["settings"]["beta"] == {"who": "beta"} and m["steps"]["mine"]["status"] == "done"


def test_a_second_run_of_one_step_is_refused(mined, tmp_path):
    import fcntl

    run = copy_run(mined, tmp_path / "run")
    with open(run / ".lock-step-values", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        one_line_error(run_cli("values", run), needle="busy")


def _mount_tmpfs(path: Path, size: str, ro: bool = False) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_run_directory(mined, tmp_path):
    mnt = tmp_path / "ro"
    if not _mount_tmpfs(mnt, "64m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = copy_run(mined, mnt / "run")
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)]).returncode == 0
        one_line_error(run_cli("values", run), needle="Read-only")
        one_line_error(run_cli("annotate", "add", run, "-a", "x", "-l", "0", "-d", "0"), needle="")
        one_line_error(run_cli("annotate", "list", run), needle="")
    finally:
        _umount(mnt)


def test_full_disk_during_mine(tiny_dirs, tmp_path):
    mnt = tmp_path / "full"
    if not _mount_tmpfs(mnt, "400k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        res = run_cli("mine", "--out", mnt / "run", "--model", tiny_dirs["gpt2"], "--corpus", VALID,
                      "--max-sentences", "3000", "--top-k", "50", "--checkpoint-every", "0")
        one_line_error(res, needle="No space left")
        no_temp_files(mnt)
        tables_readable(mnt / "run")
    finally:
        _umount(mnt)


# ---- Ctrl-C -----------------------------------------------------------------------------------
def test_ctrl_c_during_mine_then_resume(tiny_dirs, tmp_path):
    out = tmp_path / "r"
    # Long enough that the signal lands mid-pass: one that lands while the interpreter is already
    # shutting down meets SIGINT's default disposition and kills the process (-2), a race, not a bug.
    args = ["mine", "--out", str(out), "--model", str(tiny_dirs["llama"]), "--corpus", str(WT2 / "wiki.train.tokens"),
            "--max-sentences", "2000", "--top-k", "5", "--checkpoint-every", "0"]
    p = subprocess.Popen([sys.executable, "-m", "ffkv.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    # mid-pass: the checkpoint exists (the streamed `sentences` table appears only when the pass ends)
    while not (out / ".mine_checkpoint.npz").exists() and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.1)
    time.sleep(0.3)
    if p.poll() is not None:
        pytest.skip("mining finished before it could be interrupted")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)

    class R:
        returncode, stderr = p.returncode, err
    one_line_error(R, code=130, needle="interrupted")
    no_temp_files(out)
    tables_readable(out)
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "manifest.json").read_text())["steps"]["mine"]["status"] == "done"


# ---- every step can be redone: the command a damaged table names takes --force ------------------
@pytest.mark.parametrize("cmd", ["mine", "values", "compose", "mutate", "patterns", "normalize"])
def test_every_step_takes_force(cmd):
    res = run_cli(cmd, "--help")
    assert res.returncode == 0 and "--force" in res.stdout, res.stdout[-2000:]


@pytest.mark.parametrize("error", ["gpu", "host"])
def test_out_of_memory_mid_mine_is_one_line_and_resumes(tmp_path, tiny_dirs, monkeypatch, error):
    """Memory running out in the middle of a pass (the device's, as torch raises it on CUDA, or the
    host allocator's) is one line that says what to do, exit code 2; the same command then
    resumes from the last checkpoint and writes the tables of a pass never stopped."""
    import torch

    from ffkv.mine import engine
    from test_mine import _assert_same_mine

    args = ["--model", tiny_dirs["gpt2"], "--corpus", VALID, "--max-sentences", "120", "--top-k", "4",
            "--batch-tokens", "128", "--checkpoint-every", "0"]
    ref = tmp_path / "ref"
    assert run_cli("mine", "--out", ref, *args).returncode == 0
    real, calls = engine._one_batch, []

    def one_batch(*a, **kw):
        calls.append(1)
        if len(calls) == 5:
            raise (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") if error == "gpu"
                   else RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
        return real(*a, **kw)

    monkeypatch.setattr(engine, "_one_batch", one_batch)
    out = tmp_path / "run"
    res = run_cli("mine", "--out", out, *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    said = [l for l in res.stderr.splitlines() if l.startswith("ffkv: error")]
    assert len(said) == 1 and f"out of {error} memory" in said[0].lower() and "--batch-tokens" in said[0], res.stderr
    assert not (out / "triggers.parquet").exists()
    monkeypatch.setattr(engine, "_one_batch", real)
    res = run_cli("mine", "--out", out, *args)
    assert res.returncode == 0, res.stderr
    assert "resuming from checkpoint at batch 4" in res.stdout
    _assert_same_mine(out, ref)
