"""Fact sets (issue 47 item 1): the built-in sets from the real data packages, the CounterFact
parser against hand-written files and Hypothesis junk, and the "known" filter against a plain
forward of the HF model."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffkv.errors import FfkvError
from ffkv.steps.facts import data as fd
from ffkv.steps.facts.data import (REQUIRED, TEMPLATES, Fact, check_template, known, load_counterfact,
                                   load_facts, relation_counts, single_token, target_ids)


# ---- built-in sets -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sets():
    return {"countries": load_facts("countries"), "cities": load_facts("cities")}


@pytest.mark.parametrize("name", fd.BUILTIN)
def test_builtin_sets_are_well_formed(sets, name):
    facts = sets[name]
    assert len(facts) > 300
    rels = {f.relation for f in facts}
    objects = {r: {f.target_true for f in facts if f.relation == r} for r in rels}
    subjects = {r: {f.subject for f in facts if f.relation == r} for r in rels}
    for r in rels:
        assert len(TEMPLATES[r]) >= 2 and all(t.count("{}") == 1 for t in TEMPLATES[r])
    assert len({f.case_id for f in facts}) == len(facts)
    written = {r: {t.replace("{}", s): s for s in subjects[r] for t in TEMPLATES[r]} for r in rels}
    truth = {(f.relation, f.subject): f.target_true for f in facts}
    sharing = Counter((f.relation, f.target_true) for f in facts)
    for f in facts:
        assert f.prompt.count("{}") == 1 and f.prompt == TEMPLATES[f.relation][0]
        assert f.text == f.prompt.replace("{}", f.subject) and f.subject in f.text
        assert f.target_true.startswith(" ") and f.target_new.startswith(" ")
        assert f.target_new != f.target_true and f.target_new in objects[f.relation]
        assert f.target_new.split()[0] != f.target_true.split()[0]  # first tokens differ too
        assert f.paraphrases == tuple(t.replace("{}", f.subject) for t in TEMPLATES[f.relation][1:])
        assert 1 <= len(f.neighbours) <= fd.NEIGHBOURS and len(f.neighbour_targets) == len(f.neighbours)
        for p, t in zip(f.neighbours, f.neighbour_targets):
            s = written[f.relation].get(p)  # another subject of the relation, in one of its templates
            assert s is not None and s != f.subject, (f, p)
            assert t == truth[f.relation, s]
        # CounterFact's neighbours keep the true object wherever another subject shares it
        n_sharing = sharing[f.relation, f.target_true] - 1
        if n_sharing:
            assert set(f.neighbour_targets) == {f.target_true}
            assert len(f.neighbours) == min(fd.NEIGHBOURS, n_sharing)
        else:
            assert f.target_true not in f.neighbour_targets


def test_builtin_sets_hold_known_facts(sets):
    by = {(f.relation, f.subject): f for facts in sets.values() for f in facts}
    assert by["capital", "France"].target_true == " Paris"
    assert by["capital", "France"].text == "The capital of France is"
    assert by["continent", "Brazil"].target_true == " South America"
    assert by["currency", "Japan"].target_true == " Yen"
    assert by["language", "Germany"].target_true == " German"
    assert by["demonym", "Italy"].target_true == " Italian"
    assert by["city_country", "Tokyo"].target_true == " Japan"
    assert by["city_country", "Hyderabad"].target_true == " India"  # the bigger namesake
    assert ("city_country", "Valencia") not in by  # two of a size: ambiguous
    assert ("capital", "Singapore") not in by  # its own name: nothing to recall
    assert set(TEMPLATES) == {f.relation for facts in sets.values() for f in facts}


def _digest(facts) -> str:
    return hashlib.sha256(repr(facts).encode()).hexdigest()


def test_builtin_sets_are_deterministic(sets):
    """The same facts in a second load and in another process (another hash seed); another seed
    draws other counterfactuals."""
    fd._country_rows.cache_clear()
    again = load_facts("countries")
    assert again == sets["countries"]
    code = ("import hashlib; from ffkv.steps.facts.data import load_facts as l; "
            "print(hashlib.sha256((repr(l('countries')) + repr(l('cities'))).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out == hashlib.sha256((repr(sets["countries"]) + repr(sets["cities"])).encode()).hexdigest()
    other = fd.countries(seed=1)
    assert [f.target_true for f in other] == [f.target_true for f in again]
    assert [f.target_new for f in other] != [f.target_new for f in again]


def test_load_facts_filters_and_refuses(tmp_path, sets):
    caps = load_facts("countries", relation="capital", limit=7)
    assert len(caps) == 7 and {f.relation for f in caps} == {"capital"}
    assert caps == [f for f in sets["countries"] if f.relation == "capital"][:7]
    assert load_facts("cities", limit=0) == []
    for spec, words in (("planets", ["countries", "cities", "CounterFact"]),
                        (str(tmp_path / "nope.json"), ["no such file", "countries"]),
                        (str(tmp_path), ["not a file"])):
        with pytest.raises(FfkvError) as e:
            load_facts(spec)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words)
    with pytest.raises(FfkvError, match="'capital'.*'continent'") as e:
        load_facts("countries", relation="moons")
    with pytest.raises(FfkvError, match="limit"):
        load_facts("countries", limit=-1)


@pytest.mark.parametrize("prompt,ok", [("{} is located in the city of", True), ("The capital of {} is", True),
                                       ("The capital of France is", False), ("{} and {}", False),
                                       ("a {0} b", False), ("line\n{{}}", True)])
def test_check_template(prompt, ok):
    if ok:
        assert check_template(prompt) == prompt
    else:
        with pytest.raises(FfkvError) as e:
            check_template(prompt)
        assert "\n" not in str(e.value) and "{}" in str(e.value)


def test_text_is_safe_with_braces():
    f = Fact(relation="r", prompt="The {} is", subject="{x} {}", target_true=" y", target_new=None)
    assert f.text == "The {x} {} is"


# ---- CounterFact files ---------------------------------------------------------------------------
RECORDS = [
    {"case_id": 0, "pararel_idx": 2796,
     "requested_rewrite": {"prompt": "The mother tongue of {} is", "relation_id": "P103",
                           "target_new": {"str": "English", "id": "Q1860"},
                           "target_true": {"str": "French", "id": "Q150"}, "subject": "Danielle Darrieux"},
     "paraphrase_prompts": ["Shayna does this and Yossel goes still and dies. Danielle Darrieux, a native",
                            "An album was recorded for Capitol Nashville but never released. Danielle Darrieux spoke the language"],
     "neighborhood_prompts": ["The mother tongue of Léon Blum is", "The native language of Montesquieu is"],
     "attribute_prompts": ["J.\u00a0R.\u00a0R. Tolkien is a native speaker of"],
     "generation_prompts": ["Danielle Darrieux's mother tongue is"]},
    {"case_id": 17,
     "requested_rewrite": {"prompt": "{}, which is located in", "relation_id": "P17",
                           "target_new": {"str": " Sweden"}, "target_true": {"str": " Spain"},
                           "subject": "Autonomous University of Madrid"},
     "paraphrase_prompts": ["It is located in"],  # no subject: CounterFact has such paraphrases
     "neighborhood_prompts": [{"prompt": "Madrid is located in", "target": "Spain"}]},
]
EXPECTED = [
    Fact(relation="P103", prompt="The mother tongue of {} is", subject="Danielle Darrieux",
         target_true=" French", target_new=" English",
         paraphrases=tuple(RECORDS[0]["paraphrase_prompts"]), neighbours=tuple(RECORDS[0]["neighborhood_prompts"]),
         case_id=0, neighbour_targets=(" French", " French")),
    Fact(relation="P17", prompt="{}, which is located in", subject="Autonomous University of Madrid",
         target_true=" Spain", target_new=" Sweden", paraphrases=("It is located in",),
         neighbours=("Madrid is located in",), case_id=17, neighbour_targets=(" Spain",)),
]


def test_counterfact_round_trips(tmp_path):
    p = tmp_path / "facts.json"
    p.write_text(json.dumps(RECORDS))
    assert load_counterfact(p) == EXPECTED
    assert load_facts(str(p)) == EXPECTED
    assert load_facts(str(p), relation="P17") == EXPECTED[1:]
    jl = tmp_path / "facts.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    assert load_counterfact(jl) == EXPECTED
    one = tmp_path / "one.json"
    one.write_text(json.dumps(RECORDS[1]))
    assert load_counterfact(one) == EXPECTED[1:]
    # a hand-written record: no case_id (its index), no target_new, plain strings
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps([{"requested_rewrite": {"prompt": "{} is in", "subject": "Rome",
                                                       "target_true": "Italy"}}]))
    assert load_counterfact(hand) == [Fact(relation="", prompt="{} is in", subject="Rome",
                                           target_true=" Italy", target_new=None, case_id=0)]


def _error(path) -> str:
    with pytest.raises(FfkvError) as e:
        load_counterfact(path)
    msg = str(e.value)
    assert "\n" not in msg and "\r" not in msg and path.name in msg
    return msg


def test_counterfact_errors_name_the_record(tmp_path):
    p = tmp_path / "facts.json"
    bad = json.loads(json.dumps(RECORDS))
    bad[1]["requested_rewrite"]["prompt"] = "Madrid is located in"
    p.write_text(json.dumps(bad))
    assert _error(p) == 'facts.json: record 1 (case_id 17): requested_rewrite.prompt has no "{}"'
    bad[1]["requested_rewrite"]["prompt"] = "{} {}"
    p.write_text(json.dumps(bad))
    assert "has 2" in _error(p)
    bad = json.loads(json.dumps(RECORDS))
    bad[0]["requested_rewrite"]["subject"] = "  "
    p.write_text(json.dumps(bad))
    assert _error(p) == "facts.json: record 0 (case_id 0): requested_rewrite.subject is empty"
    bad[0] = [1]
    p.write_text(json.dumps(bad))
    assert _error(p) == "facts.json: record 0: expected an object, found a list"
    p.write_text('[{"case_id": 1,')
    assert _error(p).startswith("facts.json: invalid JSON (line 1 column")
    p.write_text('{"a": 1}\n{"b": \n')
    assert "line 2" in _error(p)
    p.write_text('"text"')
    assert "found a string" in _error(p)
    p.write_bytes(b"\xff\xfe[")
    assert "UTF-8" in _error(p)
    p.write_text("[" * 100_000)
    assert "nested" in _error(p) or "invalid JSON" in _error(p)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
KEYS = ["case_id", "requested_rewrite", "prompt", "subject", "target_true", "target_new", "str",
        "relation_id", "paraphrase_prompts", "neighborhood_prompts", "target"]


@st.composite
def near_records(draw):
    """A valid record with some values replaced by junk: the parser's edge cases."""
    rec = json.loads(json.dumps(draw(st.sampled_from(RECORDS))))
    for _ in range(draw(st.integers(1, 3))):
        node = rec
        path = draw(st.sampled_from([("case_id",), ("requested_rewrite",), ("requested_rewrite", "prompt"),
                                     ("requested_rewrite", "subject"), ("requested_rewrite", "target_true"),
                                     ("requested_rewrite", "target_new"), ("requested_rewrite", "target_true", "str"),
                                     ("paraphrase_prompts",), ("neighborhood_prompts",)]))
        for k in path[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[path[-1]] = draw(json_values | st.sampled_from(["{}", "", "{} {}", [], {}]))
    return rec


documents = (json_values | st.lists(near_records() | json_values, max_size=4)
             | st.dictionaries(st.sampled_from(KEYS), json_values, max_size=4))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=documents, jsonl=st.booleans())
def test_counterfact_junk_parses_or_is_one_line(tmp_path, doc, jsonl):
    p = tmp_path / "junk.json"
    if jsonl and isinstance(doc, list):
        p.write_text("\n".join(json.dumps(r) for r in doc))
    else:
        p.write_text(json.dumps(doc))
    try:
        facts = load_counterfact(p)
    except FfkvError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith("junk.json: ")
    else:
        assert all(f.prompt.count("{}") == 1 and f.subject.strip() and f.target_true.strip() for f in facts)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_counterfact_text_junk(tmp_path, text):
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    try:
        load_counterfact(p)
    except FfkvError as e:
        assert "\n" not in str(e) and str(e).startswith("t.jsonl: ")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 5), data=st.data())
def test_counterfact_missing_key_names_the_record(tmp_path, n, data):
    recs = [json.loads(json.dumps(RECORDS[i % 2])) for i in range(n)]
    for i, r in enumerate(recs):
        r["case_id"] = 100 + i
    i = data.draw(st.integers(0, n - 1))
    key = data.draw(st.sampled_from(REQUIRED)).split(".")
    node = recs[i]
    for k in key[:-1]:
        node = node[k]
    del node[key[-1]]
    p = tmp_path / "facts.json"
    p.write_text(json.dumps(recs))
    assert _error(p).startswith(f"facts.json: record {i} (case_id {100 + i}): ")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.text(max_size=30).filter(lambda s: "{}" not in s))
def test_counterfact_prompt_without_slot_is_refused(tmp_path, prompt):
    rec = json.loads(json.dumps(RECORDS[0]))
    rec["requested_rewrite"]["prompt"] = prompt
    p = tmp_path / "facts.json"
    p.write_text(json.dumps([rec]))
    msg = _error(p)
    assert msg.startswith("facts.json: record 0 (case_id 0): requested_rewrite.")
    if prompt.strip():
        assert msg.endswith('requested_rewrite.prompt has no "{}"')
    with pytest.raises(FfkvError):
        check_template(prompt)


# ---- targets and the known filter ----------------------------------------------------------------
def _plain(mm, fact: Fact) -> tuple[float, int]:
    """P(first token of the object) and its rank from a plain forward of the HF model."""
    ids = torch.tensor([mm.tok(fact.text)["input_ids"]])
    with torch.no_grad():
        logits = mm.hf(input_ids=ids).logits[0, -1].float()
    t = mm.tok(fact.target_true, add_special_tokens=False)["input_ids"][0]
    return torch.softmax(logits, -1)[t].item(), int((logits > logits[t]).sum())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_known_equals_a_plain_forward(tiny_models, arch, sets):
    mm = tiny_models[arch]
    facts = sets["countries"][::40] + sets["cities"][::60]
    # one fact the tiny model surely ranks first: its own greedy token as the object
    f0 = facts[0]
    ids = torch.tensor([mm.tok(f0.text)["input_ids"]])
    top = mm.tok.decode([int(mm.hf(input_ids=ids).logits[0, -1].argmax())])
    facts = [Fact(relation="greedy", prompt=f0.prompt, subject=f0.subject, target_true=top)] + facts
    want = [_plain(mm, f) for f in facts]
    one = known(mm, facts, batch=1)  # each prompt alone: the same forward as the plain one
    assert one.p_true.tolist() == [p for p, _ in want]
    assert one.rank.tolist() == [r for _, r in want]
    assert one.known.tolist() == [r == 0 for _, r in want] and one.known[0]
    many = known(mm, facts)  # equal lengths batched: the same up to rounding
    np.testing.assert_allclose(many.p_true, one.p_true, rtol=1e-5)
    assert (many.rank == one.rank).all()
    cut = float(np.median(one.p_true))
    by_p = known(mm, facts, min_prob=cut)
    assert by_p.known.tolist() == (one.p_true >= cut).tolist() and by_p.min_prob == cut
    counts = relation_counts(facts, one.known)
    assert counts["greedy"] == (1, 1)
    assert sum(n for n, _ in counts.values()) == len(facts)
    assert sum(k for _, k in counts.values()) == int(one.known.sum())
    with pytest.raises(FfkvError):
        known(mm, facts, min_prob=2.0)


def test_target_ids(tiny_models):
    tok = tiny_models["gpt2"].tok
    assert target_ids(tok, " the") == tok(" the", add_special_tokens=False)["input_ids"]
    assert single_token(tok, " the") and not single_token(tok, " Ouagadougou")
    assert len(target_ids(tok, " Ouagadougou")) > 1


@pytest.mark.slow
def test_smollm2_knows_capitals(smollm2, sets):
    mm = smollm2
    assert target_ids(mm.tok, " Paris") == [mm.tok(" Paris")["input_ids"][0]] and single_token(mm.tok, " Paris")
    france = next(f for f in sets["countries"] if f.relation == "capital" and f.subject == "France")
    caps = [f for f in sets["countries"] if f.relation == "capital"][:30]
    k = known(mm, [france] + caps)
    assert k.known[0] and k.rank[0] == 0 and k.p_true[0] > 0.3
    n = int(k.known[1:].sum())
    assert 3 <= n <= 29, n  # SmolLM2 (135M) knows some capitals, not all
    assert relation_counts(caps, k.known[1:]) == {"capital": (30, n)}
