"""Browser panels of every registered step, built-in or plugin (`Step.panels`): what a step
knows of one memory, shown on its page and in its JSON. Values are plain data, escaped when
rendered; a panel that fails shows its error instead of sinking the page."""
from __future__ import annotations

import math


def _cell(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def step_panels(run, layer: int, dim: int) -> list[dict]:
    from ffkv.steps.registry import ordered

    out = []
    for step in ordered():
        if step.panels is None or not run.step_done(step.name):
            continue
        try:
            for p in step.panels(run, layer, dim):
                out.append({"step": step.name, "title": str(p.title), "columns": [str(c) for c in p.columns],
                            "rows": [[_cell(v) for v in r] for r in p.rows], "note": str(p.note or "")})
        except Exception as e:  # noqa: BLE001 - a plugin's bug must not sink the memory page
            out.append({"step": step.name, "title": step.name, "columns": [], "rows": [],
                        "note": f"this panel failed: {type(e).__name__}: {e}"})
    return out
