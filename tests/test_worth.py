"""The worth step (issue 48, item 6), each number against a computation of its own on a tiny Llama:

- the first-order worth of every memory equals −m·∂L/∂m from a hand-written hooked forward and
  backward of the raw model (a zero added at down_proj's input, its gradient taken), over the
  same sentences, averaged over their predicted tokens;
- the check's real rises equal the raw model's mean loss with the memory's down_proj input column
  zeroed, less the clean loss; the estimates track them (Spearman), and for the last layer's
  memories, whose removal reaches the loss through the final norm and softmax only, they agree
  to first order;
- the memory page, the overview and the report show the table's numbers;
- bad settings and a mixture of experts are one line and exit 2.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_cli

ARGS = ("--tokens", "240", "--check", "6", "--check-tokens", "100")


@pytest.fixture(scope="module")
def worth_run(tmp_path_factory, tiny_dirs, reference_mine):
    import shutil

    from transformers import AutoModelForCausalLM

    path = tiny_dirs["llama"]
    run = tmp_path_factory.mktemp("worth") / "run"
    shutil.copytree(reference_mine(path, 30, 3), run)
    r = run_cli("worth", run, *ARGS, "--json")
    assert r.returncode == 0, r.stderr
    return run, AutoModelForCausalLM.from_pretrained(path).eval(), json.loads(r.stdout)


def _rows(run, tokens):
    from ffkv.steps.worth.compute import sentence_rows
    from ffkv.store.run import Run

    return sentence_rows(Run(run), tokens)


def _loss(hf, rows, zero=None):
    """Mean next-token loss of the raw model over rows, one at a time; `zero`: (layer, dim) removed."""
    hooks = []
    if zero is not None:
        l, i = zero

        def pre(mod, args):
            x = args[0].clone()
            x[..., i] = 0
            return (x,)
        hooks.append(hf.model.layers[l].mlp.down_proj.register_forward_pre_hook(pre))
    tot = n = 0
    with torch.no_grad():
        for r in rows:
            ids = torch.as_tensor(r)[None]
            logits = hf(input_ids=ids).logits[0, :-1].float()
            tot += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            n += len(r) - 1
    for h in hooks:
        h.remove()
    return tot / n


def test_worth_equals_a_hand_written_backward(worth_run):
    run, hf, summ = worth_run
    rows = _rows(run, 240)
    L, d_m = hf.config.num_hidden_layers, hf.config.intermediate_size
    sums, n = np.zeros((L, d_m)), 0
    for r in rows:
        ids = torch.as_tensor(r)[None]
        zs, ms, hooks = [], [], []
        for l in range(L):
            z = torch.zeros(1, len(r), d_m, requires_grad=True)
            zs.append(z)

            def pre(mod, args, z=z):
                ms.append(args[0].detach())
                return (args[0] + z,)
            hooks.append(hf.model.layers[l].mlp.down_proj.register_forward_pre_hook(pre))
        logits = hf(input_ids=ids).logits[0, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
        gs = torch.autograd.grad(loss, zs)
        for h in hooks:
            h.remove()
        for l in range(L):
            sums[l] -= (ms[l].double() * gs[l].double()).sum((0, 1)).numpy()
        n += len(r) - 1
    want = sums / n
    t = pq.read_table(run / "memory_worth.parquet").to_pandas().sort_values(["layer", "dim"])
    assert summ["tokens"] == n == 240 and (t["tokens"] == n).all()
    got = t["worth"].to_numpy().reshape(L, d_m)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-7 * np.abs(want).max())
    # rank 1 is each layer's largest worth
    top = t[t["rank"] == 1].set_index("layer")["worth"]
    assert np.allclose(top.to_numpy(), want.max(1))


def test_the_check_is_a_real_removal(worth_run):
    from ffkv.steps.worth.compute import check_rows

    run, hf, summ = worth_run
    rows = _rows(run, 240)
    rows = rows[:check_rows(rows, 100)]
    base = _loss(hf, rows)
    c = summ["check"]
    assert len(c["memories"]) == 6 and c["loss"] == pytest.approx(base, rel=1e-5)
    t = pq.read_table(run / "memory_worth.parquet").to_pandas().set_index(["layer", "dim"])
    assert t["ablated"].notna().sum() == 6
    for (l, i), real in zip(c["memories"], c["real"]):
        assert real == pytest.approx(_loss(hf, rows, (l, i)) - base, abs=1e-6)
        assert t.loc[(l, i), "ablated"] == pytest.approx(real)
    assert c["spearman"] > 0.5, c
    # the last layer's memories: removing one moves the loss to first order as estimated
    from ffkv.model import identity
    from ffkv.steps.worth.compute import estimate
    from ffkv.store.run import Run

    est, _ = estimate(identity.open_model(Run(run), device="cpu"), rows)
    last = hf.config.num_hidden_layers - 1
    for i in np.argsort(-np.abs(est[last]))[:3]:
        real = _loss(hf, rows, (last, int(i))) - base
        assert est[last, i] == pytest.approx(real, rel=0.25), (i, est[last, i], real)


def test_pages_show_the_numbers(worth_run, tmp_path):
    from fastapi.testclient import TestClient

    from ffkv.steps.registry import get
    from ffkv.store.run import Run
    from ffkv.web.app import create_app

    run, hf, summ = worth_run
    t = pq.read_table(run / "memory_worth.parquet").to_pandas()
    l, d, w = summ["top"][0]
    c = TestClient(create_app(run, log_fn=lambda m: None), base_url="http://127.0.0.1:8000")
    page = c.get(f"/memory/{l}/{d}")
    assert page.status_code == 200 and "Worth" in page.text and f"{w:+.4g}" in page.text
    ov = c.get("/api/overview").json()
    got = [r["steps"]["worth"]["worth: total"] for r in ov["rows"]]
    assert got == pytest.approx(t.groupby("layer")["worth"].sum().tolist())
    secs = get("worth").sections(Run(run), tmp_path)
    assert secs[0].html.count("<tr>") == 1 + hf.config.num_hidden_layers and "Spearman" in secs[0].html


@pytest.mark.parametrize("args,flag", [(("--tokens", "0"), "--tokens"), (("--check", "-1"), "--check"),
                                       (("--batch-tokens", "x"), "--batch-tokens")])
def test_bad_settings_are_one_line(worth_run, args, flag):
    run, _, _ = worth_run
    r = run_cli("worth", run, *args)
    assert r.returncode == 2 and flag in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_mixture_of_experts_is_refused(tmp_path_factory, tok_dir):
    from test_families import open_tiny
    from test_moe import _BUILT, MOE

    from ffkv.errors import FfkvError
    from ffkv.steps.worth.compute import estimate

    mm = open_tiny("mixtral", MOE["mixtral"][0], lambda: tmp_path_factory.mktemp("worth_moe"), tok_dir, _BUILT)[1]
    with pytest.raises(FfkvError, match="mixture of experts"):
        estimate(mm, [np.arange(5)])

