"""`ffkv reproduce`: every step of the paper in order, each resumable, then the report.

Each step runs through its own CLI command in this process, so a step behaves exactly as
when a user types it: it skips itself when the manifest says it is done with the same
settings, and mining resumes from its checkpoint after a kill.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ffkv.errors import FfkvError

STEPS = ("mine", "values", "compose", "mutate", "patterns")


@dataclass
class ReproduceSettings:
    """Defaults sized for ≤ 15 minutes on a 2-core CPU with the embedded SmolLM2."""
    model: str | None = None
    corpus: str | None = None  # mining corpus; default: the embedded Wikipedia (train split)
    compose_corpus: str | None = None  # held-out corpus; default: the embedded valid split
    sentences: int = 1500
    top_k: int = 50
    prefixes: int = 1000
    keys_per_layer: int = 4  # mutate: keys per layer (the paper: 100)
    semantic_keys_per_layer: int = 4
    negative: bool | None = None  # None: mine negatives when the FFN is gated
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0


def step_args(step: str, run: Path, s: ReproduceSettings, gated: bool) -> list[str]:
    dev = ["--device", s.device, "--dtype", s.dtype]
    if step == "mine":
        a = ["mine", "--out", str(run), "--max-sentences", str(s.sentences), "--top-k", str(s.top_k),
             "--seed", str(s.seed), "--corpus", s.corpus or "wikipedia:train", *dev]
        if s.model:
            a += ["--model", s.model]
        if s.negative or (s.negative is None and gated):
            a.append("--negative")
        return a
    if step == "values":
        return ["values", str(run), *dev]
    if step == "compose":
        return ["compose", str(run), "--prefixes", str(s.prefixes), "--seed", str(s.seed),
                "--corpus", s.compose_corpus or "wikipedia:valid", *dev]
    if step == "mutate":
        return ["mutate", str(run), "--keys-per-layer", str(s.keys_per_layer), "--seed", str(s.seed), *dev]
    if step == "patterns":
        return ["patterns", str(run), "--semantic-keys-per-layer", str(s.semantic_keys_per_layer),
                "--seed", str(s.seed), "--device", s.device]
    raise ValueError(step)


def reproduce(run: Path, s: ReproduceSettings, log=print) -> dict:
    from ffkv.cli import app, model
    from ffkv.store.run import Run

    run = Path(run)
    if run.exists() and not run.is_dir():
        raise FfkvError(f"{run} is a file, not a run directory")
    gated = model(s.model, s.device, s.dtype).gated if not (run / "manifest.json").exists() else \
        bool((Run(run).manifest.get("model") or {}).get("gated"))
    times = {}
    for i, step in enumerate(STEPS, 1):
        done = (run / "manifest.json").exists() and Run(run).step_done(step)
        log(f"\n[{i}/{len(STEPS)}] {step}" + (" (done earlier; checking settings)" if done else ""))
        t0 = time.time()
        app(step_args(step, run, s, gated), standalone_mode=False)
        times[step] = round(time.time() - t0, 1)
    from ffkv.report import build_report

    log(f"\n[report] building the HTML report")
    t0 = time.time()
    path = build_report(run)
    times["report"] = round(time.time() - t0, 1)
    r = Run(run)
    r.manifest.setdefault("reproduce", {})["wall_seconds"] = times
    r.save()
    return {"report": str(path), "times": times, "run": str(run)}


def summary_lines(run: Path, times: dict) -> list[str]:
    """Ten lines: timings, then one verdict per figure against the paper."""
    from ffkv.store.run import Run

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

        vs = json.loads(vpath.read_text())
        counts = {}
        for v in vs:
            counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
        lines.append("verdicts vs the paper: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
        for v in vs:
            lines.append(f"  {v['id']:>8}: {v['verdict']:<14} {v.get('measured', '')}"[:150])
    return lines
