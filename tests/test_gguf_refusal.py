"""An unsupported GGUF is refused from its header before torch or transformers is imported: that
import is what a refusal would otherwise wait on (~1.5 s of the 2 s goal; `benchmarks/bench_gguf_refusal.py`
times it). Checked by what a fresh process has imported, not by a clock."""
from __future__ import annotations

import subprocess
import sys

import pytest

from test_refusals import write_gguf

# every command that takes --model (or a model argument) and would otherwise load it
COMMANDS = [("info", "{gguf}"), ("explain", "The cat", "--model", "{gguf}"),
            ("corpus", "--model", "{gguf}"), ("mine", "--model", "{gguf}", "--out", "{tmp}/run"),
            ("compose", "{tmp}/run", "--model", "{gguf}")]


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "mamba.gguf", "mamba")


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_unsupported_gguf_refused_without_torch(mamba, tmp_path, cmd):
    args = [a.format(gguf=mamba, tmp=tmp_path) for a in cmd]
    code = ("import sys\nfrom ffkv.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    code = e.code\nheavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "print(code, ','.join(heavy) or '-')\n")
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                         env={"FFKV_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
                              "PATH": "/usr/bin:/bin"})
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "unsupported architecture 'mamba'" in lines[0], res.stderr
    assert res.stdout.split() == ["2", "-"], res.stdout  # exit 2; neither torch nor transformers loaded
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*"))
