"""What every registered step, built-in or plugin, adds to the browser: its panels on a memory's
page (`Step.panels`, drawn by `Step.panel_template` when it has one; `Step.later_panels`, drawn
the same way by /memory/L/D/later-panels, which the page links to and its script fetches after the
colours) and its overview columns (`Step.overview`). Values are plain data, escaped when rendered;
a step that fails shows its error instead of sinking the page."""
from __future__ import annotations

import math

from markupsafe import Markup

from ffkv.web.common import templates


def _cell(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def _failed(what: str, e: Exception) -> str:
    return f"this {what} failed: {type(e).__name__}: {e}"


WHICH = ("all", "now", "later")


def step_panels(run, layer: int, dim: int, which: str = "all") -> list[dict]:
    """The panels of every finished step, in the registry's order: `which` "now" (`Step.panels`,
    the memory page's own), "later" (`Step.later_panels`, those that need a model forward) or
    "all" (each step's panels, then its later ones: the JSON twin's)."""
    from ffkv.steps.registry import ordered

    if which not in WHICH:
        raise ValueError(f"which must be one of {WHICH} (got {which!r})")
    kinds = [k for k, w in (("panels", "now"), ("later_panels", "later")) if which in (w, "all")]
    out = []
    for step in ordered():
        if not run.step_done(step.name):
            continue
        for kind in kinds:
            make = getattr(step, kind)
            if make is None:
                continue
            try:
                for p in make(run, layer, dim):
                    out.append({"step": step.name, "title": str(p.title), "columns": [str(c) for c in p.columns],
                                "rows": [[_cell(v) for v in r] for r in p.rows], "note": str(p.note or "")})
            except Exception as e:  # noqa: BLE001 - a plugin's bug must not sink the memory page
                out.append({"step": step.name, "title": step.name, "columns": [], "rows": [],
                            "note": _failed("panel", e)})
    return out


def later_labels(run, layer: int, dim: int) -> list[dict]:
    """[{step, label}] of each finished step with `later_panels` that has some for this memory
    (`Step.later_label`, cheap: no forward), in the registry's order: what the memory page's
    placeholder offers to compute."""
    from ffkv.steps.registry import ordered

    out = []
    for step in ordered():
        if step.later_panels is None or not run.step_done(step.name):
            continue
        try:
            label = f"the {step.name} step's panels" if step.later_label is None else step.later_label(run, layer, dim)
        except Exception as e:  # noqa: BLE001 - the later fragment shows the step's error in full
            label = f"the {step.name} step's panels ({_failed('label', e)})"
        if label:
            out.append({"step": step.name, "label": str(label)})
    return out


def panel_html(m: dict) -> dict[int, Markup]:
    """Index in `m["panels"]` -> that panel drawn by its step's partial (`Step.panel_template`,
    "package:file.html", found by `ffkv.web.common.step_template`) with `p` (the panel) and `m`
    (the memory page's data); the others keep the default table. A partial that fails shows why."""
    from ffkv.steps.registry import ordered

    names = {s.name: s.panel_template for s in ordered() if s.panel_template}
    out = {}
    for i, p in enumerate(m.get("panels") or ()):
        if p["step"] in names:
            try:
                out[i] = Markup(templates.get_template(names[p["step"]]).render(p=p, m=m))
            except Exception as e:  # noqa: BLE001 - a plugin's bug must not sink the memory page
                out[i] = Markup('<p class="muted">{}</p>').format(_failed("panel's template", e))
    return out


def step_columns(run, layers: int) -> list[dict]:
    """The overview columns of every finished step: {step, title, cells: [value per layer], error}."""
    from ffkv.steps.registry import ordered

    out = []
    for step in ordered():
        if step.overview is None or not run.step_done(step.name):
            continue
        try:
            for title, cells in step.overview(run).items():
                out.append({"step": step.name, "title": str(title), "error": "",
                            "cells": [_cell(cells.get(l)) for l in range(layers)]})
        except Exception as e:  # noqa: BLE001 - a plugin's bug must not sink the overview
            out.append({"step": step.name, "title": step.name, "error": _failed("column", e), "cells": [None] * layers})
    return out
