"""The step lifecycle: each step is declared once, and `execute` runs any of them.

A step (mine, values, compose, mutate, patterns, …) is a `Step`: a name, a settings dataclass,
the steps it requires, the tables it writes and a `compute` function. Skipping a finished step,
refusing other settings, starting and finishing live here, beside `Run`, and nowhere else, so
the CLI, `reproduce` and library callers behave alike.

Adding a step: write one module that defines `STEP = Step(...)`, and add one line to
`REGISTRY` below (name -> module). Give it a CLI command in `ffkv/cli/` if users call it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ffkv.errors import FfkvError
from ffkv.store.run import sweep_temps

# name -> module defining `STEP`; imported lazily so `ffkv --help` stays fast.
REGISTRY: dict[str, str] = {
    "mine": "ffkv.mine.runner",
    "values": "ffkv.experiments.values",
    "compose": "ffkv.experiments.compose",
    "mutate": "ffkv.experiments.mutate",
    "patterns": "ffkv.experiments.patterns",
    "normalize": "ffkv.experiments.normalize",
}

# The user-facing command that makes each step, for "run `...` first" messages.
COMMANDS: dict[str, str] = {
    "mine": "ffkv mine --out {run}",
    "values": "ffkv values {run}",
    "compose": "ffkv compose {run}",
    "mutate": "ffkv mutate {run}",
    "patterns": "ffkv patterns {run}",
    "normalize": "ffkv normalize {run}",
}


@dataclass(frozen=True)
class Step:
    """One step of a run.

    `record(run, settings) -> dict` gives the settings as stored in the manifest (and validates
    them, raising FfkvError); equal records mean equal results. `compute(ctx) -> dict` does the
    work, writes `tables` through `ctx.run` and returns what the manifest keeps for the step.
    """
    name: str
    settings: type
    requires: tuple[str, ...]
    tables: tuple[str, ...]
    compute: Callable[["Context"], dict]
    record: Callable[[Any, Any], dict] = None  # default: dataclasses.asdict(settings)
    refuse_other_settings: bool = False  # mine: a run keeps one corpus and one top-k
    done_info: Callable[[Any, dict], bool] | None = None  # extra check that the stored info is whole

    def recorded(self, run, settings) -> dict:
        if self.record is not None:
            return self.record(run, settings)
        from dataclasses import asdict

        return asdict(settings)


@dataclass
class Context:
    """What `Step.compute` gets: the run, its settings, and a model loaded only when needed."""
    run: Any
    settings: Any
    record: dict
    device: str = "auto"
    dtype: str = "auto"
    model_name: str | None = None
    log: Callable[[str], None] = print
    show_progress: bool | None = None
    extra: dict = field(default_factory=dict)
    _mm: Any = None

    def model(self):
        if self._mm is None:
            from ffkv.model.load import quiet_hf

            quiet_hf()
            self._mm = self.run.open_model(model=self.model_name, device=self.device, dtype=self.dtype)
        return self._mm


@dataclass
class Outcome:
    name: str
    status: str  # "done" (computed now) or "skipped" (done earlier with these settings)
    info: dict
    result: Any = None  # whatever compute left in ctx.extra["result"], for callers that want it

    @property
    def skipped(self) -> bool:
        return self.status == "skipped"


def get(name: str) -> Step:
    if name not in REGISTRY:
        raise FfkvError(f"unknown step {name!r}; steps: {', '.join(REGISTRY)}")
    return importlib.import_module(REGISTRY[name]).STEP


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def command(name: str, run) -> str:
    return COMMANDS.get(name, f"ffkv {name} {{run}}").format(run=getattr(run, "path", run))


def require(run, name: str) -> None:
    if not run.step_done(name):
        raise FfkvError(f"run {run.path} has no finished `{name}` step; run `{command(name, run)}` first")


def is_done(run, step: Step, record: dict) -> bool:
    """Done with these settings, every table present, and newer than the steps it reads."""
    st = run.step(step.name)
    if not (run.step_done(step.name) and run.settings(step.name) == record):
        return False
    if not all(run.has_table(t) for t in step.tables):
        return False
    if any(st.get("finished", 0) < run.step(r).get("finished", 0) for r in step.requires):
        return False
    return step.done_info is None or step.done_info(run, st)


def refuse_other(run, step: Step, record: dict) -> None:
    prev = run.settings(step.name)
    if step.refuse_other_settings and prev is not None and prev != record:
        diff = {k: (prev.get(k), v) for k, v in record.items() if prev.get(k) != v}
        raise FfkvError(f"{run.path} was {step.name}d with other settings {diff} (run, new); "
                        f"use a new --out, or repeat the run's own settings to resume"
                        if step.name == "mine" else
                        f"{run.path} has `{step.name}` with other settings {diff} (run, new)")


def execute(run, name: str, settings, *, mm=None, model_name: str | None = None, device: str = "auto",
            dtype: str = "auto", force: bool = False, log: Callable[[str], None] = print,
            show_progress: bool | None = None, **extra) -> Outcome:
    """Run step `name` on `run`: skip it when done with these settings, else compute and record.

    `mm` is an already loaded model; without it the run's own model is opened only if the step
    has work to do. Extra keyword arguments reach `compute` as `ctx.extra`.
    """
    step = get(name)
    for r in step.requires:
        require(run, r)
    record = step.recorded(run, settings)
    refuse_other(run, step, record)
    if not force and is_done(run, step, record):
        return Outcome(name, "skipped", dict(run.step(name)))
    ctx = Context(run=run, settings=settings, record=record, device=device, dtype=dtype,
                  model_name=model_name, log=log, show_progress=show_progress, extra=extra, _mm=mm)
    if mm is not None:
        run.check_model(mm)
    with run.lock(f"step-{name}", wait=False):  # two runs of one step on one run would clash
        run.reload()  # what another process recorded while we waited
        sweep_temps(run.path)  # a killed run's half-written files
        refuse_other(run, step, record)
        if not force and is_done(run, step, record):
            return Outcome(name, "skipped", dict(run.step(name)))
        run.start_step(name, record)
        try:
            info = step.compute(ctx) or {}
        except FfkvError as e:
            run.fail_step(name, str(e))
            raise
        run.finish_step(name, **info)
    return Outcome(name, "done", dict(run.step(name)), ctx.extra.get("result"))
