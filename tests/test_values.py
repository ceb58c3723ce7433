"""`ffkv values`: every number checked against a direct full-vocabulary computation (argsort,
softmax over the whole row) on tiny models, with planted memories, hand counts and CLI errors."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_cli
from ffkv.defs import wilson
from ffkv.steps.values.compute import KINDS, compute_values, precision_at_k, summarize_logits
from ffkv.steps.values.summary import format_summary
from ffkv.model.memories import open_model
from ffkv.store.run import Run
from ffkv.model import identity


# ---- a hand-made run: sentences + triggers following DEVELOPING.md --------------------------------
class Synth:
    """Random sentences and a schema-valid `triggers` table; planted rows keep sentences consistent."""

    def __init__(self, L, d_m, V, n_rank=60, signs=(1, -1), n_sent=300, sent_len=12, seed=0):
        rng = self.rng = np.random.default_rng(seed)
        self.V, self.sent_len = V, sent_len
        self.sents = [rng.integers(1, V, sent_len).tolist() for _ in range(n_sent)]
        keys = [(l, i, s) for l in range(L) for i in range(d_m) for s in signs]
        n = len(keys) * n_rank
        self.t = {
            "layer": np.repeat([k[0] for k in keys], n_rank).astype(np.int16),
            "dim": np.repeat([k[1] for k in keys], n_rank).astype(np.int32),
            "sign": np.repeat([k[2] for k in keys], n_rank).astype(np.int8),
            "rank": np.tile(np.arange(1, n_rank + 1), len(keys)).astype(np.int16),
        }
        base = np.repeat(rng.exponential(1.0, len(keys)) + 0.1, n_rank)
        self.t["coef"] = (self.t["sign"] * base * (1 - 0.01 * self.t["rank"])).astype(np.float32)
        self.t["sentence_id"] = rng.integers(0, n_sent, n).astype(np.int64)
        self.t["position"] = rng.integers(0, sent_len, n).astype(np.int32)  # last position: null next
        self.n_rank = n_rank

    def row(self, l, i, s, r):
        t = self.t
        idx = np.nonzero((t["layer"] == l) & (t["dim"] == i) & (t["sign"] == s) & (t["rank"] == r))[0]
        assert len(idx) == 1
        return int(idx[0])

    def set_next(self, l, i, s, r, token):
        """Give row (l, i, s, r) a fresh sentence whose next token is `token` (None: sentence end)."""
        j = self.row(l, i, s, r)
        toks = self.rng.integers(1, self.V, self.sent_len).tolist()
        if token is None:
            pos = self.sent_len - 1
        else:
            pos = 4
            toks[pos + 1] = int(token)
        self.sents.append(toks)
        self.t["sentence_id"][j] = len(self.sents) - 1
        self.t["position"][j] = pos

    def set_coef(self, l, i, s, coef_rank1):
        for r in range(1, self.n_rank + 1):
            self.t["coef"][self.row(l, i, s, r)] = coef_rank1 * (1 - 0.01 * r)

    def next_tokens(self):
        sid, pos = self.t["sentence_id"], self.t["position"]
        return [self.sents[a][p + 1] if p + 1 < self.sent_len else None for a, p in zip(sid, pos)]

    def write(self, run):
        run.write_table("sentences", pa.table({
            "sentence_id": pa.array(range(len(self.sents)), pa.int64()),
            "doc_id": pa.array([0] * len(self.sents), pa.int64()),
            "text": pa.array([""] * len(self.sents), pa.string()),
            "token_ids": pa.array(self.sents, pa.list_(pa.int32())),
            "n_tokens": pa.array([len(s) for s in self.sents], pa.int32())}))
        cols = {c: pa.array(v) for c, v in self.t.items()}
        cols["next_token"] = pa.array(self.next_tokens(), pa.int32())
        run.write_table("triggers", pa.table(cols))


def make_run(path, mm, synth, lens="norm", mine=True) -> Run:
    run = Run(path, create=True)
    identity.record_model(run, mm)
    run.manifest["lens"] = lens
    run.save()
    if synth is not None:
        synth.write(run)
    if mine:
        from ffkv.steps.mine.compute import vocab_table

        run.start_step("mine", {"synthetic": True})
        run.write_table("vocab", vocab_table(mm.tok, mm.vocab_size))  # every mined run has one
        run.finish_step("mine")
    return run


# ---- independent references from the raw modules ----------------------------------------------
def raw_weights(mm, arch, l):
    """(values (d_m, d), keys (d_m, d)) read straight from the HF modules."""
    hf = mm.hf
    if arch == "llama":
        mlp = hf.model.layers[l].mlp
        return mlp.down_proj.weight.T, mlp.gate_proj.weight
    if arch == "gpt2":
        mlp = hf.transformer.h[l].mlp
        return mlp.c_proj.weight, mlp.c_fc.weight.T
    if arch == "opt":
        lay = hf.model.decoder.layers[l]
        return lay.fc2.weight.T, lay.fc1.weight
    raise ValueError(arch)


def raw_gain(mm, arch):
    return {"llama": lambda h: h.model.norm.weight, "gpt2": lambda h: h.transformer.ln_f.weight,
            "opt": lambda h: h.model.decoder.final_layer_norm.weight}[arch](mm.hf)


@torch.no_grad()
def direct_logits(mm, arch, lens, W):
    E = mm.hf.lm_head.weight.detach().double()
    g = raw_gain(mm, arch).detach().double() if lens == "norm" else torch.ones(E.shape[1], dtype=torch.float64)
    return (W.double() * g) @ E.T


def plant_token(mm, arch, lens):
    """A token t and a direction u with argmax(u·E) = t for sure: t = the longest unembedding row,
    u = E[t] / gain (Cauchy–Schwarz), scaled so that the logit gap to the runner-up is 30."""
    E = mm.hf.lm_head.weight.detach().double()
    t = int(E.norm(dim=1).argmax())
    g = raw_gain(mm, arch).detach().double() if lens == "norm" else torch.ones(E.shape[1], dtype=torch.float64)
    lg = E @ E[t]
    gap = float(lg[t] - lg[torch.arange(len(lg)) != t].max())
    assert gap > 0
    return t, (E[t] / g * (30.0 / gap)).float()


# ---- unit tests -----------------------------------------------------------------------------------
def test_wilson_known_values():
    lo, hi = wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-4 and abs(hi - 0.7634) < 1e-4
    lo, hi = wilson(0, 10)
    assert lo == 0 and abs(hi - 0.2775) < 1e-4
    lo, hi = wilson(0, 0)
    assert math.isnan(lo) and math.isnan(hi)


def _wilson_closed_form(k, n, z=1.959963984540054):
    """The hand-written interval `wilson` was before it called scipy (clipped to [0, 1])."""
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return min(max(centre - half, 0.0), 1.0), min(max(centre + half, 0.0), 1.0)


def test_wilson_is_the_closed_form():
    for n in (1, 2, 3, 5, 10, 37, 100, 1536, 46080):
        for k in sorted({0, 1, n // 3, n // 2, n - 1, n} - {-1}):
            lo, hi = wilson(k, n)
            want = _wilson_closed_form(k, n)
            assert abs(lo - want[0]) <= 1e-12 and abs(hi - want[1]) <= 1e-12, (k, n, lo, hi, want)
    # element-wise over arrays, NaN where n == 0
    lo, hi = wilson(np.array([0, 3, 7]), np.array([0, 10, 7]))
    assert np.isnan(lo[0]) and np.isnan(hi[0]) and hi[2] == 1.0
    assert abs(lo[1] - _wilson_closed_form(3, 10)[0]) <= 1e-12


def test_summarize_logits_vs_full_softmax():
    torch.manual_seed(0)
    z = torch.randn(9, 700) * torch.linspace(0.1, 30, 9)[:, None]
    s = summarize_logits(z, 5)
    for name, zz in (("pos", z), ("neg", -z)):
        lp = torch.log_softmax(zz.double(), -1)
        p = lp.exp()
        order = torch.argsort(zz, dim=-1, descending=True, stable=True)[:, :5]
        ti, pr, mx, en, lse, (tv, tt) = s[name]
        assert torch.equal(ti, order) and torch.equal(tt, order)
        assert torch.equal(tv, zz.gather(-1, order))  # the side's top logits, descending
        assert torch.allclose(pr.double(), p.gather(-1, order), rtol=1e-5, atol=1e-7)
        assert torch.allclose(mx.double(), p.max(-1).values, rtol=1e-5, atol=1e-7)
        assert torch.allclose(en.double(), -(p * lp).sum(-1), rtol=1e-4, atol=1e-5)
        assert torch.allclose(lse.double(), torch.logsumexp(zz.double(), -1), rtol=1e-6, atol=1e-5)
    # in blocks of 4 rows (the work buffers' size, not the chunk's): the same numbers, bit for bit;
    # a longer tail (the value index's) leaves the top 5 as they were
    work = (torch.empty(4, 700), torch.empty(4, 700))
    blocks = summarize_logits(z, 5, work=work, tail=21)
    for name in ("pos", "neg"):
        assert all(torch.equal(a, b) for a, b in zip(s[name][:5], blocks[name][:5])), name
        tv, tt = blocks[name][5]
        assert tt.shape == (9, 21) and torch.equal(tt[:, :5], s[name][0])
        assert torch.equal(tt, torch.argsort(zz := (z if name == "pos" else -z), dim=-1, descending=True, stable=True)[:, :21])
        assert torch.equal(tv, zz.gather(-1, tt))
    one = summarize_logits(z, 5, negative=False, work=work)
    assert list(one) == ["pos"] and all(torch.equal(a, b) for a, b in zip(s["pos"][:5], one["pos"][:5]))


@settings(max_examples=60, deadline=None)
@given(C=st.integers(1, 9), V=st.integers(1, 300), J=st.integers(1, 3), levels=st.integers(1, 6),
       seed=st.integers(0, 2 ** 16), numba=st.booleans())
def test_signed_ranks_equal_rank_of_in_the_signed_row(C, V, J, levels, seed, numba):
    """Every target's rank in s·z, counted in one visit of the row (numba on a CPU, else torch),
    equals `rank_of` on the negated row where s = −1; few levels make ties everywhere."""
    from ffkv.model.memories import rank_of
    from ffkv.steps.values.rows import signed_ranks

    g = torch.Generator().manual_seed(seed)
    z = torch.randint(0, levels, (C, V), generator=g).float() * 0.5 - 1.0
    tgt = torch.randint(0, V, (C, J), generator=g)
    sgn = torch.randint(0, 2, (C, J), generator=g) * 2 - 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FFKV_NUMBA", "1" if numba else "0")
        got = signed_ranks(z, tgt, sgn)
    for j in range(J):
        for s in (1, -1):
            want = rank_of(s * z, tgt[:, j])
            rows = sgn[:, j] == s
            assert torch.equal(got[rows, j], want[rows]), (j, s)


def test_extremes_take_the_first_index_on_ties():
    """The value's argmax and argmin (the `value_tops` cache), read off the top-k, are torch's
    first-index argmax/argmin, ties for first included."""
    from ffkv.steps.values.compute import _extremes

    z = torch.tensor([[3.0, 1.0, 3.0, -2.0, -2.0], [0.0, 5.0, 4.0, -1.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    for k in (1, 2, 3):
        got = _extremes(z, summarize_logits(z, k))
        assert np.array_equal(got, np.stack([z.argmax(-1).numpy(), z.argmin(-1).numpy()], 1)), k


@settings(max_examples=60, deadline=None)
@given(C=st.integers(0, 7), V=st.integers(1, 200), k=st.integers(1, 12), levels=st.integers(1, 5),
       seed=st.integers(0, 2 ** 16), numba=st.booleans())
def test_tails_are_a_stable_sort_cut_at_k(C, V, k, levels, seed, numba):
    """Both tails of each row equal a stable sort (ties: the lower token id first) cut at k, from
    the CPU kernel and from torch's top-k alike; few levels make ties everywhere."""
    from ffkv.steps.values.rows import tails

    k = min(k, V)
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(0, levels, (C, V), generator=g).float() - 2.0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FFKV_NUMBA", "1" if numba else "0")
        (tv, ti), (bv, bi) = tails(z, k)
    up = torch.argsort(-z, dim=-1, stable=True)[:, :k]
    down = torch.argsort(z, dim=-1, stable=True)[:, :k]
    assert torch.equal(ti, up) and torch.equal(tv, z.gather(-1, up))
    assert torch.equal(bi, down) and torch.equal(bv, z.gather(-1, down))


def test_index_logsumexp_in_row_blocks_equals_one_block():
    """The value index's log-sum-exp runs over blocks of rows (small temporaries); same numbers."""
    from ffkv.memories.value_index import _logsumexp_rows

    torch.manual_seed(1)
    z = torch.randn(300, 500) * 7
    for s in (1, -1):
        assert torch.equal(_logsumexp_rows(z, s, rows=64), torch.logsumexp(s * z, dim=-1))
    assert _logsumexp_rows(z[:0], 1).shape == (0,)


def test_precision_at_k_hand_count():
    # 8 examples of one key; top token 42. Ranks 1..8, k = 6 cuts ranks 7 and 8.
    nxt = [7, 42, None, 42, 5, 42, 42, 42]
    rk = [1, 2, 3, 4, 5, 6, 7, 8]
    assert precision_at_k(nxt, rk, 42, k=6) == (6, 3, 2)   # ranks 2, 4, 6 match
    assert precision_at_k(nxt, rk, 42, k=50) == (8, 5, 2)
    assert precision_at_k(nxt, rk, 9, k=50) == (8, 0, None)
    assert precision_at_k([None, 3], [2, 1], 3, k=1) == (1, 1, 1)


# ---- the step against argsort, with planted memories --------------------------------------------
CASES = [("llama", "norm"), ("llama", "naive"), ("gpt2", "naive"), ("opt", "norm")]


@pytest.mark.parametrize("arch,lens", CASES)
def test_values_step_vs_argsort(tmp_path, tiny_dirs, arch, lens):
    mm = open_model(str(tiny_dirs[arch]), device="cpu")  # a private copy: we plant into it
    L, d_m, V = mm.n_layers, mm.d_m, mm.vocab_size
    signs = (1, -1)
    syn = Synth(L, d_m, V, signs=signs, seed=1)
    Lp, i_pos, i_neg = L - 1, 3, 5
    t, u = plant_token(mm, arch, lens)
    with torch.no_grad():
        mm.values(Lp)[i_pos] = u        # v = c·E[t]/gain: top(v) = t
        mm.values(Lp)[i_neg] = -u       # −v = c·E[t]/gain: top(−v) = t
    # the view wrote the module's weight
    assert torch.equal(raw_weights(mm, arch, Lp)[0][i_pos], u)
    assert torch.equal(raw_weights(mm, arch, Lp)[0][i_neg], -u)
    # planted key i_pos: positive list wins; matches at ranks 1,3,9,22,31,40,50 (+ 55 beyond k);
    # a sentence end at rank 12; every other example of both lists does not match.
    syn.set_coef(Lp, i_pos, 1, 5.0)
    syn.set_coef(Lp, i_pos, -1, -1.0)
    syn.set_coef(Lp, i_neg, 1, 1.0)
    syn.set_coef(Lp, i_neg, -1, -5.0)
    other = (t + 1) % V or 1
    for s in signs:
        for r in range(1, syn.n_rank + 1):
            for i in (i_pos, i_neg):
                syn.set_next(Lp, i, s, r, other)
    for r in (1, 3, 9, 22, 31, 40, 50, 55):
        syn.set_next(Lp, i_pos, 1, r, t)
    syn.set_next(Lp, i_pos, 1, 12, None)
    for r in (1, 2, 5, 57):  # planted key i_neg: negative list, 3 matches within the top 50
        syn.set_next(Lp, i_neg, -1, r, t)
    # a key whose top-1 ends its sentence, and one with a negative top-1 coef in the + list
    syn.set_next(0, 0, 1, 1, None)
    syn.set_coef(0, 0, 1, 9.0)
    syn.set_coef(0, 1, 1, -8.0)   # the + list's best is negative (a key that never fires > 0)
    syn.set_coef(0, 1, -1, -1.0)
    run = make_run(tmp_path / "run", mm, syn, lens="naive" if lens == "norm" else "norm")
    kinds = "value" if arch == "gpt2" else "auto"  # auto: both, since the run has − lists
    summary = compute_values(run, mm, lens=lens, top_k=7, chunk=17, permutations=50, seed=3,
                             bins=4, table2_n=6, precision_k=50, table2_kinds=kinds,
                             show_progress=False)
    assert run.manifest["settings"]["values"]["lens"] == lens

    ag = run.read_table("values_agreement").to_pydict()
    vt = run.read_table("values").to_pydict()
    assert len(ag["layer"]) == L * d_m and len(vt["layer"]) == L * d_m * 3
    nxt_all = syn.next_tokens()
    t_idx = {(int(a), int(b), int(c), int(d)): j for j, (a, b, c, d) in
             enumerate(zip(syn.t["layer"], syn.t["dim"], syn.t["sign"], syn.t["rank"]))}
    n_eval = n_agree = 0
    for l in range(L):
        W, K = raw_weights(mm, arch, l)
        lv = direct_logits(mm, arch, lens, W.detach())      # (d_m, V), float64, full rows
        lk = direct_logits(mm, arch, lens, K.detach())
        for i in range(d_m):
            # values table: all three kinds against a full softmax + argsort
            for kind, row_logits in (("value", lv[i]), ("neg_value", -lv[i]), ("key", lk[i])):
                r = (l * d_m + i) * 3 + KINDS.index(kind)
                assert (vt["layer"][r], vt["dim"][r], vt["kind"][r]) == (l, i, kind)
                lp = torch.log_softmax(row_logits, -1)
                order = torch.argsort(row_logits, descending=True, stable=True)[:7]
                assert vt["top_tokens"][r] == order.tolist(), (l, i, kind)
                assert np.allclose(vt["top_probs"][r], lp[order].exp().numpy(), rtol=1e-4, atol=1e-7)
                assert abs(vt["max_prob"][r] - lp.max().exp().item()) < 1e-5 + 1e-4 * lp.max().exp().item()
                assert abs(vt["entropy"][r] - float(-(lp.exp() * lp).sum())) < 1e-4
            # top-1 trigger by hand
            p1 = t_idx[(l, i, 1, 1)]
            n1 = t_idx[(l, i, -1, 1)]
            j = p1 if abs(syn.t["coef"][p1]) >= abs(syn.t["coef"][n1]) else n1
            coef = float(syn.t["coef"][j])
            target = nxt_all[j]
            s = 1 if coef >= 0 else -1
            row = l * d_m + i
            assert ag["trigger_sign"][row] == int(syn.t["sign"][j])
            assert ag["direction"][row] == s
            assert ag["sentence_id"][row] == int(syn.t["sentence_id"][j])
            full = s * lv[i]
            order = torch.argsort(full, descending=True, stable=True)
            assert ag["value_top"][row] == int(order[0])
            if target is None:
                assert ag["agree"][row] is None and ag["rank"][row] is None
                continue
            n_eval += 1
            direct_rank = int((order == target).nonzero()[0, 0])
            assert ag["rank"][row] == direct_rank, (l, i)
            assert ag["agree"][row] == (int(order[0]) == target)
            n_agree += int(order[0]) == target
            p = torch.softmax(full, -1)[target].item()
            assert abs(ag["target_prob"][row] - p) < 1e-6 + 1e-4 * p
    # the planted memories
    for i, s in ((i_pos, 1), (i_neg, -1)):
        row = Lp * d_m + i
        assert ag["direction"][row] == s and ag["next_token"][row] == t
        assert ag["agree"][row] is True and ag["rank"][row] == 0 and ag["value_top"][row] == t
    assert ag["agree"][0] is None  # key (0, 0): its top-1 ends the sentence; no fall-back
    assert (ag["trigger_sign"][1], ag["direction"][1]) == (1, -1)  # compared with −v
    assert summary["evaluated"] == n_eval and summary["agree"] == n_agree
    assert summary["sentence_end"] == L * d_m - n_eval and summary["no_trigger"] == 0

    # per-layer table: counts, Wilson interval, rank quantiles vs the agreement table
    lay = run.read_table("values_layers").to_pylist()
    agree = np.array([a is True for a in ag["agree"]]).reshape(L, d_m)
    rank = np.array([-1 if r is None else r for r in ag["rank"]]).reshape(L, d_m)
    for r in lay:
        l = r["layer"]
        ok = rank[l] >= 0
        assert r["n"] == ok.sum() and r["n_agree"] == agree[l].sum()
        assert r["agreement"] == pytest.approx(agree[l].sum() / ok.sum())
        lo, hi = wilson(agree[l].sum(), ok.sum())
        assert (r["ci_low"], r["ci_high"]) == pytest.approx((float(lo), float(hi)))
        assert r["rank_median"] == pytest.approx(float(np.median(rank[l][ok])))
        assert r["random_baseline"] == pytest.approx(1 / V)
    # Fig 5 histogram: counts per layer add up and match the ranks
    hist = run.read_table("values_rank_hist").to_pylist()
    for l in range(L):
        rows = [h for h in hist if h["layer"] == l]
        for h in rows:
            rr = rank[l][rank[l] >= 0]
            assert h["count"] == ((rr >= h["lo"]) & (rr < h["hi"])).sum()
        assert rows[-1]["hi"] == V and rows[0]["lo"] == 0
    # Fig 6: the bins partition the evaluated memories; agreement per bin by hand
    f6 = run.read_table("values_fig6").to_pylist()
    mp = np.array([np.nan if m is None else m for m in ag["max_prob"]])
    ev = rank.ravel() >= 0
    assert sum(b["n"] for b in f6) == n_eval and sum(b["n_agree"] for b in f6) == n_agree
    for b in f6:
        last = b is f6[-1]
        sel = ev & (mp >= b["lo"]) & ((mp <= b["hi"]) if last else (mp < b["hi"]))
        assert b["n"] == sel.sum() and b["n_agree"] == agree.ravel()[sel].sum()
    assert f6[-1]["agreement"] > 0  # the planted memories have max_prob ≈ 1

    # Table 2: planted memories first; precision@50 against the hand count
    t2 = run.read_table("values_table2").to_pylist()
    assert len(t2) == 6
    assert [r["max_prob"] for r in t2] == sorted([r["max_prob"] for r in t2], reverse=True)
    top2 = {(r["dim"], r["kind"]): r for r in t2[:2]}
    if kinds == "auto":  # the run has negative lists: value and neg_value compete
        assert set(top2) == {(i_pos, "value"), (i_neg, "neg_value")}
        rn = top2[(i_neg, "neg_value")]
        assert (rn["layer"], rn["direction"], rn["top_token"]) == (Lp, -1, t)
        assert (rn["n_examples"], rn["n_agree"], rn["example_rank"]) == (50, 3, 1)
        assert rn["precision"] == pytest.approx(3 / 50)
    else:  # value only (the paper): −v of i_neg is not a candidate
        assert all(r["kind"] == "value" for r in t2)
        assert t2[0]["dim"] == i_pos
    rp = top2.get((i_pos, "value")) or t2[0]
    assert (rp["layer"], rp["dim"], rp["top_token"], rp["direction"]) == (Lp, i_pos, t, 1)
    assert (rp["n_examples"], rp["n_agree"], rp["example_rank"]) == (50, 7, 1)
    assert rp["precision"] == pytest.approx(7 / 50)
    j = t_idx[(Lp, i_pos, 1, 1)]
    assert rp["example_sentence_id"] == int(syn.t["sentence_id"][j])
    assert rp["example_text"] == mm.tok.decode(syn.sents[rp["example_sentence_id"]][: rp["example_position"] + 1])
    # the agreement count of Table 2 as the summary reports it
    assert summary["table2_with_agreeing"] == sum(1 for r in t2 if r["n_agree"] > 0)
    assert "agreement" in format_summary(summary)


def test_shuffled_baseline_near_chance(tmp_path, tiny_dirs):
    """Random weights, uniform next tokens: the shuffled pairing equals the exact permutation
    expectation (1/d_m Σ_j [top(s_i v_j) = t_i], averaged over i) and sits near 1/|V|."""
    R = 400
    pooled_k = pooled_n = 0.0
    for arch in ("llama", "gpt2"):
        mm = open_model(str(tiny_dirs[arch]), device="cpu")
        L, d_m, V = mm.n_layers, mm.d_m, mm.vocab_size
        syn = Synth(L, d_m, V, n_rank=2, seed=7)
        run = make_run(tmp_path / arch, mm, syn)
        compute_values(run, mm, permutations=R, seed=11, show_progress=False, table2_n=3)
        ag = run.read_table("values_agreement").to_pydict()
        vt = run.read_table("values").to_pydict()
        lay = run.read_table("values_layers").to_pylist()
        tops = np.array([tt[0] for tt in vt["top_tokens"]]).reshape(L, d_m, 3)
        for l in range(L):
            idx = [l * d_m + i for i in range(d_m) if ag["agree"][l * d_m + i] is not None]
            exp = np.mean([np.mean(tops[l, :, 0 if ag["direction"][r] > 0 else 1] == ag["next_token"][r])
                           for r in idx])
            n = len(idx)
            sd = math.sqrt(max(exp, 1 / V) * (1 - exp) / (R * n))
            assert abs(lay[l]["shuffled"] - exp) < 6 * sd + 1e-9, (arch, l, lay[l]["shuffled"], exp)
            assert lay[l]["shuffled_ci_low"] <= lay[l]["shuffled"] <= lay[l]["shuffled_ci_high"]
            pooled_k += lay[l]["shuffled"] * n
            pooled_n += n
    rate = pooled_k / pooled_n
    assert 0.2 / V < rate < 5 / V, (rate, 1 / V)


def test_chunk_and_seed_invariance(tmp_path, tiny_dirs):
    """Results do not depend on the chunk size; the same seed gives the same baseline."""
    mm = open_model(str(tiny_dirs["gpt2"]), device="cpu")
    syn = Synth(mm.n_layers, mm.d_m, mm.vocab_size, n_rank=3, seed=2)
    tabs = []
    for c in (7, 1000):
        run = make_run(tmp_path / f"c{c}", mm, syn)
        compute_values(run, mm, chunk=c, permutations=20, show_progress=False, table2_n=4)
        tabs.append({n: run.read_table(n) for n in ("values", "values_agreement", "values_layers")})
    for n in tabs[0]:
        a, b = tabs[0][n].to_pydict(), tabs[1][n].to_pydict()
        for col in a:
            if col in ("top_probs",):
                assert np.allclose(np.array(a[col]), np.array(b[col]), rtol=1e-5)
            elif col in ("max_prob", "entropy", "target_prob", "value_max_prob_mean",
                         "value_entropy_mean", "key_max_prob_mean", "key_entropy_mean"):
                x = np.array([np.nan if v is None else v for v in a[col]], float)
                y = np.array([np.nan if v is None else v for v in b[col]], float)
                assert np.allclose(x, y, rtol=1e-4, atol=1e-6, equal_nan=True), col
            else:
                assert a[col] == b[col] or np.allclose(np.array(a[col], float), np.array(b[col], float),
                                                       equal_nan=True), (n, col)


def test_a_bf16_model_projects_its_values_in_float32(tmp_path, tiny_dirs):
    """On a GPU the model runs in bf16, whose logits tie (about half of a value's rows at its 20th
    token): the values step reads them in float32, so a bf16 model gives the tables of a float32
    model holding the same (bf16-rounded) weights."""
    from ffkv.model.memories import lens_for

    half = open_model(str(tiny_dirs["llama"]), device="cpu", dtype="bfloat16")
    full = open_model(str(tiny_dirs["llama"]), device="cpu", dtype="float32")
    assert half.dtype == torch.bfloat16
    with torch.no_grad():
        for p in full.hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    for name in ("naive", "norm"):
        z = lens_for(half, name).direction_logits(half.values(0))
        want = (full.values(0) * (lens_for(full, name).gain if name == "norm" else 1)) @ full.lens.E.T
        assert z.dtype == torch.float32 and torch.allclose(z, want, rtol=1e-5, atol=1e-6), name
    syn = Synth(full.n_layers, full.d_m, full.vocab_size, n_rank=3, seed=4)
    tabs = []
    for mm, tag in ((half, "bf16"), (full, "f32")):
        run = make_run(tmp_path / tag, mm, syn)
        compute_values(run, mm, permutations=5, show_progress=False, table2_n=4)
        tabs.append({n: run.read_table(n).to_pydict() for n in ("values", "value_index")})
    for n in tabs[0]:
        for col, a in tabs[0][n].items():
            b = tabs[1][n][col]
            if col in ("top_probs", "max_prob", "entropy", "prob"):
                assert np.allclose(np.array(a, float), np.array(b, float), rtol=1e-4, atol=1e-7), (n, col)
            else:
                assert a == b, (n, col)


def test_skip_when_done(tmp_path, tiny_dirs):
    mm = open_model(str(tiny_dirs["opt"]), device="cpu")
    syn = Synth(mm.n_layers, mm.d_m, mm.vocab_size, n_rank=2, signs=(1,), seed=4)
    run = make_run(tmp_path / "r", mm, syn)
    s1 = compute_values(run, mm, permutations=5, show_progress=False)
    s2 = compute_values(Run(run.path), mm, permutations=5, show_progress=False)
    assert s2.pop("skipped") is True and s2 == s1
    assert "already done" in format_summary({**s1, "skipped": True})
    s3 = compute_values(Run(run.path), mm, permutations=6, show_progress=False)
    assert "skipped" not in s3
    # only + lists: Table 2 candidates are the values alone (auto)
    assert Run(run.path).settings("values")["table2_kinds"] == "value"
    assert set(run.read_table("values_table2")["kind"].to_pylist()) == {"value"}
    # only + lists (a ReLU model's miner): every key's top-1 comes from them
    ag = run.read_table("values_agreement").to_pydict()
    assert set(ag["trigger_sign"]) == {1}


def test_both_lenses_and_the_value_index(tmp_path, tiny_dirs):
    """The other lens's block of values_lenses equals a run whose own lens is that one; the run's
    lens block equals values_layers; value_index equals `build_index` (both lenses, k = 20)."""
    from ffkv.memories.value_index import build_index
    from ffkv.steps.values import ValuesSettings
    from ffkv.steps.lifecycle import execute

    mm = open_model(str(tiny_dirs["llama"]), device="cpu")
    syn = Synth(mm.n_layers, mm.d_m, mm.vocab_size, n_rank=3, seed=5)
    both = make_run(tmp_path / "both", mm, syn, lens="norm")
    execute(both, "values", ValuesSettings(permutations=7, table2_n=5), mm=mm, show_progress=False)
    naive = make_run(tmp_path / "naive", mm, syn, lens="naive")
    execute(naive, "values", ValuesSettings(lens="naive", permutations=7, table2_n=5, both_lenses=False), mm=mm,
            show_progress=False)
    assert both.settings("values")["lenses"] == ["norm", "naive"]
    lay = both.read_table("values_lenses").to_pandas()
    assert list(dict.fromkeys(lay["lens"])) == ["norm", "naive"]
    skip = {"key_max_prob_mean", "key_entropy_mean"}
    for ln, run in (("norm", both), ("naive", naive)):
        ref = run.read_table("values_layers").to_pandas()
        got = lay[lay["lens"] == ln].drop(columns="lens").reset_index(drop=True)
        for c in ref.columns:
            if ln == "naive" and c in skip:
                assert got[c].isna().all()
                continue
            np.testing.assert_allclose(got[c].to_numpy(float), ref[c].to_numpy(float), rtol=1e-5, err_msg=c)
    f6 = both.read_table("values_fig6_lenses").to_pandas()
    ref6 = naive.read_table("values_fig6").to_pandas()
    np.testing.assert_array_equal(f6[f6["lens"] == "naive"]["n_agree"].to_numpy(), ref6["n_agree"].to_numpy())
    t2 = both.read_table("values_table2_lenses").to_pandas()
    ref2 = naive.read_table("values_table2").to_pandas()
    got2 = t2[t2["lens"] == "naive"]
    assert got2["dim"].tolist() == ref2["dim"].tolist() and got2["n_agree"].tolist() == ref2["n_agree"].tolist()
    # the inverse index: the same rows as a direct build over both lenses
    idx = both.read_table("value_index").to_pandas()
    direct = build_index(mm).to_pandas()
    key = ["lens", "sign", "token", "rank", "layer", "dim"]
    a = idx.sort_values(key).reset_index(drop=True)
    b = direct.sort_values(key).reset_index(drop=True)
    assert a[key].equals(b[key])
    np.testing.assert_allclose(a["prob"], b["prob"], rtol=1e-5)
    # the value_tops cache compose reads: the values step's argmax/argmin equal a fresh projection
    from ffkv.memories.value_tops import value_tops

    stored, fresh = value_tops(both, mm), value_tops(None, mm)
    assert both.manifest["tables"]["value_tops"]["lenses"] == ["norm", "naive"]
    for ln in ("naive", "norm"):
        assert torch.equal(stored[ln][0], fresh[ln][0]) and torch.equal(stored[ln][1], fresh[ln][1])
    # the rank < 100 share, next to rank < 10
    ag = both.read_table("values_agreement").to_pandas()
    for r in both.read_table("values_layers").to_pylist():
        rk = ag[(ag["layer"] == r["layer"]) & ag["rank"].notna()]["rank"]
        if len(rk):
            assert r["frac_rank_lt100"] == pytest.approx(float((rk < 100).mean()))


# ---- CLI ----------------------------------------------------------------------------------------
def _one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    lines = [l for l in res.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_errors(tmp_path, tiny_dirs):
    mm = open_model(str(tiny_dirs["gpt2"]), device="cpu")
    # no mine step at all
    make_run(tmp_path / "nomine", mm, None, mine=False)
    _one_line_error(run_cli("values", tmp_path / "nomine"), "ffkv mine")
    # mine marked done but no triggers table
    make_run(tmp_path / "notrig", mm, None, mine=True)
    _one_line_error(run_cli("values", tmp_path / "notrig"), "triggers", "ffkv mine")
    # a model whose unembedding differs from the run's
    syn = Synth(mm.n_layers, mm.d_m, mm.vocab_size, n_rank=2, seed=5)
    make_run(tmp_path / "ok", mm, syn)
    _one_line_error(run_cli("values", tmp_path / "ok", "--model", tiny_dirs["opt"]), "model mismatch")


def test_cli_end_to_end(tmp_path, tiny_dirs):
    mm = open_model(str(tiny_dirs["llama"]), device="cpu")
    syn = Synth(mm.n_layers, mm.d_m, mm.vocab_size, n_rank=3, seed=6)
    run = make_run(tmp_path / "run", mm, syn, lens="naive")
    res = run_cli("values", run.path, "--table2", "5", "--permutations", "10")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "agreement (Fig 4)" in res.stdout and "lens = naive" in res.stdout
    r = Run(run.path)
    assert r.step_done("values") and r.manifest["settings"]["values"]["lens"] == "naive"
    for t in ("values", "values_agreement", "values_layers", "values_rank_hist", "values_fig6",
              "values_table2"):
        assert r.has_table(t)
    assert r.read_table("values_table2").num_rows == 5
    res2 = run_cli("values", run.path, "--table2", "5", "--permutations", "10")
    assert res2.returncode == 0 and "already done" in res2.stdout


# ---- the real model -------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_sampled_vs_argsort(tmp_path, smollm2_cut):
    """SmolLM2 (tied embeddings, 49,152 tokens; its first layers, real weights): 40 sampled
    memories against full argsorts."""
    mm = smollm2_cut
    L, d_m, V = mm.n_layers, mm.d_m, mm.vocab_size
    rng = np.random.default_rng(0)
    syn = Synth(L, d_m, V, n_rank=2, n_sent=500, sent_len=16, seed=8)
    run = make_run(tmp_path / "run", mm, syn, lens="norm")
    s = compute_values(run, mm, permutations=20, show_progress=False)
    assert s["evaluated"] + s["sentence_end"] == L * d_m
    ag = run.read_table("values_agreement").to_pydict()
    vt = run.read_table("values", columns=["top_tokens", "max_prob", "entropy"]).to_pydict()
    E = mm.hf.get_output_embeddings().weight.detach().double()
    g = mm.hf.model.norm.weight.detach().double()
    for _ in range(40):
        l, i = int(rng.integers(L)), int(rng.integers(d_m))
        v = mm.hf.model.layers[l].mlp.down_proj.weight[:, i].detach().double()
        full = (v * g) @ E.T
        row = l * d_m + i
        r = row * 3
        lp = torch.log_softmax(full, -1)
        assert vt["top_tokens"][r] == torch.argsort(full, descending=True, stable=True)[:10].tolist()
        assert abs(vt["entropy"][r] - float(-(lp.exp() * lp).sum())) < 1e-3
        assert abs(vt["max_prob"][r] - float(lp.max().exp())) < 1e-5
        if ag["rank"][row] is not None:
            sfull = ag["direction"][row] * full
            order = torch.argsort(sfull, descending=True, stable=True)
            # float32 (the step) vs float64 (here): near-tied logits may swap, so the rank must lie
            # between the float64 counts above target ± 1e-4; it is exact on the tiny models.
            tv = float(sfull[ag["next_token"][row]])
            lo, hi = int((sfull > tv + 1e-4).sum()), int((sfull > tv - 1e-4).sum()) - 1
            assert lo <= ag["rank"][row] <= hi, (l, i, ag["rank"][row], lo, hi)
            assert hi - lo < 50
            assert ag["value_top"][row] == int(order[0])


def test_no_usable_triggers(tmp_path, tiny_dirs):
    """Every top-1 ends its sentence: nothing is evaluated, nothing crashes, the JSON stays clean."""
    import json

    mm = open_model(str(tiny_dirs["gpt2"]), device="cpu")
    syn = Synth(mm.n_layers, mm.d_m, mm.vocab_size, n_rank=1, signs=(1,), seed=9)
    syn.t["position"][:] = syn.sent_len - 1
    run = make_run(tmp_path / "r", mm, syn)
    s = compute_values(run, mm, permutations=3, table2_n=4, show_progress=False)
    assert s["evaluated"] == 0 and s["sentence_end"] == mm.n_layers * mm.d_m
    assert s["agreement"] is None and s["ci_low"] is None
    json.loads(json.dumps(s), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    t2 = run.read_table("values_table2").to_pylist()
    assert len(t2) == 4 and all(r["n_agree"] == 0 and r["example_text"] is None for r in t2)
    assert run.read_table("values_fig6").num_rows == 0
    assert "n/a" in format_summary(s)


def test_on_a_real_mined_run(tmp_path, tiny_dirs):
    """The miner's own `triggers` table (both signs) feeds the step; the top-1 choice, direction,
    agreement and rank are recomputed here from the table and full argsorts."""
    from conftest import WT2
    from ffkv.steps.mine import MineSettings
    from ffkv.steps.mine.compute import mine

    mm = open_model(str(tiny_dirs["llama"]), device="cpu")
    run = Run(tmp_path / "run", create=True)
    mine(run, mm, MineSettings(corpus=str(WT2 / "wiki.valid.tokens"), max_sentences=80, top_k=5,
                               negative=True), show_progress=False, log=lambda *a: None)
    s = compute_values(run, mm, permutations=10, table2_n=5, precision_k=5, show_progress=False)
    tr = run.read_table("triggers").to_pylist()
    best = {}
    for r in tr:
        if r["rank"] == 1:
            k = (r["layer"], r["dim"])
            if k not in best or abs(r["coef"]) > abs(best[k]["coef"]):  # ties: + (sorted first)
                best[k] = r
    ag = run.read_table("values_agreement").to_pylist()
    n_eval = 0
    for row in ag:
        b = best[(row["layer"], row["dim"])]
        assert (row["trigger_sign"], row["sentence_id"], row["position"]) == (b["sign"], b["sentence_id"], b["position"])
        sgn = 1 if b["coef"] >= 0 else -1
        assert row["direction"] == sgn
        if b["next_token"] is None:
            assert row["rank"] is None
            continue
        n_eval += 1
        full = sgn * direct_logits(mm, "llama", run.manifest["lens"], raw_weights(mm, "llama", row["layer"])[0][row["dim"]])
        order = torch.argsort(full, descending=True, stable=True)
        assert row["rank"] == int((order == b["next_token"]).nonzero()[0, 0])
        assert row["agree"] == (int(order[0]) == b["next_token"])
    assert s["evaluated"] == n_eval and s["no_trigger"] == 0
    assert run.settings("values")["table2_kinds"] == "value+neg_value"
