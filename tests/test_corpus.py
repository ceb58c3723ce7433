import pytest
from hypothesis import example, given, settings, strategies as st

from conftest import WT2
from ffkv.corpus.sources import open_corpus
from ffkv.corpus.wikitext import detokenize, is_heading
from ffkv.errors import FfkvError


def _find(pattern):
    for line in (WT2 / "wiki.valid.tokens").read_text().split("\n"):
        if pattern in line:
            return line
    raise AssertionError(pattern)


def test_detok_hyphen_number_apostrophe_real_lines():
    line = _find("red @-@ tipped")
    out = detokenize(line)
    assert "red-tipped" in out and "@" not in out
    line = _find("0 @.@ 7")
    assert "0.7 – 2.2 kg (1.5 – 4.9 lb)" in detokenize(line)
    line = _find(" @,@ ")
    i = line.index(" @,@ ")
    num = line[i - 3:i + 8].split()
    assert "".join(num).replace("@,@", ",") in detokenize(line)
    line = _find("Club 's")
    assert "Club's" in detokenize(line)
    line = _find("isn 't")
    assert "isn't that" in detokenize(line)


def test_detok_punctuation_and_headings():
    assert detokenize(' He said " hello " , then left ( quickly ) . ') == 'He said "hello", then left (quickly).'
    assert is_heading(" = Homarus gammarus = ") and is_heading(" = = = Life = = = ")
    assert not is_heading(" A = B is an equation . ")


def test_wikitext_counts_and_determinism():
    a = open_corpus(str(WT2 / "wiki.valid.tokens"), seed=1).sentences(200)
    b = open_corpus(str(WT2 / "wiki.valid.tokens"), seed=1).sentences(200)
    c = open_corpus(str(WT2 / "wiki.valid.tokens"), seed=2).sentences(200)
    assert [s.text for s in a] == [s.text for s in b] and len(a) == 200
    assert [s.text for s in a] != [s.text for s in c]
    assert all(not s.text.startswith("=") for s in a)


def test_plain_jsonl_and_bad_bytes(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"First doc. Second sentence here.\n\nAnother doc \xff\xfe with bad bytes.\n")
    src = open_corpus(str(p))
    s = src.sentences()
    assert [x.text for x in sorted(s, key=lambda x: (x.doc_id, x.sentence_id))][:2] == ["First doc.", "Second sentence here."]
    assert src.stats.replaced_chars == 2 and src.stats.documents == 2
    j = tmp_path / "a.jsonl"
    j.write_text('{"body": "One. Two."}\n{"body": "Three."}\n')
    assert len(open_corpus(str(j), field="body").sentences()) == 3
    with pytest.raises(FfkvError, match="no field 'text'"):
        open_corpus(str(j)).sentences()


def test_embedded_splits_disjoint():
    tr = open_corpus("wikipedia:train")._documents()
    va = open_corpus("wikipedia:valid")._documents()
    assert 800 < len(va) < 1200 and len(tr) + len(va) == 10033
    assert not set(va) & set(tr[:2000])


def test_empty_corpus(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("\n\n  \n")
    with pytest.raises(FfkvError, match="empty"):
        open_corpus(str(p)).sentences()


def test_text_without_spacy_is_one_line(monkeypatch, tmp_path):
    """A box without spaCy (a bare GPU machine) still reads pre-tokenized corpora; splitting text
    there is refused in one line that names the way out, not with an ImportError."""
    import sys

    from ffkv.corpus import sources

    monkeypatch.setitem(sys.modules, "spacy", None)  # import spacy raises ImportError
    monkeypatch.setattr(sources, "_NLP", None)
    p = tmp_path / "plain.txt"
    p.write_text("One sentence here. Another one there.\n")
    with pytest.raises(FfkvError, match="needs spaCy.*pre-tokenized"):
        sources.open_corpus(str(p)).sentences(None)


_ALPHABET = ["a", "b", " ", "\n", "\r", "\r\n", "\n\n", "\t", "é", "\u00a0", " = H = ", "@-@", "\ufffd"]


@settings(max_examples=300, deadline=None)
@example(["a", "\r\n", "\r\n", "b"], "plain")  # CRLF paragraphs
@example(["a", "\n", "\r", "\r\n", "b"], "plain")  # a lone CR: no blank line
@example(["a", b"\xff", "\n", " = H = ", "\n", "b"], "wikitext")
@given(st.lists(st.one_of(st.sampled_from(_ALPHABET), st.binary(max_size=3)), max_size=40),
       st.sampled_from(["wikitext", "plain"]))
def test_file_documents_equal_reading_the_file_whole(tmp_path_factory, parts, kind):
    """`FileDocs` (byte ranges, read when asked) gives the documents, sha256, replaced-character
    count and refusals that reading the whole file gave, for any bytes: CRLF, lone CR, blank and
    whitespace-only lines, headings, invalid UTF-8."""
    from ffkv.corpus.sources import CorpusStats, FileDocs, _read_text, _sha256, eager_documents

    data = b"".join(p.encode() if isinstance(p, str) else p for p in parts)
    path = tmp_path_factory.mktemp("docs") / "c.txt"
    path.write_bytes(data)
    try:
        want_stats = CorpusStats()
        text = _read_text(path, want_stats)
        want = (eager_documents(path, kind), _sha256(text.encode()), want_stats.replaced_chars)
    except FfkvError as e:
        with pytest.raises(FfkvError) as got:
            FileDocs.index(path, CorpusStats(), kind)
        assert str(got.value) == str(e)
        return
    stats = CorpusStats()
    docs, sha = FileDocs.index(path, stats, kind)
    assert (list(docs), sha, stats.replaced_chars) == want


def test_text_corpus_is_read_by_ranges(tmp_path):
    """A corpus file's documents come from byte ranges: the source keeps no copy of its text."""
    from ffkv.corpus.sources import FileDocs

    p = tmp_path / "c.tokens"
    p.write_text(" = Title = \n A first line @-@ here . \n\n Second one .\n")
    src = open_corpus(str(p))
    docs = src._documents()
    assert isinstance(docs, FileDocs) and list(docs) == ["A first line-here.", "Second one."]
    assert docs.ends.tolist() == [p.read_bytes().index(b" \n\n") + 1, len(p.read_bytes()) - 1]
    assert [s.text for s in open_corpus(str(p)).sentences(None, shuffle=False)] == list(docs)


def test_a_corpus_edited_after_indexing_is_refused_in_one_line(tmp_path):
    """A text corpus written to (or cut short, or removed) between indexing and reading a document
    gives FfkvError, not wrong text or a traceback; a copy sent to a worker process checks alike."""
    import os
    import pickle

    from ffkv.corpus.sources import FileDocs
    from ffkv.errors import FfkvError

    p = tmp_path / "c.tokens"
    p.write_text(" A first line . \n Second one .\n")
    docs = open_corpus(str(p))._documents()
    assert isinstance(docs, FileDocs) and docs[1] == "Second one."
    st = os.stat(p)
    with open(p, "r+b") as f:  # the same size, new bytes and a new modification time
        f.write(b" B")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    for d in (docs, pickle.loads(pickle.dumps(docs))):
        with pytest.raises(FfkvError, match="changed while ffkv was reading it"):
            d[0]
    docs = open_corpus(str(p))._documents()
    p.write_text(" A\n")  # cut short
    with pytest.raises(FfkvError, match="changed"):
        docs[1]
    docs = open_corpus(str(p))._documents()
    p.unlink()
    with pytest.raises(FfkvError, match="cannot read corpus"):
        docs[0]


_JSON_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@settings(max_examples=80, deadline=None)
@example([("t", "a\u2028b"), ("blank", "\r\n"), ("t", "c\x85")], "\n")  # raw line separators inside strings
@example([("t", "x"), ("t", "y")], "\r\n")
@given(st.lists(st.one_of(st.tuples(st.just("t"), _JSON_TEXT), st.tuples(st.just("blank"), st.sampled_from(["", " ", "\t"])),
                          st.tuples(st.just("bad"), st.sampled_from(['{"t": 1}', '[1]', '{"u": "x"}', '{"t": NaN}', '{', 'null']))),
                max_size=12),
       st.sampled_from(["\n", "\r\n"]))
def test_jsonl_documents_are_read_by_line_ranges(tmp_path_factory, lines, eol):
    """A JSON-lines corpus is indexed by byte ranges (one pass, nothing kept) and each document
    read when asked: the same texts, sha256 and refusals as parsing the file's "\\n"-separated
    lines whole (the JSON Lines rule: a raw U+2028 or U+0085 inside a string is text, not a line end)."""
    import json

    from ffkv.corpus.sources import CorpusStats, FileDocs, _read_text, _sha256

    body = []
    for kind, v in lines:
        body.append(json.dumps({"t": v, "n": 1}, ensure_ascii=False) if kind == "t" else v)
    data = eol.join(body).encode() + (eol.encode() if body else b"")
    path = tmp_path_factory.mktemp("jl") / "c.jsonl"
    path.write_bytes(data)
    want_err = None
    want = []
    for n, line in enumerate(data.decode().split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except ValueError:
            want_err = f"line {n}"
            break
        if not isinstance(rec, dict):
            want_err = f"line {n}"
            break
        if not isinstance(rec.get("t"), str):
            want_err = f":{n}:"
            break
        want.append(rec["t"])
    if want_err is not None:
        with pytest.raises(FfkvError) as got:
            FileDocs.index(path, CorpusStats(), "jsonl", field="t")
        assert want_err in str(got.value) and "\n" not in str(got.value)
        return
    docs, sha = FileDocs.index(path, CorpusStats(), "jsonl", field="t")
    assert list(docs) == want
    assert sha == _sha256(_read_text(path, CorpusStats()).encode())
