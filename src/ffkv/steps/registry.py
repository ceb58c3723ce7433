"""Where steps come from: the built-in ones, any installed package's `ffkv.steps` entry points,
and `register()` for a step defined in the running process.

A third-party step needs no edit of ffkv: its package declares one entry point,

    [project.entry-points."ffkv.steps"]
    my_step = "my_package:STEP"

and the step then appears in `ffkv --help` (a command generated from its settings), in
`ffkv reproduce`, in the report and on the browser's memory page. Modules are imported lazily, on
the first question about the registry, so `ffkv --help` stays fast when no plugin is installed.
"""
from __future__ import annotations

import importlib
from importlib import metadata

from ffkv.errors import FfkvError

GROUP = "ffkv.steps"

# name -> "module:attribute"; the order is the paper's (and a valid dependency order).
BUILTIN: dict[str, str] = {
    "mine": "ffkv.steps.mine:STEP",
    "values": "ffkv.steps.values:STEP",
    "compose": "ffkv.steps.compose:STEP",
    "mutate": "ffkv.steps.mutate:STEP",
    "patterns": "ffkv.steps.patterns:STEP",
    "normalize": "ffkv.steps.normalize:STEP",
    "census": "ffkv.steps.census:STEP",
    "worth": "ffkv.steps.worth:STEP",
    "facts": "ffkv.steps.facts:STEP",
    "facts_evaluate": "ffkv.steps.facts:EVALUATE",
}

_registered: dict = {}  # name -> Step, from register()
_loaded: dict = {}  # name -> Step, cache of imported ones
_plugins: dict[str, metadata.EntryPoint] | None = None


def register(step):
    """Add `step` (a `Step`) to the registry of this process; returns it, so a module can write
    `STEP = register(Step(...))`. A name already taken by another step is refused."""
    if step.name in BUILTIN and not _builtin_home(step):
        raise FfkvError(f"{step.name!r} is a built-in step; choose another name")
    have = _registered.get(step.name) or _loaded.get(step.name)
    if have is not None and have is not step:
        raise FfkvError(f"a step named {step.name!r} is already registered")
    _registered[step.name] = step
    return step


def _builtin_home(step) -> bool:
    """A built-in's computation lives in its own package (`ffkv.steps.NAME` or a module beneath it);
    anything else taking a built-in's name is another step."""
    home = BUILTIN[step.name].split(":")[0]
    mod = getattr(step.compute, "__module__", "") or ""
    return mod == home or mod.startswith(home + ".")


def plugins() -> dict[str, metadata.EntryPoint]:
    """Installed packages' steps (entry point group `ffkv.steps`), by name."""
    global _plugins
    if _plugins is None:
        eps = metadata.entry_points(group=GROUP)
        _plugins = {ep.name: ep for ep in sorted(eps, key=lambda e: e.name) if ep.name not in BUILTIN}
    return _plugins


def _load(name: str):
    if name in _registered:
        return _registered[name]
    if name not in _loaded:
        if name in BUILTIN:
            mod, attr = BUILTIN[name].split(":")
            step = getattr(importlib.import_module(mod), attr)
        else:
            try:
                step = plugins()[name].load()
            except Exception as e:  # noqa: BLE001 - a broken plugin must name itself, not sink ffkv
                raise FfkvError(f"the step {name!r} (entry point {plugins()[name].value}) failed to load: "
                                f"{type(e).__name__}: {e}") from None
        if getattr(step, "name", None) != name:
            raise FfkvError(f"entry point {name!r} does not give a Step named {name!r}")
        _loaded[name] = step
    return _loaded[name]


def known() -> tuple[str, ...]:
    """Every step name, built-in first, without importing any step."""
    return tuple(dict.fromkeys([*BUILTIN, *plugins(), *_registered]))


def get(name: str):
    if name not in known():
        raise FfkvError(f"unknown step {name!r}; steps: {', '.join(known())}")
    return _load(name)


def ordered(names=None) -> list:
    """The steps `names` (default: all), each after the steps it requires among them (built-in
    order kept, plugins after)."""
    names = known() if names is None else tuple(names)
    steps = {n: _load(n) for n in names}
    out, seen = [], set()

    def visit(n: str, path: tuple[str, ...]) -> None:
        if n in seen or (n not in steps and n in known()):
            return  # done, or outside the set asked for
        if n in path:
            raise FfkvError(f"steps require each other in a circle: {' -> '.join(path + (n,))}")
        if n not in steps:
            raise FfkvError(f"step {path[-1]!r} requires {n!r}, which is not a registered step")
        for r in steps[n].requires:
            visit(r, path + (n,))
        seen.add(n)
        out.append(steps[n])

    for n in steps:
        visit(n, ())
    return out


def command(name: str, run) -> str:
    """The user-facing command that makes step `name` on `run`, for "run `...` first" messages."""
    tmpl = f"ffkv {name.replace('_', '-')} {{run}}"
    if name in known():
        tmpl = getattr(_load(name), "command", None) or tmpl
    return tmpl.format(run=getattr(run, "path", run))
