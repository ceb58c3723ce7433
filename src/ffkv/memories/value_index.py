"""The token → memories inverse index: which values promote (or suppress) a token.

For every value v_i of every layer, both directions (+v_i, and −v_i, which a negative
coefficient writes) and both lenses of `ffkv.model.memories.Lens` ("naive": v·E, the paper's;
"norm": through the final norm's gain), the index lists the tokens whose exact rank in
softmax(±v_i·E) is below k. It answers "which memories put token w in their top k?" by a lookup,
where the direct way projects all L × d_m values onto the vocabulary (about 40 s for SmolLM2).

Definitions
- rank: `ffkv.model.memories.rank_of` semantics, the number of tokens with a strictly larger
  logit (0 = the top token). It is exact over the whole vocabulary: the index keeps every token
  whose logit is ≥ the k-th largest logit of the row, which are exactly the tokens of rank < k.
  With tied logits at the k-th place a row has more than k entries (all tied tokens are kept).
- "promotes w": w has rank < k in the distribution of +v_i (sign +1). "suppresses w": w has rank
  < k in the distribution of −v_i (sign −1), i.e. it is among the k lowest logits of v_i.
- prob: softmax probability of the token in that distribution (float32 logits, log-sum-exp).

Table `value_index` (public contract; written by the values step, atomically)
- lens string (naive | norm), sign int8 (+1: v_i, −1: −v_i), token int32, rank int16
  (0-based, see above), prob float32, layer int16, dim int32.
- Sorted by lens, sign, token, rank, layer, dim, so a DuckDB query for one token reads few row
  groups, e.g. ``select layer, dim, rank from value_index where lens = 'norm' and sign = 1 and
  token = 42 and rank < 10``.
- Schema metadata: ``ffkv.k`` (the k of the index; ranks < k are all present) and
  ``ffkv.lenses`` (comma-separated).

Size: L × d_m × 2 signs × |lenses| × k rows (SmolLM2, k = 20: 3.7M rows, about 13 MB of
Parquet). Memory while building: the (chunk × |V|) float32 logits and (128 × |V|) temporaries.

`ffkv serve` builds the same table in memory (never writing the run) when a run lacks it.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

TABLE = "value_index"
DEFAULT_K = 20
LENSES = ("naive", "norm")
COLUMNS = ("lens", "sign", "token", "rank", "prob", "layer", "dim")
SCHEMA = pa.schema([("lens", pa.string()), ("sign", pa.int8()), ("token", pa.int32()), ("rank", pa.int16()),
                    ("prob", pa.float32()), ("layer", pa.int16()), ("dim", pa.int32())])


def _top_rows(z, k: int, sign: int = 1, top=None):
    """Tokens of rank < k in each row of sign·z (C, V), with their ranks and logits (of sign·z).

    Returns (row, token, rank, logit) as 1-d tensors. Ranks count strictly larger logits.
    sign = −1 reads −z without materializing it (the smallest logits of z). `top`: (logits of
    sign·z descending, their tokens), at least k + 1 columns (all V where V ≤ k), when the caller
    has them (the values step's top-k): the same rows come out, without a top-k of its own.
    """
    import torch

    C, V = z.shape
    k = min(k, V)
    extra = int(k < V)  # one more than k: a tie beyond the k-th shows as an equal (k+1)-th
    if top is not None and top[0].shape[1] >= k + extra:
        vals, idx = top[0][:, :k + extra], top[1][:, :k + extra]
    else:
        vals, idx = z.topk(k + extra, dim=-1, largest=sign > 0)
        if sign < 0:
            vals = vals.neg_()  # descending in −z
    beyond = vals[:, k] == vals[:, k - 1] if extra else torch.zeros(C, dtype=torch.bool, device=z.device)
    vals, idx = vals[:, :k], idx[:, :k]
    # rank of each kept logit = index of the first equal value in the descending list
    pos = torch.arange(k, device=z.device).expand(C, k)
    new = torch.ones_like(vals, dtype=torch.bool)
    new[:, 1:] = vals[:, 1:] != vals[:, :-1]
    rank = torch.where(new, pos, torch.zeros_like(pos)).cummax(dim=1).values
    thr = vals[:, -1:]
    tied = torch.nonzero(beyond).flatten()  # rows where tokens beyond the k-th tie with it
    keep = torch.ones(C, dtype=torch.bool, device=z.device)
    keep[tied] = False
    rows = torch.arange(C, device=z.device)[:, None].expand(C, k)[keep]
    out = [(rows.flatten(), idx[keep].flatten(), rank[keep].flatten(), vals[keep].flatten())]
    for r in tied.tolist():  # every token ≥ the k-th logit (Gemma 3's unused tokens tie in hundreds)
        row = z[r] if sign > 0 else -z[r]
        toks = torch.nonzero(row >= thr[r, 0]).flatten()
        lv = row[toks]
        # every larger logit is among them: a token's rank is the count of larger ones there
        desc = torch.sort(lv, descending=True).values
        rk = len(desc) - torch.searchsorted(desc.flip(0), lv, right=True)
        out.append((torch.full_like(toks, r), toks, rk, lv))
    return tuple(torch.cat([o[j] for o in out]) for j in range(4))


def _logsumexp_rows(z, sign: int, rows: int = 128):
    """logsumexp of each row of sign·z, over blocks of rows: the temporaries (−z, and the
    exponentials inside logsumexp) stay (rows × V), not (C × V) (Gemma 3: 0.5 GB each at C = 512)."""
    import torch

    return torch.cat([torch.logsumexp(z[a:a + rows] if sign > 0 else -z[a:a + rows], dim=-1)
                      for a in range(0, len(z), rows)]) if len(z) else z.new_zeros(0)


class IndexBuilder:
    """Collects index rows chunk by chunk, so a step that already projects the values (the
    values step, for its own lens) can feed its logits instead of projecting them again:

        ib = IndexBuilder(k)
        ib.add("norm", layer, a, z)   # z: (C, V) float32 logits of values a..a+C-1 of `layer`
        table = ib.table()
    """

    def __init__(self, k: int = DEFAULT_K):
        if k < 1:
            from ffkv.errors import FfkvError

            raise FfkvError(f"the index needs k ≥ 1 (got {k})")
        self.k = int(k)
        self.parts: dict[tuple[str, int], list] = {}
        self.lenses: list[str] = []

    def add(self, lens: str, layer: int, start: int, z, lse=None, tops=None) -> None:
        """Index the rows of z (C, V), the logits of values start..start+C-1 of `layer` under
        `lens`, for +v and −v. z is not modified. `lse`: the log-sum-exp of z and of −z per row,
        `tops`: the top logits of z and of −z with their tokens (`_top_rows`' `top`), when the
        caller has them already (the values step does)."""
        import torch

        if lens not in self.lenses:
            self.lenses.append(lens)
        z = z.float()
        for j, s in enumerate((1, -1)):
            ls = lse[j] if lse is not None else _logsumexp_rows(z, s)
            row, tok, rk, lv = _top_rows(z, self.k, sign=s, top=tops[j] if tops is not None else None)
            prob = torch.exp(lv - ls[row])
            self.parts.setdefault((lens, s), []).append((
                np.full(len(row), layer, np.int16),
                (row + start).cpu().numpy().astype(np.int32),
                tok.cpu().numpy().astype(np.int32),
                rk.cpu().numpy().astype(np.int16),
                prob.cpu().numpy().astype(np.float32)))

    def table(self) -> pa.Table:
        cols = {c: [] for c in COLUMNS}
        for (ln_name, s) in sorted(self.parts, key=lambda x: (x[0], -x[1])):
            ps = self.parts[(ln_name, s)]
            layer, dim, tok, rk, pr = (np.concatenate([p[j] for p in ps]) for j in range(5))
            order = np.lexsort((dim, layer, rk, tok))
            n = len(order)
            cols["lens"].append(pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)),
                                                               pa.array([ln_name])).cast(pa.string()))
            cols["sign"].append(pa.array(np.full(n, s, np.int8)))
            cols["token"].append(pa.array(tok[order]))
            cols["rank"].append(pa.array(rk[order]))
            cols["prob"].append(pa.array(pr[order]))
            cols["layer"].append(pa.array(layer[order]))
            cols["dim"].append(pa.array(dim[order]))
        arrays = [pa.chunked_array(cols[c], SCHEMA.field(c).type) for c in COLUMNS]
        meta = {"ffkv.k": str(self.k), "ffkv.lenses": ",".join(sorted(self.lenses))}
        return pa.Table.from_arrays(arrays, schema=SCHEMA.with_metadata(meta)).combine_chunks()


def build_index(mm, lenses=LENSES, k: int = DEFAULT_K, chunk: int = 512, progress=None) -> pa.Table:
    """The `value_index` table of model `mm` (a `MemoryModel`): see the module docstring.

    `progress(done, total)` is called after each chunk of values (for a progress bar or page).
    """
    import torch

    from ffkv.model.memories import lens_for

    lenses = tuple(lenses)
    bad = [l for l in lenses if l not in LENSES]
    if bad or not lenses:
        from ffkv.errors import FfkvError

        raise FfkvError(f"unknown lens(es) {bad or lenses}; choose from {', '.join(LENSES)}")
    ib = IndexBuilder(k)
    L, d_m = mm.n_layers, mm.d_m
    chunk = max(1, min(chunk, d_m))
    n_chunks = len(lenses) * L * ((d_m + chunk - 1) // chunk)
    done = 0
    with torch.no_grad():
        for ln_name in lenses:
            ln = lens_for(mm, ln_name)
            for layer in range(L):
                W = mm.values(layer)
                for a in range(0, d_m, chunk):
                    ib.add(ln_name, layer, a, ln.direction_logits(W[a:a + chunk]))
                    done += 1
                    if progress is not None:
                        progress(done, n_chunks)
    return ib.table()


def index_k(table: pa.Table) -> int | None:
    """The k of a `value_index` table (from its metadata; None when absent)."""
    meta = table.schema.metadata or {}
    v = meta.get(b"ffkv.k")
    return int(v) if v is not None else None


def write_index(run, table: pa.Table) -> None:
    """Write the table into the run (the values step's job; atomic, row groups of 200k rows)."""
    run.write_table(TABLE, table, row_group_size=200_000)
