"""Refusals before work: what a user asks for is checked against its real limit before a weight
loads, a tensor is dequantized or a table is written, in one line with exit code 2.

- A GGUF is read from its header (`ffkv.model.load.gguf_metadata`): an unsupported architecture,
  a truncated or a foreign file is refused before transformers is imported, with no progress bar
  and nothing in the model cache.
- A --suppress spec is checked against the model's shape from its config or GGUF header.
- A text longer than the model's context is refused, or cut with an explicit --truncate and said
  so (`ffkv.model.context.fit_context`, the one rule).
- `ffkv values --bins` against its int16 column; `ffkv mutate` pads within the model's positions.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import WT2, mine_tiny, run_cli
from ffkv.errors import FfkvError
from ffkv.model.context import fit_context

BAR_TEXT = ("Converting", "de-quantizing", "it/s", "%|")


def one_line_error(res, needle: str | None = None) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = [l for l in res.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    assert not any(b in res.stderr for b in BAR_TEXT), res.stderr
    if needle is not None:
        assert needle in lines[0], lines[0]
    return lines[0]


def write_gguf(path: Path, arch: str, vocab: int = 64) -> Path:
    """A small GGUF written by the `gguf` package itself: a few metadata keys, two tensors."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(16)
    w.add_token_list([f"t{i}" for i in range(vocab)])  # a string array the header walk skips
    w.add_tensor("token_embd.weight", rng.random((vocab, 32), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", rng.random((16, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    out = {"mamba": write_gguf(d / "mamba.gguf", "mamba"), "rwkv6": write_gguf(d / "rwkv6.gguf", "rwkv6"),
           "llama": write_gguf(d / "llama.gguf", "llama", vocab=512)}
    whole = out["llama"].read_bytes()
    (d / "truncated.gguf").write_bytes(whole[: len(whole) // 2])  # header whole, tensor data cut
    (d / "header_cut.gguf").write_bytes(whole[:200])  # cut inside the metadata
    (d / "foreign.gguf").write_bytes(b"PK\x03\x04 a zip file, not a model " * 20)
    # an unsupported architecture whose tensor data is garbage: refused all the same, since no
    # tensor is ever read
    raw = bytearray(out["mamba"].read_bytes())
    raw[-2000:] = np.random.default_rng(1).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    (d / "mamba_garbage.gguf").write_bytes(bytes(raw))
    out.update({k: d / f"{k}.gguf" for k in ("truncated", "header_cut", "foreign", "mamba_garbage")})
    return out


# ---- GGUF: the header decides, before any tensor --------------------------------------------------
def test_gguf_header_matches_the_gguf_reader(ggufs):
    """The hand-written header walk agrees with the gguf package's own reader."""
    from gguf import GGUFReader

    from ffkv.model.load import _gguf_header

    for name in ("mamba", "llama"):
        meta, need = _gguf_header(ggufs[name])
        r = GGUFReader(str(ggufs[name]))
        assert meta["general.architecture"] == name
        assert meta[f"{name}.block_count"] == 2 and meta[f"{name}.feed_forward_length"] == 16
        assert meta["tokenizer.ggml.tokens"] == len(r.fields["tokenizer.ggml.tokens"].data)
        end = max(t.data_offset + t.n_bytes for t in r.tensors)
        assert need == end == ggufs[name].stat().st_size


def test_gguf_metadata_of_the_default_model():
    from ffkv.model.load import gguf_metadata, resolve_default_model

    meta = gguf_metadata(resolve_default_model())
    assert meta == {"gguf_architecture": "llama", "model_type": "llama", "layers": 30, "d_m": 1536,
                    "context": 8192}


@pytest.mark.parametrize("name, needle", [
    ("mamba", "unsupported architecture 'mamba'"), ("rwkv6", "unsupported architecture 'rwkv6'"),
    ("mamba_garbage", "unsupported architecture 'mamba'"), ("truncated", "is truncated"),
    ("header_cut", "not a readable GGUF"), ("foreign", "not a readable GGUF")])
def test_gguf_refused_before_transformers(ggufs, name, needle):
    """In a fresh process: the refusal comes before transformers is even imported, so no tensor
    can have been dequantized (the garbage tensor data proves it too)."""
    code = ("import sys\nfrom ffkv.errors import FfkvError\nfrom ffkv.model.load import load_model\n"
            f"try:\n    load_model({str(ggufs[name])!r}, device='cpu')\nexcept FfkvError as e:\n"
            "    print(e)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    msg, mods = res.stdout.strip().splitlines()
    assert needle in msg and mods == "[]", res.stdout


@pytest.mark.parametrize("name, needle", [("mamba", "unsupported architecture 'mamba'"),
                                          ("truncated", "is truncated"), ("foreign", "not a readable GGUF")])
def test_cli_gguf_refusal_is_one_line_and_writes_no_cache(ggufs, tmp_path, name, needle):
    cache = tmp_path / "cache"
    res = run_cli("info", ggufs[name], env={"FFKV_CACHE": str(cache)})
    line = one_line_error(res, needle)
    if name == "mamba":  # the supported types are listed
        assert "llama" in line and "gpt2" in line
    assert not cache.exists() or not any(cache.rglob("*"))


def test_explain_suppress_checked_before_the_default_model_loads(tmp_path):
    """`ffkv explain --suppress 99:0` with an empty model cache: refused from the GGUF's header,
    no dequantizing bar first, nothing cached."""
    cache = tmp_path / "cache"
    res = run_cli("explain", "The cat", "--suppress", "99:0", env={"FFKV_CACHE": str(cache)})
    one_line_error(res, "layer 99 out of range 0..29")
    res = run_cli("explain", "The cat", "--suppress", "3:1536", env={"FFKV_CACHE": str(cache)})
    one_line_error(res, "dim 1536 out of range 0..1535")
    assert not cache.exists() or not any(cache.rglob("*"))


def test_explain_suppress_checked_from_the_config_alone(tiny_dirs, tmp_path):
    """A folder with only config.json: its weights cannot load, so a refusal naming the layer or
    the dim proves the check read the config, not the model."""
    for arch, layers, d_m in (("gpt2", 2, 96), ("llama", 3, 80)):
        d = tmp_path / arch
        d.mkdir()
        shutil.copy(tiny_dirs[arch] / "config.json", d / "config.json")
        res = run_cli("explain", "The cat", "--model", d, "--suppress", f"{layers}:0")
        one_line_error(res, f"layer {layers} out of range 0..{layers - 1}")
        res = run_cli("explain", "The cat", "--model", d, "--suppress", f"0:{d_m}")
        one_line_error(res, f"dim {d_m} out of range 0..{d_m - 1}")


def test_model_shape_refuses_an_unsupported_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "num_hidden_layers": 2}))
    res = run_cli("info", tmp_path)
    one_line_error(res, "unsupported architecture 'mamba'")


def test_an_unknown_type_names_the_family_its_modules_match(tmp_path):
    """CodeGen's config alone: every command that opens a model refuses it in one line, before any
    weight loads, listing the supported types and naming GPT-J, whose module paths it has."""
    import transformers as tf

    tf.CodeGenConfig(n_embd=32, n_layer=1, n_head=4, rotary_dim=4, vocab_size=600, n_positions=64,
                     bos_token_id=0, eos_token_id=0).to_json_file(tmp_path / "config.json")
    for args in (("info", tmp_path), ("explain", "The cat", "--model", tmp_path)):
        line = one_line_error(run_cli(*args), "unsupported architecture 'codegen'")
        assert "layout of 'gptj'" in line and "supported: bloom, falcon, gemma" in line, line


# ---- the context: one rule ------------------------------------------------------------------------
def test_fit_context_rule():
    ids = list(range(10))
    assert fit_context(ids, 10) == (ids, 0)
    assert fit_context(ids, 4, "left") == ([6, 7, 8, 9], 6)
    assert fit_context(ids, 4, "right") == ([0, 1, 2, 3], 6)
    with pytest.raises(FfkvError, match="10 tokens long.*at most 4.*--truncate"):
        fit_context(ids, 4)
    with pytest.raises(FfkvError, match="choose left"):
        fit_context(ids, 4, "middle")


def long_text(mm, n_tokens: int) -> str:
    words = " ".join(w for s in (WT2 / "wiki.valid.tokens").read_text().split("\n")[:400] for w in s.split())
    text = " ".join(words.split()[: n_tokens])
    assert len(mm.tok(text)["input_ids"]) > n_tokens // 2 > mm.max_length
    return text


def test_explain_refuses_or_cuts_a_long_text(tiny_models):
    from ffkv.web.explain import explain

    mm = tiny_models["gpt2"]  # 128 positions
    text = long_text(mm, 400)
    ids = mm.tok(text)["input_ids"]
    with pytest.raises(FfkvError, match=r"tokens long; the model's context \(128 tokens\) takes at most 128"):
        explain(mm, text)
    left = explain(mm, text, truncate="left")
    right = explain(mm, text, truncate="right")
    dropped = len(ids) - 128
    assert left["truncated"] == {"side": "left", "dropped_tokens": dropped, "text_tokens": len(ids)}
    assert right["truncated"] == {"side": "right", "dropped_tokens": dropped, "text_tokens": len(ids)}
    assert left["n_tokens"] == right["n_tokens"] == 128
    # the kept tokens are the text's end (left) or start (right), explained as such
    dec = [mm.tok.decode([i]) for i in ids]
    assert left["tokens"] == dec[-128:] and right["tokens"] == dec[:128]
    assert left["prediction_id"] == explain(mm, mm.tok.decode(ids[-128:]))["prediction_id"]
    assert explain(mm, "The cat")["truncated"] is None


def test_cli_explain_long_text(tiny_dirs, tiny_models):
    text = long_text(tiny_models["gpt2"], 400)
    res = run_cli("explain", text, "--model", tiny_dirs["gpt2"], "--json")
    one_line_error(res, "the model's context (128 tokens) takes at most 128")
    assert res.stdout == ""
    res = run_cli("explain", text, "--model", tiny_dirs["gpt2"], "--json", "--truncate", "left")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["truncated"]["side"] == "left" and out["truncated"]["dropped_tokens"] > 0
    assert out["n_tokens"] == 128
    assert f"dropped {out['truncated']['dropped_tokens']:,} tokens at its start" in res.stderr
    one_line_error(run_cli("explain", text, "--model", tiny_dirs["gpt2"], "--truncate", "both"),
                   "--truncate 'both'")


# ---- steps: limits checked before work ------------------------------------------------------------
@pytest.fixture(scope="module")
def long_run(tiny_dirs, tmp_path_factory) -> Path:
    """A tiny GPT-2 run (128 positions) whose corpus has sentences cut at the context."""
    return mine_tiny(tmp_path_factory.mktemp("refusals") / "run", tiny_dirs["gpt2"], 300, 5)


def test_values_bins_checked_against_the_column(long_run):
    before = json.loads((long_run / "manifest.json").read_text())["steps"].get("values")
    res = run_cli("values", long_run, "--bins", "100000", "--force")
    one_line_error(res, "--bins 100,000 is too large: at most 32,768")
    assert json.loads((long_run / "manifest.json").read_text())["steps"].get("values") == before
    assert not list(long_run.glob("values*.parquet"))


def test_rescore_pads_within_the_context(tiny_models):
    """Leaves of one original that share its first 100 and 90 tokens, in one batch: the shorter
    one's padding ran past GPT-2's 128 positions (IndexError). Equal to full passes now."""
    from ffkv.memories.rescore import rescore, sharing_ok

    mm = tiny_models["gpt2"]
    assert mm.max_length == 128 and sharing_ok(mm)
    base = tuple(int(x) for x in np.random.default_rng(0).integers(3, mm.vocab_size - 1, 128))
    seqs = [base, base[:100] + base[101:], base[:90] + base[91:]]
    args = (seqs, [1, 1, 1], [127, 126, 126], [0, 1, 2])
    shared = rescore(mm, *args, anchors=[-1, 0, 0])
    full = rescore(mm, *args)
    np.testing.assert_allclose(shared, full, rtol=1e-4, atol=1e-5)
    with pytest.raises(FfkvError, match="does not fit the model's context of 128"):
        rescore(mm, [base + base[:1]], [1], [128], [0])


def test_mutate_every_key_on_a_run_at_the_context(long_run):
    res = run_cli("mutate", long_run, "--keys-per-layer", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((long_run / "manifest.json").read_text())["steps"]["mutate"]
    assert m["status"] == "done" and m["max_rel_mismatch_vs_mined_coef"] < 1e-3
