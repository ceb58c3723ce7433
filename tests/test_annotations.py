"""The annotation store: validation that writes nothing, 200 concurrent writes, export/import
round trips, and statistics checked against hand computations."""
from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import sqlite3
import threading

import numpy as np
import pyarrow as pa
import pytest

from ffkv.errors import FfkvError
from ffkv.store.annotations import AnnotationStore, cohen_kappa, prefix_categories
from ffkv.store.run import Run

# keys of the hand-made run: (layer, dim) -> number of positive triggers
KEYS = {(0, 1): 25, (0, 4): 25, (0, 7): 10, (1, 2): 25, (1, 3): 30, (2, 0): 25}
KEYS.update({(3, d): 25 for d in range(60)})  # room for 200 distinct concurrent writes


def hand_run(path) -> Run:
    run = Run(path, create=True)
    run.start_step("mine", {"test": "by hand"})
    texts = [f"Sentence number {i} is about topic {i % 7} and ends here" for i in range(40)]
    run.write_table("sentences", pa.table({
        "sentence_id": pa.array(range(40), pa.int64()), "doc_id": pa.array([0] * 40, pa.int64()),
        "text": texts, "token_ids": pa.array([list(range(5, 15))] * 40, pa.list_(pa.int32())),
        "n_tokens": pa.array([10] * 40, pa.int32())}))
    rows = {c: [] for c in ("layer", "dim", "sign", "rank", "coef", "sentence_id", "position", "next_token")}
    for (l, d), n in sorted(KEYS.items()):
        for sign in (1, -1):
            for r in range(1, (n if sign == 1 else 5) + 1):
                for c, v in zip(rows, (l, d, sign, r, sign * (100.0 - r), (r * 7 + d) % 40, r % 10, None)):
                    rows[c].append(v)
    run.write_table("triggers", pa.table({
        "layer": pa.array(rows["layer"], pa.int16()), "dim": pa.array(rows["dim"], pa.int32()),
        "sign": pa.array(rows["sign"], pa.int8()), "rank": pa.array(rows["rank"], pa.int16()),
        "coef": pa.array(rows["coef"], pa.float32()), "sentence_id": pa.array(rows["sentence_id"], pa.int64()),
        "position": pa.array(rows["position"], pa.int32()), "next_token": pa.array(rows["next_token"], pa.int32())}))
    run.finish_step("mine")
    return run


@pytest.fixture
def run(tmp_path):
    return hand_run(tmp_path / "run")


PATS = [{"description": 'ends with "base"/"bases"', "kind": "shallow", "prefixes": [0, 3, 5, 9]},
        {"description": "military", "kind": "semantic", "prefixes": [3, 4, 5, 20, 24]}]


def test_save_get_replace(run):
    st = AnnotationStore(run)
    aid = st.add_annotation("ann", 0, 1, PATS, note="first look")
    rec = st.get("ann", 0, 1)
    assert rec["patterns"] == PATS and rec["note"] == "first look" and rec["sign"] == 1
    with sqlite3.connect(st.path) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # saving again replaces patterns, keeps uid and created
    new = [{"description": "  ends with a year ", "kind": "shallow", "prefixes": [2, 1, 1]}]
    assert st.add_annotation("ann", 0, 1, new) == aid
    rec2 = st.get("ann", 0, 1)
    assert rec2["patterns"] == [{"description": "ends with a year", "kind": "shallow", "prefixes": [1, 2]}]
    assert rec2["uid"] == rec["uid"] and rec2["created"] == rec["created"] and rec2["updated"] >= rec["updated"]
    with sqlite3.connect(st.path) as con:  # no orphans left by the replacement
        assert con.execute("SELECT count(*) FROM patterns").fetchone()[0] == 1
        assert con.execute("SELECT count(*) FROM pattern_prefixes").fetchone()[0] == 2
    # an annotation without patterns is allowed (no pattern found), a second annotator is separate
    st.add_annotation("other", 0, 1, [])
    assert st.get("other", 0, 1)["patterns"] == [] and st.count() == 2
    assert st.delete("other", 0, 1) and st.count() == 1


@pytest.mark.parametrize("kwargs, needle", [
    (dict(layer=0, dim=2), "unknown key"),  # no triggers
    (dict(layer=9, dim=1), "unknown key"),
    (dict(sign=-1, patterns=[{"description": "x", "kind": "shallow", "prefixes": [7]}]), "outside 0..4"),
    (dict(patterns=[{"description": "x", "kind": "shallow", "prefixes": [25]}]), "outside 0..24"),
    (dict(patterns=[{"description": "x", "kind": "shallow", "prefixes": [-1]}]), "outside 0..24"),
    (dict(layer=0, dim=7, patterns=[{"description": "x", "kind": "shallow", "prefixes": [10]}]), "outside 0..9"),
    (dict(patterns=[{"description": "", "kind": "shallow", "prefixes": [1]}]), "description is empty"),
    (dict(patterns=[{"description": "   ", "kind": "shallow", "prefixes": [1]}]), "description is empty"),
    (dict(patterns=[{"description": "x", "kind": "syntactic", "prefixes": [1]}]), "kind must be"),
    (dict(patterns=[{"description": "x", "kind": "shallow", "prefixes": []}]), "at least one"),
    (dict(patterns=[{"description": "x", "kind": "shallow", "prefixes": ["3"]}]), "not an integer"),
    (dict(patterns=[{"description": "x", "kind": "shallow", "prefixes": [True]}]), "not an integer"),
    (dict(patterns=[{"description": "x", "kind": "shallow", "prefixes": [1], "color": 1}]), "unknown field"),
    (dict(annotator=" "), "annotator"),
    (dict(layer="0"), "integers"),
])
def test_invalid_input_writes_nothing(run, kwargs, needle):
    st = AnnotationStore(run)
    st.add_annotation("ann", 0, 1, PATS)  # an existing record must survive a refused save too
    before = st.export()
    args = dict(annotator="ann", layer=0, dim=1, patterns=PATS + [], sign=1)
    args.update(kwargs)
    with pytest.raises(FfkvError) as e:
        st.add_annotation(args.pop("annotator"), args.pop("layer"), args.pop("dim"), args.pop("patterns"),
                          sign=args.pop("sign"))
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert st.export() == before
    with sqlite3.connect(st.path) as con:
        assert con.execute("SELECT count(*) FROM patterns").fetchone()[0] == 2


def _writes(run_path, worker: int, n_threads: int, per_thread: int):
    """n_threads threads, each saving per_thread annotations with its own (annotator, key)."""
    st = AnnotationStore(run_path)
    errors = []

    def go(t):
        try:
            for k in range(per_thread):
                i = (worker * n_threads + t) * per_thread + k
                st.add_annotation(f"w{worker}t{t}", 3, i % 60,
                                  [{"description": f"pattern {i}", "kind": ("shallow", "semantic")[i % 2],
                                    "prefixes": [i % 25, (i * 7) % 25]}])
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    th = [threading.Thread(target=go, args=(t,)) for t in range(n_threads)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return errors


def test_200_concurrent_writes_from_processes_and_threads(run):
    AnnotationStore(run)  # create the file first, as the app would
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        errs = pool.starmap(_writes, [(str(run.path), w, 5, 8) for w in range(4)])  # 160 writes
    errs.append(_writes(str(run.path), 4, 4, 10))  # and 40 from threads of this process
    assert errs == [[]] * 5
    st = AnnotationStore(run)
    recs = st.list()
    assert len(recs) == 200
    got = {(r["annotator"], r["dim"]): r["patterns"] for r in recs}
    for w, nt, pt in [(w, 5, 8) for w in range(4)] + [(4, 4, 10)]:
        for t in range(nt):
            for k in range(pt):
                i = (w * nt + t) * pt + k
                assert got[(f"w{w}t{t}", i % 60)] == [{"description": f"pattern {i}",
                                                       "kind": ("shallow", "semantic")[i % 2],
                                                       "prefixes": sorted({i % 25, (i * 7) % 25})}]


def test_export_import_round_trip(run, tmp_path):
    st = AnnotationStore(run)
    st.add_annotation("ann", 0, 1, PATS, note="ünïcode ✓")
    st.add_annotation("ann", 1, 3, [{"description": 'contains "part of"', "kind": "shallow",
                                     "prefixes": [0, 24]}])
    st.add_annotation("bob", 0, 1, [])
    st.add_annotation("bob", 2, 0, [{"description": "x", "kind": "semantic", "prefixes": [4]}], sign=-1)
    text = st.export(tmp_path / "a.jsonl")
    assert (tmp_path / "a.jsonl").read_text() == text and len(text.splitlines()) == 4
    # a fresh store of a copy of the run
    shutil.copytree(run.path, tmp_path / "copy")
    (tmp_path / "copy" / "annotations.sqlite").unlink()
    for f in (tmp_path / "copy").glob("annotations.sqlite-*"):
        f.unlink()
    fresh = AnnotationStore(tmp_path / "copy")
    assert fresh.import_(tmp_path / "a.jsonl") == {"added": 4, "replaced": 0, "unchanged": 0, "kept": 0}
    assert fresh.export() == text  # every record, uid, time and prefix kept
    assert fresh.import_(text) == {"added": 0, "replaced": 0, "unchanged": 4, "kept": 0}
    assert fresh.export() == text
    # a newer edit replaces, an older one is kept
    recs = [json.loads(l) for l in text.splitlines()]
    newer = dict(recs[0], updated=recs[0]["updated"] + 10, patterns=[PATS[0]])
    older = dict(recs[1], updated=recs[1]["updated"] - 10, patterns=[PATS[0]])
    c = fresh.import_("\n".join(json.dumps(r) for r in (newer, older)) + "\n")
    assert c == {"added": 0, "replaced": 1, "unchanged": 0, "kept": 1}
    assert fresh.get(recs[0]["annotator"], recs[0]["layer"], recs[0]["dim"])["patterns"] == [PATS[0]]


def test_bad_import_writes_nothing(run):
    st = AnnotationStore(run)
    st.add_annotation("ann", 0, 1, PATS)
    before = st.export()
    good = json.dumps({"annotator": "z", "layer": 1, "dim": 2, "patterns": PATS})
    bad = json.dumps({"annotator": "z", "layer": 1, "dim": 3, "patterns": [
        {"description": "x", "kind": "shallow", "prefixes": [31]}]})
    for text, needle in ((good + "\n" + bad + "\n", "line 2"), (good + "\n{not json\n", "not valid JSON"),
                         (good + "\n" + good + "\n", "second record"),
                         (json.dumps({"annotator": "z", "layer": 1}) + "\n", "missing field")):
        with pytest.raises(FfkvError, match=needle):
            st.import_(text)
        assert st.export() == before


def test_stats_by_hand(run):
    st = AnnotationStore(run)
    # key (0,1): annotator a: shallow {0..9}, semantic {5..14} -> 5 shallow, 5 both, 5 semantic, 10 none
    st.add_annotation("a", 0, 1, [{"description": "s", "kind": "shallow", "prefixes": list(range(10))},
                                  {"description": "m", "kind": "semantic", "prefixes": list(range(5, 15))}])
    # same key, annotator b: shallow {0..19}
    st.add_annotation("b", 0, 1, [{"description": "s", "kind": "shallow", "prefixes": list(range(20))}])
    # key (0,7) has 10 prefixes: semantic {0,1,2}, twice, and one shallow {9}
    st.add_annotation("a", 0, 7, [{"description": "m", "kind": "semantic", "prefixes": [0, 1, 2]},
                                  {"description": "m2", "kind": "semantic", "prefixes": [1, 2]},
                                  {"description": "end", "kind": "shallow", "prefixes": [9]}])
    # layer 1: one key, no pattern
    st.add_annotation("a", 1, 2, [])
    s = st.stats()
    assert s["annotations"] == 4 and s["keys"] == 3 and s["annotators"] == ["a", "b"]
    assert s["patterns_per_key"] == pytest.approx((2 + 1 + 3 + 0) / 4)
    assert s["keys_with_pattern"] == pytest.approx(3 / 4)
    f0, f1 = s["fig2"]
    n0 = 25 + 25 + 10
    assert f0["prefixes"] == n0
    assert f0["shallow"] == pytest.approx((5 + 20 + 1) / n0)
    assert f0["both"] == pytest.approx(5 / n0)
    assert f0["semantic"] == pytest.approx((5 + 3) / n0)
    assert f0["not_covered"] == pytest.approx((10 + 5 + 6) / n0)
    assert f1["not_covered"] == 1.0 and f1["prefixes"] == 25
    # inter-annotator on key (0,1): labels both vs shallow; prefix categories by hand
    ia = s["inter_annotator"]
    ca = ["shallow"] * 5 + ["both"] * 5 + ["semantic"] * 5 + ["not_covered"] * 10
    cb = ["shallow"] * 20 + ["not_covered"] * 5
    assert ia["keys"] == 1 and ia["pairs"] == 1 and ia["key_label_agreement"] == 0.0
    assert ia["prefix_category_agreement"] == pytest.approx(10 / 25)
    assert ia["prefix_category_kappa"] == pytest.approx(cohen_kappa(ca, cb))
    assert ia["covered_jaccard"] == pytest.approx(15 / 20)
    assert s["auto_vs_human"] is None  # no `ffkv patterns` yet
    # automatic labels for (0,1) and (1,2) only; (0,7) was not semantically analysed
    run.write_table("pattern_keys", pa.table({
        "layer": pa.array([0, 0, 1], pa.int16()), "dim": pa.array([1, 7, 2], pa.int32()),
        "sign": pa.array([1, 1, 1], pa.int8()), "semantic_done": [True, False, True]}))
    run.write_table("patterns", pa.table({
        "layer": pa.array([0, 1], pa.int16()), "dim": pa.array([1, 2], pa.int32()),
        "sign": pa.array([1, 1], pa.int8()), "kind": ["shallow", "semantic"],
        "covered": pa.array([list(range(0, 12)), [0, 1, 2]], pa.list_(pa.int16()))}))
    av = st.stats()["auto_vs_human"]
    assert av["annotations"] == 3 and av["without_automatic_labels"] == 1
    # key labels: human (both, shallow, none) vs automatic (shallow, shallow, semantic)
    assert av["key_label_agreement"] == pytest.approx(1 / 3)
    auto01 = ["shallow"] * 12 + ["not_covered"] * 13
    auto12 = ["semantic"] * 3 + ["not_covered"] * 22
    hum = ca + cb + ["not_covered"] * 25
    aut = auto01 + auto01 + auto12
    assert av["prefix_category_agreement"] == pytest.approx(np.mean([x == y for x, y in zip(hum, aut)]))
    assert av["prefix_category_kappa"] == pytest.approx(cohen_kappa(hum, aut))
    assert av["human_coverage"] == pytest.approx(np.mean([x != "not_covered" for x in hum]))


def test_kappa_and_categories_by_hand():
    assert cohen_kappa(list("ssnb"), list("snnb")) == pytest.approx(7 / 11)
    assert cohen_kappa(list("aaaa"), list("aaaa")) != cohen_kappa(list("aaaa"), list("aaaa"))  # nan
    assert prefix_categories([{"kind": "shallow", "prefixes": [0, 1]}, {"kind": "semantic", "covered": [1, 2]}],
                             4) == ["shallow", "both", "semantic", "not_covered"]


def test_sample_is_seeded_nested_and_stored(run):
    from ffkv.store.query import mined_keys, read_triggers, sample_keys

    st = AnnotationStore(run)
    keys = st.sample(per_layer=2, seed=4)
    assert keys == st.stored_sample()
    want = sample_keys(mined_keys(read_triggers(run, 1)), 2, 4)
    assert keys == [(l, int(d)) for l, ds in want.items() for d in ds]
    assert len([k for k in keys if k[0] == 3]) == 2 and len([k for k in keys if k[0] == 2]) == 1
    big = st.sample(per_layer=5, seed=4)
    assert set(keys) <= set(big) and st.stored_sample() == big


def test_key_prefixes_texts(run, tiny_models):
    st = AnnotationStore(run)
    tok = tiny_models["gpt2"].tok
    # the hand run's token ids are not the tokenization of its texts: texts are decoded from ids
    px = st.key_prefixes(0, 7, tok)
    assert [p["index"] for p in px] == list(range(10)) and px[0]["coef"] == pytest.approx(99)
    assert px[3]["text"] == tok.decode(list(range(5, 15))[: 4 % 10 + 1])
    with pytest.raises(FfkvError, match="unknown key"):
        st.key_prefixes(0, 2, tok)


def test_cli_annotate(run, tmp_path):
    from test_mutate import cli_inproc

    code, out, err = cli_inproc("annotate", "add", run.path, "-a", "cli", "-l", "0", "-d", "1",
                                "-p", 'shallow:0,3,7-9:ends with "base"', "-p", "semantic:1,2,4:military")
    assert code == 0, err
    rec = AnnotationStore(run).get("cli", 0, 1)
    assert rec["patterns"] == [{"description": 'ends with "base"', "kind": "shallow", "prefixes": [0, 3, 7, 8, 9]},
                               {"description": "military", "kind": "semantic", "prefixes": [1, 2, 4]}]
    for bad, needle in ((["-p", "shallow:0,99:x"], "outside 0..24"), (["-p", "shallow:0,x:y"], "not an integer"),
                        (["-p", "shallow:1:"], "description is empty"), (["-d", "2"], "unknown key"),
                        (["-p", "nonsense"], "KIND:PREFIXES:DESCRIPTION")):
        args = ["annotate", "add", run.path, "-a", "cli", "-l", "0", "-d", "1", *bad]
        code, out, err = cli_inproc(*args)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (bad, err)
    assert AnnotationStore(run).get("cli", 0, 1) == rec
    code, out, err = cli_inproc("annotate", "export", run.path, "-o", tmp_path / "x.jsonl")
    assert code == 0 and (tmp_path / "x.jsonl").exists()
    code, out, err = cli_inproc("annotate", "import", run.path, tmp_path / "x.jsonl")
    assert code == 0 and "unchanged 1" in out
    code, out, err = cli_inproc("annotate", "stats", run.path, "--json")
    assert code == 0 and json.loads(out)["patterns_per_key"] == 2.0
    code, out, err = cli_inproc("annotate", "sample", run.path, "--per-layer", "1", "--json")
    assert code == 0 and len(json.loads(out)) == 4


def test_cli_annotate_prints_terminal_controls_escaped(run):
    """An annotator name or description typed with escape sequences is stored as typed and shown
    escaped by `add` and `list`, so listing annotations cannot clear or reverse the terminal."""
    from test_mutate import cli_inproc

    who, desc = "ev\x1b[2Jil", "rev\u202eersed \x07bell"
    code, out, err = cli_inproc("annotate", "add", run.path, "-a", who, "-l", "0", "-d", "1",
                                "-p", f"semantic:1,2:{desc}")
    assert code == 0, err
    assert AnnotationStore(run).get(who, 0, 1)["patterns"][0]["description"] == desc
    code, listed, err = cli_inproc("annotate", "list", run.path)
    assert code == 0, err
    for out in (out, listed):
        assert not any(c in out for c in ("\x1b", "\u202e", "\x07")), out
    assert "ev\\x1b[2Jil" in listed and "rev\\u202eersed \\x07bell" in listed
