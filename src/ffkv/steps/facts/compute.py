"""The facts steps' computations: `trace_step` (table `fact_traces`) and `evaluate_step` (table
`fact_scores`), their records and printed summaries.

``fact_traces`` (a public contract): one row per fact, restored kind, token and layer: fact int32
(its index in the trace), case_id string, relation string, subject string, text string (the
prompt with its subject), target string (the traced object), kind string (hidden, ffn, attn),
token int16, token_text string, layer int16, grp int8 (ROME's heatmap row, `trace.GROUPS`; -1 for
none), effect float32 (the indirect effect P_restored − P_corrupt), p_clean and p_corrupt float32.

``fact_scores``: one row per method (unedited, rome, memit, values) and fact: method string, fact
int32, case_id string, relation string, subject string, target_true string, target_new string,
efficacy, generalization, specificity, fluency float32 (`ffkv.steps.facts.evaluate`), seconds
float32 (the edit's computation; ROME and values share the target v*, counted for the first).
"""
from __future__ import annotations

import json
import time

import numpy as np

from ffkv.errors import FfkvError


# ---- shared -------------------------------------------------------------------------------------------------------
def _facts(s, mm, show_progress=None) -> tuple[list, dict]:
    """The fact set's facts, the known filter applied, cut to the limit; and counts per relation."""
    from ffkv.steps.facts.data import known, load_facts, relation_counts

    facts = load_facts(s.facts, relation=s.relation, seed=s.seed)
    if not facts:
        raise FfkvError(f"the fact set {s.facts!r} has no fact" + (f" of relation {s.relation!r}" if s.relation else ""))
    k = known(mm, facts)
    counts = {r: {"facts": n, "known": kn} for r, (n, kn) in relation_counts(facts, k.known).items()}
    chosen = [f for f, ok in zip(facts, k.known) if ok or not s.known]
    return chosen[: s.limit], counts


def _check_facts(s) -> None:
    """The fact set read (a file parsed, a relation found) before any model loads: one line if not."""
    from ffkv.steps.facts.data import load_facts

    load_facts(s.facts, relation=s.relation, seed=s.seed)


def _check_record(s) -> dict:
    from ffkv.defs import canonical_dtype
    from ffkv.steps.settings import record

    r = record(s)
    r["dtype"] = canonical_dtype(s.dtype)
    return r


# ---- trace --------------------------------------------------------------------------------------------------------
def trace_record(run, s) -> dict:
    """Either one prompt (with its subject) or a fact set, checked before the model loads."""
    if (s.prompt is None) == (s.facts is None):
        raise FfkvError("facts trace: give --prompt with --subject, or --facts (countries, cities or a file)")
    if s.prompt is not None and not s.subject:
        raise FfkvError("facts trace: --prompt needs --subject, the text its {} stands for")
    if s.facts is not None and (s.subject or s.target):
        raise FfkvError("facts trace: --subject and --target go with --prompt; a fact set brings its own")
    if s.facts is not None:
        _check_facts(s)
    return _check_record(s)


def _requests(s, mm) -> tuple[list, dict]:
    """[(fact-like row, text, subject, target)] to trace."""
    if s.prompt is not None:
        import torch

        from ffkv.steps.facts.data import Fact, prompt_ids

        text = s.prompt.replace("{}", s.subject, 1)
        target = s.target
        if target is None:  # the model's own prediction, as ROME traces what the model says
            with torch.no_grad():
                ids = torch.tensor([prompt_ids(mm.tok, text, mm.max_length)], device=mm.device)
                target = mm.tok.decode([int(mm.hf(input_ids=ids).logits[0, -1].argmax())])
        f = Fact("prompt", s.prompt, s.subject, target)
        return [f], {}
    return _facts(s, mm)


def trace_step(ctx) -> dict:
    import pyarrow as pa

    from ffkv.steps.facts.trace import GROUPS, groups, rome_verdict, summary, trace_many

    s, mm = ctx.settings, ctx.model()
    facts, counts = _requests(s, mm)
    if not facts:
        raise FfkvError("facts trace: no fact is known to the model (pass --all to trace them anyway)")
    t0 = time.time()
    res = trace_many(mm, [(f.text, f.subject, f.target_true) for f in facts], show_progress=ctx.show_progress,
                     kinds=s.kinds.split(","), noise=s.noise, samples=s.samples, window=s.window, seed=s.seed)
    cols = {c: [] for c in ("fact", "case_id", "relation", "subject", "text", "target", "kind", "token",
                            "token_text", "layer", "grp", "effect", "p_clean", "p_corrupt")}
    for i, (f, r) in enumerate(zip(facts, res)):
        T, L = len(r.tokens), mm.n_layers
        grp = np.full(T, -1, np.int8)
        for g, toks in enumerate(groups(r)):
            grp[toks] = g
        for k, e in r.effect.items():
            n = T * L
            cols["fact"].append(np.full(n, i, np.int32))
            for c, v in (("case_id", str(f.case_id)), ("relation", f.relation), ("subject", f.subject),
                         ("text", f.text), ("target", mm.tok.decode([r.target])), ("kind", k)):
                cols[c].append([v] * n)
            cols["token"].append(np.repeat(np.arange(T, dtype=np.int16), L))
            cols["token_text"].append(np.repeat(np.array(r.tokens, dtype=object), L))
            cols["layer"].append(np.tile(np.arange(L, dtype=np.int16), T))
            cols["grp"].append(np.repeat(grp, L))
            cols["effect"].append(e.astype(np.float32).reshape(-1))
            cols["p_clean"].append(np.full(n, r.p_clean, np.float32))
            cols["p_corrupt"].append(np.full(n, r.p_corrupt, np.float32))
    table = pa.table({c: pa.array(np.concatenate([np.asarray(x, dtype=object if c in (
        "case_id", "relation", "subject", "text", "target", "kind", "token_text") else None) for x in v]))
        for c, v in cols.items()})
    ctx.run.write_table("fact_traces", table)
    summ = summary(res)
    verdicts = {k: rome_verdict(res, k) for k in s.kinds.split(",") if k in ("ffn", "attn", "hidden")}
    ctx.result = res
    return {"facts": len(res), "known": counts, "groups": list(GROUPS), "seconds": round(time.time() - t0, 2),
            "forwards": int(sum(r.forwards for r in res)), "sigma": res[0].sigma,
            "p_clean": summ["p_clean"], "p_corrupt": summ["p_corrupt"],
            "verdicts": {k: {kk: vv for kk, vv in v.items()} for k, v in verdicts.items()}}


def trace_summary(run, out, s=None, as_json: bool = False) -> None:
    info = out.info
    if as_json:
        print(json.dumps({"status": out.status, **info}, indent=2, default=str))
        return
    v = info["verdicts"].get("ffn")
    lines = [f"facts trace: {info['facts']} fact{'s' if info['facts'] != 1 else ''} traced "
             f"(P clean {info['p_clean']:.3f}, corrupted {info['p_corrupt']:.3f}, noise σ = {info['sigma']:.4g}; "
             f"{info['forwards']} forward passes, {info['seconds']:.1f} s) into table fact_traces"
             + ("  [already done; --force to redo]" if out.skipped else "")]
    for rel, c in (info.get("known") or {}).items():
        lines.append(f"  {rel}: the model knows {c['known']} of {c['facts']}")
    if v:
        lines.append(f"  ROME's finding (the FFN's effect peaks at the last subject token, in middle layers): "
                     f"{v['verdict']}; difference {v['difference']:+.4f} [{v['low']:+.4f}, {v['high']:+.4f}] over "
                     f"{v['facts_judged']} facts; peak at layer {v['peak_layer']} (depth {v['peak_depth']:.2f}"
                     f"{', middle third' if v['middle'] else ''})")
    lines.append(f"  the heatmaps: `ffkv report {run.path}`")
    print("\n".join(lines))


# ---- evaluate -----------------------------------------------------------------------------------------------------
def evaluate_record(run, s) -> dict:
    _check_facts(s)
    return _check_record(s)


def _layers_of(s, mm) -> tuple[int, list[int]]:
    layer = s.layer if s.layer is not None else max(0, mm.n_layers // 4)
    if not 0 <= layer < mm.n_layers:
        raise FfkvError(f"--layer {layer} out of range 0..{mm.n_layers - 1}")
    return layer, list(range(max(0, layer - s.span + 1), layer + 1))


def evaluate_step(ctx) -> dict:
    import pyarrow as pa

    from ffkv.progress import progress
    from ffkv.steps.facts import edit as E
    from ffkv.steps.facts.evaluate import aggregate, fact_scores
    from ffkv.store import query

    s, run, mm = ctx.settings, ctx.run, ctx.model()
    methods = s.methods.split(",")
    layer, span = _layers_of(s, mm)
    need = sorted({layer} if set(methods) & {"rome"} else set()) + (span if "memit" in methods else [])
    covs = {l: query.key_covariance(run, l)[1] for l in sorted(set(need))}  # one line when missing, first
    facts, counts = _facts(s, mm)
    facts = [f for f in facts if f.target_new]
    if not facts:
        raise FfkvError("facts evaluate: no known fact with a new object to write (try --all or another set)")
    templates = E.prefixes_from(run, mm.tok, n=s.prefixes, seed=s.seed)
    hp = {"steps": s.steps, **({} if s.clamp is None else {"clamp": s.clamp})}
    rows, agg, targets = [], {}, {}

    def score(method, f, i, secs):
        sc = fact_scores(mm, f, fluency=s.tokens > 0, tokens=s.tokens)
        rows.append({"method": method, "fact": i, "case_id": str(f.case_id), "relation": f.relation,
                     "subject": f.subject, "target_true": f.target_true, "target_new": f.target_new,
                     "efficacy": sc.efficacy, "generalization": sc.generalization, "specificity": sc.specificity,
                     "fluency": sc.fluency, "seconds": secs})
        return sc

    reqs = [E.Request(f.prompt, f.subject, f.target_new, f.target_true) for f in facts]
    total = len(facts) * (1 + len(methods))
    with progress(disable=None if ctx.show_progress is None else not ctx.show_progress) as bar:
        task = bar.add_task("facts evaluate: edits and scores", total=total)
        for method in ["unedited", *methods]:
            got = []
            if method == "memit":
                t0 = time.time()
                e = E.memit(mm, span, reqs, covs, templates, hp, lam=s.lam, lam_rel=s.lam_rel)
                secs = (time.time() - t0) / len(facts)
                with E.applied(mm, e):
                    for i, f in enumerate(facts):
                        got.append(score(method, f, i, secs))
                        bar.advance(task)
            else:
                for i, (f, r) in enumerate(zip(facts, reqs)):
                    t0 = time.time()
                    if method != "unedited" and i not in targets:  # ROME's and the values' shared v*
                        targets[i] = E.target_output(mm, layer, r, templates, hp)
                    e = (None if method == "unedited" else
                         E.rome(mm, layer, r, covs[layer], templates, hp, target=targets[i]) if method == "rome"
                         else E.values_edit(mm, layer, r, templates, top=s.top, hp=hp, target=targets[i]))
                    secs = time.time() - t0
                    if e is None:
                        got.append(score(method, f, i, 0.0))
                    else:
                        with E.applied(mm, e):
                            got.append(score(method, f, i, secs))
                    bar.advance(task)
            agg[method] = aggregate(got)
    strings = ("method", "case_id", "relation", "subject", "target_true", "target_new")
    table = pa.table({c: pa.array([r[c] for r in rows], type=pa.string() if c in strings else
                                  (pa.int32() if c == "fact" else pa.float32())) for c in rows[0]})
    run.write_table("fact_scores", table)
    return {"facts": len(facts), "known": counts, "layer": layer, "memit_layers": span, "methods": methods,
            "scores": agg}


def evaluate_summary(run, out, s=None, as_json: bool = False) -> None:
    info = out.info
    if as_json:
        print(json.dumps({"status": out.status, **info}, indent=2, default=str))
        return
    print(format_scores(info) + ("\n  [already done; --force to redo]" if out.skipped else ""))


def format_scores(info: dict) -> str:
    def f(v, pct=True):
        return "n/a" if v is None else (f"{100 * v:5.1f}%" if pct else f"{v:6.2f}")

    lines = [f"facts evaluate: {info['facts']} facts; ROME and values at layer {info['layer']}, MEMIT at layers "
             f"{info['memit_layers'][0]}-{info['memit_layers'][-1]}",
             f"  {'method':10} {'efficacy':>9} {'generaliz.':>10} {'specificity':>11} {'score':>7} {'fluency':>8}"]
    for m, a in info["scores"].items():
        lines.append(f"  {m:10} {f(a['efficacy']):>9} {f(a['generalization']):>10} {f(a['specificity']):>11} "
                     f"{f(a['score']):>7} {f(a['fluency'], False):>8}")
    lines.append("  (EasyEdit's names: rewrite_acc, rephrase_acc, locality, ngram_entropy; score: their harmonic mean)")
    return "\n".join(lines)
