"""`ffkv repair`: rebuild a run's manifest from the tables it can verify.

A run whose manifest.json was deleted or damaged is refused by every step (nothing is written
into it). Each table ffkv writes carries, in its Parquet footer, which step wrote it, with which
settings and which model (`ffkv.store.run.table_origin`); a table that reads whole restores its
record, and a step whose every table is whole is marked done again with the settings its tables
name. A damaged manifest is kept beside the new one (manifest.json.damaged); a table that cannot
be verified is named and left as it is.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, ModelOpt, RunArg
from ffkv.errors import FfkvError
from ffkv.model import identity


def _verify(p: Path) -> tuple[dict | None, dict | None, str | None]:
    """(origin, record, problem) of a table file: read whole, or why not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ffkv.store.run import table_digest, table_origin

    try:
        digest = table_digest(p)
        origin = table_origin(p)
        n = pq.read_table(p).num_rows  # every page, not only the footer
    except (ValueError, OSError, pa.ArrowException) as e:
        return None, None, f"unreadable ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})"
    rec = {"rows": n, **digest, "step": (origin or {}).get("step"), "written": p.stat().st_mtime}
    return origin, rec, None


def rebuild(path: Path, model_name: str | None = None, device: str = "auto", log=print) -> dict:
    """Write a manifest for the run at `path` from its verified tables; returns it."""
    from ffkv.store.run import MANIFEST, Run, atomic_write_json
    from ffkv.steps.lifecycle import get, names

    found, problems = {}, {}
    for p in sorted(path.glob("*.parquet")):
        origin, rec, why = _verify(p)
        if why:
            problems[p.stem] = why
        else:
            found[p.stem] = (origin, rec)
    if not found:
        raise FfkvError(f"{path} holds no table that ffkv can verify; nothing to repair (start afresh with "
                        f"`ffkv mine --out {path} --overwrite`)")
    origins = [o for o, _ in found.values() if o]
    model = next((o["model"] for o in origins if o.get("step") == "mine" and o.get("model")), None) \
        or next((o["model"] for o in origins if o.get("model")), None)
    models = {json.dumps({k: (o.get("model") or {}).get(k) for k in ("model_id", "unembed_sha256")})
              for o in origins if o.get("model")}
    if len(models) > 1:
        raise FfkvError(f"the tables of {path} were written with {len(models)} different models; "
                        f"repair cannot tell which is the run's (start afresh with --overwrite)")
    man = {"ffkv_version": None, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": {}, "settings": {},
           "counts": {}, "tables": {n: rec for n, (_, rec) in found.items()}, "repaired": time.time()}
    if model_name is not None or model is None:
        if model_name is None:
            raise FfkvError(f"the tables of {path} do not say which model made them (written before ffkv "
                            f"recorded it); pass the run's model: `ffkv repair {path} --model MODEL`")
        from ffkv.cli.options import model as load_model

        mm = load_model(model_name, device=device)
        probe = Run.__new__(Run)  # a run object over the recovered record, to reuse its model check
        probe.path, probe.manifest = path, {"model": model}
        identity.check_model(probe, mm)
        if "vocab" in found and found["vocab"][1]["rows"] != mm.vocab_size:
            raise FfkvError(f"{model_name} has {mm.vocab_size} tokens; the run's vocab table has "
                            f"{found['vocab'][1]['rows']}: not the run's model")
        model = identity.model_record(mm)
    man["model"] = model
    lens = next((o.get("lens") for o in origins if o.get("lens")), None)
    if lens:
        man["lens"] = lens
    restored, missing, foreign = [], {}, {}
    passes: dict[str, set] = {}  # step -> the passes its own tables record (`Run._pass_identity`)
    for o, _ in found.values():
        if o and o.get("step"):
            passes.setdefault(o["step"], set()).add(o.get("pass"))
    for name in names():
        step = get(name)
        own = [found[t][0] for t in found if found[t][0] and found[t][0].get("step") == name]
        optional = _optional_tables(name)  # written when a setting says so: damaged, they block too
        if not all(t in found for t in step.tables) or any(t in problems for t in optional):
            lost = [t for t in (*step.tables, *optional) if t not in found and (t in step.tables or t in problems)]
            if own or any(t in found for t in step.tables):
                missing[name] = lost
            continue
        why = _inconsistent(name, step, own, passes, man["steps"])
        if why:
            foreign[name] = why
            continue
        times = [found[t][1]["written"] for t in step.tables]
        settings = next((o.get("settings") for o in own if o.get("settings") is not None), None)
        one = next(iter(passes.get(name) or {None}))
        info = {"status": "done", "started": one if isinstance(one, (int, float)) else min(times),
                "finished": max(times), "repaired": True}
        if name == "mine":
            info.update(_mine_info(path, found, settings, man))
        man["steps"][name] = info
        if settings is not None:
            man["settings"][name] = settings
        restored.append(name)
    mp = path / MANIFEST
    if mp.exists():
        os.replace(mp, path / f"{MANIFEST}.damaged")  # kept, never deleted
        log(f"repair: kept the damaged manifest as {MANIFEST}.damaged")
    atomic_write_json(mp, {**man, "ffkv_version": __import__("ffkv").__version__})
    Run(path)  # it loads
    for t, why in sorted(problems.items()):
        log(f"repair: left {t}.parquet as it is: {why}")
    for name, why in foreign.items():
        log(f"repair: step {name} not restored: {why}; redo it with its command and --force")
    for name, lost in missing.items():
        log(f"repair: step {name} not restored (missing or unreadable: {', '.join(lost)}); redo it with "
            f"its command and --force")
    log(f"repaired {path}: {len(found)} table(s) verified; steps done again: {', '.join(restored) or 'none'}; "
        f"model {model.get('model_id') or model.get('model')}")
    return man


def _inconsistent(name: str, step, own: list[dict], passes: dict[str, set], done: dict) -> str | None:
    """Why the tables of step `name` (`own`: their origins) cannot be taken as one finished pass
    of this run, or None: they must come from one pass, and the upstream passes they record (each
    step it requires, and mine when they name one) must be the ones restored here. A step's
    tables copied from another run name another mine; tables of two passes mixed are not one
    result."""
    mine = passes.get(name) or set()
    if len(mine) > 1:
        return (f"its tables come from {len(mine)} different passes (tables of another run or of an "
                f"older pass mixed in)")
    if not step.requires and not any((o.get("upstream") or {}).get("mine") is not None for o in own):
        return None
    if None in mine or not own:
        return ("its tables do not record which pass of the steps it reads they come from (written by "
                "an older ffkv), so they cannot be matched to this run's")
    for o in own:
        up = o.get("upstream") or {}
        for u in dict.fromkeys([*step.requires, *(["mine"] if "mine" in up else [])]):
            if u not in done:
                return f"it reads `{u}`, which is not restored"
            if up.get(u) != done[u].get("started"):
                return (f"its tables read another `{u}` pass than this run's (copied from another run, "
                        f"or left from before `{u}` was redone)")
    return None


def _optional_tables(name: str) -> tuple[str, ...]:
    if name == "mine":
        from ffkv.steps.mine import STATS_TABLES

        return tuple(STATS_TABLES)
    return ()


def _mine_info(path: Path, found: dict, settings: dict | None, man: dict) -> dict:
    """What the manifest keeps of a mine step that the tables can tell: rows, key statistics,
    the corpus counts (sentences and tokens), and the settings key that lets a rerun resume."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ffkv.steps.mine import STATS_TABLES

    info = {"rows": found["triggers"][1]["rows"], "stats": None}
    if all(t in found for t in STATS_TABLES):
        from ffkv.mine.stats import layout

        info["stats"] = {**layout(), "tables": list(STATS_TABLES),
                         "samples_per_bin": (settings or {}).get("samples_per_bin", 5)}
    tokens = int(pc.sum(pq.read_table(path / "sentences.parquet", columns=["n_tokens"])["n_tokens"]).as_py() or 0)
    counts = {"sentences": found["sentences"][1]["rows"], "tokens": tokens}
    corpus = {"source": (settings or {}).get("corpus"), "counts": counts, "repaired": True}
    if settings is not None:
        from ffkv.steps.mine import MineSettings

        try:
            corpus.update(seed=settings.get("seed", 0), field=settings.get("field", "text"),
                          max_sentences=settings.get("max_sentences"),
                          settings_key=MineSettings(**settings).key())
        except TypeError:
            pass
    man["corpora"] = {"sentences": corpus}
    man["corpus"], man["counts"] = corpus, counts
    return info


def repair(run_dir: Path = RunArg,
           model_name: Optional[str] = typer.Option(None, "--model", "-m", help="The run's model, for tables written "
                                                    "before ffkv recorded it in them (checked against the tables). "
                                                    + ModelOpt.help.split(".")[0] + "."),
           device: str = DeviceOpt):
    """Rebuild a run's manifest from the tables it can verify (after manifest.json was deleted or
    damaged). A step whose tables are all whole is done again, with the settings and model its
    tables record; a table that cannot be verified is named and left as it is. A run whose
    manifest is whole is only checked."""
    from ffkv.store.run import MANIFEST, Run
    from ffkv.steps.lifecycle import check_tables, get, names

    if not run_dir.is_dir():
        raise FfkvError(f"{run_dir} is not a directory")
    try:
        run = Run(run_dir) if (run_dir / MANIFEST).exists() else None
    except FfkvError:
        run = None  # damaged: rebuilt below
    if run is not None:
        for name, st in run.manifest.get("steps", {}).items():
            if st.get("status") == "done" and name in names():
                check_tables(run, name, get(name))
        print(f"{run_dir}: the manifest is whole and every recorded table verifies; nothing to repair")
        return
    with Run.lock(_Lockable(run_dir), "manifest"):  # no step saves the manifest meanwhile
        rebuild(run_dir, model_name, device)


class _Lockable:
    """Enough of a Run for `Run.lock` (a folder without a loadable manifest)."""

    def __init__(self, path: Path):
        self.path = path


def register(app: typer.Typer) -> None:
    app.command()(repair)
