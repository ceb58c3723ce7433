"""Automatic patterns: planted shallow patterns, planted topics, and a whole run checked against
independent re-computation of every pattern's claim."""
from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import wikitext_sentences
from ffkv.steps.patterns import ALPHA, PatternsSettings
from ffkv.steps.patterns import compute as P
from ffkv.steps.patterns import semantic, shallow, words
from ffkv.store.labels import label_of
from test_mutate import make_run


def _cut(s: str, frac: float = 0.5) -> str:
    w = s.split()
    return " ".join(w[: max(2, int(len(w) * frac))])


@pytest.fixture(scope="module")
def background():
    sents = wikitext_sentences(400, split="valid", seed=3)
    rng = np.random.default_rng(0)
    return words.Background.from_prefixes([words.Prefix(_cut(s, rng.uniform(0.2, 1)), "")
                                       for s in sents[:300]])


def _fillers(n, seed=1):
    sents = [s for s in wikitext_sentences(3000, split="train", seed=seed)[::37] if "<unk>" not in s]
    out = []
    for s in sents:
        t = _cut(s, 0.6).rstrip(",.;:")
        if t.split()[-1].lower() in ("of", "the", "a", "substitute", "substitutes"):
            continue
        if "nobel" in t.lower() or re.search(r"\d{4}$", t):
            continue
        out.append(t)
        if len(out) == n:
            return out
    raise AssertionError("not enough fillers")


PLANTED = {
    # prefix index -> text; planted groups below
    "subst": ["At the meeting, Elton said that there could be no substitutes",
              "In German service, they were used as substitutes",
              "Two weeks later, he came off the substitutes",
              "The club named seven substitutes",
              "He was named among the substitute",
              "Both goalkeepers were listed as substitutes"],
    "partof": ["He was also a part of",
               "The island is now a part of",
               "This region eventually became part of",
               "The song was recorded as part of"],
    "nobel": ["In 1921 the Nobel Prize committee met and chose",
              "She won a Nobel Prize and moved to",
              "After the Nobel Prize ceremony the physicist returned to"],
    "year": ["The band released its first album in 1987",
             "The cathedral was rebuilt in 1923",
             "The station closed on 4 March 2004",
             "Construction of the dam began in 1911",
             "He retired from the navy in 1889"],
}


def _planted_set():
    texts, groups = [], {}
    for g, ts in PLANTED.items():
        groups[g] = list(range(len(texts), len(texts) + len(ts)))
        texts += ts
    texts += _fillers(25 - len(texts))
    order = np.random.default_rng(5).permutation(len(texts))  # shuffle: indices carry no hint
    inv = np.argsort(order)
    texts = [texts[i] for i in order]
    groups = {g: sorted(int(inv[i]) for i in ix) for g, ix in groups.items()}
    last_tok = ["stitutes" if t.endswith("substitutes") else t.split()[-1] for t in texts]
    return [words.Prefix(t, lt) for t, lt in zip(texts, last_tok)], groups


def test_norm_word():
    assert [words.norm_word(w) for w in ("bases", "Base", "cities", "churches", "boxes", "class", "bus",
                                     "analysis", "as")] == \
        ["base", "base", "city", "church", "box", "class", "bus", "analysis", "as"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["the", "of", "a", "cat", "cats", "sat", "mat", "on", "x"]), max_size=12),
                max_size=10), st.integers(1, 4))
def test_has_cover_is_every_frequent_ngram(nws, min_cover):
    """The apriori cover equals brute force: every contiguous 1–3 word n-gram not made only of
    stop words, with the prefixes holding it, wherever it covers at least min_cover of them."""
    from ffkv.steps.patterns.shallow import _has_cover
    from ffkv.steps.patterns.words import STOP

    brute: dict = {}
    for i, nw in enumerate(nws):
        for n in (1, 2, 3):
            for j in range(len(nw) - n + 1):
                g = tuple(nw[j:j + n])
                if not STOP.issuperset(g):
                    brute.setdefault(("has", g), set()).add(i)
    want = {f: c for f, c in brute.items() if len(c) >= min_cover}
    got = {f: c for f, c in _has_cover(nws, min_cover).items() if len(c) >= min_cover}
    assert got == want


def test_planted_shallow_patterns(background):
    prefixes, groups = _planted_set()
    pats = shallow.shallow_patterns(prefixes, background)
    by_desc = {p.description: p for p in pats}
    want = {
        'ends with "substitutes"/"substitute"': ("last_word", groups["subst"]),
        'ends with "part of"': ("suffix", groups["partof"]),
        'contains "nobel prize"': ("ngram", groups["nobel"]),
    }
    for desc, (sub, cov) in want.items():
        assert desc in by_desc, (desc, [p.description for p in pats])
        assert by_desc[desc].subtype == sub and list(by_desc[desc].covered) == cov
        assert by_desc[desc].p_value < ALPHA
    year = [p for p in pats if p.subtype == "shape"]
    assert len(year) == 1 and year[0].description.startswith("ends with a year")
    assert list(year[0].covered) == groups["year"]
    # redundant variants are gone: the last token piece, the bare last word "of", "nobel" alone
    assert not any(p.subtype == "last_token" for p in pats)
    assert 'ends with "of"' not in by_desc and 'contains "nobel"' not in by_desc
    assert 'contains "part of"' not in by_desc and 'contains "substitutes"/"substitute"' not in by_desc
    # nothing else was found in the fillers
    planted = set().union(*map(set, groups.values()))
    assert all(set(p.covered) <= planted for p in pats), [(p.description, p.covered) for p in pats]


def test_min_cover_and_background(background):
    prefixes, groups = _planted_set()
    # with min_cover 5 only the 6 'substitutes' and the 5 years survive
    pats = shallow.shallow_patterns(prefixes, background, min_cover=5)
    assert sorted(len(p.covered) for p in pats) == [5, 6]
    # a pattern as common as the background is not a pattern: 'ends with "of"' in a corpus
    # where most prefixes end with "of"
    bg = words.Background.from_prefixes([words.Prefix(f"word{i} of", "of") for i in range(50)]
                                    + [words.Prefix(f"thing{i} and", "and") for i in range(50)])
    common = [words.Prefix(f"alpha{i} of", "of") for i in range(10)] + \
             [words.Prefix(f"beta{i} zeta", "zeta") for i in range(4)]
    descs = {p.description for p in shallow.shallow_patterns(common, bg)}
    assert 'ends with "zeta"' in descs and 'ends with "of"' not in descs
    assert 'ends with "of"' in {p.description for p in shallow.shallow_patterns(common, bg, alpha=1)}


def test_binomial_tail_exact():
    from math import comb

    n, c, df, B = 25, 4, 30, 999
    p = (df + 0.5) / (B + 1)
    want = sum(comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(c, n + 1))
    assert words.binom_tail(n, c, df, B) == pytest.approx(want, rel=1e-9)


def test_agglomerate_brute_force():
    rng = np.random.default_rng(0)
    E = rng.normal(size=(12, 5))
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    S = E @ E.T
    cl = semantic.agglomerate(S, 0.3)
    assert sorted(i for c in cl for i in c) == list(range(12))
    # no two final clusters could still be merged, and every merge respected tau at its time:
    # the average similarity between final clusters is below tau
    for a in range(len(cl)):
        for b in range(a + 1, len(cl)):
            assert S[np.ix_(cl[a], cl[b])].mean() < 0.3
    assert semantic.agglomerate(S, 2.0) == [[i] for i in range(12)]
    assert semantic.agglomerate(S, -2.0) == [list(range(12))]


# ---- scipy replaces the hand-written statistics: the old routines, kept as the reference -------
def _old_binom_tail(n, c, df, B):
    """The hand-written P(X ≥ c), X ~ Binomial(n, (df + 0.5)/(B + 1)), before scipy."""
    import math

    p = (df + 0.5) / (B + 1)
    if c <= 0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq
             for k in range(c, n + 1)]
    m = max(terms)
    return min(1.0, math.exp(m) * sum(math.exp(t - m) for t in terms))


def _old_agglomerate(S, tau):
    """The hand-written average linkage before scipy; also returns each merge's mean similarity
    and the best one left unmerged, to tell ties apart."""
    n = S.shape[0]
    clusters = [[i] for i in range(n)]
    W = S.astype(np.float64).copy()
    size = np.ones(n)
    alive = np.ones(n, dtype=bool)
    heights, stop = [], None
    while alive.sum() > 1:
        avg = W / np.outer(size, size)
        avg[~alive, :] = -np.inf
        avg[:, ~alive] = -np.inf
        np.fill_diagonal(avg, -np.inf)
        a, b = np.unravel_index(int(np.argmax(avg)), avg.shape)
        if avg[a, b] < tau:
            stop = avg[a, b]
            break
        heights.append(avg[a, b])
        a, b = min(a, b), max(a, b)
        W[a, :] += W[b, :]
        W[:, a] += W[:, b]
        size[a] += size[b]
        alive[b] = False
        clusters[a] += clusters[b]
        clusters[b] = []
    return [sorted(c) for c, al in zip(clusters, alive) if al], heights, stop


def test_binom_tail_equals_hand_written():
    rng = np.random.default_rng(11)
    cases = [(25, 4, 30, 999), (25, 25, 0, 2000), (25, 3, 2000, 2000), (1, 1, 0, 1), (25, 0, 5, 100)]
    for _ in range(400):
        n = int(rng.integers(1, 60))
        B = int(rng.integers(1, 5000))
        cases.append((n, int(rng.integers(0, n + 1)), int(rng.integers(0, B + 1)), B))
    for n, c, df, B in cases:
        assert words.binom_tail(n, c, df, B) == pytest.approx(_old_binom_tail(n, c, df, B), rel=1e-9, abs=1e-300)


def test_binom_tail_is_scipys_binom_sf_exactly():
    """binom_tail calls the kernel binom.sf evaluates (speed, issue 24): the same float, bit for bit."""
    from scipy.stats import binom

    rng = np.random.default_rng(12)
    for _ in range(400):
        n, B = int(rng.integers(1, 60)), int(rng.integers(1, 5000))
        c, df = int(rng.integers(0, n + 2)), int(rng.integers(0, B + 1))
        want = 1.0 if c <= 0 else float(binom.sf(c - 1, n, (df + 0.5) / (B + 1)))
        assert words.binom_tail(n, c, df, B) == want, (n, c, df, B)


def test_equal_prefixes_are_read_and_split_once(tiny_models, tiny_dirs, tmp_path):
    """prefix_texts gives one Prefix per distinct (sentence, position), in the order asked, with
    the texts of the read API; its words and endings are computed once."""
    from ffkv.store import query

    mm = tiny_models["gpt2"]
    run = make_run(tmp_path / "r", tiny_dirs["gpt2"], n_sentences=5, k=3, mm=mm)
    n_tok = run.read_table("sentences", columns=["n_tokens"]).column("n_tokens").to_numpy()
    sids = np.array([0, 1, 0, 2, 1, 0])
    pos = np.minimum(np.array([1, 0, 1, 2, 0, 0]), n_tok[sids] - 1)
    px = words.prefix_texts(run, mm.tok, sids, pos)
    assert [(p.text, p.last_token) for p in px] == query.prefix_texts(run, mm.tok, sids, pos)
    assert px[0] is px[2] and px[1] is px[4] and px[0] is not px[5]
    assert px[0].words is px[2].words and px[0].ends == words.end_features(px[0].words, px[0].last_token)
    assert px[0].norm_words == [words.norm_word(w) for w in words.words_of(px[0].text)]
    assert words.prefix_texts(run, mm.tok, [], []) == []


def _unit(rng, n, d, dtype=np.float64):
    E = rng.normal(size=(n, d)).astype(dtype)
    return E / np.linalg.norm(E, axis=1, keepdims=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_agglomerate_equals_hand_written(dtype):
    """The same partitions as the hand-written average linkage on random inputs (sizes 2..40, the
    thresholds spread over the similarities), unless two candidate merges tie."""
    rng = np.random.default_rng(3)
    compared = 0
    for trial in range(300):
        n, d = int(rng.integers(2, 41)), int(rng.choice([3, 8, 64]))
        E = _unit(rng, n, d, dtype)
        S = E @ E.T
        if dtype == np.float64:
            S = (S + S.T) / 2  # a similarity matrix is symmetric; float32 S is used as computed
        off = S[~np.eye(n, dtype=bool)]
        tau = float(np.quantile(off, rng.uniform(0.5, 1.0)))
        want, heights, stop = _old_agglomerate(S, tau)
        got = semantic.agglomerate(S, tau)
        gaps = np.diff(sorted(heights + ([stop] if stop is not None else [])))
        tie = (len(gaps) and gaps.min() < 1e-6) or (stop is not None and abs(stop - tau) < 1e-6) \
            or any(abs(h - tau) < 1e-6 for h in heights)
        if got != want:
            assert tie, (trial, got, want)
        compared += not tie
    assert compared > 250


def test_semantic_null_equals_hand_written(monkeypatch):
    """The calibration (thresholds from 200 random sets) is the same with either clustering."""

    E = _unit(np.random.default_rng(5), 300, 16, np.float32)
    new = semantic.SemanticNull.calibrate(E, sets=200)
    monkeypatch.setattr(semantic, "agglomerate", lambda S, tau: _old_agglomerate(S, tau)[0])
    old = semantic.SemanticNull.calibrate(E, sets=200)
    assert (new.mu, new.tau, new.null_rate) == (old.mu, old.tau, old.null_rate)
    assert new.thresholds == pytest.approx(old.thresholds, abs=1e-9)


class HashEmbedder:
    """Bag of hashed words: a fast, deterministic stand-in for the sentence encoder."""

    def __init__(self, dim=64):
        self.dim, self.cache = dim, {}

    def embed(self, texts, bar=None):
        for t in texts:
            if t not in self.cache:
                v = np.zeros(self.dim, np.float32)
                for w in words.words_of(t):
                    if w.isalpha() and len(w) > 3:
                        v[zlib.crc32(words.norm_word(w).encode()) % self.dim] += 1
                v[zlib.crc32(t.encode()) % self.dim] += 0.1
                self.cache[t] = v / np.linalg.norm(v)
        if bar:
            bar(len(texts))
        return np.stack([self.cache[t] for t in texts]) if texts else np.zeros((0, self.dim), np.float32)


TOPICS = {
    "football": ["The striker scored twice as the football club won the league match",
                 "The goalkeeper saved a penalty in the football league final",
                 "The football club signed a striker before the league season",
                 "Fans watched the league match as the striker scored",
                 "The manager praised the goalkeeper after the football match",
                 "In the league final the striker and the goalkeeper clashed"],
    "chemistry": ["The compound reacts with oxygen to form an oxide",
                  "Sodium chloride dissolves in water to form ions",
                  "The acid reacts with the metal and releases hydrogen gas",
                  "Carbon atoms form covalent bonds with hydrogen atoms",
                  "The oxide of the metal reacts with acid",
                  "Electrons are shared between the atoms in a covalent bond"],
}


@pytest.mark.slow
def test_embeddings_do_not_depend_on_the_order_of_the_texts():
    """The encoder's batches follow the distinct texts (by token count, then text), not the order
    they come in: the same bits either way."""
    texts = [t for ts in TOPICS.values() for t in ts] + [t[:n] for t in TOPICS["chemistry"] for n in (9, 17, 30)]
    a = semantic.Embedder(batch_size=4).embed(texts)
    b = semantic.Embedder(batch_size=4).embed(texts[::-1])[::-1]
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_semantic_topics_real_encoder():
    """The real all-MiniLM-L6-v2 finds two planted topics among random Wikipedia prefixes."""
    emb = semantic.Embedder()
    rng = np.random.default_rng(0)
    sents = [s for s in wikitext_sentences(900, split="valid", seed=7) if "<unk>" not in s]
    bg = words.Background.from_prefixes([words.Prefix(_cut(s, rng.uniform(0.3, 1)), "") for s in sents[:400]])
    null = semantic.SemanticNull.calibrate(emb.embed(bg.texts), sets=300)
    fill = [_cut(s, 0.6) for s in sents[400:413]]
    texts = TOPICS["football"] + TOPICS["chemistry"] + fill
    pats = semantic.semantic_patterns(emb.embed(texts), texts, bg, null)
    covers = [set(p.covered) for p in pats]
    foot, chem = set(range(6)), set(range(6, 12))
    assert any(len(c & foot) >= 5 and len(c - foot) <= 1 for c in covers), [p.description for p in pats]
    assert any(len(c & chem) >= 5 and len(c - chem) <= 1 for c in covers), [p.description for p in pats]
    desc = " ".join(p.description for p in pats)
    assert "striker" in desc or "league" in desc or "football" in desc or "goalkeeper" in desc
    # calibration: random corpus prefixes mostly yield no semantic pattern
    hits = 0
    for r in range(40):
        m = rng.choice(len(bg.texts), 25, replace=False)
        tx = [bg.texts[i] for i in m]
        hits += bool(semantic.semantic_patterns(emb.embed(tx), tx, bg, null))
    assert hits <= 4


# ---- a whole run: every claim re-checked independently ----------------------------------------
def _forms(desc):
    return [json.loads(f'"{x}"') for x in re.findall(r'"((?:[^"\\]|\\.)*)"', desc)]


def _last_words(text, n):
    ws = re.findall(r"<[a-z]+>|[^\W_]+(?:['’][^\W_]+)*|[^\w\s]", text.lower())
    return " ".join(ws[-n:]) if len(ws) >= n else None


@pytest.fixture(scope="module")
def prun(tmp_path_factory, tiny_dirs, tiny_models):
    return make_run(tmp_path_factory.mktemp("prun") / "r", tiny_dirs["gpt2"], n_sentences=60, k=25,
                    mm=tiny_models["gpt2"])


def test_patterns_run_tables(prun, tiny_models):
    tok = tiny_models["gpt2"].tok
    res = P.patterns(prun, tok, semantic_keys_per_layer=5, alpha=1.0, background=300,
                     embedder=HashEmbedder(), show_progress=False)
    pt, kt = res.patterns.to_pylist(), res.keys.to_pylist()
    assert len(kt) == 2 * 96  # every mined key of the tiny model
    assert sum(k["semantic_done"] for k in kt) == 10
    assert res.patterns.num_rows > 50
    # texts of each key's prefixes, recomputed by decoding the token ids
    from ffkv.store.query import read_triggers, sentence_lookup

    trig = read_triggers(prun, 1, 25).to_pylist()
    sents = sentence_lookup(prun, [t["sentence_id"] for t in trig])
    text = {(t["layer"], t["dim"], t["rank"] - 1): tok.decode(sents[t["sentence_id"]][: t["position"] + 1])
            for t in trig}
    checked = 0
    for p in pt:
        assert p["n_covered"] == len(p["covered"]) >= 3
        assert p["covered"] == sorted(set(p["covered"])) and all(0 <= i < 25 for i in p["covered"])
        if p["subtype"] in ("last_word", "suffix"):
            forms = _forms(p["description"])
            n = len(forms[0].split())
            cov = {i for i in range(25) if _last_words(text[(p["layer"], p["dim"], i)], n) in forms}
            # covered prefixes end with one of the forms; uncovered ones end with none of the forms
            assert set(p["covered"]) == cov, (p, [text[(p["layer"], p["dim"], i)] for i in p["covered"]])
            checked += 1
        if p["subtype"] == "ngram":
            forms = _forms(p["description"])
            for i in p["covered"]:
                t = " ".join(re.findall(r"<[a-z]+>|[^\W_]+(?:['’][^\W_]+)*|[^\w\s]", text[(p["layer"], p["dim"], i)].lower()))
                assert any(f" {f} " in f" {t} " for f in forms)
    assert checked > 10
    # key rows agree with the pattern rows
    by_key = {}
    for p in pt:
        by_key.setdefault((p["layer"], p["dim"]), []).append(p)
    for k in kt:
        ps = by_key.get((k["layer"], k["dim"]), [])
        sh = set().union(*[set(p["covered"]) for p in ps if p["kind"] == "shallow"])
        se = set().union(*[set(p["covered"]) for p in ps if p["kind"] == "semantic"])
        assert k["n_patterns"] == len(ps) and k["n_prefixes"] == 25
        assert k["coverage"] == pytest.approx(len(sh | se) / 25)
        assert (k["only_shallow"], k["only_semantic"], k["both"]) == (len(sh - se), len(se - sh), len(sh & se))
        assert k["label"] == label_of(bool(sh), bool(se))
        assert k["semantic_done"] or not se
    # Fig 2 rows: shares sum to 1 and match the key table
    for f in res.fig2.to_pylist():
        assert f["shallow"] + f["semantic"] + f["both"] + f["not_covered"] == pytest.approx(1)
        ks = [k for k in kt if k["layer"] == f["layer"] and (f["scope"] == "all" or k["semantic_done"])]
        assert f["keys"] == len(ks)
        assert f["not_covered"] == pytest.approx(sum(k["not_covered"] for k in ks) / (25 * len(ks)))
    assert {f["scope"] for f in res.fig2.to_pylist()} == {"all", "semantic_sample"}


def test_workers_give_the_serial_tables(prun, tiny_models, monkeypatch):
    """Shallow patterns found in forked workers, a few keys a task, equal the serial pass's tables
    (semantic patterns too, which stay in this process)."""
    from ffkv.steps.patterns import compute as S

    tok = tiny_models["gpt2"].tok
    monkeypatch.setattr(S, "KEYS_PER_TASK", 3)
    runs = [P.patterns(prun, tok, semantic_keys_per_layer=3, background=300, write=False, embedder=HashEmbedder(),
                       show_progress=False, workers=w) for w in (0, 3)]
    assert runs[0].keys.num_rows >= 4 * S.KEYS_PER_TASK and runs[0].patterns.num_rows > 0
    for r in runs[1:]:
        assert r.patterns.equals(runs[0].patterns) and r.keys.equals(runs[0].keys) and r.fig2.equals(runs[0].fig2)
    assert S.shallow_workers(0) == 0 and S.shallow_workers(5) == 5 and 0 <= S.shallow_workers(None) <= 8


def _worker_dies(lo, hi):
    import os

    os._exit(3)


def test_a_dead_worker_is_one_line(prun, tiny_models, monkeypatch):
    from ffkv.errors import FfkvError
    from ffkv.steps.patterns import compute as S

    monkeypatch.setattr(S, "KEYS_PER_TASK", 3)
    monkeypatch.setattr(S, "_shallow_keys", _worker_dies)
    with pytest.raises(FfkvError, match="worker process died.*--workers 0"):
        P.patterns(prun, tiny_models["gpt2"].tok, semantic=False, background=300, write=False,
                   show_progress=False, workers=2)
    assert not S._SHARED


def test_patterns_sample_and_strict_alpha(prun, tiny_models):
    tok = tiny_models["gpt2"].tok
    res = P.patterns(prun, tok, keys_per_layer=7, semantic=False, background=300, write=False,
                     show_progress=False)
    kt = res.keys.to_pylist()
    assert len(kt) == 14 and not any(k["semantic_done"] for k in kt)
    assert all(p["p_value"] < ALPHA for p in res.patterns.to_pylist())
    assert {f["scope"] for f in res.fig2.to_pylist()} == {"all"}
    # the semantic sample is drawn from all mined keys (nested samples), not from the 7
    from ffkv.store.query import mined_keys, read_triggers, sample_keys

    res = P.patterns(prun, tok, keys_per_layer=7, semantic_keys_per_layer=3, background=300, write=False,
                     embedder=HashEmbedder(), show_progress=False)
    want = sample_keys(mined_keys(read_triggers(prun, 1)), 3, 0)
    got = {(k["layer"], k["dim"]) for k in res.keys.to_pylist() if k["semantic_done"]}
    assert got == {(l, int(d)) for l, ds in want.items() for d in ds}


def test_patterns_step(tmp_path, tiny_dirs, tiny_models):
    """execute(run, "patterns", ...): the manifest keeps today's settings (not the device), a second
    call is skipped and reports the same labels and Fig 2, bad settings are refused up front."""
    from ffkv.errors import FfkvError
    from ffkv.steps.lifecycle import execute

    run = make_run(tmp_path / "r", tiny_dirs["gpt2"], n_sentences=60, k=25, mm=tiny_models["gpt2"])
    s = PatternsSettings(semantic_keys_per_layer=3, background=300, device="cpu")
    out = execute(run, "patterns", s, device="cpu", embedder=HashEmbedder(), show_progress=False)
    assert out.status == "done" and out.result.keys.num_rows == 2 * 96
    assert run.settings("patterns") == P.settings_for(0, 3, 25, 1, 0, 3, 1e-3, 300, True)
    assert {k: v for k, v in out.result.stats.items() if k != "seconds"}.items() <= run.step("patterns").items()
    first = P.summary(run, out)
    assert first["status"] == "done" and sum(first["labels"].values()) == 2 * 96
    again = execute(run, "patterns", s, device="cpu")
    assert again.skipped
    second = P.summary(run, again)
    assert second["status"] == "already done"
    assert (second["labels"], second["fig2"]) == (first["labels"], first["fig2"])
    with pytest.raises(FfkvError, match="--alpha"):
        execute(run, "patterns", PatternsSettings(alpha=0), device="cpu")
    assert run.step_done("patterns")


def test_cli_on_a_mined_run(tmp_path, tiny_dirs):
    """`ffkv mine` (the real miner) -> mutate -> patterns -> annotate sample, in one process."""
    from conftest import WT2
    from ffkv.store.annotations import AnnotationStore
    from ffkv.store.run import Run
    from test_mutate import cli_inproc

    r = tmp_path / "run"
    code, out, err = cli_inproc("mine", "--out", r, "--model", tiny_dirs["llama"], "--corpus",
                                WT2 / "wiki.valid.tokens", "--max-sentences", "60", "--top-k", "30")
    assert code == 0, err[-2000:]
    code, out, err = cli_inproc("mutate", r, "--keys-per-layer", "2", "--examples", "10", "--json")
    assert code == 0, err[-2000:]
    assert json.loads(out)["keys"] == 6
    code, out, err = cli_inproc("patterns", r, "--semantic-keys-per-layer", "2", "--background", "200",
                                "--json")
    assert code == 0, err[-2000:]
    info = json.loads(out)
    run = Run(r)
    assert info["keys"] == 3 * 80 and info["semantic_keys"] == 6 and run.step_done("patterns")
    assert run.read_table("pattern_keys").num_rows == 240
    assert {f["scope"] for f in info["fig2"]} == {"all", "semantic_sample"}
    code, out, err = cli_inproc("patterns", r, "--semantic-keys-per-layer", "2", "--background", "200")
    assert code == 0 and "already done" in out
    # the semantic sample is the annotators' sample
    st = AnnotationStore(run)
    sample = set(st.sample(per_layer=2))
    kt = run.read_table("pattern_keys").to_pylist()
    assert sample == {(k["layer"], k["dim"]) for k in kt if k["semantic_done"]}
    code, out, err = cli_inproc("patterns", r, "--alpha", "0")
    assert code == 2 and "--alpha" in err
