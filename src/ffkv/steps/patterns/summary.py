"""What `ffkv patterns` prints: counts, key labels and Fig 2 per layer."""
from __future__ import annotations

import json

from ffkv.defs import pct
from ffkv.steps.patterns.compute import summary as gather
from ffkv.store.labels import LABELS, TOP


def summary(run, out, s=None, as_json: bool = False) -> None:
    """Counts, key labels and Fig 2 per layer."""
    from ffkv.cli.options import print_table

    top = s.top if s is not None else TOP
    info = gather(run, out)
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    if out.skipped:
        print(f"patterns: already done with these settings in {run.path} (use --force to re-run)")
    else:
        print(f"patterns: {info['keys']:,} keys ({info['semantic_keys']:,} with semantic patterns), "
              f"{info['patterns']:,} patterns in {info['seconds']:.1f} s "
              f"(embedding {info['embedding_seconds']:.1f} s)")
    print("key labels: " + ", ".join(f"{k} {info['labels'].get(k, 0):,}" for k in LABELS))
    fig2 = info["fig2"]
    scope = "semantic_sample" if any(f["scope"] == "semantic_sample" for f in fig2) else "all"
    pct0 = lambda x: pct(x, 0)  # noqa: E731
    print_table(f"Fig 2 (scope {scope}): share of top-{top} prefixes by pattern kind",
                [f for f in fig2 if f["scope"] == scope],
                ["layer", "keys", "shallow", "semantic", "both", "not_covered", "patterns_per_key"],
                {"shallow": pct0, "semantic": pct0, "both": pct0, "not_covered": pct0,
                 "patterns_per_key": lambda x: f"{x:.1f}"})
