"""FFKV_CACHE from the environment is checked (issue 49): empty or relative, it would be the
folder the user stands in, and a 517 MB model conversion landed there."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import run_cli
from test_cli_errors import one_line_error

from ffkv.errors import FfkvError
from ffkv.files import cache_dir


@pytest.mark.parametrize("value", ["", "  ", "cache", "./cache", "a/b"])
def test_empty_or_relative_cache_is_refused(monkeypatch, value):
    monkeypatch.setenv("FFKV_CACHE", value)
    with pytest.raises(FfkvError, match="FFKV_CACHE must be an absolute folder"):
        cache_dir()


def test_absolute_home_and_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("FFKV_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.setenv("FFKV_CACHE", "~/x")
    assert cache_dir() == Path.home() / "x"
    monkeypatch.delenv("FFKV_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "ffkv"


@pytest.mark.parametrize("value", ["", "rel"])
def test_info_with_a_bad_cache_is_one_line_and_writes_nothing_here(tmp_path, monkeypatch, value):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("FFKV_CACHE", value)
    line = one_line_error(run_cli("info"), needle="FFKV_CACHE")
    assert "absolute" in line
    assert list(here.iterdir()) == []


def test_commands_from_a_scratch_folder_write_nothing_there(tmp_path, tiny_dirs, monkeypatch):
    """ffkv writes only under the run, the cache and --out: commands that read write nothing in the
    folder they run from."""
    here = tmp_path / "scratch"
    here.mkdir()
    corpus = tmp_path / "c.txt"
    corpus.write_text("The cat sat on the mat.\n\nA dog ran.\n")
    out = tmp_path / "run"
    monkeypatch.chdir(here)
    monkeypatch.setenv("FFKV_CACHE", str(tmp_path / "cache"))
    for args in (("info", tiny_dirs["gpt2"]), ("corpus", corpus, "--model", tiny_dirs["gpt2"]),
                 ("explain", "The cat", "--model", tiny_dirs["gpt2"]),
                 ("mine", "--out", out, "--model", tiny_dirs["gpt2"], "--corpus", corpus, "--top-k", "2")):
        res = run_cli(*args)  # in this process, from `here`
        assert res.returncode == 0, (args, res.stderr[-800:])
        assert sorted(os.listdir(here)) == [], args
    assert (out / "manifest.json").is_file()
