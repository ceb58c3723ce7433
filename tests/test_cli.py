"""The CLI as users meet it: help, info, and one-line errors with exit code 2."""
import json

import pytest

from conftest import WT2, build_tiny, run_cli


def _one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    lines = [l for l in res.stderr.strip().splitlines() if l.strip() and "[: unexpected" not in l]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_help_lists_commands():
    res = run_cli("--help")
    assert res.returncode == 0
    for c in ("info", "explain", "corpus"):
        assert c in res.stdout


def test_info_tiny_json(tiny_dirs):
    res = run_cli("info", tiny_dirs["opt"], "--json")
    inf = json.loads(res.stdout)
    assert inf["architecture"] == "opt" and inf["layers"] == 2 and inf["d_m"] == 96
    assert inf["memories"] == 192 and inf["gated"] is False and inf["activation"] == "relu"


@pytest.mark.slow
def test_info_default_model():
    res = run_cli("info", "--json")
    inf = json.loads(res.stdout)
    assert (inf["layers"], inf["d_m"], inf["memories"], inf["d"]) == (30, 1536, 46080, 576)
    assert inf["gated"] and inf["activation"] == "silu" and inf["vocab_size"] == 49152


def test_unknown_model_id():
    _one_line_error(run_cli("info", "no-such-org/no-such-model-xyz"), "unknown model")


def test_missing_model_path(tmp_path):
    _one_line_error(run_cli("info", tmp_path / "nope" / "model.gguf"), "does not exist")


def test_corrupt_gguf(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    _one_line_error(run_cli("info", p), "not a readable GGUF")


def test_truncated_gguf(tmp_path):
    from ffkv.model.load import resolve_default_model

    src = resolve_default_model()
    p = tmp_path / "trunc.gguf"
    with open(src, "rb") as f:
        p.write_bytes(f.read(3_000_000))
    _one_line_error(run_cli("info", p, env={"FFKV_CACHE": str(tmp_path / "cache")}), "GGUF")


def test_unsupported_architecture(tmp_path, tok_dir):
    import transformers as tf
    from transformers import AutoTokenizer

    cfg = tf.CodeGenConfig(n_embd=32, n_layer=1, n_head=4, rotary_dim=4, vocab_size=600, n_positions=64,
                           bos_token_id=0, eos_token_id=0)
    tf.CodeGenForCausalLM(cfg).save_pretrained(tmp_path / "codegen")
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(tmp_path / "codegen")
    _one_line_error(run_cli("info", tmp_path / "codegen"), "unsupported architecture 'codegen'", "llama", "gpt2")


def test_empty_corpus_and_missing_file(tmp_path, tiny_dirs):
    e = tmp_path / "empty.txt"
    e.write_text("\n \n")
    _one_line_error(run_cli("corpus", e, "--model", tiny_dirs["gpt2"]), "empty")
    _one_line_error(run_cli("corpus", tmp_path / "missing.txt", "--model", tiny_dirs["gpt2"]), "does not exist")


def test_bad_bytes_and_truncation_are_counted(tmp_path, tiny_dirs):
    p = tmp_path / "x.txt"
    long = " ".join(["word"] * 400) + "."
    p.write_bytes(b"Fine sentence \xff here. " + long.encode() + b"\n")
    res = run_cli("corpus", p, "--model", tiny_dirs["gpt2"], "--json")
    out = json.loads(res.stdout)
    assert out["replaced_chars"] == 1 and out["truncated"] == 1 and out["sentences"] == 2


def test_explain_tiny(tiny_dirs):
    res = run_cli("explain", "The cat sat on the", "--model", tiny_dirs["llama"], "--json")
    out = json.loads(res.stdout)
    assert len(out["layers"]) == 3 and out["layers"][-1]["top_o"] == out["prediction"]


def test_corpus_counts_equal_the_whole_corpus_path(tiny_dirs):
    """`ffkv corpus` streams the corpus; its counts and head equal reading every sentence at once
    and tokenizing them (`CorpusSource.sentences` + `tokenize`), computed here directly."""
    from ffkv.corpus.sources import open_corpus, tokenize
    from ffkv.model.memories import open_model

    spec = str(WT2 / "wiki.valid.tokens")
    res = run_cli("corpus", spec, "--model", tiny_dirs["gpt2"], "--max-sentences", "300", "--head", "3", "--json")
    out = json.loads(res.stdout)
    mm = open_model(str(tiny_dirs["gpt2"]), device="cpu")
    src = open_corpus(spec)
    sents = src.sentences(max_sentences=300)
    ids, n_cut = tokenize(mm.tok, sents, mm.max_length, mm.vocab_size)
    assert (out["sentences"], out["tokens"], out["truncated"]) == (len(sents), sum(map(len, ids)), n_cut)
    assert out["documents"] == src.stats.documents and out["sha256"] == src.sha256
    assert out["head"] == [s.text for s in sents[:3]]
