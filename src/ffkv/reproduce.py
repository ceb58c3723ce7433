"""`ffkv reproduce`: every registered step in order, each resumable, then the report.

Each step runs through the step lifecycle (`ffkv.steps.lifecycle.execute`) with the settings its
own command would give it, so a step behaves exactly as when a user types it: it skips itself
when the manifest says it is done with the same settings, and mining resumes from its
checkpoint after a kill. The model is loaded once for all steps. reproduce's options are the
steps' settings fields marked for it (`setting(..., reproduce=...)`, `options()`); each step
makes its settings from them (`Step.reproduce`).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from ffkv.errors import FfkvError
from ffkv.store.run import Run
from ffkv.model import identity

COMMON = {"model": None, "preset": "default", "seed": 0, "device": "auto", "dtype": "auto"}  # reproduce's own


@dataclass(frozen=True)
class Option:
    """One `ffkv reproduce` option, from the settings fields that name it (`setting(..., reproduce=)`)."""
    dest: str  # its name in `ReproduceSettings` ("--top-k": top_k)
    decls: tuple[str, ...]  # typer's declarations: the flag ("--on/--off" for a switch) and its short form
    annotation: Any  # typer's type
    default: Any  # reproduce's default, before any preset
    help: str | None
    presets: dict  # preset name -> value
    min: Any = None
    max: Any = None
    parse: Callable | None = None  # typed as text, parsed by the field's parser
    checks: tuple = ()  # (flag, check) of every field it gives: run before anything opens


def options() -> list[Option]:
    """Every registered step's reproduce options, in the registry's order; a flag that several
    fields name is one option (as the first declares it). A step that fails to load adds none
    (its own command says why)."""
    import typing

    from ffkv.steps.cli import _annotation
    from ffkv.steps.registry import get, known
    from ffkv.steps.settings import _FIELDS, cli_default, flag, flag_name, spec

    out: dict[str, Option] = {}
    for name in known():
        try:
            step = get(name)
        except FfkvError:
            continue
        if not dataclasses.is_dataclass(step.settings):
            continue
        hints = typing.get_type_hints(step.settings)
        for f in dataclasses.fields(step.settings):
            s = spec(f)
            r = s.reproduce
            if r is None:
                continue
            fl = r.name or flag_name(f)
            dest = fl.lstrip("-").replace("-", "_")
            if dest in COMMON:
                continue
            if dest in out:
                o = out[dest]
                out[dest] = dataclasses.replace(o, checks=o.checks + ((fl, s.check),))
                continue
            default = cli_default(f) if r.default is _FIELDS else r.default
            switch = hints[f.name] is bool
            if switch:
                pair = flag(f) if r.name is None and "/" in flag(f) else f"{fl}/--no-{fl[2:]}"
                ann = typing.Optional[bool] if default is None else bool
            else:
                pair = fl
                ann = typing.Optional[str] if s.parse is not None else typing.Optional[_annotation(hints[f.name])]
            out[dest] = Option(dest, (pair, *([r.short] if r.short else [])), ann, default, r.help or s.help or None,
                               dict(r.presets), r.min, r.max, s.parse, ((fl, s.check),))
    return list(out.values())


def presets(opts: list[Option] | None = None) -> tuple[str, ...]:
    """The presets' names: "default" (every option's default), then those the options name."""
    opts = options() if opts is None else opts
    return tuple(dict.fromkeys(["default", *(n for o in opts for n in o.presets)]))


class ReproduceSettings(SimpleNamespace):
    """What `reproduce` runs with, by name: `model`, `preset`, `seed`, `device`, `dtype` and every
    registered step's reproduce options (`options()`), each at its preset's value unless given.
    The defaults are sized so that `make demo` on a fresh clone (install included) stays under 10
    minutes on a 2-core CPU with the embedded SmolLM2. A step's `Step.reproduce(r, model)` reads it."""

    def __init__(self, **given):
        opts = options()
        name = given.get("preset", "default")
        if name not in presets(opts):
            raise FfkvError(f"unknown preset {name!r}; presets: {', '.join(presets(opts))}")
        values = {**COMMON, **{o.dest: o.presets.get(name, o.default) for o in opts}, "preset": name}
        unknown = [k for k in given if k not in values]
        if unknown:
            raise FfkvError(f"reproduce has no setting {unknown[0]!r}; settings: {', '.join(values)}")
        super().__init__(**{**values, **given})


def preset(name: str, **overrides) -> ReproduceSettings:
    """The settings of preset `name`, with `overrides` (flags the user typed) on top."""
    return ReproduceSettings(preset=name, **overrides)


def check(s: ReproduceSettings) -> None:
    """Every given value through the checks of the fields it reaches, before anything opens."""
    for o in options():
        v = getattr(s, o.dest)
        for fl, chk in o.checks:
            err = chk(v) if chk is not None and v is not None else None
            if err:
                raise FfkvError(f"{fl} {err}")


def step_settings(step: str, s: ReproduceSettings, gated: bool, n_layers: int | None = None):
    """The settings step `step` gets: what its own `Step.reproduce` makes of reproduce's values
    for a model with these properties (None: it sits this run out)."""
    from ffkv.steps.registry import get

    return get(step).reproduce(s, SimpleNamespace(gated=gated, n_layers=n_layers))


def plan_steps(s: ReproduceSettings, mm) -> list[tuple[str, object]]:
    """(step, settings) for every registered step that `reproduce` runs, in dependency order: each
    step whose `Step.reproduce` gives settings for this run (None: it sits this one out)."""
    from ffkv.steps.registry import ordered

    plan = []
    for step in ordered():
        settings = step.reproduce(s, mm) if step.reproduce is not None else None
        if settings is not None:
            plan.append((step.name, settings))
    return plan


def preflight(s: ReproduceSettings) -> None:
    """Each registered step's own check before anything runs (`Step.preflight`: patterns' encoder)."""
    from ffkv.steps.registry import ordered

    for step in ordered():
        if step.preflight is not None and step.reproduce is not None:
            step.preflight(s)


def _open(run: Path, s: ReproduceSettings):
    """The run (created when new) and the model, loaded once for every step."""
    from ffkv.cli.options import model
    from ffkv.store.run import Run

    if run.exists() and not run.is_dir():
        raise FfkvError(f"{run} is a file, not a run directory")
    if not run.exists():  # the model first: one that does not load leaves no empty run behind
        mm = model(s.model, s.device, s.dtype)
        return Run(run, create=True), mm
    r = Run(run, create=True)
    if r.manifest.get("model") and not s.model:
        from ffkv.model.load import quiet_hf

        quiet_hf()
        return r, identity.open_model(r, device=s.device, dtype=s.dtype)
    return r, model(s.model, s.device, s.dtype)


def reproduce(run: Path, s: ReproduceSettings, log=print, show=None) -> dict:
    """Run every step through the step lifecycle (each skips itself when done), then the report.

    `show(step, run, outcome)` prints a step's outcome as its own command would.
    """
    from ffkv.steps.lifecycle import execute

    run = Path(run)
    check(s)
    preflight(s)  # before any step runs: a missing encoder would otherwise stop it at step 5
    r, mm = _open(run, s)
    times = {}
    plan = plan_steps(s, mm)
    for i, (step, settings) in enumerate(plan, 1):
        done = r.step_done(step)
        log(f"\n[{i}/{len(plan)}] {step}" + (" (done earlier; checking settings)" if done else ""))
        t0 = time.time()
        out = execute(r, step, settings, mm=mm, device=s.device, dtype=s.dtype, log=log,
                      warn=lambda msg: log(f"ffkv: note: {msg}"))
        if show is not None:
            show(step, r, out)
        times[step] = round(time.time() - t0, 1)
    from ffkv.report import build_report

    log("\n[report] building the HTML report")
    t0 = time.time()
    path = build_report(run)
    times["report"] = round(time.time() - t0, 1)
    r = Run(run)
    r.manifest.setdefault("reproduce", {})["wall_seconds"] = times
    r.save()
    return {"report": str(path), "times": times, "run": str(run)}


def summary_lines(run: Path, times: dict) -> list[str]:
    """At most ten lines: the run, its timings, the verdict counts, then the figures grouped by
    verdict (one line per verdict), so that every figure is named however many there are."""
    r = Run(run)
    c = (r.manifest.get("corpus") or {}).get("counts", {})
    m = r.manifest.get("model") or {}
    lines = [f"{m.get('model_id', '?')}: {m.get('layers')} layers x {m.get('d_m')} memories; "
             f"{c.get('sentences', '?')} sentences mined ({c.get('tokens', '?')} tokens)",
             "wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items())
             + f" (total {sum(times.values()) / 60:.1f} min)"]
    vpath = r.path / "report" / "verdicts.json"
    if vpath.exists():
        import json

        groups: dict[str, list[str]] = {}
        for v in json.loads(vpath.read_text()):
            groups.setdefault(v["verdict"], []).append(v["id"])
        lines.append("verdicts vs the paper: " + ", ".join(f"{len(ids)} {k}" for k, ids in groups.items())
                     + f" (details: ffkv verdicts {r.path})")
        lines += [f"  {k:<14} {' '.join(ids)}" for k, ids in groups.items()]
    return lines[:10]
