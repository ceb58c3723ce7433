"""The text search's index (`ffkv.web.textindex`, issue 27 item 10) answers exactly as the reference
scan (`Browser._word_hits` and the DuckDB grouping, `FFKV_TEXT_SEARCH=scan`), on a tiny run whose
corpus holds the edge cases: words cut by a prefix's end ("The" of "Then"), punctuation, underscores,
case, non-ASCII letters that case-fold to ASCII (Kelvin sign, long s), repeated words.

Speed is a benchmark (`benchmarks/bench_serve.py --text-load`), never a timed assertion here.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import build_tiny, wikitext_sentences
from test_report import cli

EDGE = [
    "Then the cat sat on the mat, and then the other cat sat there too.",
    "New York's mayor met the mayor of new york city in York.",
    "the_underscore word and the-dash word and the.dot word.",
    "A \u212aelvin sign, a long \u017fign, an İstanbul street, STRASSE and straße.",
    "The The the THE tHe theme thereafter: the.",
    "city-state city state cities city's citywide Citybus",
    "12 1990 1990s 19 90 the 1990 war.",
    "   spaced   words   with  tabs\tand\nnewlines  ",
    "Turnout was 85% in 1990, 185% of the 12.5% quota (a rise) and 5%.",
]
QUERIES = ["the", "The", "THE", "cat", "new york", "York", "york city", "e", "s", "city", "-", "the cat",
           "a", "K", "k", "kelvin", "\u212a", "sign", "ſ", "istanbul", "straße", "strasse", "'s", "1990", "19",
           " the ", "Then", "then the", "xyz-not-there", ".", ",", "of the", "the_underscore", "word",
           "_", "tabs", "the.", "The The", "(", "a long", "mayor of", "%", "85%", "5%", "(a", "12.5"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory, tok_dir):
    from ffkv.web.data import Browser

    root = tmp_path_factory.mktemp("textindex")
    model = build_tiny("llama", root / "llama", tok_dir)
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(wikitext_sentences(120) + EDGE) + "\n", encoding="utf-8")
    run = root / "run"
    cli("mine", "--out", run, "--model", model, "--corpus", corpus, "--top-k", 25, "--negative")
    return Browser(run)


def test_word_hits_equal_the_reference_scan(browser, monkeypatch):
    from ffkv.web import textindex

    monkeypatch.delenv("FFKV_TEXT_SEARCH", raising=False)
    ti = textindex.get(browser)
    assert ti is not None and textindex.get(browser) is ti  # built once
    # letters a non-ASCII character of the corpus also matches without folding to them (long s, dotted
    # İ) take the regex path; the other ASCII queries the folded strings' find (the Kelvin sign folds to k)
    assert {"s", "i"} <= ti.text()[-1] and not {"k", "t"} & ti.text()[-1]
    nonempty = 0
    for q in QUERIES:
        got, want = ti.word_hits(q), browser._word_hits(q)
        assert got.dtype.kind == "i" and np.array_equal(got, want), q
        nonempty += bool(len(want))
    assert nonempty >= 25  # the queries do find prefixes


def test_search_text_equals_the_reference_for_every_order_and_filter(browser, monkeypatch):
    """Whole answers (counts, order, pages, best trigger of each list) with and without the index."""
    def answer(q, **kw):
        return browser.search_text(q, **kw)

    combos = [{}, {"sort": "rank"}, {"sort": "coef"}, {"sort": "layer", "order": "desc"},
              {"sort": "count", "order": "asc"}, {"sign": -1}, {"sign": 1, "sort": "coef", "order": "asc"},
              {"layer": 1}, {"layer": 0, "sign": -1, "sort": "rank"}, {"page": 2, "per_page": 7}]
    for q in QUERIES:
        for kw in combos:
            monkeypatch.setenv("FFKV_TEXT_SEARCH", "scan")
            want = answer(q, **kw)
            monkeypatch.delenv("FFKV_TEXT_SEARCH")
            got = answer(q, **kw)
            assert got == want, (q, kw)


def test_groups_equal_duckdb_on_any_selection(browser):
    """The grouping alone, on random selections of trigger rows (not only word hits)."""
    import pyarrow as pa

    from ffkv.web import textindex

    ti = textindex.TextIndex(browser)
    rng = np.random.default_rng(0)
    n = browser.trig.table.num_rows
    for frac in (0.001, 0.05, 0.5, 1.0):
        sel = np.flatnonzero(rng.random(n) < frac)
        for col, how in (("n", "desc"), ("best_rank", "asc"), ("best_coef", "desc"), ("best_coef", "asc"),
                         ("layer", "asc")):
            hits = browser.trig.table.take(pa.array(sel, pa.int64())).select(
                ["layer", "dim", "sign", "rank", "coef", "sentence_id", "position"])
            con = browser._con
            with browser._con_lock:
                con.register("hits", hits)
                want = con.sql(f"""SELECT layer, dim, sign, count(*) AS n, min(rank) AS best_rank,
                                          arg_min(coef, rank) AS best_coef, arg_min(sentence_id, rank) AS sentence_id,
                                          arg_min(position, rank) AS position
                                   FROM hits GROUP BY layer, dim, sign
                                   ORDER BY {col} {how.upper()} NULLS LAST, layer, dim, sign DESC""").to_arrow_table()
                con.unregister("hits")
            got = ti.groups(sel, col, how)
            assert got.to_pylist() == want.to_pylist(), (frac, col, how)


def test_scan_setting_turns_the_index_off(browser, monkeypatch):
    from ffkv.web import textindex

    monkeypatch.setenv("FFKV_TEXT_SEARCH", "scan")
    assert textindex.get(browser) is None


def test_groups_of_a_table_in_another_order(browser):
    """A trigger table not in (list, rank) order is sorted once by the index; the grouping is the same."""
    import duckdb
    import pyarrow as pa

    from ffkv.web import textindex

    t = browser.trig.table
    rng = np.random.default_rng(1)
    shuffled = t.take(pa.array(rng.permutation(t.num_rows)))

    class Fake:
        d_m = browser.d_m
        trig = type("T", (), {"table": shuffled})()

    ti = textindex.TextIndex(Fake())
    assert ti.perm is not None
    sel = np.flatnonzero(rng.random(t.num_rows) < 0.3)
    hits = shuffled.take(pa.array(sel, pa.int64()))
    con = duckdb.connect()
    con.register("hits", hits)
    for col, how in (("n", "desc"), ("best_rank", "asc"), ("best_coef", "desc")):
        want = con.sql(f"""SELECT layer, dim, sign, count(*) AS n, min(rank) AS best_rank,
                                  arg_min(coef, rank) AS best_coef, arg_min(sentence_id, rank) AS sentence_id,
                                  arg_min(position, rank) AS position
                           FROM hits GROUP BY layer, dim, sign
                           ORDER BY {col} {how.upper()} NULLS LAST, layer, dim, sign DESC""").to_arrow_table()
        assert ti.groups(sel, col, how).to_pylist() == want.to_pylist(), (col, how)


@pytest.mark.parametrize("q", ["%", "85%", "5%", "(a", "(", "the", "'s", "12.5"])
def test_word_hits_equal_a_regex_over_every_prefix(browser, q):
    """Independently of both: a trigger row is a hit when its prefix's text (its tokens' texts
    joined, read from the parquet files) holds q with a word boundary at each end of q that is a
    word character (issue 48: "%" found nothing, where "85%" found 1,731)."""
    import re

    import pyarrow.parquet as pq

    from ffkv.web import textindex

    run = browser.run.path
    voc = dict(zip(*pq.read_table(run / "vocab.parquet", columns=["token_id", "text"]).to_pydict().values()))
    sent = dict(zip(*pq.read_table(run / "sentences.parquet", columns=["sentence_id", "token_ids"]).to_pydict().values()))
    trig = pq.read_table(run / "triggers.parquet", columns=["sentence_id", "position"]).to_pydict()
    pre = r"(?<!\w)" if re.match(r"\w", q[0]) else ""
    post = r"(?!\w)" if re.match(r"\w", q[-1]) else ""
    pat = re.compile(pre + re.escape(q) + post, re.IGNORECASE)
    want = [i for i, (s, p) in enumerate(zip(trig["sentence_id"], trig["position"]))
            if pat.search("".join(voc[t] for t in sent[s][:p + 1]))]
    assert want, q  # the corpus holds it
    assert browser._word_hits(q).tolist() == want
    assert textindex.get(browser).word_hits(q).tolist() == want
