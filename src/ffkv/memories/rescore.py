"""Re-scoring: memory coefficients of many token sequences, each at one position, with the work
shared. `rescore(mm, seqs, layers, positions, dims)` gives m_dims[r] of layer layers[r] at position
positions[r] of seqs[r], equal to a forward pass of each sequence alone (up to float rounding).
Its user is mutate (Fig 3: a key's trigger prefixes with a token removed, `ffkv.steps.mutate`),
whose variants make the examples below; the engine knows nothing of mutations.

How the work is shared:
- A re-scoring pass stops at the deepest layer its batch needs (`MemoryModel.capture`).
- Causal masking: the coefficient of a sequence at position p only depends on tokens 0..p. So every
  request whose sequence is a prefix of another request's sequence is read from the longer one.
  Mutate's "last" variants (and the originals) are thus read from one pass over each original
  sentence, at positions j−1 (and j): removing the last token costs no forward pass of its own.
  All "first" variants of one sentence share one sequence too.
- Anchors: a request may name another (its anchor) whose sequence it starts like. A "random"
  variant drops token r of x_1..x_j: its first r tokens are those of the original, so it is
  computed from the original's cached keys and values, running only its j − r later tokens with
  explicit position ids (about half the tokens of the random variants). The original pass keeps
  those tokens' keys and values for that, and goes as deep as its deepest variant needs; on a CPU
  they wait in a pool, so that variants of many original batches share passes. Checked once per model
  (`sharing_ok`); a model where it does not reproduce a full pass gets full passes.
- Requests of all keys and all layers share batches; batches are packed by length within groups
  of equal deepest layer, right-padded. On a CPU, where padding costs in full, the length-sorted
  group is cut where padded tokens plus a pass's fixed cost are fewest (`ffkv.corpus.batching.
  pack_cheapest`: the default run's padding 1.36× → 1.16×); on CUDA by the budget alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ffkv.corpus.batching import pack, pack_cheapest, tight_ratio
from ffkv.errors import FfkvError
from ffkv.model.onednn import fast_products
from ffkv.model.prefix import context as _context
from ffkv.model.prefix import fits


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
    """Index batches of `members`: groups of equal deepest layer, packed by length (on a CPU, where
    `ratio` is set (`ffkv.corpus.batching.tight_ratio`), at the cheapest split: `pack_cheapest`),
    deepest first. A group's first batch joins the batch
    before it (of a deeper group) when running it that deep costs less than a pass of its own
    (`fixed`: a pass's cost per layer in tokens, `pass_tokens`). Why: a root's leaves read many
    layers, and one small leaf batch per layer made a pass for every 2 to 3 sequences."""
    out, shape = [], None  # shape: (rows, length, deep) of out[-1]
    for L in np.unique(deepest[members])[::-1]:
        m = members[deepest[members] == L]
        cut = (pack(lengths[m], batch_tokens, max_batch=max_rows, ratio=ratio, slack=SLACK) if ratio is None
               else pack_cheapest(lengths[m], batch_tokens, max_rows, fixed))
        for b in cut:
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
POOL_FACTOR = 4  # leaves' pasts kept on a CPU before their leaves run: this many root batches' worth


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
    """The forward passes of one `rescore` call: roots in full, each root batch's leaves' shared
    prefixes kept from its cache in a pool, whose leaves run together when it is full and at the
    end; every pass writes its requests' coefficients into `out`."""

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
        self.pool: list[tuple[int, list, int]] = []  # (leaf, its root batch's gathered past, row in it)
        self.held = 0  # token-layers of the pooled pasts
        for b in _batches(self.run_len, self.deepest, roots, self.batch_tokens, self.max_rows, self.ratio,
                            self.fixed):
            self.root_batch(b, zero)
            if self.held > self.pool_cap():
                self.flush()
        self.flush()

    def pool_cap(self) -> int:
        """Token-layers of leaves' pasts kept across root batches before their leaves run: on a CPU
        POOL_FACTOR root batches' worth, so that leaves of many root batches share passes (one root
        batch's leaves made passes of 4 rows, padded 1.9×, on the default run); on CUDA none,
        whose batch sizing counts one root batch's cache only."""
        if str(getattr(self.mm, "device", "cpu")).startswith("cuda"):
            return 0
        return POOL_FACTOR * self.batch_tokens * int(self.mm.n_layers)

    def root_batch(self, b: np.ndarray, zero: np.ndarray) -> None:
        """Run sequences `b` in full, keeping for each of their leaves its shared prefix's keys and
        values (rows gathered from this batch's cache) in the pool."""
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
        P, kdeep = int(self.share[kids].max()), int(self.deepest[kids].max())
        rows = [row_of_root[int(self.parent[w])] for w in kids]
        if self.pool_cap() == 0:  # run at once: each leaf batch gathers its own rows, bounded by `_past_bounded`
            past = [(cache.layers[l].keys, cache.layers[l].values) for l in range(kdeep + 1)]
            self.pool += [(int(w), past, j) for w, j in zip(kids, rows)]
        else:
            src = torch.as_tensor(rows, device=ids.device)
            past = [(cache.layers[l].keys[src, :, :P], cache.layers[l].values[src, :, :P]) for l in range(kdeep + 1)]
            self.pool += [(int(w), past, j) for j, w in enumerate(kids)]
        self.held += len(kids) * P * (kdeep + 1)

    def flush(self) -> None:
        """Run the pooled leaves, batched among themselves whatever their root batch."""
        if not self.pool:
            return
        where = {w: (past, j) for w, past, j in self.pool}
        leaves = np.array([w for w, _, _ in self.pool], dtype=np.int64)
        self.pool, self.held = [], 0
        for lb in _batches(self.new_len, self.deepest, leaves, self.batch_tokens, self.max_rows, self.ratio,
                             self.fixed):
            for part in _past_bounded(lb, self.share, self.batch_tokens):
                self.leaf_batch(part, where)

    def leaf_batch(self, lb: np.ndarray, where: dict) -> None:
        """Run the tokens of leaves `lb` after their shared prefix, on their roots' cached keys and
        values (`where`: each leaf's gathered past and row), cut to the longest shared prefix P;
        a row's layers past its own deepest are zeros, read by nothing."""
        from ffkv.model.prefix import continued

        mm = self.mm
        ids_new, mask_new = mm.batch([list(self.run_seqs[w][self.share[w]:]) for w in lb])
        device = ids_new.device
        kk = torch.as_tensor(self.share[lb], device=device)
        P = int(kk.max())
        ldeep = int(self.deepest[lb].max())
        if not fits(mm, P, ids_new.shape[1]):
            # past a sliding window the cache's masked places would count in it: run them in full
            ids, mask = mm.batch([list(self.run_seqs[w]) for w in lb])
            self.forward(lb, ids, mask, np.zeros(len(self.run_seqs), dtype=np.int64), ldeep)
            return
        groups: dict[int, tuple[list, list[int], list[int]]] = {}  # one per root batch: (past, rows, its rows)
        for i, w in enumerate(lb):
            past, j = where[int(w)]
            g = groups.setdefault(id(past), (past, [], []))
            g[1].append(i)
            g[2].append(j)
        k0, v0 = next(iter(groups.values()))[0][0]
        out = []
        for l in range(ldeep + 1):
            K = k0.new_zeros((len(lb), k0.shape[1], P, k0.shape[3]))
            V = v0.new_zeros((len(lb), v0.shape[1], P, v0.shape[3]))
            for past, rows, js in groups.values():
                if l < len(past):
                    c = min(P, past[l][0].shape[2])
                    r, j = torch.as_tensor(rows, device=device), torch.as_tensor(js, device=device)
                    K[r, :, :c] = past[l][0][j, :, :c]
                    V[r, :, :c] = past[l][1][j, :, :c]
            out.append((K, V))
        kw = continued(out, kk, ids_new, mask_new, self.max_pos)
        self.forward(lb, ids_new, kw.pop("attention_mask"), self.share, ldeep,
                     **{k: v for k, v in kw.items() if k != "input_ids"})

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
