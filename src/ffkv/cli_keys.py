"""CLI for the keys experiments (paper §3): `mutate`, `patterns` and `annotate ...`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from ffkv.errors import FfkvError

RunArg = typer.Argument(..., metavar="RUN", help="A run directory made by `ffkv mine --out RUN`.")
DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:N.")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (float32), float32, float16, bfloat16.")
SignOpt = typer.Option("+", "--sign", help="Which triggers: + (top positive, the paper) or - (most negative).")
SeedOpt = typer.Option(0, "--seed", help="Seed of the key sample (and of the random mutation).")
JsonOpt = typer.Option(False, "--json", help="Print JSON for scripts.")


def parse_sign(s: str) -> int:
    v = str(s).strip().lower()
    if v in ("+", "+1", "1", "pos", "positive"):
        return 1
    if v in ("-", "-1", "neg", "negative"):
        return -1
    raise FfkvError(f"--sign must be + or - (got {s!r})")


def _open_run(path):
    from ffkv.store.run import Run

    return Run(path)


def _model(run, device, dtype):
    from ffkv.cli import quiet_hf

    quiet_hf()
    return run.open_model(device=device, dtype=dtype)


def _done_with(run, step: str, settings: dict, tables) -> bool:
    return (run.step_done(step) and run.settings(step) == settings
            and all(run.has_table(t) for t in tables))


def _print_table(title: str, rows: list[dict], cols: list[str], fmt: dict | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt = fmt or {}
    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*[(fmt[c](r[c]) if c in fmt and r[c] is not None else str(r[c])) for c in cols])
    Console().print(t)


def register(app: typer.Typer) -> None:
    @app.command()
    def mutate(run_dir: Path = RunArg,
               keys_per_layer: int = typer.Option(10, "--keys-per-layer", min=0,
                                                  help="Keys sampled per layer (seeded); the paper used 100 "
                                                       "(a GPU setting); 0 = every mined key."),
               examples: int = typer.Option(50, "--examples", min=1, help="Top trigger examples per key."),
               sign: str = SignOpt, seed: int = SeedOpt,
               layers: Optional[List[int]] = typer.Option(None, "--layer", help="Only these layers (repeatable)."),
               batch_tokens: int = typer.Option(2048, "--batch-tokens", min=16,
                                                help="Padded tokens per re-scoring batch."),
               device: str = DeviceOpt, dtype: str = DtypeOpt,
               force: bool = typer.Option(False, "--force", help="Re-run even when done with these settings."),
               as_json: bool = JsonOpt):
        """Fig 3: remove the first, last or a random token of each key's top trigger examples and
        report the relative change of the key's coefficient per layer (tables `mutations`,
        `mutations_layers`)."""
        from ffkv.experiments import mutate as M

        run = _open_run(run_dir)
        run.require("mine", f"ffkv mine --out {run_dir}")
        s = parse_sign(sign)
        settings = M.settings_for(keys_per_layer, examples, s, seed, layers)
        if not force and _done_with(run, "mutate", settings, ["mutations", "mutations_layers"]):
            summary = run.read_table("mutations_layers").to_pylist()
            info = {"status": "already done", **{k: v for k, v in run.step("mutate").items()
                                                 if k not in ("status",)}}
        else:
            mm = _model(run, device, dtype)
            run.start_step("mutate", settings)
            res = M.mutate(run, mm, keys_per_layer=keys_per_layer, examples=examples, sign=s,
                           seed=seed, batch_tokens=batch_tokens, layers=layers)
            run.finish_step("mutate", **{k: v for k, v in res.stats.items() if k != "seconds"})
            summary = res.layers.to_pylist()
            info = {"status": "done", **res.stats}
        if as_json:
            print(json.dumps({**info, "layers": summary}, indent=2, default=str))
            return
        if info["status"] == "already done":
            print(f"mutate: already done with these settings in {run_dir} (use --force to re-run)")
        else:
            r = info["rescore"]
            print(f"mutate: {info['keys']} keys, {info['variants']:,} variants "
                  f"({info['examples_skipped']} one-token examples skipped) in {info['seconds']:.1f} s; "
                  f"{r['sequences_run']:,} sequences run for {r['requests']:,} requests")
        rows = []
        by = {(x["layer"], x["mutation"]): x for x in summary}
        for l in sorted({x["layer"] for x in summary}):
            row = {"layer": l}
            for m in M.MUTATIONS:
                x = by.get((l, m))
                row[m] = (f"{x['median']:+.2f} [{x['q25']:+.2f}, {x['q75']:+.2f}] mean {x['mean']:+.2f}"
                          if x and x["n"] else "-")
            rows.append(row)
        _print_table("relative change of the coefficient: median [q25, q75]", rows,
                     ["layer", *M.MUTATIONS])
