"""Options and helpers shared by every command, defined once."""
from __future__ import annotations

import typer

from ffkv.defs import LENS_HELP
from ffkv.errors import FfkvError
from ffkv.parse import parse_sign  # noqa: F401  (kept importable from here)
from ffkv.model import identity

ModelOpt = typer.Option(None, "--model", "-m", help="HF id, local folder, .gguf file, or gemma3 (Gemma 3 270M from PyPI). "
                        "Default: the embedded SmolLM2-135M-Instruct GGUF.")
DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:N.")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (bfloat16 on a CUDA device that supports it, else float32), float32, float16, bfloat16.")
LensOpt = typer.Option("norm", "--lens", help=LENS_HELP)
RunArg = typer.Argument(..., metavar="RUN", help="A run directory made by `ffkv mine --out RUN`.")
SignOpt = typer.Option("+", "--sign", help="Which triggers: + (top positive, the paper) or - (most negative).")
SeedOpt = typer.Option(0, "--seed", min=0, max=2**32 - 1,
                       help="Seed of the key sample (and of the random mutation).")
JsonOpt = typer.Option(False, "--json", help="Print JSON for scripts.")


def model(model: str | None, device: str = "auto", dtype: str = "auto", lens: str = "norm"):
    """Open a model for commands that work on a model rather than a run."""
    from ffkv.model.load import check_gguf, quiet_hf

    check_gguf(model)  # before torch and transformers load
    from ffkv.model.memories import open_model

    quiet_hf()
    return open_model(model, device=device, dtype=dtype, lens=lens)


def open_run(path, create: bool = False, overwrite: bool = False):
    """A run; `create` makes it in a new or empty folder (`ffkv.store.run.claim` is the rule)."""
    from ffkv.store.run import Run

    return Run(path, create=create, overwrite=overwrite)


def json_text(obj, **kw) -> str:
    """JSON for a terminal or a script: corpus text keeps every character, but controls and bidi
    overrides are JSON escapes (\\u001b, \\u202e), never raw (the same set `printable` escapes)."""
    import json

    from ffkv.display import _UNSAFE

    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}",
                       json.dumps(obj, indent=2, ensure_ascii=False, **kw))


def open_run_with_model(run_dir, model_name: str | None, device: str = "auto", dtype: str = "auto"):
    """A run for the steps that can start one (compose, normalize): created when new, its model
    recorded when it has none. Returns (run, the model loaded for that, or None)."""
    from ffkv.store.run import MANIFEST

    if run_dir.exists() and not run_dir.is_dir():
        raise FfkvError(f"{run_dir} is a file, not a run directory")
    fresh = not (run_dir / MANIFEST).exists()
    run = open_run(run_dir, create=fresh)
    mm = None
    if fresh or not run.manifest.get("model"):
        mm = model(model_name, device=device, dtype=dtype)
        identity.record_model(run, mm)
        run.save()
    return run, mm


def print_table(title: str, rows: list[dict], cols: list[str], fmt: dict | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ffkv.display import printable

    fmt = fmt or {}
    t = Table(title=escape(printable(title)))
    for c in cols:
        t.add_column(escape(c))
    for r in rows:
        t.add_row(*[escape(printable(fmt[c](r[c]) if c in fmt and r[c] is not None else str(r[c]), newlines=False))
                    for c in cols])
    Console().print(t)
