"""top(v_i) and top(-v_i) of every memory, under each lens, cached in the run as `value_tops`.

Compose needs them for Fig 8; the values step already projects every value under both lenses,
so it stores them on its way (`store`) and compose reads them instead of projecting again.
top(v_i) = argmax `Lens.direction_logits(v_i)`; top(-v_i) = argmin of the same logits (negation
is exact). Ties: the lowest token id (torch's argmax/argmin).

- `value_tops`: layer int16, dim int32, lens string, top_token int32 (top(v_i)),
  top_token_neg int32 (top(-v_i)). Sorted by lens, layer, dim. Reused only while the manifest's
  tables.value_tops.unembed_sha256 matches the model.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from ffkv.defs import LENSES
from ffkv.model.memories import lens_for


# ---- value tops --------------------------------------------------------------------------
@torch.no_grad()
def value_tops(run, mm, lenses=LENSES, chunk: int = 384, bar=None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{lens: (top(v_i), top(-v_i))}, each (L, d_m) int64; read from the run's `value_tops`
    table when it holds these lenses for this model's shape, else computed and cached."""
    from ffkv.model.identity import unembed_digest

    digest = unembed_digest(mm) if run is not None else None
    cached = _cached_value_tops(run, mm, lenses, digest) if run is not None else None
    if cached is not None:
        return cached
    from ffkv.model.onednn import fast_products

    with fast_products(getattr(mm, "device", None)):
        out = _compute(mm, lenses, chunk, bar)
    if run is not None:
        _write_value_tops(run, out, mm.n_layers, mm.d_m, digest)
    return out


def _compute(mm, lenses, chunk: int, bar) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    L, dm = mm.n_layers, mm.d_m
    out = {}
    task = bar.add_task("value tops", total=len(lenses) * L) if bar is not None else None
    for ln in lenses:
        lens = lens_for(mm, ln)
        pos = torch.empty(L, dm, dtype=torch.long)
        neg = torch.empty(L, dm, dtype=torch.long)
        for l in range(L):
            V = mm.values(l).detach()
            for s in range(0, dm, chunk):
                z = lens.direction_logits(V[s:s + chunk])
                pos[l, s:s + chunk] = z.argmax(-1).cpu()
                neg[l, s:s + chunk] = z.argmin(-1).cpu()
            if task is not None:
                bar.advance(task)
        out[ln] = (pos, neg)
    return out


def _cached_value_tops(run, mm, lenses, digest: str) -> dict | None:
    """The run's `value_tops` for these lenses, if made for this unembedding and shape, and whole (a
    cut or swapped cache is made again, not read)."""
    L, dm = mm.n_layers, mm.d_m
    cached = (run.manifest.get("tables") or {}).get("value_tops") or {}
    if not (cached.get("unembed_sha256") == digest and run.table_problem("value_tops") is None):
        return None
    t = run.read_table("value_tops")
    have = set(t.column("lens").to_pylist())
    if not (set(lenses) <= have and t.num_rows == L * dm * len(have)):
        return None
    out = {}
    lens_col = np.asarray(t.column("lens").to_pylist())
    for ln in lenses:
        sel = lens_col == ln
        layer = t.column("layer").to_numpy()[sel].astype(np.int64)
        dim = t.column("dim").to_numpy()[sel].astype(np.int64)
        pos = torch.empty(L, dm, dtype=torch.long)
        neg = torch.empty(L, dm, dtype=torch.long)
        pos[layer, dim] = torch.from_numpy(t.column("top_token").to_numpy()[sel].astype(np.int64))
        neg[layer, dim] = torch.from_numpy(t.column("top_token_neg").to_numpy()[sel].astype(np.int64))
        out[ln] = (pos, neg)
    return out


def _write_value_tops(run, tops: dict, L: int, dm: int, digest: str) -> None:
    """tops: {lens: (pos, neg)}, each (L, dm) integer arrays."""
    layer = np.repeat(np.arange(L), dm)
    dim = np.tile(np.arange(dm), L)
    run.write_table("value_tops", pa.concat_tables([pa.table({
        "layer": pa.array(layer, pa.int16()), "dim": pa.array(dim, pa.int32()),
        "lens": pa.array([ln] * (L * dm), pa.string()),
        "top_token": pa.array(pos.reshape(-1).numpy(), pa.int32()),
        "top_token_neg": pa.array(neg.reshape(-1).numpy(), pa.int32())}) for ln, (pos, neg) in tops.items()]))
    # beside the table's own record (rows, bytes, footer: written by write_table), not instead of it
    run.manifest.setdefault("tables", {}).setdefault("value_tops", {}).update(
        {"unembed_sha256": digest, "lenses": list(tops)})
    run.save()


def store(run, mm, tops: dict) -> None:
    """Cache tops ({lens: (pos, neg)}, each (L, d_m)) computed elsewhere, e.g. by the values step."""
    from ffkv.model.identity import unembed_digest

    tops = {ln: (torch.as_tensor(np.asarray(p)), torch.as_tensor(np.asarray(n))) for ln, (p, n) in tops.items()}
    _write_value_tops(run, tops, mm.n_layers, mm.d_m, unembed_digest(mm))
