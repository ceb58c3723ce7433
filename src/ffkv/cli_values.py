"""`ffkv values RUN`: values (and keys) as distributions over the vocabulary (paper §4)."""
from __future__ import annotations

import json
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    from ffkv.cli import DeviceOpt, DtypeOpt, ModelOpt

    @app.command()
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
               force: bool = typer.Option(False, "--force", help="Recompute even if done with the same settings."),
               as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON.")):
        """Project every value to the vocabulary; agreement with its key's triggers (Fig 4–6, Table 2)."""
        from ffkv.experiments.values import (check_triggers, done_summary, format_summary,
                                             resolve_settings)
        from ffkv.store.run import Run

        def show(s):
            print(json.dumps(s, indent=2) if as_json else format_summary(s))

        run = Run(run_dir)
        run.require("mine", f"ffkv mine --out {run.path}")
        check_triggers(run)
        kw = dict(lens=lens, top_k=top_k, chunk=chunk, permutations=permutations, seed=seed, bins=bins,
                  table2_n=table2, precision_k=precision_k, table2_kinds=table2_kinds)
        settings = resolve_settings(run, dtype=dtype, **kw)  # validates the flags before loading
        if not force and model_name is None and (done := done_summary(run, settings)):
            show(done)  # same settings, same model: nothing to recompute
            return
        from ffkv.cli import quiet_hf
        from ffkv.experiments.values import compute_values

        quiet_hf()
        mm = run.open_model(model=model_name, device=device, dtype=dtype, lens=lens)
        show(compute_values(run, mm, force=force, **kw))
