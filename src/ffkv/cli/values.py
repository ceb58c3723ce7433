"""`ffkv values RUN`: values (and keys) as distributions over the vocabulary (paper §4)."""
from __future__ import annotations

import json
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, DtypeOpt, ModelOpt, open_run


def values(run_dir: str = typer.Argument(..., metavar="RUN", help="A run directory with a finished `ffkv mine`."),
           model_name: Optional[str] = ModelOpt, device: str = DeviceOpt, dtype: str = DtypeOpt,
           lens: Optional[str] = typer.Option(None, "--lens", help="naive: v·E as in the paper; norm: "
                                              "with the final norm's gain. Default: the run's lens."),
           top_k: int = typer.Option(10, "--top-k", help="Tokens stored per value/key distribution."),
           chunk: int = typer.Option(1024, "--chunk", help="Values projected at a time (memory ≈ 3 × chunk × |V| × 4 B)."),
           permutations: int = typer.Option(100, "--permutations", help="Shuffled pairings per layer for the baseline."),
           seed: int = typer.Option(0, "--seed", help="Seed of the shuffled pairings."),
           bins: int = typer.Option(10, "--bins", help="Max-probability bins (quantiles) for Fig 6."),
           table2: int = typer.Option(100, "--table2", help="Values in Table 2 (highest max probability)."),
           precision_k: int = typer.Option(50, "--precision-k", help="Trigger examples per key for precision@k."),
           table2_kinds: str = typer.Option("auto", "--table2-kinds", help="value (the paper), both (v and −v), "
                                            "or auto: both when the run has negative trigger lists (mine --negative)."),
           both_lenses: bool = typer.Option(True, "--both-lenses/--one-lens", help="Also read the values through "
                                             "the other lens (the paper's naive one when the run's is norm)."),
           force: bool = typer.Option(False, "--force", help="Recompute even if done with the same settings."),
           as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON.")):
    """Project every value to the vocabulary; agreement with its key's triggers (Fig 4–6, Table 2)."""
    from ffkv.experiments.values import ValuesSettings
    from ffkv.store.steps import execute

    run = open_run(run_dir)
    s = ValuesSettings(lens=lens, top_k=top_k, chunk=chunk, permutations=permutations, seed=seed, bins=bins,
                       table2_n=table2, precision_k=precision_k, table2_kinds=table2_kinds, dtype=dtype,
                       both_lenses=both_lenses)
    out = execute(run, "values", s, model_name=model_name, device=device, dtype=dtype, force=force)
    print_values(out, as_json)


def print_values(out, as_json: bool = False) -> None:
    from ffkv.experiments.values import format_summary

    summary = {**out.info["summary"], **({"skipped": True} if out.skipped else {})}
    print(json.dumps(summary, indent=2) if as_json else format_summary(summary))


def register(app: typer.Typer) -> None:
    app.command()(values)
