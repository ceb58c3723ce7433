"""`ffkv reproduce`: every step of the paper in order, each resumable, then the report.

Each step runs through the step lifecycle (`ffkv.steps.lifecycle.execute`) with the settings its
own command would give it, so a step behaves exactly as when a user types it: it skips itself
when the manifest says it is done with the same settings, and mining resumes from its
checkpoint after a kill. The model is loaded once for all steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ffkv.errors import FfkvError
from ffkv.store.run import Run
from ffkv.model import identity

STEPS = ("mine", "values", "compose", "mutate", "patterns", "normalize")


@dataclass
class ReproduceSettings:
    """Defaults sized so that `make demo` on a fresh clone (install included) stays under 10 minutes
    on a 2-core CPU with the embedded SmolLM2."""
    model: str | None = None
    corpus: str | None = None  # mining corpus; default: the embedded Wikipedia (train split)
    compose_corpus: str | None = None  # held-out corpus; default: the embedded valid split
    sentences: int | None = 1500  # None: every sentence of the corpus
    top_k: int = 50
    prefixes: int = 1000
    prefixes_per_sentence: int = 1  # compose --per-sentence: used only when the held-out split runs short
    keys_per_layer: int = 3  # mutate: keys per layer (the paper: 100); 3 × 50 examples × 30 layers
    semantic_keys_per_layer: int = 10  # the paper's experts read 10 keys per layer
    semantic: bool = True  # False: shallow patterns only (no sentence encoder needed)
    normalize: str = "reproduce"  # "reproduce": the ≤ 2-minute sizing; "default": `ffkv normalize` as is
    negative: bool | None = None  # None: mine negatives when the FFN is gated
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0


# Named sets of flags. "full" mines every sentence of the corpus and uses the paper's sample
# sizes (4,000 held-out prefixes, 100 mutated keys per layer, 10 semantic keys per layer). The
# embedded valid split has 3,432 usable sentences, so 568 of them give a second prefix.
PRESETS: dict[str, dict] = {
    "default": {},
    "full": {"sentences": None, "prefixes": 4000, "prefixes_per_sentence": 2, "keys_per_layer": 100,
             "semantic_keys_per_layer": 10, "normalize": "default"},
}


def preset(name: str, **overrides) -> ReproduceSettings:
    """The settings of preset `name`, with `overrides` (flags the user typed) on top."""
    if name not in PRESETS:
        raise FfkvError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return ReproduceSettings(**{**PRESETS[name], **overrides})


def step_settings(step: str, s: ReproduceSettings, gated: bool, n_layers: int | None = None):
    """The settings each step gets: the same as typing its command with reproduce's flags (a step
    that says so itself, through `Step.reproduce`, is asked)."""
    from ffkv.steps.registry import get

    own = get(step).reproduce
    if own is not None:
        from types import SimpleNamespace

        return own(s, SimpleNamespace(gated=gated, n_layers=n_layers))
    raise ValueError(step)


def plan_steps(s: ReproduceSettings, mm) -> list[tuple[str, object]]:
    """(step, settings) for every registered step that `reproduce` runs, in dependency order: the
    built-in ones as their own commands would run them, then each plugin step whose `reproduce`
    gives settings for this run (None: it sits this one out)."""
    from ffkv.steps.registry import ordered

    plan = []
    for step in ordered():
        if step.reproduce is not None:
            settings = step.reproduce(s, mm)
        elif step.name in STEPS:
            settings = step_settings(step.name, s, mm.gated, mm.n_layers)
        else:
            settings = None
        if settings is not None:
            plan.append((step.name, settings))
    return plan


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
    if s.semantic:  # before any step runs: a missing encoder would otherwise stop it at step 5
        from ffkv.steps.patterns.semantic import require_encoder

        require_encoder()
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
