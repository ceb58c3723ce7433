"""Fig 2: per layer, the share of top prefixes covered by shallow / semantic / both / no pattern."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from ffkv.store.labels import layer_shares

SHARES = ("shallow", "semantic", "both", "not_covered")


def fig2_rows(layer_of_key, counts, n_patterns, scope: str) -> dict:
    """Per layer shares of prefixes by category (columns of `patterns_fig2`); inputs are per key:
    counts (K, 4) of only_shallow, only_semantic, both, not_covered prefixes, and n_patterns."""
    rows = layer_shares(layer_of_key, counts, n_patterns)
    cols = ("layer", "scope", "keys", "prefixes", *SHARES, "patterns_per_key", "keys_with_pattern")
    return {c: [scope if c == "scope" else r["n"] if c == "keys" else r[c] for r in rows] for c in cols}


def fig2_table(ktable: pa.Table, semantic: bool = True) -> pa.Table:
    """`patterns_fig2` from `pattern_keys`: scope all, and semantic_sample when semantic ran."""
    layer = ktable.column("layer").to_numpy()
    counts = np.stack([ktable.column(c).to_numpy() for c in ("only_shallow", "only_semantic", "both",
                                                             "not_covered")], axis=-1)
    npat = ktable.column("n_patterns").to_numpy()
    parts = [fig2_rows(layer, counts, npat, "all")]
    m = ktable.column("semantic_done").to_numpy().astype(bool)
    if semantic and m.any():
        parts.insert(0, fig2_rows(layer[m], counts[m], npat[m], "semantic_sample"))
    cols = {c: sum((p[c] for p in parts), []) for c in parts[0]}
    return pa.table({
        "layer": pa.array(cols["layer"], pa.int16()), "scope": pa.array(cols["scope"], pa.string()),
        "keys": pa.array(cols["keys"], pa.int32()), "prefixes": pa.array(cols["prefixes"], pa.int64()),
        **{c: pa.array(cols[c], pa.float64()) for c in (*SHARES, "patterns_per_key", "keys_with_pattern")}})
