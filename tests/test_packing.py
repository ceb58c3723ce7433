"""Mining's forward over packed rows (`ffkv.mine.packing`, FFKV_PACK=C): the same tables as padded
rows, a layout that puts every token in one slot and back, and a bad setting as one line.

Every family's packed mining against a per-sentence brute force is in tests/test_families.py and
tests/test_moe.py (`test_packed_mining_equals_brute_force`, FFKV_PACK=40)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import WT2, run_cli
from test_cli_errors import one_line_error
from test_mine import _assert_same_mine
from ffkv.mine.packing import Packed


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "gpt_neox"])
def test_packed_mining_writes_the_padded_tables(tiny_dirs, tiny_models, tmp_path, monkeypatch, reference_mine, arch):
    """Rotary (llama, gpt_neox) and learned absolute positions (gpt2) alike: the tables of
    `ffkv mine` with rows of 48 tokens equal those of padded rows, statistics included. OPT
    derives positions from the mask and builds its mask without position ids, so its sentences
    would mix: the check refuses it, and it mines padded rows."""
    from ffkv import errors
    from ffkv.mine.packing import refusal

    why = refusal(tiny_models[arch])
    assert (why is not None) == (arch == "opt"), why
    want = reference_mine(tiny_dirs[arch], 60, 5, "--negative")
    monkeypatch.setenv("FFKV_PACK", "48")
    errors._said.clear()
    res = run_cli("mine", "--out", tmp_path / "packed", "--model", tiny_dirs[arch], "--corpus",
                  WT2 / "wiki.valid.tokens", "--max-sentences", "60", "--top-k", "5", "--negative")
    assert res.returncode == 0, res.stderr
    said = [l for l in res.stderr.splitlines() if "FFKV_PACK" in l]
    assert said == ([f"ffkv: FFKV_PACK: padded rows for this model: {why}"] if why else []), res.stderr
    _assert_same_mine(tmp_path / "packed", want)
    rec = json.loads((tmp_path / "packed" / "manifest.json").read_text())["steps"]["mine"]
    assert rec["packed_rows"] == (None if why else 48)
    assert ("packed rows of 48 tokens" in res.stdout) == (why is None), res.stdout


@pytest.mark.parametrize("switch, value", [("FFKV_PACK", v) for v in ("x", "-3", "1.5", "1e9x", "autox")]
                         + [("FFKV_COMPILE", v) for v in ("yes", "2", "-1")]
                         + [("FFKV_TRITON", v) for v in ("yes", "2", "on")])
def test_a_bad_switch_is_one_line(tiny_dirs, tmp_path, monkeypatch, switch, value):
    """Refused before any work, the switch named."""
    monkeypatch.setenv(switch, value)
    res = run_cli("mine", "--out", tmp_path / "r", "--model", tiny_dirs["llama"], "--corpus",
                  WT2 / "wiki.valid.tokens", "--max-sentences", "5")
    one_line_error(res, 2, switch)
    assert not (tmp_path / "r" / "triggers.parquet").exists()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=40), st.integers(1, 64))
def test_layout_round_trip(lengths, cap):
    """Each real token has one slot; a row holds at most max(cap, longest) tokens and whole
    sentences, position ids restart at each; unpacking a capture of slot numbers gives every
    sentence's own slots in the padded layout."""
    lens = np.array(lengths)
    flat = np.arange(1, int(lens.sum()) + 1)  # token "ids" that name the token
    p = Packed(flat, lens, 0, cap, "cpu")
    ids, pos = p.ids.numpy(), p.position_ids.numpy()
    R, C = ids.shape
    assert C <= max(cap, lens.max()) and p.shape == (len(lens), lens.max())
    assert sorted(ids[ids > 0].tolist()) == flat.tolist()  # every token once, nothing else
    slot = torch.arange(R * C, dtype=torch.float32).view(R, C, 1)
    back = p.unpack(slot)[..., 0].long().numpy()
    starts = np.cumsum(lens) - lens
    for b, n in enumerate(lens):
        where = back[b, :n]
        assert (ids.reshape(-1)[where] == flat[starts[b]:starts[b] + n]).all()
        assert (pos.reshape(-1)[where] == np.arange(n)).all()
        assert len(set(where // C)) == 1  # one row
    if len(lens) > 1 and lens.max() <= cap:
        assert R <= -(-2 * int(lens.sum()) // cap) + 1  # next-fit: fewer rows than sentences where they fit
