"""`ffkv NAME`, generated from a step's settings dataclass: one option per field (its flag, help
and default from the field), plus --force, --json, --model, --device and --dtype. Nothing is
written twice, so a command cannot drift from its step.

A step whose command does not take its run as `ffkv NAME RUN` (mine: `--out`, created there)
declares the command's own options as a second dataclass (`Step.options`, fields from `setting`;
one named like a common option, e.g. `force`, gives that option its help) and how the command
opens its run and model (`Step.open`)."""
from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import List, Optional

import typer

from ffkv.steps.settings import _default, cli_default, flag, spec

SHARED = ("device", "dtype")  # settings fields that every command already has as options
COMMON = ("force", "as_json", "model_name", "device", "dtype")  # every command's own options


def _annotation(tp):
    """typer's view of a field type: `X | None` becomes Optional[X], `tuple[X, ...]` a repeatable List[X]."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return Optional[_annotation(args[0])]
    if origin is tuple:
        return List[typing.get_args(tp)[0]]
    return tp


def _help(s) -> str | None:
    """The field's help, with the range its check allows (`at_least`, `between`)."""
    rng = getattr(s.check, "range", None)
    return ((s.help or "") + (f" (range {rng})" if rng else "")).strip() or None


def _options(cls, skip=()) -> list[inspect.Parameter]:
    """One option per field of the dataclass `cls`, except those named in `skip`."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        s = spec(f)
        default = cli_default(f)
        if s.parse is not None:  # typed as text on the command line, parsed by the field's own parser
            ann, default = Optional[str], s.shown or (None if default in (None, ...) else str(default))
        else:
            ann = _annotation(hints[f.name])
        decls = [flag(f)] + ([s.short] if s.short else [])
        if ann is bool and "/" not in flag(f):
            decls = [f"{flag(f)}/--no-{flag(f)[2:]}"] + ([s.short] if s.short else [])
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=ann,
                                     default=typer.Option(default, *decls, help=_help(s))))
    return out


def _common(step) -> list[inspect.Parameter]:
    """--force, --json, --model, --device, --dtype; a field of `step.options` with one of these
    names gives that option its help (mine's --force resumes, and says so)."""
    from ffkv.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelOpt

    own = {f.name: spec(f).help for f in dataclasses.fields(step.options)} if step.options else {}

    def opt(name, std, default, *decls):
        return typer.Option(default, *decls, help=own[name]) if own.get(name) else std

    K = inspect.Parameter.KEYWORD_ONLY
    force = typer.Option(False, "--force", help="Redo the step even if it is done with the same settings.")
    return [inspect.Parameter("force", K, annotation=bool, default=opt("force", force, False, "--force")),
            inspect.Parameter("as_json", K, annotation=bool, default=opt("as_json", JsonOpt, False, "--json")),
            inspect.Parameter("model_name", K, annotation=Optional[str],
                              default=opt("model_name", ModelOpt, None, "--model", "-m")),
            inspect.Parameter("device", K, annotation=str, default=opt("device", DeviceOpt, "auto", "--device")),
            inspect.Parameter("dtype", K, annotation=str, default=opt("dtype", DtypeOpt, "auto", "--dtype"))]


def build(cls, values: dict):
    """An instance of the dataclass `cls` from CLI values (each `parse`d field parsed), every
    field's check run: before any model loads."""
    from ffkv.steps.settings import check

    kw = {}
    for f in dataclasses.fields(cls):
        v = values.get(f.name, cli_default(f))
        p = spec(f).parse
        if p is not None and isinstance(v, str):
            v = p(v)
        elif isinstance(v, list):  # a repeatable option
            v = tuple(v) if v else _default(f)
        kw[f.name] = v
    s = cls(**kw)
    check(s)
    return s


def build_settings(step, values: dict):
    """The step's settings from CLI values, checked before any model loads."""
    return build(step.settings, values)


def run_generated(step, run_dir: Path | None, values: dict, *, force=False, as_json=False, model_name=None,
                  device="auto", dtype="auto") -> None:
    from ffkv.cli.options import open_run, open_run_with_model
    from ffkv.steps.lifecycle import execute

    s = build_settings(step, values)
    mm = None
    if step.open is not None:  # the command's own options say where the run is (mine: --out)
        opts = build(step.options, {**values, "force": force, "as_json": as_json, "model_name": model_name,
                                    "device": device, "dtype": dtype})
        run, mm = step.open(opts, s, model_name, device, dtype)
    elif step.requires:
        run = open_run(run_dir)
    else:
        run, mm = open_run_with_model(run_dir, model_name, device, dtype)
    out = execute(run, step.name, s, mm=mm, model_name=model_name, device=device, dtype=dtype, force=force,
                  warn=lambda msg: print(f"ffkv: note: {msg}", file=sys.stderr))
    if step.summary is not None:
        step.summary(run, out, s, as_json)
    elif as_json:
        print(json.dumps({"status": out.status, "info": out.info}, indent=2, default=str))
    else:
        verb = "already done with these settings (--force to redo)" if out.skipped else "done"
        print(f"{step.name}: {verb}; " + ", ".join(f"{k} {v}" for k, v in out.info.items()
                                                  if k not in ("status", "started", "finished")),
              file=sys.stderr if out.skipped else sys.stdout)


def command(step):
    """A typer command function for `step`, its signature made from the settings' fields (and
    the command's own options, `Step.options`)."""
    params = []
    if step.open is None:
        where = ("A run directory with a finished " + ", ".join(f"`{r}`" for r in step.requires) + " step."
                 if step.requires else "Run directory (created if it has no manifest).")
        params.append(inspect.Parameter("run_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Path,
                                        default=typer.Argument(..., metavar="RUN", help=where)))
    if step.options is not None:
        params += _options(step.options, skip=COMMON)
    params += _options(step.settings, skip=SHARED) + _common(step)
    names = {f.name for f in dataclasses.fields(step.settings)}
    if step.options is not None:
        names |= {f.name for f in dataclasses.fields(step.options)}

    def cmd(run_dir: Path | None = None, **kw):
        common = {k: kw.pop(k) for k in COMMON}
        values = {k: v for k, v in kw.items() if k in names}
        values.update({k: common[k] for k in SHARED if k in names})
        run_generated(step, run_dir, values, **common)

    cmd.__signature__ = inspect.Signature(params)
    cmd.__name__ = step.name
    cmd.__doc__ = step.help or f"The `{step.name}` step."
    return cmd


def register_all(app: typer.Typer, taken: set[str]) -> None:
    """Add a generated command for every registered step that asks for one (`Step.cli`), built-in
    or not, in the registry's order. A step that fails to load does not keep the others out: its
    error is raised once the rest are added."""
    from ffkv.errors import FfkvError
    from ffkv.steps.registry import get, known

    failed = None
    for name in known():
        try:
            step = get(name)
        except FfkvError as e:
            failed = failed or e
            continue
        cmd = step.name.replace("_", "-")
        if step.group is not None and cmd not in taken:
            app.add_typer(step.group(), name=cmd, help=step.help or None)
            taken.add(cmd)
        elif step.cli and cmd not in taken:
            app.command(name=cmd, help=step.help or None)(command(step))
            taken.add(cmd)
    if failed is not None:
        raise failed