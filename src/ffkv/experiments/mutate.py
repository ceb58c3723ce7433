"""Fig 3 of the paper: how a key's coefficient changes when a trigger example is mutated.

For a seeded sample of keys per layer, each key's top trigger examples (default 50) get three
variants: the first token removed, the last token removed, a random token removed. The key's
coefficient is re-scored on every variant and compared with the original.

Conventions (documented because they are choices):
- A trigger example of key (ℓ, i) is the prefix `token_ids[:position + 1]` of its sentence; its
  coefficient is m_i at the prefix's last position (`MemoryModel.coefficients`, read by the
  capture at the value projection's input).
- "first" removes the first *real* token: when the tokenizer prepends special tokens (a BOS, as
  Llama-2 tokenizers do; SmolLM2 and GPT-2 prepend none) and the sentence starts with them, they
  are kept and the token after them is removed. "random" removes a token drawn uniformly from the
  real tokens of the prefix (it may be the first or the last one), with a generator seeded by
  (seed, layer). A prefix with fewer than 2 real tokens cannot be mutated (the variant would be
  empty or only specials): it is skipped and counted (`n_skipped` in `mutations_layers`).
- Relative change = (new − old) / old = new/old − 1, with old = the trigger's coefficient
  re-computed in the same pass as the variants (same device and dtype; the mined `coef` is kept as
  `trigger_coef` and the largest mismatch is recorded in the manifest). The formula is the same for
  gated FFNs, whose coefficients are signed: for positive triggers (sign +1, the default) and for
  negative ones (`sign=-1`) alike, −0.5 means the coefficient lost half of its value in the
  trigger's own direction, and a value below −1 means it changed sign. `rel_change` is NaN when
  old == 0 (left out of the summaries).
- A mixture of experts: the coefficient carries the router's weight, so a mutation that routes the
  token to other experts gives exactly 0 (rel_change −1): the key no longer fires. Nothing here
  is specific to it (tests/test_moe_steps.py holds every coefficient to a brute force).

Speed (the whole point of the engine below, `rescore`):
- A re-scoring pass stops at the deepest layer its batch needs (`MemoryModel.capture`).
- Causal masking: the coefficient of a sequence at position p only depends on tokens 0..p. So every
  request whose sequence is a prefix of another request's sequence is read from the longer one.
  "last" variants (and the originals) are thus read from one pass over each original sentence, at
  positions j−1 (and j): removing the last token costs no forward pass of its own. All "first"
  variants of one sentence share one sequence too.
- A "random" variant drops token r of x_1..x_j: its first r tokens are those of the original, so
  it is computed from the original's cached keys and values, running only its j − r later
  tokens with explicit position ids (about half the tokens of the random variants). The original
  pass keeps its cache for that, and goes as deep as its deepest variant needs. Checked once per
  model (`sharing_ok`); a model where it does not reproduce a full pass gets full passes.
- Requests of all keys and all layers share batches; batches are packed by length within groups
  of equal deepest layer, right-padded, and cut so that padding stays under a third
  (`ffkv.corpus.batching.pack` with ratio=1.5: on a CPU padding costs in full, smaller batches hardly).

Tables (public contract):
- `mutations`: layer int16, dim int32, sign int8, rank int16, sentence_id int64, position int32
  (the trigger prefix's last index in the sentence), mutation string (first | last | random),
  removed_position int32 (index in the sentence of the removed token), removed_token int32,
  n_tokens int32 (length of the mutated prefix), trigger_coef float32 (as mined), old_coef float32
  (re-computed), new_coef float32, rel_change float32. Sorted by layer, dim, rank, mutation.
- `mutations_layers`: layer int16, mutation string, n int64 (variants scored), n_skipped int64
  (examples too short to mutate), mean, q25, median, q75 (of rel_change, float64),
  share_lower float64 (share of variants with new < old in the trigger's direction, rel < 0).

The step: `STEP` (settings `MutateSettings`, manifest settings `settings_for`), run through
`ffkv.steps.lifecycle.execute(run, "mutate", MutateSettings(...))`; `mutate(run, mm, ...)` is the
computation alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from ffkv.corpus.batching import pack, tight_ratio
from ffkv.errors import FfkvError
from ffkv.model.onednn import fast_products
from ffkv.store.query import mined_keys, read_triggers, sample_keys, sentence_lookup

MUTATIONS = ("first", "last", "random")
from ffkv.steps.mutate import DEFAULT_EXAMPLES, DEFAULT_KEYS_PER_LAYER, STEP, MutateSettings  # noqa: F401


# ---- the re-scoring engine ---------------------------------------------------------------------
@dataclass
class RescoreStats:
    requests: int = 0
    unique_sequences: int = 0
    sequences_run: int = 0  # after absorbing prefixes into longer sequences
    tokens_run: int = 0  # real tokens fed to the model
    layer_tokens: int = 0  # Σ over batches of real tokens × (batch's deepest layer + 1): the work done
    padded_layer_tokens: int = 0  # the same, counting padding
    batches: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def absorb_prefixes(seqs: list[tuple]) -> np.ndarray:
    """For each sequence, the index of a sequence that has it as a prefix and is itself no
    prefix of another one (possibly itself). Duplicates map to one representative.

    In lexicographic order every sequence that extends A follows A directly, so A is a prefix
    of some other sequence iff it is a prefix of its successor; walking backwards, A's
    representative is its successor's.
    """
    n = len(seqs)
    order = sorted(range(n), key=seqs.__getitem__)
    rep = np.empty(n, dtype=np.int64)
    nxt = None
    for i in reversed(order):
        s = seqs[i]
        if nxt is not None and len(seqs[nxt]) >= len(s) and seqs[nxt][: len(s)] == s:
            rep[i] = rep[nxt]
        else:
            rep[i] = i
        nxt = i
    return rep


def _lcp(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# Padded tokens a row may add before the length ratio cuts a batch: a pass's fixed cost (some
# 30 modules of Python and small ops) is worth about that many tokens here; measured on 4 layers'
# requests (12,000 variants): 48 -> 0.91x the time of 0 (16: 0.94x, 128: 1.04x).
SLACK = 48


MAX_ROWS = 256  # rows of a re-scoring batch on a CPU (`ffkv.corpus.batching.step_batch` on CUDA)
# A pass's fixed cost per layer, in tokens of that layer: SLACK on a CPU; on CUDA a layer's
# launches and Python (about 0.5 ms on an H100) against some 0.1 µs a token of SmolLM2's shape.
CUDA_PASS_TOKENS = 8192


def pass_tokens(device) -> int:
    return CUDA_PASS_TOKENS if str(device).startswith("cuda") else SLACK


def _pass_cost(rows: int, length: int, deep: int, fixed: int) -> int:
    """A pass of `rows` rows of `length` tokens to layer `deep`, in layer-tokens."""
    return (deep + 1) * (fixed + rows * length)


def _batches(lengths: np.ndarray, deepest: np.ndarray, members: np.ndarray, batch_tokens: int,
             max_rows: int = MAX_ROWS, ratio: float | None = 1.5, fixed: int = SLACK):
    """Index batches of `members`: groups of equal deepest layer, packed by length (tightly on a
    CPU: `ffkv.corpus.batching.tight_ratio`), deepest first. A group's first batch joins the batch
    before it (of a deeper group) when running it that deep costs less than a pass of its own
    (`fixed`: a pass's cost per layer in tokens, `pass_tokens`). Why: a root's leaves read many
    layers, and one small leaf batch per layer made a pass for every 2 to 3 sequences."""
    out, shape = [], None  # shape: (rows, length, deep) of out[-1]
    for L in np.unique(deepest[members])[::-1]:
        m = members[deepest[members] == L]
        for b in pack(lengths[m], batch_tokens, max_batch=max_rows, ratio=ratio, slack=SLACK):
            b = m[b]
            rows, length = len(b), int(lengths[b].max())
            if shape is not None:
                r0, l0, d0 = shape
                r1, l1 = r0 + rows, max(l0, length)
                if (r1 * l1 <= batch_tokens and r1 <= max_rows and _pass_cost(r1, l1, d0, fixed)
                        <= _pass_cost(r0, l0, d0, fixed) + _pass_cost(rows, length, int(L), fixed)):
                    out[-1], shape = np.concatenate([out[-1], b]), (r1, l1, d0)
                    continue
            out.append(b)
            shape = (rows, length, int(L))
    return out


PAST_FACTOR = 4  # a leaf batch's gathered cache: at most this many root batches' worth of tokens


def _past_bounded(lb: np.ndarray, share: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Leaf batch `lb` in pieces whose gathered past (rows × their longest shared prefix) stays
    under PAST_FACTOR × batch_tokens. Why: the budget counts a leaf's new tokens only, so leaves
    with a few new tokens after a long prefix (a token removed near the end) packed up to the
    row cap, and their copied keys and values grew with the context (an 8B model at 1,024 tokens:
    hundreds of GB)."""
    cap = PAST_FACTOR * batch_tokens
    if len(lb) * int(share[lb].max(initial=0)) <= cap:
        return [lb]
    lb = lb[np.argsort(share[lb], kind="stable")]
    out, start = [], 0
    for i in range(1, len(lb) + 1):
        if i == len(lb) or (i + 1 - start) * int(share[lb[i]]) > cap:
            out.append(lb[start:i])
            start = i
    return out


def sharing_ok(mm) -> bool:
    """Does continuing a cached prefix (past keys/values, explicit position ids) reproduce a full
    pass on this model? Checked once per model on a random 9-token sequence; when it does not
    (or the model's forward refuses the arguments), `rescore` runs every sequence in full."""
    ok = getattr(mm, "_ffkv_prefix_sharing_ok", None)
    if ok is None:
        g = torch.Generator().manual_seed(0)
        base = tuple(torch.randint(3, max(4, mm.vocab_size - 1), (9,), generator=g).tolist())
        seqs = [base, base[:3] + base[4:], base[:6] + base[7:]]
        L = min(2, mm.n_layers - 1)
        lays, pos, dims = [L] * 3, [len(x) - 1 for x in seqs], [0, 1 % mm.d_m, 2 % mm.d_m]
        try:
            a = rescore(mm, seqs, lays, pos, dims, anchors=[-1, 0, 0], _check=False)
            b = rescore(mm, seqs, lays, pos, dims)
            ok = bool(np.allclose(a, b, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(b).max()))))
        except Exception:  # noqa: BLE001 - any failure means: do not share
            ok = False
        mm._ffkv_prefix_sharing_ok = ok
    return ok


def plan(seqs: list[tuple], layers: np.ndarray, positions: np.ndarray, anchors=None,
         min_share: int = 2):
    """Which sequences to run, and how (no model needed; see `rescore`).

    Returns (run_seqs, rid, deepest, parent, share, n_unique): the sequences to run, each
    request's run sequence, each run sequence's deepest layer (including its leaves'), its parent
    run sequence (-1 for a root, run in full) and how many leading tokens it shares with it.

    Without anchors every sequence that is a prefix of another is read from the longer one.
    With anchors, requests split in two: group A (anchors, and requests without an anchor) and
    group B (requests with an anchor). A-sequences are absorbed among themselves: each anchor's
    run sequence is then an A-sequence (e.g. a whole original sentence), a root. A B-sequence that
    is a prefix of an A run sequence is read from it (free: e.g. removing the last token); the
    others are absorbed among themselves and become leaves of their anchor's run sequence when
    they share ≥ `min_share` leading tokens with it (else roots).
    """
    R = len(seqs)
    layers = np.asarray(layers, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    uniq: dict[tuple, int] = {}
    uid = np.fromiter((uniq.setdefault(s, len(uniq)) for s in seqs), dtype=np.int64, count=R)
    useqs = list(uniq)
    if anchors is None:
        rep_of_u = absorb_prefixes(useqs)
    else:
        anchors = np.asarray(anchors, dtype=np.int64)
        rep_of_u = _absorb_anchored(useqs, uid, anchors)
    reps, rid = np.unique(rep_of_u[uid], return_inverse=True)  # request -> run-sequence index
    run_seqs = [useqs[u] for u in reps]
    n_run = len(run_seqs)
    deepest = np.full(n_run, -1, dtype=np.int64)
    np.maximum.at(deepest, rid, layers)
    if anchors is None:
        parent, share = np.full(n_run, -1, dtype=np.int64), np.zeros(n_run, dtype=np.int64)
    else:
        parent, share = _attach_leaves(run_seqs, rid, positions, anchors, min_share)
        leaves = np.nonzero(parent >= 0)[0]
        np.maximum.at(deepest, parent[leaves], deepest[leaves])  # a parent's cache reaches its leaves' layers
    return run_seqs, rid, deepest, parent, share, len(useqs)


def _absorb_anchored(useqs: list[tuple], uid: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """Unique sequence -> its representative, group A first (see `plan`)."""
    n_u = len(useqs)
    has = anchors >= 0
    in_a = np.zeros(n_u, dtype=bool)
    in_a[uid[~has]] = True
    in_a[uid[anchors[has]]] = True
    rep_of_u = np.arange(n_u, dtype=np.int64)
    a_idx = np.nonzero(in_a)[0]
    ra = absorb_prefixes([useqs[u] for u in a_idx])
    rep_of_u[a_idx] = a_idx[ra]
    prefixes: dict[tuple, int] = {}
    for u in np.unique(rep_of_u[a_idx]):
        a = useqs[u]
        for i in range(1, len(a) + 1):
            prefixes.setdefault(a[:i], int(u))
    b_rest = []
    for u in np.nonzero(~in_a)[0]:
        hit = prefixes.get(useqs[u])
        if hit is None:
            b_rest.append(int(u))
        else:
            rep_of_u[u] = hit
    if b_rest:
        b_rest = np.array(b_rest, dtype=np.int64)
        rb = absorb_prefixes([useqs[u] for u in b_rest])
        rep_of_u[b_rest] = b_rest[rb]
    return rep_of_u


def _attach_leaves(run_seqs: list[tuple], rid: np.ndarray, positions: np.ndarray, anchors: np.ndarray,
                   min_share: int) -> tuple[np.ndarray, np.ndarray]:
    """(parent, share) per run sequence: a run sequence whose requests all have anchors, and that
    is no anchor's run sequence itself, continues its anchors' run sequence (a root) from the
    cached keys and values of their common prefix, when that is ≥ `min_share` tokens long and no
    request reads a position inside it."""
    n_run = len(run_seqs)
    has = anchors >= 0
    parent = np.full(n_run, -1, dtype=np.int64)
    share = np.zeros(n_run, dtype=np.int64)
    is_parent = np.zeros(n_run, dtype=bool)
    is_parent[rid[anchors[has]]] = True
    all_have = np.ones(n_run, dtype=bool)
    np.logical_and.at(all_have, rid, has)
    minpos = np.full(n_run, np.iinfo(np.int64).max)
    np.minimum.at(minpos, rid, positions)
    cand = np.full(n_run, -1, dtype=np.int64)
    cand[rid[has]] = rid[anchors[has]]
    for w in np.nonzero((cand >= 0) & all_have & ~is_parent)[0]:
        p = int(cand[w])
        if p == w or parent[p] >= 0:
            continue
        k = min(_lcp(run_seqs[w], run_seqs[p]), int(minpos[w]))
        if k >= min_share:
            parent[w], share[w] = p, k
    return parent, share


def _context(mm) -> int:
    """Positions the model has (`MemoryModel.max_length`); a model object without one: no limit."""
    return int(getattr(mm, "max_length", None) or np.iinfo(np.int64).max)


def _check_requests(mm, seqs: list[tuple], layers, positions, dims):
    """The requests as int64 arrays; a position outside its sequence or a bad layer raises, and a
    sequence longer than the model's context is refused (FfkvError) before any pass."""
    layers = np.asarray(layers, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    dims = np.asarray(dims, dtype=np.int64)
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    ctx = _context(mm)
    if len(lens) and int(lens.max()) > ctx:
        raise FfkvError(f"a prefix of {int(lens.max()):,} tokens does not fit the model's context of "
                        f"{ctx:,} positions; the run's sentences were cut for another model")
    if (positions < 0).any() or (positions >= lens).any():
        raise ValueError("a requested position lies outside its sequence")
    if (layers < 0).any() or (layers >= mm.n_layers).any():
        raise FfkvError(f"layer out of range 0..{mm.n_layers - 1}")
    return layers, positions, dims


@torch.no_grad()
def rescore(mm, seqs: list[tuple], layers, positions, dims, batch_tokens: int = 2048,
            bar=None, stats: RescoreStats | None = None, anchors=None, min_share: int = 2,
            _check: bool = True, max_rows: int = MAX_ROWS) -> np.ndarray:
    """Coefficient m_dims[r] of layer layers[r] at position positions[r] of sequence seqs[r].

    Equal to a forward pass of each sequence alone (up to float rounding). Work is shared three
    ways: duplicates and prefixes of longer sequences are read from the longer sequence;
    sequences share batches; each batch stops at its deepest layer. With `anchors` (per request,
    the index of another request or -1), a sequence that starts like its anchor's sequence is
    computed from the anchor's cached keys and values: only its tokens after the common prefix
    (of ≥ `min_share` tokens) are run, with explicit position ids. Returns float32 (R,).
    """
    t0 = time.perf_counter()
    R = len(seqs)
    out = np.full(R, np.nan, dtype=np.float32)
    st = stats if stats is not None else RescoreStats()
    st.requests += R
    if R == 0:
        return out
    layers, positions, dims = _check_requests(mm, seqs, layers, positions, dims)
    sharing = anchors is not None and (not _check or sharing_ok(mm))
    planned = plan(seqs, layers, positions, anchors if sharing else None, min_share)
    passes = _Passes(mm, planned, layers, positions, dims, out, st, bar, batch_tokens, max_rows)
    with fast_products(getattr(mm, "device", None)):
        passes.run()
    st.seconds += time.perf_counter() - t0
    return out


class _Passes:
    """The forward passes of one `rescore` call: roots in full, each root batch keeping its cache
    for its leaves when it has any; every pass writes its requests' coefficients into `out`."""

    def __init__(self, mm, planned: tuple, layers: np.ndarray, positions: np.ndarray, dims: np.ndarray,
                 out: np.ndarray, st: RescoreStats, bar, batch_tokens: int, max_rows: int = MAX_ROWS):
        self.mm, self.layers, self.positions, self.dims = mm, layers, positions, dims
        self.out, self.st, self.bar, self.batch_tokens = out, st, bar, batch_tokens
        self.max_rows = max_rows
        self.ratio = tight_ratio(getattr(mm, "device", "cpu"))
        self.fixed = pass_tokens(getattr(mm, "device", "cpu"))
        self.max_pos = _context(mm)
        self.run_seqs, self.rid, self.deepest, self.parent, self.share, n_unique = planned
        n_run = len(self.run_seqs)
        self.run_len = np.array([len(s) for s in self.run_seqs], dtype=np.int64)
        self.new_len = self.run_len - self.share  # tokens each run sequence feeds the model
        st.unique_sequences += n_unique
        st.sequences_run += n_run
        st.tokens_run += int(self.new_len.sum())
        # requests grouped by run sequence
        self.req_order = np.argsort(self.rid, kind="stable")
        self.starts = np.searchsorted(self.rid[self.req_order], np.arange(n_run + 1))
        self.leaves_of: dict[int, list[int]] = {}
        for w in np.nonzero(self.parent >= 0)[0]:
            self.leaves_of.setdefault(int(self.parent[w]), []).append(int(w))
        if bar is not None:
            bar(0, 0, total=n_run)

    def run(self) -> None:
        zero = np.zeros(len(self.run_seqs), dtype=np.int64)
        roots = np.nonzero(self.parent < 0)[0]
        for b in _batches(self.run_len, self.deepest, roots, self.batch_tokens, self.max_rows, self.ratio,
                            self.fixed):
            self.root_batch(b, zero)

    def root_batch(self, b: np.ndarray, zero: np.ndarray) -> None:
        """Run sequences `b` in full; then their leaves, from this batch's cache."""
        mm = self.mm
        ids, mask = mm.batch([list(self.run_seqs[s]) for s in b])
        deep = int(self.deepest[b].max())
        kids = np.array([w for s in b for w in self.leaves_of.get(int(s), [])], dtype=np.int64)
        if not len(kids):
            self.forward(b, ids, mask, zero, deep)
            return
        from transformers import DynamicCache

        cache = DynamicCache(config=mm.hf.config)
        self.forward(b, ids, mask, zero, deep, past_key_values=cache, use_cache=True)
        row_of_root = {int(s): k for k, s in enumerate(b)}
        for lb in _batches(self.new_len, self.deepest, kids, self.batch_tokens, self.max_rows, self.ratio,
                             self.fixed):
            for part in _past_bounded(lb, self.share, self.batch_tokens):
                self.leaf_batch(part, cache, row_of_root, ids.device)

    def leaf_batch(self, lb: np.ndarray, cache, row_of_root: dict[int, int], device) -> None:
        """Run the tokens of leaves `lb` after their shared prefix, on their roots' cached keys and
        values (rows picked from the root batch, cut to the longest shared prefix P)."""
        from transformers import DynamicCache

        kk = torch.as_tensor(self.share[lb], device=device)
        P = int(kk.max())
        ids_new, mask_new = self.mm.batch([list(self.run_seqs[w][self.share[w]:]) for w in lb])
        T = ids_new.shape[1]
        src = torch.as_tensor([row_of_root[int(self.parent[w])] for w in lb], device=device)
        ldeep = int(self.deepest[lb].max())
        past = [(cache.layers[l].keys[src, :, :P], cache.layers[l].values[src, :, :P])
                for l in range(ldeep + 1)]
        am = torch.cat([(torch.arange(P, device=device)[None] < kk[:, None]).to(mask_new.dtype),
                        mask_new], 1)
        # a leaf's real tokens sit at positions share..len-1 < the model's context (`_check_requests`);
        # its padding, after them, would run past it when a longer leaf shares the batch (GPT-2's
        # position table has no row there): padding takes the last position, masked and never read
        pos_ids = (kk[:, None] + torch.arange(T, device=device)[None]).clamp_(max=self.max_pos - 1)
        self.forward(lb, ids_new, am, self.share, ldeep, past_key_values=DynamicCache(ddp_cache_data=past),
                     use_cache=True, position_ids=pos_ids)

    def requests_by_layer(self, b: np.ndarray, offset: np.ndarray) -> dict[int, tuple]:
        """layer -> (request ids, batch rows, positions in the batch, dims) of run sequences `b`,
        whose first `offset` tokens are not in the batch (they come from a cache)."""
        rid, layers = self.rid, self.layers
        rq = np.concatenate([self.req_order[self.starts[s]:self.starts[s + 1]] for s in b])
        row_of_seq = {int(s): k for k, s in enumerate(b)}
        rows = np.array([row_of_seq[int(rid[r])] for r in rq], dtype=np.int64)
        pos = self.positions[rq] - offset[rid[rq]]
        need = {}
        for l in np.unique(layers[rq]):
            sel = layers[rq] == l
            need[int(l)] = (rq[sel], torch.as_tensor(rows[sel]), torch.as_tensor(pos[sel]),
                            torch.as_tensor(self.dims[rq[sel]]))
        return need

    def forward(self, b: np.ndarray, ids, mask, offset: np.ndarray, deep: int, **kw) -> None:
        """One pass of batch `b` up to layer `deep`, reading the coefficients its requests ask for."""
        need = self.requests_by_layer(b, offset)
        out = self.out

        def take(layer, name, m):
            if layer in need:
                r_idx, rr, pp, dd = need[layer]
                out[r_idx] = m[rr.to(m.device), pp.to(m.device), dd.to(m.device)].float().cpu().numpy()

        self.mm.capture(ids, mask, layers=sorted(set(need) | {deep}), what=("m",), callback=take, **kw)
        new_tokens = int(self.new_len[b].sum())
        self.st.batches += 1
        self.st.layer_tokens += new_tokens * (deep + 1)
        self.st.padded_layer_tokens += int(ids.shape[0] * ids.shape[1] * (deep + 1))
        if self.bar is not None:
            self.bar(len(b), new_tokens)


# ---- inputs ------------------------------------------------------------------------------------
def leading_specials(tok) -> list[int]:
    """Token ids the tokenizer prepends to every text (e.g. [BOS]); [] for SmolLM2 and GPT-2."""
    if tok is None:
        return []
    try:
        with_sp = tok("hello world", add_special_tokens=True)["input_ids"]
        without = tok("hello world", add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001
        return []
    n = len(with_sp) - len(without)
    if n > 0 and with_sp[n:n + len(without)] == without:
        return list(with_sp[:n])
    return []


def n_special(token_ids, specials: list[int]) -> int:
    k = len(specials)
    return k if k and list(token_ids[:k]) == specials else 0


# ---- the experiment ----------------------------------------------------------------------------
@dataclass
class MutateResult:
    mutations: pa.Table
    layers: pa.Table
    stats: dict = field(default_factory=dict)


def build_variants(trig: dict, sents: dict[int, list[int]], specials: list[int], seed: int):
    """Requests for originals and variants. `trig` has numpy columns layer, dim, rank, coef,
    sentence_id, position, sorted by layer, dim, rank. Returns (requests, rows, skipped) where
    requests = (seqs, layers, positions, dims, anchors) — a variant's anchor is its original,
    whose first tokens it shares — and rows describe each variant."""
    seqs, lays, poss, dims, anchors = [], [], [], [], []
    rows = {k: [] for k in ("t", "mutation", "removed_position", "removed_token", "n_tokens",
                            "old_req", "new_req")}
    skipped: dict[int, int] = {}
    rngs: dict[int, np.random.Generator] = {}

    def req(seq, layer, dim, anchor=-1):
        seqs.append(seq)
        lays.append(layer)
        poss.append(len(seq) - 1)
        dims.append(dim)
        anchors.append(anchor)
        return len(seqs) - 1

    for t in range(len(trig["layer"])):
        layer, dim = int(trig["layer"][t]), int(trig["dim"][t])
        sid, pos = int(trig["sentence_id"][t]), int(trig["position"][t])
        ids = sents[sid]
        if pos >= len(ids):
            raise FfkvError(f"trigger position {pos} lies outside sentence {sid} ({len(ids)} tokens); "
                            "the run is inconsistent")
        k = n_special(ids, specials)
        if pos + 1 - k < 2:
            skipped[layer] = skipped.get(layer, 0) + 1
            continue
        prefix = tuple(ids[: pos + 1])
        old = req(prefix, layer, dim)
        rng = rngs.setdefault(layer, np.random.default_rng([seed, 1, layer]))
        r = int(rng.integers(k, pos + 1))
        for mut, rm in (("first", k), ("last", pos), ("random", r)):
            v = prefix[:rm] + prefix[rm + 1:]
            rows["t"].append(t)
            rows["mutation"].append(mut)
            rows["removed_position"].append(rm)
            rows["removed_token"].append(prefix[rm])
            rows["n_tokens"].append(len(v))
            rows["old_req"].append(old)
            rows["new_req"].append(req(v, layer, dim, old))  # shares prefix[:rm] with the original
    return (seqs, lays, poss, dims, anchors), rows, skipped


def summarize(layer: np.ndarray, mutation: np.ndarray, rel: np.ndarray,
              skipped: dict[int, int], layers: list[int]) -> pa.Table:
    cols = {k: [] for k in ("layer", "mutation", "n", "n_skipped", "mean", "q25", "median", "q75",
                            "share_lower")}
    for l in layers:
        for mut in MUTATIONS:
            sel = (layer == l) & (mutation == mut)
            x = rel[sel]
            x = x[np.isfinite(x)].astype(np.float64)
            cols["layer"].append(l)
            cols["mutation"].append(mut)
            cols["n"].append(int(sel.sum()))
            cols["n_skipped"].append(int(skipped.get(l, 0)))
            if len(x):
                q25, med, q75 = np.percentile(x, [25, 50, 75])
                cols["mean"].append(float(x.mean()))
                cols["share_lower"].append(float((x < 0).mean()))
            else:
                q25 = med = q75 = float("nan")
                cols["mean"].append(float("nan"))
                cols["share_lower"].append(float("nan"))
            cols["q25"].append(float(q25))
            cols["median"].append(float(med))
            cols["q75"].append(float(q75))
    return pa.table({
        "layer": pa.array(cols["layer"], pa.int16()), "mutation": pa.array(cols["mutation"], pa.string()),
        "n": pa.array(cols["n"], pa.int64()), "n_skipped": pa.array(cols["n_skipped"], pa.int64()),
        **{k: pa.array(cols[k], pa.float64()) for k in ("mean", "q25", "median", "q75", "share_lower")}})


def check_settings(keys_per_layer: int | None, examples: int, sign: int = 1) -> None:
    """Settings a user can get wrong, checked before any table or model is read."""
    if examples < 1:
        raise FfkvError("--examples must be at least 1")
    if keys_per_layer is not None and keys_per_layer < 0:
        raise FfkvError("--keys-per-layer must be ≥ 0 (0 = all mined keys)")
    if sign not in (1, -1):
        raise FfkvError(f"--sign must be + or - (1 or -1), not {sign}")


def _require_layers(run, layers, mined) -> None:
    bad = sorted(set(layers) - set(int(l) for l in mined))
    if bad:
        raise FfkvError(f"layer(s) {bad} have no mined keys in {run.path}")


def select_triggers(run, sign: int, examples: int, keys_per_layer: int | None, seed: int,
                    layers=None) -> tuple[dict, dict[int, np.ndarray]]:
    """The top-`examples` triggers of a seeded sample of keys: (numpy columns layer, dim, rank,
    coef, sentence_id, position sorted by layer, dim, rank; the sample, layer -> dims)."""
    trig = read_triggers(run, sign, examples, columns=["layer", "dim", "rank", "coef", "sentence_id",
                                                       "position"])
    keys = mined_keys(trig)
    if layers is not None:
        _require_layers(run, layers, keys)
        keys = {l: keys[l] for l in layers}
    chosen = sample_keys(keys, keys_per_layer, seed)
    code = np.concatenate([l * (1 << 32) + d for l, d in chosen.items()])
    tl = trig.column("layer").to_numpy().astype(np.int64)
    td = trig.column("dim").to_numpy().astype(np.int64)
    sel = np.nonzero(np.isin(tl * (1 << 32) + td, code))[0]
    t = {c: trig.column(c).to_numpy()[sel] for c in trig.column_names}
    order = np.lexsort((t["rank"], t["dim"], t["layer"]))
    return {c: v[order] for c, v in t.items()}, chosen


def _rescore_with_bar(mm, requests: tuple, batch_tokens: int, show_progress: bool | None,
                      share_prefixes: bool, max_rows: int = MAX_ROWS) -> tuple[np.ndarray, RescoreStats]:
    """`rescore` the requests of `build_variants` under a progress bar."""
    from ffkv.progress import progress

    seqs, lays, poss, dims, anchors = requests
    stats = RescoreStats()
    with progress(show_progress is False if show_progress is not None else None) as pb:
        task = pb.add_task("mutate: re-scoring", total=None, tokens=0)

        def bar(n, tok, total=None):
            if total is not None:
                pb.update(task, total=total)
            pb.update(task, advance=n, tokens=pb.tasks[task].fields["tokens"] + tok)

        coef = rescore(mm, seqs, lays, poss, dims, batch_tokens=batch_tokens, bar=bar, stats=stats,
                       anchors=anchors if share_prefixes else None, max_rows=max_rows)
    return coef, stats


def mutations_table(t: dict, rows: dict, coef: np.ndarray, sign: int) -> pa.Table:
    """The `mutations` table: one row per variant, its trigger's columns and both coefficients."""
    ti = np.asarray(rows["t"], dtype=np.int64)
    old = coef[np.asarray(rows["old_req"], dtype=np.int64)] if len(ti) else np.zeros(0, np.float32)
    new = coef[np.asarray(rows["new_req"], dtype=np.int64)] if len(ti) else np.zeros(0, np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(old != 0, (new - old) / old, np.nan).astype(np.float32)
    return pa.table({
        "layer": pa.array(t["layer"][ti].astype(np.int16), pa.int16()),
        "dim": pa.array(t["dim"][ti].astype(np.int32), pa.int32()),
        "sign": pa.array(np.full(len(ti), sign, np.int8), pa.int8()),
        "rank": pa.array(t["rank"][ti].astype(np.int16), pa.int16()),
        "sentence_id": pa.array(t["sentence_id"][ti].astype(np.int64), pa.int64()),
        "position": pa.array(t["position"][ti].astype(np.int32), pa.int32()),
        "mutation": pa.array(list(np.asarray(rows["mutation"], dtype=object)), pa.string()),
        "removed_position": pa.array(np.asarray(rows["removed_position"], np.int32), pa.int32()),
        "removed_token": pa.array(np.asarray(rows["removed_token"], np.int32), pa.int32()),
        "n_tokens": pa.array(np.asarray(rows["n_tokens"], np.int32), pa.int32()),
        "trigger_coef": pa.array(t["coef"][ti].astype(np.float32), pa.float32()),
        "old_coef": pa.array(old, pa.float32()),
        "new_coef": pa.array(new, pa.float32()),
        "rel_change": pa.array(rel, pa.float32()),
    })


def max_rel_mismatch(table: pa.Table) -> float:
    """Largest |old − mined| / |mined| (denominator ≥ 1e-6): re-computed against mined coefficients."""
    if not table.num_rows:
        return 0.0
    trig_coef = table.column("trigger_coef").to_numpy().astype(np.float64)
    old = table.column("old_coef").to_numpy()
    return float(np.max(np.abs(old - trig_coef) / np.maximum(np.abs(trig_coef), 1e-6)))


def mutate(run, mm, keys_per_layer: int | None = DEFAULT_KEYS_PER_LAYER,
           examples: int = DEFAULT_EXAMPLES, sign: int = 1, seed: int = 0,
           batch_tokens: int | str = "auto", layers=None, show_progress: bool | None = None,
           write: bool = True, share_prefixes: bool = True) -> MutateResult:
    """Run the experiment and (with `write`) store `mutations` and `mutations_layers`.
    batch_tokens: a number, or auto (2048 on a CPU; on CUDA sized from free memory,
    `ffkv.corpus.batching.step_batch`)."""
    from ffkv.corpus.batching import resolve_step_batch

    check_settings(keys_per_layer, examples, sign)
    batch_tokens, max_rows = resolve_step_batch(mm, batch_tokens, 2048, MAX_ROWS)
    t0 = time.perf_counter()
    t, chosen = select_triggers(run, sign, examples, keys_per_layer, seed, layers)
    sents = sentence_lookup(run, t["sentence_id"])
    requests, rows, skipped = build_variants(t, sents, leading_specials(mm.tok), seed)
    coef, stats = _rescore_with_bar(mm, requests, batch_tokens, show_progress, share_prefixes, max_rows)
    table = mutations_table(t, rows, coef, sign)
    summary = summarize(table.column("layer").to_numpy().astype(np.int64),
                        np.asarray(rows["mutation"], dtype=object),
                        table.column("rel_change").to_numpy(), skipped, sorted(chosen))
    info = {
        "keys": int(sum(len(d) for d in chosen.values())),
        "layers": len(chosen),
        "examples_scored": int(table.num_rows // 3),
        "examples_skipped": int(sum(skipped.values())),
        "variants": int(table.num_rows),
        "max_rel_mismatch_vs_mined_coef": max_rel_mismatch(table),
        "rescore": {**stats.as_dict(), "batch_tokens": batch_tokens, "max_rows": max_rows},
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if write:
        run.write_table("mutations", table)
        run.write_table("mutations_layers", summary)
    return MutateResult(table, summary, info)


def settings_for(keys_per_layer, examples, sign, seed, layers, dtype: str = "auto") -> dict:
    """What the results depend on (not batch size or device, up to float rounding)."""
    return {"keys_per_layer": keys_per_layer or 0, "examples": examples, "sign": sign, "seed": seed,
            "layers": sorted(layers) if layers else None, "dtype": dtype}


# ---- the step ----------------------------------------------------------------------------------
# MutateSettings and STEP: `ffkv.steps.mutate` (the step as one unit).


def record(run, s: MutateSettings) -> dict:
    """The manifest's settings of the step (`settings_for`); the fields' own checks ran before
    (`ffkv.steps.mutate`); this refuses layers without mined triggers, before any model is loaded."""
    if s.layers:
        mined = read_triggers(run, s.sign, 1, columns=["layer"]).column("layer").to_numpy()
        _require_layers(run, s.layers, np.unique(mined))
    return settings_for(s.keys_per_layer, s.examples, s.sign, s.seed, s.layers, s.dtype)


def compute(ctx) -> dict:
    """Open the model (in the settings' dtype unless the caller gave one), run the experiment, and
    keep its numbers but the wall time (the manifest times the step itself)."""
    s = ctx.settings
    res = mutate(ctx.run, ctx.model(), keys_per_layer=s.keys_per_layer, examples=s.examples, sign=s.sign,
                 seed=s.seed, batch_tokens=s.batch_tokens, layers=list(s.layers) if s.layers else None,
                 show_progress=ctx.show_progress)
    ctx.result = res
    return {k: v for k, v in res.stats.items() if k != "seconds"}
