"""Property tests of everything fed user input: range parsers, corpus readers, annotation import.

Each either returns a well-formed result or raises FfkvError with one line: never another
exception, never a silent wrong answer.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffkv.errors import FfkvError
from ffkv.parse import MAX_RANGE, parse_int_list, parse_ranges

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def spans(draw_ints):
    return st.lists(st.tuples(st.integers(0, 500), st.integers(0, 40)), min_size=1, max_size=8)


@FAST
@given(spans(None))
def test_ranges_round_trip(parts):
    text = ",".join(f"{a}-{a + n}" if n else str(a) for a, n in parts)
    want = sorted({x for a, n in parts for x in range(a, a + n + 1)})
    assert parse_ranges(text, "--dims") == want
    assert parse_int_list(text, 10_000, "dims") == want


@FAST
@given(st.text(max_size=40))
def test_ranges_any_text_parses_or_fails_in_one_line(text):
    try:
        out = parse_ranges(text, "--dims", upper=1000)
    except FfkvError as e:
        assert "\n" not in str(e) and str(e)
        return
    assert out == sorted(set(out)) and all(0 <= x < 1000 for x in out)


@FAST
@given(st.integers(0, 10_000), st.integers(1, 10_000))
def test_reversed_range_is_refused(a, d):
    with pytest.raises(FfkvError, match="reversed"):
        parse_ranges(f"{a + d}-{a}", "--dims")


def test_huge_range_is_refused_without_building_it():
    with pytest.raises(FfkvError, match="longer than"):
        parse_ranges(f"0-{MAX_RANGE * 1000}", "-p")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400), st.sampled_from([".txt", ".jsonl", ".tokens"]))
def test_corpus_readers_on_any_bytes(tmp_path, data, suffix):
    from ffkv.corpus.sources import open_corpus

    f = tmp_path / f"c{suffix}"
    f.write_bytes(data)
    try:
        sents = open_corpus(str(f)).sentences()
    except FfkvError as e:
        assert "\n" not in str(e)
        return
    assert sents and all(isinstance(s.text, str) and s.text.strip() for s in sents)
    assert [s.sentence_id for s in sents] == list(range(len(sents)))


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=6), ch, max_size=3),
                           max_leaves=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(json_values, min_size=1, max_size=4))
def test_jsonl_corpus_fields_are_text_or_an_error(tmp_path, vals):
    from ffkv.corpus.sources import open_corpus

    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"text": v}) + "\n" for v in vals))
    try:
        sents = open_corpus(str(f)).sentences()
    except FfkvError as e:
        assert "\n" not in str(e)
        assert not all(isinstance(v, str) and v.strip() for v in vals) or "empty" in str(e)
        return
    assert all(isinstance(v, str) for v in vals)
    assert " ".join(s.text for s in sents).split() == " ".join(v for v in vals).split()


records = st.fixed_dictionaries(
    {"annotator": st.one_of(st.text(max_size=6), st.integers()), "layer": st.one_of(st.integers(-2, 3), st.text(max_size=2)),
     "dim": st.one_of(st.integers(-2, 5), st.floats()), "patterns": json_values},
    optional={"sign": st.sampled_from([1, -1, 0, "x"]), "updated": st.floats(allow_nan=True, allow_infinity=True),
              "note": json_values})


@pytest.fixture(scope="module")
def store_run(tiny_dirs, tmp_path_factory):
    from conftest import WT2, run_cli

    out = tmp_path_factory.mktemp("props") / "run"
    res = run_cli("mine", "--out", out, "--model", tiny_dirs["gpt2"], "--corpus", WT2 / "wiki.valid.tokens",
                  "--max-sentences", "40", "--top-k", "5")
    assert res.returncode == 0, res.stderr
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(records, min_size=1, max_size=3))
def test_annotation_import_of_any_records(store_run, recs):
    from ffkv.store.annotations import AnnotationStore

    st_ = AnnotationStore(store_run)
    before = st_.export()
    text = "".join(json.dumps(r) + "\n" for r in recs)  # NaN/Infinity become the JSON tokens users send
    try:
        counts = st_.import_(text)
    except FfkvError as e:
        assert "\n" not in str(e)
        assert st_.export() == before  # all or nothing
        return
    assert sum(counts.values()) == len(recs)
