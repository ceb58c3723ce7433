"""What `ffkv mutate` prints: per layer, the relative change of the coefficient for each mutation."""
from __future__ import annotations

import json

from ffkv.steps.mutate.compute import MUTATIONS


def summary(run, out, s=None, as_json: bool = False) -> None:
    """Per layer, the relative change of the coefficient for each mutation (median [q25, q75])."""
    from ffkv.cli.options import print_table

    if out.skipped:
        info = {"status": "already done", **{k: v for k, v in out.info.items() if k != "status"}}
    else:
        info = {"status": "done", **out.result.stats}
    layers = (run.read_table("mutations_layers") if out.skipped else out.result.layers).to_pylist()
    if as_json:
        print(json.dumps({**info, "layers": layers}, indent=2, default=str))
        return
    if out.skipped:
        print(f"mutate: already done with these settings in {run.path} (use --force to re-run)")
    else:
        r = info["rescore"]
        print(f"mutate: {info['keys']} keys, {info['variants']:,} variants "
              f"({info['examples_skipped']} one-token examples skipped) in {info['seconds']:.1f} s; "
              f"{r['sequences_run']:,} sequences run for {r['requests']:,} requests")
    by = {(x["layer"], x["mutation"]): x for x in layers}
    rows = []
    for l in sorted({x["layer"] for x in layers}):
        row = {"layer": l}
        for m in MUTATIONS:
            x = by.get((l, m))
            row[m] = (f"{x['median']:+.2f} [{x['q25']:+.2f}, {x['q75']:+.2f}] mean {x['mean']:+.2f}"
                      if x and x["n"] else "-")
        rows.append(row)
    print_table("relative change of the coefficient: median [q25, q75]", rows, ["layer", *MUTATIONS])
