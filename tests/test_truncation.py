"""No silent truncation (issue 27 item 4): a corpus's sentences meet the model's context through
one function (`ffkv.model.context.fit_sentences`, over `fit_context`), cut at their end, and every
step that reads a corpus says so on stderr and keeps the count (mine, compose, normalize).

The tiny models hold 128 positions; the corpus has one run-on sentence far past that, tokenized
here by the tokenizer itself (the independent computation the stored ids are held to).
"""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from test_cli_errors import one_line_error

from ffkv.model.context import fit_context, fit_sentences, sentences_note

CONTEXT = 128  # the tiny models' positions (conftest.tiny_config)
LONG = ("The mill by the river ground wheat and barley and rye, " * 40).strip() + "."
SHORT = ["The cat sat on the mat by the door.", "A quiet town grew up beside the old stone bridge.",
         "Rain fell all night over the hills and the farms."]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp("trunc") / "long.txt"
    p.write_text("\n".join([SHORT[0], LONG, *SHORT[1:]]) + "\n")
    return p


def own_ids(model_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=True)["input_ids"]


def test_fit_sentences_cuts_at_the_end_through_fit_context():
    ids = [list(range(10)), [7, 8], [], list(range(4))]
    out, cut = fit_sentences(ids, 4)
    assert out == [[0, 1, 2, 3], [7, 8], [], [0, 1, 2, 3]]
    assert cut == {"sentences": 1, "dropped_tokens": 6, "context": 4}
    assert out == [fit_context(i, 4, "right")[0] for i in ids]
    assert fit_sentences(ids, 10) == (ids, {"sentences": 0, "dropped_tokens": 0, "context": 10})
    assert sentences_note("sentences", 0) is None
    note = sentences_note("sentences", 2, 50, 128)
    assert "2 of 50 sentence(s) of `sentences`" in note and "first 128 tokens" in note


def test_mine_says_a_cut_sentence_and_keeps_its_start(tiny_dirs, corpus, tmp_path):
    """A sentence past the context is cut to its first 128 tokens, said on stderr and counted in the
    manifest; every mined prefix lies within it (it used to be cut with no word on stderr)."""
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    res = run_cli("mine", "--out", run, "--model", tiny_dirs["gpt2"], "--corpus", corpus, "--top-k", "3")
    assert res.returncode == 0, res.stderr
    full = own_ids(tiny_dirs["gpt2"], LONG)
    assert len(full) > CONTEXT
    note = [l for l in res.stderr.splitlines() if "longer than the model's context" in l]
    assert len(note) == 1 and "1 of 4 sentence(s) of `sentences`" in note[0], res.stderr
    assert f"first {CONTEXT} tokens" in note[0]
    m = json.loads((run / "manifest.json").read_text())
    assert m["corpora"]["sentences"]["counts"]["truncated"] == 1
    sents = pq.read_table(run / "sentences.parquet").to_pylist()
    long_row = next(r for r in sents if r["text"] == LONG)
    assert long_row["token_ids"] == full[:CONTEXT] and long_row["n_tokens"] == CONTEXT
    for r in sents:
        if r["text"] != LONG:
            assert r["token_ids"] == own_ids(tiny_dirs["gpt2"], r["text"])  # not cut
    assert max(pq.read_table(run / "triggers.parquet", columns=["position"]).column("position").to_pylist()) < CONTEXT
    # done with these settings: a second run says nothing to do (and the note again: it is still true)
    again = run_cli("mine", "--out", run, "--model", tiny_dirs["gpt2"], "--corpus", corpus, "--top-k", "3")
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_compose_says_a_cut_sentence(tiny_dirs, corpus, tmp_path):
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    res = run_cli("compose", run, "--model", tiny_dirs["gpt2"], "--corpus", corpus, "--prefixes", "5")
    assert res.returncode == 0, res.stderr
    assert "sentence(s) of `compose_sentences` were longer than the model's context" in res.stderr, res.stderr
    m = json.loads((run / "manifest.json").read_text())
    assert m["corpora"]["compose_sentences"]["counts"]["truncated"] == 1
    rows = pq.read_table(run / "compose_sentences.parquet").to_pylist()
    assert next(r for r in rows if r["text"] == LONG)["token_ids"] == own_ids(tiny_dirs["gpt2"], LONG)[:CONTEXT]


def test_normalize_says_a_cut_held_out_sentence(tiny_dirs, tiny_models, corpus, tmp_path):
    """normalize's held-out text: the same cut, the same note (through the step's warn)."""
    from ffkv.steps.normalize import NormalizeSettings
    from ffkv.model import identity
    from ffkv.steps.lifecycle import execute
    from ffkv.store.run import Run

    text = tmp_path / "held.txt"  # enough tokens for the splits, one sentence past the context
    text.write_text("\n\n".join([" ".join(SHORT * 8), LONG, " ".join(SHORT[::-1] * 8)]) + "\n")
    run = Run(tmp_path / "r", create=True)
    mm = tiny_models["gpt2"]
    identity.record_model(run, mm)
    run.save()
    notes = []
    s = NormalizeSettings(corpus=str(text), tokens=200, fit_tokens=100, sweep_tokens=100, capacity_n=(16,),
                          synthetic_draws=20, variance_repeats=2, batch_tokens=512)
    execute(run, "normalize", s, mm=mm, show_progress=False, warn=notes.append, log=lambda m: None)
    cut = [n for n in notes if "`normalize_sentences` were longer than the model's context" in n]
    assert len(cut) == 1 and cut[0].startswith("1 of "), notes


@pytest.mark.parametrize("cmd", ["mine", "compose", "normalize"])
def test_corpus_steps_take_no_truncate_side(cmd, tmp_path):
    """A corpus is always cut at its end (a prefix never depends on what follows it): the corpus
    steps refuse --truncate in one line, as any unknown option."""
    args = ["mine", "--out", tmp_path / "r"] if cmd == "mine" else [cmd, tmp_path / "r"]
    line = one_line_error(run_cli(*args, "--truncate", "left"), needle="--truncate")
    assert "No such option" in line


def test_pre_tokenized_rows_past_the_context_are_cut_and_said(tiny_dirs, tmp_path):
    """Rows of ids (an (N, T) .npy) meet the same rule: cut at their end, counted, said."""
    import numpy as np
    import pyarrow.parquet as pq

    rows = np.random.default_rng(0).integers(1, 500, size=(4, 200)).astype(np.int32)
    src = tmp_path / "ids.npy"
    np.save(src, rows)
    run = tmp_path / "run"
    res = run_cli("mine", "--out", run, "--model", tiny_dirs["gpt2"], "--corpus", src, "--top-k", "3")
    assert res.returncode == 0, res.stderr
    assert "4 of 4 sentence(s) of `sentences` were longer than the model's context" in res.stderr, res.stderr
    stored = {r["sentence_id"]: r["token_ids"] for r in pq.read_table(run / "sentences.parquet").to_pylist()}
    assert sorted(map(tuple, stored.values())) == sorted(tuple(r[:CONTEXT]) for r in rows.tolist())
    assert json.loads((run / "manifest.json").read_text())["corpora"]["sentences"]["counts"]["truncated"] == 4


# ---- the sentence encoder of semantic patterns: its own, shorter context -----------------------------
@pytest.fixture(scope="module")
def embedder():
    from ffkv.steps.patterns.semantic import Embedder

    return Embedder()


def mean_pooled(emb, enc):
    """all-MiniLM-L6-v2's embedding, computed here: mean over the mask, then unit length."""
    import torch

    with torch.no_grad():
        h = emb.model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()


def test_a_long_prefix_is_embedded_by_its_end(embedder):
    """The encoder holds 256 tokens: a longer prefix keeps its end, where its trigger is (it used to
    keep its start, so two prefixes differing only in their trigger got one embedding)."""
    import numpy as np

    short = ["The cat sat on the mat.", "A much longer sentence about rivers and mills, with many words."]
    hf = embedder.tok(short, padding=True, truncation=True, max_length=256, return_tensors="pt")
    ours = embedder.encode(short)
    assert ours["input_ids"].tolist() == hf["input_ids"].tolist()
    assert np.allclose(embedder.embed(short), mean_pooled(embedder, hf), atol=1e-6)
    assert embedder.cut == 0

    body = "The mill by the river ground wheat and barley and rye, " * 30
    a, b = body + "and then the football match began", body + "and then the chemistry lecture began"
    ea, eb = embedder.embed([a, b])
    assert embedder.cut == 2
    assert float(ea @ eb) < 0.999  # the ends differ, so do the embeddings
    tok = type(embedder.tok).from_pretrained(embedder.tok.name_or_path, truncation_side="left")
    ref = mean_pooled(embedder, tok([a], truncation=True, max_length=256, return_tensors="pt"))[0]
    assert np.allclose(ea, ref, atol=1e-5)


def test_patterns_says_prefixes_cut_for_the_encoder(tiny_dirs, tmp_path):
    """With an encoder context of 8 tokens every prefix is cut: the step says so and counts them."""
    from conftest import mine_tiny
    from ffkv.steps.patterns import PatternsSettings
    from ffkv.steps.patterns.semantic import Embedder
    from ffkv.steps.lifecycle import execute
    from ffkv.store.run import Run

    run = Run(mine_tiny(tmp_path / "run", tiny_dirs["gpt2"], 40, 5))
    notes = []
    out = execute(run, "patterns", PatternsSettings(keys_per_layer=2, semantic_keys_per_layer=1, top=5),
                  embedder=Embedder(max_length=8), show_progress=False, warn=notes.append, log=lambda m: None)
    assert out.info["embedded_cut"] > 0
    assert [n for n in notes if "longer than the sentence encoder's context" in n] == [
        f"{out.info['embedded_cut']:,} prefix text(s) were longer than the sentence encoder's context and were "
        f"embedded by their end (where the trigger is)"]
