"""Reading mined triggers back: one key's prefixes, decoded with the run's vocab table."""
from __future__ import annotations

import pyarrow.compute as pc

from ffkv.errors import FfkvError


def key_triggers(run, layer: int, dim: int, sign: int | None = None, top: int = 10) -> list[dict]:
    filters = [("layer", "=", layer), ("dim", "=", dim)]
    if sign is not None:
        filters.append(("sign", "=", sign))
    trig = run.read_table("triggers", filters=filters)
    if trig.num_rows == 0:
        m = run.manifest.get("model", {})
        raise FfkvError(f"no triggers for key {layer}/{dim} in {run.path} (the model has "
                        f"{m.get('layers')} layers × {m.get('d_m')} dims; mined: "
                        f"layers={run.settings('mine').get('layers') or 'all'}, dims={run.settings('mine').get('dims') or 'all'})")
    trig = trig.sort_by([("sign", "descending"), ("rank", "ascending")])
    out_rows = []
    sids = trig.column("sentence_id")
    sent = run.read_table("sentences", filters=[("sentence_id", "in", sorted(set(sids.to_pylist())))])
    by_sid = {r["sentence_id"]: r for r in sent.select(["sentence_id", "text", "token_ids"]).to_pylist()}
    vocab = run.read_table("vocab").column("text").to_pylist()
    counts = {}
    for r in trig.to_pylist():
        counts[r["sign"]] = counts.get(r["sign"], 0) + 1
        if counts[r["sign"]] > top:
            continue
        s = by_sid[r["sentence_id"]]
        toks = s["token_ids"][: r["position"] + 1]
        nt = r["next_token"]
        out_rows.append({**r, "text": s["text"], "prefix_tokens": [vocab[t] for t in toks],
                         "prefix": "".join(vocab[t] for t in toks),
                         "trigger_token": vocab[toks[-1]],
                         "next_token_text": vocab[nt] if nt is not None else None})
    return out_rows
