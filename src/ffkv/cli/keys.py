"""`ffkv mutate` and `ffkv patterns`: the keys experiments (paper §3)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from ffkv.cli.options import (DeviceOpt, DtypeOpt, JsonOpt, RunArg, SeedOpt, SignOpt, open_run, parse_sign,
                              print_table)

ForceOpt = typer.Option(False, "--force", help="Re-run even when done with these settings.")


def _status(out) -> dict:
    """What a skipped or finished step reports: its stored info, or the stats just computed."""
    if out.skipped:
        return {"status": "already done", **{k: v for k, v in out.info.items() if k != "status"}}
    return {"status": "done", **out.result.stats}


def mutate(run_dir: Path = RunArg,
           keys_per_layer: int = typer.Option(10, "--keys-per-layer", min=0,
                                              help="Keys sampled per layer (seeded); the paper used 100 "
                                                   "(a GPU setting); 0 = every mined key."),
           examples: int = typer.Option(50, "--examples", min=1, help="Top trigger examples per key."),
           sign: str = SignOpt, seed: int = SeedOpt,
           layers: Optional[List[int]] = typer.Option(None, "--layer", help="Only these layers (repeatable)."),
           batch_tokens: int = typer.Option(2048, "--batch-tokens", min=16,
                                            help="Padded tokens per re-scoring batch."),
           device: str = DeviceOpt, dtype: str = DtypeOpt, force: bool = ForceOpt, as_json: bool = JsonOpt):
    """Fig 3: remove the first, last or a random token of each key's top trigger examples and
    report the relative change of the key's coefficient per layer (tables `mutations`,
    `mutations_layers`)."""
    from ffkv.experiments import mutate as M
    from ffkv.store.steps import execute

    run = open_run(run_dir)
    s = M.MutateSettings(keys_per_layer=keys_per_layer, examples=examples, sign=parse_sign(sign), seed=seed,
                         layers=layers, batch_tokens=batch_tokens, dtype=dtype)
    print_mutate(run, execute(run, "mutate", s, device=device, dtype=dtype, force=force), as_json)


def print_mutate(run, out, as_json: bool = False) -> None:
    from ffkv.experiments.mutate import MUTATIONS

    info = _status(out)
    summary = (run.read_table("mutations_layers") if out.skipped else out.result.layers).to_pylist()
    if as_json:
        print(json.dumps({**info, "layers": summary}, indent=2, default=str))
        return
    if out.skipped:
        print(f"mutate: already done with these settings in {run.path} (use --force to re-run)")
    else:
        r = info["rescore"]
        print(f"mutate: {info['keys']} keys, {info['variants']:,} variants "
              f"({info['examples_skipped']} one-token examples skipped) in {info['seconds']:.1f} s; "
              f"{r['sequences_run']:,} sequences run for {r['requests']:,} requests")
    _print_mutations(summary, MUTATIONS)


def _print_mutations(summary: list[dict], mutations) -> None:
    rows = []
    by = {(x["layer"], x["mutation"]): x for x in summary}
    for l in sorted({x["layer"] for x in summary}):
        row = {"layer": l}
        for m in mutations:
            x = by.get((l, m))
            row[m] = (f"{x['median']:+.2f} [{x['q25']:+.2f}, {x['q75']:+.2f}] mean {x['mean']:+.2f}"
                      if x and x["n"] else "-")
        rows.append(row)
    print_table("relative change of the coefficient: median [q25, q75]", rows, ["layer", *mutations])


def patterns(run_dir: Path = RunArg,
             keys_per_layer: int = typer.Option(0, "--keys-per-layer", min=0,
                                                help="Keys per layer for shallow patterns (seeded sample); "
                                                     "0 = every mined key."),
             semantic_keys_per_layer: int = typer.Option(
                 10, "--semantic-keys-per-layer", min=0,
                 help="Keys per layer that also get semantic patterns (the nested seeded sample that "
                      "`ffkv annotate sample` gives annotators); 0 = all analysed keys. Embedding costs "
                      "about 1/70 s per prefix on a CPU."),
             no_semantic: bool = typer.Option(False, "--no-semantic", help="Shallow patterns only."),
             top: int = typer.Option(25, "--top", min=1, max=1000, help="Top prefixes per key (the paper: 25)."),
             min_cover: int = typer.Option(3, "--min-cover", min=1, help="Prefixes a pattern must cover (the paper: 3)."),
             alpha: float = typer.Option(1e-3, "--alpha", help="Significance of a shallow pattern against random "
                                                               "corpus prefixes; 1 = keep all."),
             background: int = typer.Option(2000, "--background", min=50, help="Random corpus prefixes for the baselines."),
             sign: str = SignOpt, seed: int = SeedOpt, device: str = DeviceOpt, force: bool = ForceOpt,
             as_json: bool = JsonOpt):
    """Automatic patterns in each key's top-25 prefixes: shallow (shared last words, suffixes,
    n-grams) and semantic (clusters of sentence embeddings); a label per key and Fig 2 for
    every key (tables `patterns`, `pattern_keys`, `patterns_fig2`)."""
    from ffkv.experiments import patterns as P
    from ffkv.store.steps import execute

    run = open_run(run_dir)
    s = P.PatternsSettings(keys_per_layer=keys_per_layer, semantic_keys_per_layer=semantic_keys_per_layer,
                           top=top, sign=parse_sign(sign), seed=seed, min_cover=min_cover, alpha=alpha,
                           background=background, semantic=not no_semantic, device=device)
    print_patterns(run, execute(run, "patterns", s, device="cpu", force=force), top, as_json)


def print_patterns(run, out, top: int = 25, as_json: bool = False) -> None:
    from ffkv.experiments.patterns import LABELS, summary

    info = summary(run, out)
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
    _print_fig2(info["fig2"], top)


def _print_fig2(fig2: list[dict], top: int) -> None:
    from ffkv.defs import pct

    scope = "semantic_sample" if any(f["scope"] == "semantic_sample" for f in fig2) else "all"
    pct0 = lambda x: pct(x, 0)  # noqa: E731
    print_table(f"Fig 2 (scope {scope}): share of top-{top} prefixes by pattern kind",
                [f for f in fig2 if f["scope"] == scope],
                ["layer", "keys", "shallow", "semantic", "both", "not_covered", "patterns_per_key"],
                {"shallow": pct0, "semantic": pct0, "both": pct0, "not_covered": pct0,
                 "patterns_per_key": lambda x: f"{x:.1f}"})


def register(app: typer.Typer) -> None:
    app.command()(mutate)
    app.command()(patterns)
