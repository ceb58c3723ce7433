"""`ffkv reproduce`: the whole paper in one command. Its options beyond the run, the model, the
preset, the seed and the device are the registered steps' (`ffkv.reproduce.options`)."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, DtypeOpt

PRESET_HELP = ("default (about 9 minutes on a 2-core CPU) or full (every sentence of the corpus, the paper's 4,000 "
               "prefixes (2 from some sentences) and 100 keys per layer, every layer for normalize; about 90 "
               "minutes on a 2-core CPU); flags below override it.")
OWN = ("run_dir", "model_name", "preset", "seed", "device", "dtype")


def reproduce(run_dir: Path, model_name: Optional[str], preset: str, seed: int, device: str, dtype: str,
              **typed) -> None:
    from ffkv.reproduce import options, preset as make_preset, reproduce as run_reproduce, summary_lines

    parse = {o.dest: o.parse for o in options() if o.parse is not None}
    typed = {k: parse[k](v) if k in parse and isinstance(v, str) else v for k, v in typed.items() if v is not None}
    s = make_preset(preset, model=model_name, seed=seed, device=device, dtype=dtype, **typed)
    res = run_reproduce(run_dir, s, show=show_step)
    print()
    for line in summary_lines(run_dir, res["times"])[:10]:
        print(line)
    print(f"report: {res['report']}")


def command():
    """`reproduce` with one option per registered step's reproduce option (`ffkv.reproduce.options`)."""
    from ffkv.reproduce import options
    from ffkv.steps.registry import get, known

    K = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("run_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Path,
                                default=typer.Argument(Path("runs/default"), metavar="[RUN]",
                                                       help="Run directory (created or resumed).")),
              inspect.Parameter("model_name", K, annotation=Optional[str], default=typer.Option(
                  None, "--model", "-m", help="HF id, folder or .gguf (default: embedded SmolLM2), e.g. gpt2.")),
              inspect.Parameter("preset", K, annotation=str, default=typer.Option("default", "--preset", help=PRESET_HELP))]
    for o in options():
        if o.dest in OWN:
            continue
        default = o.default if o.annotation in (bool, Optional[bool]) else None  # None: not typed, the preset's
        params.append(inspect.Parameter(o.dest, K, annotation=o.annotation, default=typer.Option(
            default, *o.decls, help=o.help, min=o.min, max=o.max)))
    params += [inspect.Parameter("seed", K, annotation=int, default=typer.Option(
                   0, "--seed", min=0, max=2**32 - 1, help="Seed of every sample.")),
               inspect.Parameter("device", K, annotation=str, default=DeviceOpt),
               inspect.Parameter("dtype", K, annotation=str, default=DtypeOpt)]

    def cmd(run_dir: Path = Path("runs/default"), **kw):
        reproduce(run_dir, **kw)

    names = []
    for n in known():
        try:
            if get(n).reproduce is not None:
                names.append(n)
        except Exception:  # noqa: BLE001 - a plugin that fails to load is named by its own command
            continue
    cmd.__signature__ = inspect.Signature(params)
    cmd.__name__ = "reproduce"
    cmd.__doc__ = f"""Run every experiment of the paper ({", ".join(names)}) and build
    the report. The defaults take about 9 minutes on a 2-core CPU; a killed run resumes where it
    stopped. Compare two runs' verdicts with `ffkv verdicts RUN_A RUN_B`.

    Scale up for real studies, e.g. --sentences 1000000 --device cuda, --model gpt2,
    --corpus wikitext-103:train.
    """
    return cmd


def show_step(step: str, run, out) -> None:
    """Print a step's outcome as its own command prints it (`Step.summary`)."""
    from ffkv.steps.registry import get

    st = get(step)
    if st.summary is not None:
        st.summary(run, out, None, False)
    else:
        print(f"{step}: {'already done' if out.skipped else 'done'}")


def register(app: typer.Typer) -> None:
    app.command(name="reproduce")(command())
