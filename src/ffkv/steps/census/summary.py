"""What `ffkv census` prints: the step's summary (the manifest's steps.census.summary) as text or JSON."""
from __future__ import annotations

import json

from ffkv.defs import pct
from ffkv.steps.census import TABLES


def summary(run, out, s=None, as_json: bool = False) -> None:
    summ = {**out.info["summary"], **({"skipped": True} if out.skipped else {})}
    print(json.dumps(summ, indent=2) if as_json else format_summary(summ))


def _share(k: int, n: int) -> str:
    return f"{k:,} ({pct(k / n, 1)})" if n else f"{k:,}"


def _thirds(xs: list) -> str:
    L = len(xs)
    parts = []
    for a, b in ((0, L // 3), (L // 3, 2 * L // 3), (2 * L // 3, L)):
        v = [x for x in xs[a:b] if x is not None]
        if b > a:
            parts.append(f"{a}–{b - 1}: " + (pct(sum(v) / len(v), 1) if v else "n/a"))
    return ", ".join(parts)


def format_summary(s: dict) -> str:
    n, nm = s["memories"], s["mined"]
    eps = f"|m| > {s['eps']:g}" + (f" (read as |m| ≥ {s['eps_used']:g}, the key histogram's edge)"
                                   if s["eps_used"] != s["eps"] else "")
    io = ", ".join(f"{c.replace('_', ' ')} {_share(k, n)}" for c, k in s["io_classes"].items() if k or s["gated"])
    lines = [
        f"census: {n:,} memories ({s['layers']} layers × {s['d_m']:,}), lens = {s['lens']}"
        + ("  [already done; pass --force to recompute]" if s.get("skipped") else ""),
        f"  dead (never {eps} over {s['tokens']:,} mined tokens): {_share(s['dead'], nm)} of {nm:,} mined; "
        f"rare: {_share(s['rare'], nm)}",
        f"  prediction {_share(s['prediction'], n)}, suppression {_share(s['suppression'], n)}, "
        f"partition {_share(s['partition'], n)}",
        f"  input-output classes: {io}",
        *([f"  token detectors (top-token share ≥ {s['detector']:g}): {_share(s['token_detector'], s['with_triggers'])}, "
           f"n-gram {_share(s['ngram_detector'], s['with_triggers'])} of {s['with_triggers']:,} with triggers; "
           f"self-suppressing {_share(s['self_suppressing'], s['token_detector'])} of the token detectors",
           f"  positional (TV from chance ≥ {s['positional_tv']:g}, > 2× shuffled): {_share(s['positional'], nm)}"]
          if "token_detector" in s else []),
        "  by layer thirds: prediction " + _thirds(s["by_layer"]["prediction"]) + "; suppression "
        + _thirds(s["by_layer"]["suppression"]) + "; dead " + _thirds(s["by_layer"]["dead"]),
        f"  tables: {', '.join(TABLES)}  ({s['seconds']:.1f} s)",
    ]
    return "\n".join(lines)
