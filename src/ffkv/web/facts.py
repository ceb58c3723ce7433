"""The facts page's data: traced facts and their heatmaps (`fact_traces`), the editors' scores
(`fact_scores`), the run's kept edits (`edits/NAME`), and on demand the memories that hold a fact
(`ffkv.steps.facts.locate`) and an edit's before/after continuations, computed with the run's model."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ffkv.errors import FfkvError

KINDS = ("ffn", "hidden", "attn")
MAX_TOP = 50


def _cell(v: float, vmax: float) -> dict:
    """A heatmap cell: its value and the alpha of its shading (its share of the grid's max)."""
    if v is None or not math.isfinite(v):
        return {"v": None, "a": 0.0}
    return {"v": float(v), "a": round(max(0.0, min(1.0, v / vmax)), 3) if vmax > 0 else 0.0}


def traces(run) -> dict | None:
    """Per kind: ROME's average rows and each fact's (token × layer) grid, from `fact_traces`."""
    from ffkv.steps.facts.report import heatmaps
    from ffkv.steps.facts.trace import GROUPS
    from ffkv.store import query

    if not run.has_table("fact_traces"):
        return None
    t = query.table(run, "fact_traces").to_pandas()
    if not len(t):
        return None
    L = int(t["layer"].max()) + 1
    avg = heatmaps(run)
    kinds = [k for k in KINDS if k in avg]
    out = {"layers": L, "kinds": kinds, "groups": list(GROUPS), "average": {}, "facts": []}
    for k in kinds:
        a = avg[k]
        vmax = float(np.nanmax(a)) if np.isfinite(a).any() else 0.0
        out["average"][k] = [[_cell(a[g, l], vmax) for l in range(L)] for g in range(len(GROUPS))]
    for fid, g in t.groupby("fact", sort=True):
        first = g.iloc[0]
        fact = {"fact": int(fid), "text": first["text"], "subject": first["subject"], "target": first["target"],
                "relation": first["relation"], "p_clean": float(first["p_clean"]),
                "p_corrupt": float(first["p_corrupt"]), "grids": {}}
        T = int(g["token"].max()) + 1
        toks = g.drop_duplicates("token").sort_values("token")
        fact["tokens"] = [{"text": r.token_text, "grp": int(r.grp)} for r in toks.itertuples()]
        for k in kinds:
            gk = g[g["kind"] == k]
            if not len(gk):
                continue
            a = np.full((T, L), np.nan)
            a[gk["token"].to_numpy(), gk["layer"].to_numpy()] = gk["effect"].to_numpy()
            vmax = float(np.nanmax(a)) if np.isfinite(a).any() else 0.0
            fact["grids"][k] = [[_cell(a[i, l], vmax) for l in range(L)] for i in range(T)]
        out["facts"].append(fact)
    return out


def scores(run) -> dict | None:
    info = run.step("facts_evaluate") or {}
    return info.get("scores") or None if run.has_table("fact_scores") else None


def edits(run) -> list[dict]:
    """The run's kept edits (`ffkv facts edit`), newest first."""
    root = Path(run.path) / "edits"
    out = []
    if not root.is_dir():
        return out
    from ffkv.steps.facts.edit import Edit

    for d in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if not (d / "edit.json").is_file():
            continue
        try:
            e = Edit.load(d)
        except FfkvError:
            continue
        f = e.facts[0] if e.facts else {}
        out.append({"name": d.name, "method": e.method, "layers": e.layers, "facts": len(e.facts),
                    "prompt": f.get("prompt"), "subject": f.get("subject"), "target_new": f.get("target_new")})
    return out


def edit_path(run, name: str) -> Path:
    import re

    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}", name or ""):
        raise FfkvError(f"no edit named {name[:40]!r}")
    p = Path(run.path) / "edits" / name
    if not (p / "edit.json").is_file():
        raise FfkvError(f"no edit named {name!r} in this run")
    return p


def before_after(mm, run, name: str, tokens: int) -> dict:
    """An edit's fact: the prompt's greedy continuation and the new object's log-probability,
    without and with the edit."""
    from ffkv.steps.facts.edit import Edit, applied
    from ffkv.steps.facts.evaluate import greedy, target_nll

    e = Edit.load(edit_path(run, name))
    out = {"name": name, "method": e.method, "layers": e.layers, "rows": []}
    for f in e.facts:
        text = f["prompt"].replace("{}", f["subject"], 1)
        new = f["target_new"]
        row = {"text": text, "new": new, "true": f.get("target_true"),
               "before": greedy(mm, text, tokens), "logp_before": float(-target_nll(mm, [text], new)[0])}
        with applied(mm, e):
            row["after"] = greedy(mm, text, tokens)
            row["logp_after"] = float(-target_nll(mm, [text], new)[0])
        out["rows"].append(row)
    return out


def located(mm, prompt: str, subject: str, target: str | None, method: str, at: str, top: int) -> dict:
    """The memories that hold a fact (`facts locate`), with the ablation check at k = 1, 5, top."""
    import torch

    from ffkv.steps.facts.data import check_template, prompt_ids
    from ffkv.steps.facts.locate import METHODS, ablate, rank
    from ffkv.steps.facts.trace import subject_span, target_id

    check_template(prompt)
    if not subject.strip():
        raise FfkvError("the subject is empty")
    if method not in METHODS:
        raise FfkvError(f"method {method!r}: choose {', '.join(METHODS)}")
    if at not in ("subject", "last"):
        raise FfkvError(f"at {at!r}: choose subject or last")
    text = prompt.replace("{}", subject, 1)
    ids = prompt_ids(mm.tok, text, mm.max_length)
    pos = subject_span(mm.tok, text, subject, ids)[1] - 1 if at == "subject" else len(ids) - 1
    if target:
        tid = target_id(mm.tok, target)
    else:
        with torch.no_grad():
            tid = int(mm.hf(input_ids=torch.tensor([ids], device=mm.device)).logits[0, -1].argmax())
    r = rank(mm, ids, tid, pos, method)
    best = r.top(max(1, min(top, MAX_TOP)))
    ks = sorted({k for k in (1, 5, len(best)) if k <= len(best)})
    checks = ablate(mm, ids, tid, r, ks, draws=10)
    return {"text": text, "target": mm.tok.decode([tid]), "position": pos, "token": mm.tok.decode([ids[pos]]),
            "method": method, "at": at,
            "memories": [{"layer": l, "dim": d, "score": s} for l, d, s in best],
            "ablation": [{"k": a.k, "p_clean": a.p_clean, "p_top": a.p_top, "drop_top": a.drop_top,
                          "drop_random": a.drop_random, "interval": list(a.interval())} for a in checks]}
