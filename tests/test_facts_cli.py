"""`ffkv facts trace|locate|edit|evaluate` end to end on a mined tiny run: tables against the library
and a plain forward, the report's sections, and one-line refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import mine_tiny, run_cli

CF = [
    {"case_id": 1, "requested_rewrite": {"prompt": "{} is in the city of", "subject": "The tower",
                                         "target_true": {"str": " London"}, "target_new": {"str": " the"},
                                         "relation_id": "P131"},
     "paraphrase_prompts": ["Where is The tower? It is in"], "neighborhood_prompts": ["The bridge is in the city of"]},
    {"case_id": 2, "requested_rewrite": {"prompt": "The language of {} is", "subject": "the island",
                                         "target_true": {"str": " English"}, "target_new": {"str": " of"},
                                         "relation_id": "P37"},
     "paraphrase_prompts": ["People on the island speak"], "neighborhood_prompts": ["The language of the city is"]},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dirs):
    d = tmp_path_factory.mktemp("facts")
    (d / "cf.json").write_text(json.dumps(CF))
    return mine_tiny(d / "run", tiny_dirs["llama"], 30, 3, "--covariance", "1,2")


def _table(run, name):
    from ffkv.store import query
    from ffkv.store.run import Run

    return query.table(Run(run), name).to_pandas()


def test_trace_of_a_prompt_is_stored_as_the_library_computes_it(run, tiny_models):
    from ffkv.steps.facts.trace import trace

    res = run_cli("facts", "trace", run, "--prompt", "{} is in the city of", "--subject", "The tower",
                  "--target", " London", "--samples", "2", "--kinds", "ffn,hidden")
    assert res.returncode == 0, res.stderr
    assert "1 fact traced" in res.stdout and "fact_traces" in res.stdout
    t = _table(run, "fact_traces")
    mm = tiny_models["llama"]
    want = trace(mm, "The tower is in the city of", "The tower", " London", samples=2, kinds=("ffn", "hidden"))
    T, L = len(want.tokens), mm.n_layers
    assert len(t) == 2 * T * L and set(t["kind"]) == {"ffn", "hidden"}
    for k in ("ffn", "hidden"):
        got = t[t["kind"] == k].sort_values(["token", "layer"])["effect"].to_numpy().reshape(T, L)
        np.testing.assert_allclose(got, want.effect[k], atol=1e-6)
    assert t["p_clean"].iloc[0] == pytest.approx(want.p_clean, abs=1e-6)
    # the heatmap rows: the last subject token is ROME's row 2
    last = t[(t["grp"] == 2)]["token"].unique()
    assert list(last) == [want.last_subject]


def test_trace_of_a_counterfact_file_and_its_report_section(run, tmp_path):
    res = run_cli("facts", "trace", run, "--facts", run.parent / "cf.json", "--all", "--samples", "2",
                  "--kinds", "ffn")
    assert res.returncode == 0, res.stderr
    assert "2 facts traced" in res.stdout and "ROME's finding" in res.stdout
    t = _table(run, "fact_traces")
    assert sorted(t["case_id"].unique()) == ["1", "2"]
    res = run_cli("report", run, "--out", tmp_path / "r")
    assert res.returncode == 0, res.stderr
    html = next((tmp_path / "r").glob("*.html")).read_text()
    assert "Where facts are recalled: causal tracing" in html


def test_evaluate_scores_equal_a_plain_forward_for_the_unedited_model(run, tiny_models):
    res = run_cli("facts", "evaluate", run, "--facts", run.parent / "cf.json", "--all", "--layer", "2", "--span",
                  "2", "--steps", "3", "--prefixes", "1", "--tokens", "6")
    assert res.returncode == 0, res.stderr
    assert "rewrite_acc" in res.stdout
    t = _table(run, "fact_scores")
    assert list(t["method"].unique()) == ["unedited", "rome", "memit", "values"] and len(t) == 8
    mm = tiny_models["llama"]

    def nll(text, target):
        p = mm.tok(text)["input_ids"]
        o = mm.tok(target, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(mm.hf(input_ids=torch.tensor([p + o])).logits[0].float(), -1)
        return float(-np.mean([lp[len(p) - 1 + i, o[i]] for i in range(len(o))]))

    for i, rec in enumerate(CF):
        rw = rec["requested_rewrite"]
        text = rw["prompt"].replace("{}", rw["subject"])
        row = t[(t["method"] == "unedited") & (t["fact"] == i)].iloc[0]
        assert row["efficacy"] == float(nll(text, rw["target_new"]["str"]) < nll(text, rw["target_true"]["str"]))
        para = rec["paraphrase_prompts"][0]
        assert row["generalization"] == float(nll(para, rw["target_new"]["str"]) < nll(para, rw["target_true"]["str"]))
        nb = rec["neighborhood_prompts"][0]
        assert row["specificity"] == float(nll(nb, rw["target_true"]["str"]) < nll(nb, rw["target_new"]["str"]))


def test_evaluate_takes_memits_lambda_as_edit_does(run, monkeypatch):
    """--lambda and --lambda-rel reach MEMIT's solve (as `ffkv facts edit` passes them) and the
    step's record; the default is the relative λ."""
    from ffkv.steps.facts import MEMIT_LAMBDA_REL
    from ffkv.steps.facts import edit as E
    from ffkv.store.run import Run

    seen = []
    real = E.memit

    def spy(*a, **kw):
        seen.append((kw.get("lam"), kw.get("lam_rel")))
        return real(*a, **kw)

    monkeypatch.setattr(E, "memit", spy)
    base = ["facts", "evaluate", run, "--facts", run.parent / "cf.json", "--all", "--layer", "2", "--span", "2",
            "--steps", "1", "--prefixes", "0", "--tokens", "0", "--methods", "memit", "--limit", "1", "--force"]
    assert run_cli(*base, "--lambda", "7.5").returncode == 0
    assert run_cli(*base, "--lambda-rel", "3").returncode == 0
    assert seen == [(7.5, MEMIT_LAMBDA_REL), (None, 3.0)]
    rec = Run(run).settings("facts_evaluate")
    assert rec["lam"] is None and rec["lam_rel"] == 3.0


def test_locate_json_ranks_and_checks(run):
    res = run_cli("facts", "locate", run, "--prompt", "{} is in the city of", "--subject", "The tower",
                  "--target", " London", "--method", "grad", "--at", "last", "--top", "4", "--ablate", "1,2",
                  "--draws", "3", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    scores = [m["score"] for m in out["memories"]]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)
    assert [a["k"] for a in out["ablation"]] == [1, 2]
    assert all(m["memory"] == f"/memory/{m['layer']}/{m['dim']}" for m in out["memories"])


@pytest.mark.parametrize("args, says", [
    (["trace", "--prompt", "no slot", "--subject", "x"], 'has no "{}"'),
    (["trace"], "give --prompt with --subject, or --facts"),
    (["trace", "--facts", "planets"], "unknown fact set 'planets'"),
    (["trace", "--prompt", "{} is", "--subject", "x", "--kinds", "mlp"], "--kinds"),
    (["edit", "--prompt", "{} is", "--subject", "x", "--new", " a", "--layer", "9"], "--layer 9 out of range 0..2"),
    (["edit", "--prompt", "{} is", "--subject", "x", "--new", " a", "--layer", "0"], "no key covariance of layer 0"),
    (["edit", "--prompt", "{} is", "--subject", "x", "--new", " ", "--layer", "1"], "--new"),
    (["locate", "--prompt", "{} is", "--subject", "y z", "--method", "magic"], "--method"),
    (["evaluate", "--facts", "countries", "--methods", "rome,lora"], "--methods"),
    (["evaluate", "--facts", "countries", "--lambda-rel", "-1"], "--lambda-rel"),
    (["evaluate", "--facts", "countries", "--lambda", "-5"], "--lambda"),
])
def test_refusals_are_one_line(run, args, says):
    res = run_cli("facts", args[0], run, *args[1:])
    assert res.returncode == 2, res.stdout
    assert says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_each_method_takes_its_published_clamp_unless_told(run, monkeypatch):
    """`facts edit` records the clamp its target was sought under: MEMIT's 0.75 and ROME's 4 by
    default, --clamp when given; `facts evaluate --clamp` hands it to MEMIT too."""
    from ffkv.steps.facts import edit as E

    def edited(method, *extra):
        name = f"clamp-{method}-{len(extra)}"
        res = run_cli("facts", "edit", run, "--prompt", "{} is in", "--subject", "The tower", "--new", " London",
                      "--method", method, "--layer", "2", "--span", "2", "--steps", "1", "--prefixes", "0",
                      "--tokens", "0", "--name", name, *extra)
        assert res.returncode == 0, res.stderr
        return E.Edit.load(run / "edits" / name).settings["clamp"]

    assert edited("memit") == 0.75 and edited("rome") == 4.0
    assert edited("memit", "--clamp", "2") == 2.0
    seen = []
    real = E.memit
    monkeypatch.setattr(E, "memit", lambda *a, **kw: seen.append(a[5]) or real(*a, **kw))
    assert run_cli("facts", "evaluate", run, "--facts", run.parent / "cf.json", "--all", "--layer", "2", "--span",
                   "2", "--steps", "1", "--prefixes", "0", "--tokens", "0", "--methods", "memit", "--limit", "1",
                   "--clamp", "1.5", "--force").returncode == 0
    assert seen and seen[0]["clamp"] == 1.5
