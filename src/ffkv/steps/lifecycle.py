"""The step lifecycle: each step is declared once, and `execute` runs any of them.

A step (mine, values, compose, mutate, patterns, …) is a `Step`: a name, a settings dataclass,
the steps it requires, the tables it writes and a `compute` function. Skipping a finished step,
refusing other settings, starting and finishing live here, beside `Run`, and nowhere else, so
the CLI, `reproduce` and library callers behave alike.

Adding a step: see `ffkv.steps` (one package, registered once by an entry point or
`ffkv.steps.register`).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ffkv.atomic import sweep_temps
from ffkv.errors import FfkvError
from ffkv.model import identity

HEARTBEAT_S = 10.0  # how often a working step says it is alive: a killed try's time is lost by at most this

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
    # What the rest of ffkv reads from a step, so that nothing else names it (all optional):
    help: str = ""  # one paragraph: the generated command's --help, `reproduce`'s listing
    command: str | None = None  # "ffkv NAME {run}" by default; the "run `...` first" hint
    cli: bool = False  # generate `ffkv NAME` from `settings` (ffkv.steps.cli)
    # () -> typer.Typer: the step's own command group `ffkv NAME SUBCOMMAND` (facts: trace, locate,
    # edit, evaluate) instead of one generated command; `ffkv.steps.cli.command(step)` makes a
    # generated subcommand of it. Called when the CLI is built: name it by "module:attr" (`lazy`)
    group: Callable[[], Any] | None = None
    summary: Callable[[Any, "Outcome", Any, bool], None] | None = None  # (run, outcome, settings, as_json): what the command prints
    reproduce: Callable[[Any, Any], Any] | None = None  # (ReproduceSettings, model) -> settings, or None: skip
    preflight: Callable[[Any], None] | None = None  # (ReproduceSettings): raise FfkvError before reproduce opens anything
    sections: Callable[[Any, Any], list] | None = None  # (run, fig_dir) -> [ffkv.steps.ReportSection]
    panels: Callable[[Any, int, int], list] | None = None  # (run, layer, dim) -> [ffkv.steps.Panel]
    # (run, layer, dim) -> [ffkv.steps.Panel]: panels that need a model forward (seconds). The memory
    # page never waits for them: it shows a placeholder (a link to /memory/L/D/later-panels, which the
    # page's script fetches once the colours are done) and the JSON twin adds them after `panels`
    later_panels: Callable[[Any, int, int], list] | None = None
    # (run, layer, dim) -> what `later_panels` will compute, a few words ("the sign-regime panels"),
    # cheap (no forward): "" when they would be empty for that memory (no placeholder). None: the
    # placeholder offers "the NAME step's panels"
    later_label: Callable[[Any, int, int], str] | None = None
    # (the step's recorded settings, {} when it has not run) -> rows of the report's "how this run
    # differs from the paper's" table: [property, paper, this run, where it matters] (sample sizes)
    differences: Callable[[dict], list] | None = None
    # "package:file.html": a Jinja partial in the step's own package drawing each of its panels (`p`:
    # step, title, columns, rows, note; `m`: the memory page's data); None: the default table
    panel_template: str | None = None
    # run -> {column title: {layer: plain value}}: the step's columns in the browser's overview
    # (its page, /api/overview's rows under the step's name, and the layer table's CSV/JSON)
    overview: Callable[[Any], dict] | None = None
    # True: `sections` are drawn before the step has run (each naming the command that makes what is
    # missing: the paper's steps), and a user's error in them (a damaged table) stops the report in one
    # line; False: drawn once the step is done, and any error in them shown as that section's.
    report_before_done: bool = False
    # A command that does not take its run as `ffkv NAME RUN` (mine: `--out`, created there):
    options: type | None = None  # a dataclass of the command's own options (fields from `setting`)
    open: Callable[..., tuple] | None = None  # (options, settings, model_name, device, dtype) -> (run, model)
    rebuild: Callable[[Any], list[str]] | None = None  # run -> `ffkv NAME`'s arguments redoing it as it was

    def recorded(self, run, settings) -> dict:
        """The manifest's record of `settings`, after every field's own check (`ffkv.steps.setting`)."""
        from ffkv.steps.settings import check, record

        check(settings)
        if self.record is not None:
            return self.record(run, settings)
        return record(settings)


@dataclass
class Context:
    """What `Step.compute` gets: the run, its settings, and a model loaded only when needed.

    Everything a step's result depends on is in `settings`; the other fields say how to run it
    (device, output) and what the caller handed over, so no step reads an untyped side channel."""
    run: Any
    settings: Any
    record: dict
    device: str = "auto"
    dtype: str = "auto"
    model_name: str | None = None
    log: Callable[[str], None] = print
    show_progress: bool | None = None
    _mm: Any = None
    force: bool = False  # redo from scratch (mine: no resume from its checkpoint or its sentences)
    warn: Callable[[str], None] | None = None  # notes for the user (the CLI: stderr); None: `log`
    embedder: Any = None  # a sentence encoder handed over (patterns; tests, notebooks): else loaded
    result: Any = None  # a rich result `compute` leaves for the caller (`Outcome.result`)

    def __post_init__(self):
        if self.warn is None:
            self.warn = self.log

    def model(self):
        if self._mm is None:
            from ffkv.model.load import quiet_hf

            quiet_hf()
            self._mm = identity.open_model(self.run, model=self.model_name, device=self.device, dtype=self.dtype)
        return self._mm


@dataclass
class Outcome:
    name: str
    status: str  # "done" (computed now) or "skipped" (done earlier with these settings)
    info: dict
    result: Any = None  # whatever compute left in `ctx.result`, for callers that want it

    @property
    def skipped(self) -> bool:
        return self.status == "skipped"


def get(name: str) -> Step:
    from ffkv.steps.registry import get as _get

    return _get(name)


def names() -> tuple[str, ...]:
    from ffkv.steps.registry import known

    return known()


def command(name: str, run) -> str:
    from ffkv.steps.registry import command as _command

    return _command(name, run)


def require(run, name: str, step: Step | None = None) -> None:
    """Step `name` is done and every table it wrote is whole (`check_tables`)."""
    if not run.step_done(name):
        raise FfkvError(f"run {run.path} has no finished `{name}` step; run `{command(name, run)}` first")
    check_tables(run, name, step)


def step_tables(run, name: str, step: Step | None = None) -> list[str]:
    """The tables step `name` wrote in its last pass: those it always writes (when `step` is
    given) and those the manifest records as written by it since it started."""
    started = run.step(name).get("started") or 0
    recs = run.manifest.get("tables") or {}
    extra = [t for t, r in recs.items() if isinstance(r, dict) and r.get("step") == name
             and ((r.get("written") or 0) >= started or run.table_path(t).exists())]
    return list(dict.fromkeys([*(step.tables if step is not None else ()), *extra]))


def table_problems(run, name: str, step: Step | None = None, known: bool = False) -> list[tuple[str, str]]:
    """(table, what is wrong) for each table of step `name` that is missing, cut short or foreign.
    `known`: only the tables the manifest records or the folder holds (a table an older ffkv never
    wrote is missing to the step, which redoes itself, but no damage to a reader)."""
    recs = run.manifest.get("tables") or {}
    return [(t, pr) for t in step_tables(run, name, step) if not known or t in recs or run.table_path(t).exists()
            if (pr := run.table_problem(t)) is not None]


def check_tables(run, name: str, step: Step | None = None, known: bool = False) -> None:
    """One line naming the first damaged table of step `name` and the command that rebuilds it."""
    bad = table_problems(run, name, step, known)
    if bad:
        t, pr = bad[0]
        others = ", ".join(f"`{u}`" for u, _ in bad[1:])
        more = f" (so are {others})" if len(bad) > 1 and all(p == pr for _, p in bad) else (
            f" (and {others} too)" if len(bad) > 1 else "")
        raise FfkvError(f"the `{t}` table of {run.path} {pr}{more}; rebuild it with "
                        f"`{rebuild_command(run, name)}`")


def check_run(run) -> None:
    """Every finished step's tables that the run records or holds, whole (`check_tables`): what a
    reader of the whole run (`ffkv serve`) checks before it starts, so a damaged table is one line
    naming its rebuild. An older run's table that was never written is left to the reader."""
    for name, st in (run.manifest.get("steps") or {}).items():
        if isinstance(st, dict) and st.get("status") == "done":
            check_tables(run, name, get(name) if name in names() else None, known=True)


def rebuild_command(run, name: str) -> str:
    """The command that redoes step `name` from scratch with the run's own settings: the step's
    `rebuild` arguments (mine: its --out, model, corpus and every flag that differs from the
    default), else `ffkv NAME RUN` and the flags of its recorded settings that differ from the
    command's defaults (`ffkv.steps.settings.flags`); then `--force`."""
    import dataclasses
    import shlex

    step = get(name) if name in names() else None
    if step is not None and step.rebuild is not None:
        args = [f"ffkv {name.replace('_', '-')}", *map(shlex.quote, step.rebuild(run))]
    else:
        args = [command(name, run)]
        if step is not None and step.cli and dataclasses.is_dataclass(step.settings):
            from ffkv.steps.settings import flags

            args += map(shlex.quote, flags(step.settings, run.settings(name) or {}))
    return " ".join([*args, "--force"])


def verify_outputs(run, name: str, step: Step) -> None:
    """Before a step says done: every table it wrote is what it recorded (`Run.verify_table`: the
    footer reads, its digest, bytes and rows as written), else FfkvError, one line, and the step is
    not done. A disk that lost a write, or a step that never wrote a table it declares, stops here
    and not at the next reader."""
    for t in step_tables(run, name, step):
        pr = run.verify_table(t)
        if pr is not None:
            raise FfkvError(f"`{name}` did not finish: the `{t}` table of {run.path} {pr}; "
                            f"rerun `{rebuild_command(run, name)}`")


def corpus_notes(run, name: str, step: Step) -> list[str]:
    """The notes for corpus sentences the step's tables hold cut to the model's context (the
    manifest's `corpora.<table>.counts.truncated`; `ffkv.model.context.fit_sentences`)."""
    from ffkv.model.context import sentences_note

    corpora = run.manifest.get("corpora") or {}
    context = (run.manifest.get("model") or {}).get("context")
    notes = []
    for t in step_tables(run, name, step):
        c = (corpora.get(t) or {}).get("counts") or {}
        n = (c.get("sentences") or 0) + (c.get("dropped_short") or 0)
        if note := sentences_note(t, c.get("truncated") or 0, n or None, context):
            notes.append(note)
    return notes


def is_done(run, step: Step, record: dict) -> bool:
    """Done with these settings, every table it wrote whole (present, and the size and footer
    recorded when written; an older run's tables: a readable footer), and newer than the steps
    it reads."""
    st = run.step(step.name)
    if not (run.step_done(step.name) and run.settings(step.name) == record):
        return False
    if table_problems(run, step.name, step):
        return False
    if any(st.get("finished", 0) < run.step(r).get("finished", 0) for r in step.requires):
        return False
    return step.done_info is None or step.done_info(run, st)


def refuse_other(run, step: Step, record: dict) -> None:
    prev = run.settings(step.name)
    if step.refuse_other_settings and prev is not None and prev != record:
        diff = {k: (prev.get(k), v) for k, v in record.items() if prev.get(k) != v}
        raise FfkvError(f"{run.path} has `{step.name}` with other settings {diff} (run, new); a run keeps "
                        f"its `{step.name}` settings: make a new run, or repeat them to resume")


@contextlib.contextmanager
def heartbeat(run, name: str, every: float | None = None):
    """`run.beat(name)` every `every` (HEARTBEAT_S) seconds while the block runs, from a daemon
    thread: if the process is killed, the last beat is when its work stopped (`Run.start_step`
    counts a resumed step's time by it, not by the hours it lay dead)."""
    stop = threading.Event()
    period = HEARTBEAT_S if every is None else every

    def beat():
        while not stop.wait(period):
            run.beat(name)

    t = threading.Thread(target=beat, name=f"ffkv-heartbeat-{name}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def execute(run, name: str, settings, *, mm=None, model_name: str | None = None, device: str = "auto",
            dtype: str = "auto", force: bool = False, log: Callable[[str], None] = print,
            show_progress: bool | None = None, warn: Callable[[str], None] | None = None,
            embedder=None) -> Outcome:
    """Run step `name` on `run`: skip it when done with these settings, else compute and record.

    `mm` is an already loaded model; without it the run's own model is opened only if the step
    has work to do. `warn` and `embedder` reach `compute` as `ctx.warn` and `ctx.embedder`.
    """
    step = get(name)
    for r in step.requires:
        require(run, r, get(r))  # done, and its tables whole: one line naming what rebuilds them
    if mm is not None:
        identity.check_model(run, mm)  # a run is one model's: before any skip or resume
    record = step.recorded(run, settings)
    refuse_other(run, step, record)
    if not force and is_done(run, step, record):
        return Outcome(name, "skipped", dict(run.step(name)))
    if dtype == "auto":  # a model opened for the step is in the dtype its settings name, if they name one
        dtype = getattr(settings, "dtype", None) or "auto"
    ctx = Context(run=run, settings=settings, record=record, device=device, dtype=dtype,
                  model_name=model_name, log=log, show_progress=show_progress, _mm=mm, force=force,
                  warn=warn, embedder=embedder)
    with run.lock(f"step-{name}", wait=False):  # two runs of one step on one run would clash
        run.reload()  # what another process recorded while we waited
        sweep_temps(run.path)  # a killed run's half-written files
        refuse_other(run, step, record)
        if not force and is_done(run, step, record):
            return Outcome(name, "skipped", dict(run.step(name)))
        run.start_step(name, record)
        try:
            with heartbeat(run, name):
                info = step.compute(ctx) or {}
            verify_outputs(run, name, step)
        except FfkvError as e:
            run.fail_step(name, str(e))
            raise
        for note in corpus_notes(run, name, step):
            ctx.warn(note)
        run.finish_step(name, **info)
    return Outcome(name, "done", dict(run.step(name)), ctx.result)
