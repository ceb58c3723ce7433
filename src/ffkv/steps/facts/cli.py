"""`ffkv facts ...`: the facts step package's command group. `trace` and `evaluate` are generated
from their steps' settings (`ffkv.steps.cli.command`); `locate` and `edit` answer one prompt and
write no table (an edit is kept in the run's `edits/NAME/` folder). Light: typer only at import."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

from ffkv.errors import FfkvError
from ffkv.steps.facts import MEMIT_LAMBDA_REL

PromptOpt = typer.Option(..., "--prompt", help='A prompt template whose {} is the subject, e.g. "{} is located in the city of".')
SubjectOpt = typer.Option(..., "--subject", help='The subject, e.g. "The Eiffel Tower".')
RunArg = typer.Argument(..., metavar="RUN", help="A run directory made by `ffkv mine --out RUN`.")


def _open(run_dir: Path, device: str, dtype: str):
    from ffkv.cli.options import open_run
    from ffkv.model import identity

    run = open_run(run_dir)
    if not run.step("mine").get("finished"):
        raise FfkvError(f"{run_dir} is not mined yet: run `ffkv mine --out {run_dir}` first")
    return run, identity.open_model(run, device=device, dtype=dtype)


def _text(prompt: str, subject: str) -> str:
    from ffkv.steps.facts.data import check_template

    check_template(prompt)
    if not subject or not subject.strip():
        raise FfkvError("--subject is empty: give the text the prompt's {} stands for")
    return prompt.replace("{}", subject, 1)


def _tokens_of(mm, v, k: int = 5) -> str:
    from ffkv.display import show_token

    top = mm.lens.direction_logits(v[None])[0].topk(k).indices.tolist()
    return " ".join(show_token(mm.tok.decode([t])) for t in top)


def locate(run_dir: Path = RunArg, prompt: str = PromptOpt, subject: str = SubjectOpt,
           target: Optional[str] = typer.Option(None, "--target", help="The true object (its first token). "
                                                "Default: the model's own top prediction."),
           method: str = typer.Option("direct", "--method", help="direct (the memory's direct share of the object's "
                                      "logit), grad (gradient × coefficient) or ig (integrated gradients, 20 steps)."),
           at: str = typer.Option("subject", "--at", help="Where memories are ranked: subject (the subject's last "
                                  "token) or last (the prompt's last token)."),
           top: int = typer.Option(20, "--top", min=1, help="Memories listed."),
           ablate: str = typer.Option("1,5,10,20", "--ablate", help="Check: suppress the top k memories (m = 0 at "
                                      "the position) for each k, against k random memories of the same layers; "
                                      "'' for none."),
           draws: int = typer.Option(10, "--draws", min=1, max=1000, help="Random draws per k."),
           seed: int = typer.Option(0, "--seed", min=0, help="Seed of the random memories."),
           device: str = typer.Option("auto", "--device"), dtype: str = typer.Option("auto", "--dtype"),
           as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")) -> None:
    """Which memories hold a fact: every memory ranked by its effect on P(true object), and the
    ranking checked by ablation."""
    import torch

    from ffkv.parse import parse_int_list
    from ffkv.steps.facts.data import prompt_ids
    from ffkv.steps.facts.locate import METHODS, ablate as run_ablate, rank
    from ffkv.steps.facts.trace import subject_span, target_id

    text = _text(prompt, subject)
    if method not in METHODS:
        raise FfkvError(f"--method {method!r}: choose {', '.join(METHODS)}")
    if at not in ("subject", "last"):
        raise FfkvError(f"--at {at!r}: choose subject or last")
    ks = parse_int_list(ablate, None, "ablate") if ablate.strip() else []
    if any(k < 1 for k in ks or []):
        raise FfkvError("--ablate takes counts of 1 or more")
    run, mm = _open(run_dir, device, dtype)
    ids = prompt_ids(mm.tok, text, mm.max_length)
    span = subject_span(mm.tok, text, subject, ids)
    pos = span[1] - 1 if at == "subject" else len(ids) - 1
    if target is None:
        with torch.no_grad():
            tid = int(mm.hf(input_ids=torch.tensor([ids], device=mm.device)).logits[0, -1].argmax())
    else:
        tid = target_id(mm.tok, target)
    r = rank(mm, ids, tid, pos, method)
    best = r.top(top)
    rows = [{"rank": i + 1, "layer": l, "dim": d, "score": sc, "memory": f"/memory/{l}/{d}",
             "value_tokens": _tokens_of(mm, mm.values(l)[d])} for i, (l, d, sc) in enumerate(best)]
    checks = [{"k": a.k, "p_clean": a.p_clean, "p_top": a.p_top, "drop_top": a.drop_top,
               "drop_random": a.drop_random, "random_interval": a.interval()}
              for a in (run_ablate(mm, ids, tid, r, ks, draws=draws, seed=seed) if ks else [])]
    out = {"text": text, "target": mm.tok.decode([tid]), "position": pos, "token": mm.tok.decode([ids[pos]]),
           "method": method, "memories": rows, "ablation": checks}
    if as_json:
        from ffkv.cli.options import json_text

        print(json_text(out))
        return
    from ffkv.cli.options import print_table
    from ffkv.display import printable

    print(f"facts locate: {printable(text)!s} → {printable(out['target'])!r}; memories at token {pos} "
          f"({printable(out['token'])!r}) by {method}")
    print_table(f"top {len(rows)} memories", rows, ["rank", "layer", "dim", "score", "value_tokens", "memory"],
                {"score": lambda v: f"{v:+.4g}"})
    if checks:
        print_table("ablation check: P(true) with the memories suppressed at that token", checks,
                    ["k", "p_clean", "p_top", "drop_top", "drop_random", "random_interval"],
                    {"p_clean": "{:.4f}".format, "p_top": "{:.4f}".format, "drop_top": "{:+.4f}".format,
                     "drop_random": "{:+.4f}".format,
                     "random_interval": lambda v: f"[{v[0]:+.4f}, {v[1]:+.4f}]"})
    print(f"  pages: `ffkv serve {run_dir}`, then each memory's path above")


def edit(run_dir: Path = RunArg, prompt: str = PromptOpt, subject: str = SubjectOpt,
         new: str = typer.Option(..., "--new", help='The new object, e.g. " Rome" (keep its leading space).'),
         method: str = typer.Option("rome", "--method", help="rome (rank one at --layer), memit (the --span "
                                    "layers ending at --layer), values (the --top located memories' values)."),
         layer: int = typer.Option(..., "--layer", help="The layer edited (MEMIT: the last of its range)."),
         span: int = typer.Option(5, "--span", min=1, max=64, help="MEMIT's layers."),
         top: int = typer.Option(10, "--top", min=1, help="values: memories rewritten."),
         lam: Optional[float] = typer.Option(None, "--lambda", help="memit: C's weight λ, absolute (MEMIT's "
                                             "published 15000 for GPT-J). Default: relative, λ = λ_rel · mean "
                                             "kᵀC⁻¹k of the edited keys (--lambda-rel)."),
         lam_rel: float = typer.Option(MEMIT_LAMBDA_REL, "--lambda-rel", min=0.0, help="memit: λ relative to the "
                                       "edited keys' C-whitened squared norm (a lone fact gets 1/(1+λ_rel) of its "
                                       "share at each layer; MEMIT's 15000 on GPT-J's typical keys)."),
         steps: int = typer.Option(20, "--steps", min=1, max=1000, help="Adam steps of the target (ROME: 20)."),
         clamp: Optional[float] = typer.Option(None, "--clamp", min=0.01, max=100.0, help="How far the target may "
                                               "move, × the norm of what it starts from. Default: the method's "
                                               "published one (ROME and values 4; MEMIT 0.75 of the residual, "
                                               "4 of the raw output behind a post-FFN norm)."),
         prefixes: int = typer.Option(10, "--prefixes", min=0, max=100, help="Context prefixes from the run's sentences."),
         tokens: int = typer.Option(30, "--tokens", min=0, max=1000, help="Greedy tokens shown before and after."),
         name: Optional[str] = typer.Option(None, "--name", help="The edit's folder under RUN/edits (default: "
                                            "method and subject)."),
         export: Optional[Path] = typer.Option(None, "--export", help="Also write the edited model here, a "
                                               "Hugging Face folder `transformers` loads."),
         seed: int = typer.Option(0, "--seed", min=0, help="Seed of the prefixes."),
         device: str = typer.Option("auto", "--device"), dtype: str = typer.Option("auto", "--dtype"),
         as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")) -> None:
    """Change a fact: compute the edit, keep it in the run (a few vectors, never a model copy),
    show the prompt's P(new) and greedy continuation before and after; --export the edited model."""
    from ffkv.steps.facts import edit as E
    from ffkv.steps.facts.data import target_ids
    from ffkv.steps.facts.evaluate import greedy, target_nll

    text = _text(prompt, subject)
    if method not in E.METHODS:
        raise FfkvError(f"--method {method!r}: choose {', '.join(E.METHODS)}")
    if not new.strip():
        raise FfkvError("--new is empty: give the new object, e.g. \" Rome\"")
    if export is not None and export.exists() and (not export.is_dir() or any(export.iterdir())):
        raise FfkvError(f"--export {export} exists and is not an empty folder")
    if name is not None and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}", name):
        raise FfkvError(f"--name {name[:40]!r}: letters, digits, _ . - (up to 80), not starting with . or -")
    name = name or re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{method}-{subject}").strip("-.")[:80] or method
    run, mm = _open(run_dir, device, dtype)
    E.check_layer(mm, layer)
    if not target_ids(mm.tok, new):
        raise FfkvError(f"--new {new!r} has no token")
    from ffkv.store import query

    req = E.Request(prompt, subject, new)
    templates = E.prefixes_from(run, mm.tok, n=prefixes, seed=seed)
    hp = {"steps": steps, **({} if clamp is None else {"clamp": clamp})}
    layers = list(range(max(0, layer - span + 1), layer + 1))
    if method == "rome":
        e = E.rome(mm, layer, req, query.key_covariance(run, layer)[1], templates, hp)
    elif method == "memit":
        e = E.memit(mm, layers, [req], {l: query.key_covariance(run, l)[1] for l in layers}, templates, hp,
                   lam=lam, lam_rel=lam_rel)
    else:
        e = E.values_edit(mm, layer, req, templates, top=top, hp=hp)
    where = run.path / "edits" / name
    e.save(where)  # an edit of that name is replaced whole, once the new one is written
    before = (float(-target_nll(mm, [text], new)[0]), greedy(mm, text, tokens) if tokens else "")
    with E.applied(mm, e):
        after = (float(-target_nll(mm, [text], new)[0]), greedy(mm, text, tokens) if tokens else "")
    if export is not None:
        E.export(mm, e, export)
    out = {"edit": str(where), "method": method, "layers": e.layers, "text": text, "new": new,
           "logp_new": {"before": before[0], "after": after[0]},
           "continuation": {"before": before[1], "after": after[1]}, "export": str(export) if export else None}
    if as_json:
        from ffkv.cli.options import json_text

        print(json_text(out))
        return
    from ffkv.display import printable

    print(f"facts edit ({method}, layer{'s' if len(e.layers) > 1 else ''} {', '.join(map(str, e.layers))}): "
          f"kept in {where}")
    print(f"  mean log P({printable(new)!r} | {printable(text)!r}): {before[0]:.3f} before, {after[0]:.3f} after")
    if tokens:
        print(f"  before: {printable(text + before[1], newlines=False)}")
        print(f"  after:  {printable(text + after[1], newlines=False)}")
    if export is not None:
        print(f"  exported: {export} (loads with transformers.AutoModelForCausalLM.from_pretrained)")


def app() -> typer.Typer:
    """The `ffkv facts` group."""
    from ffkv.steps.cli import command
    from ffkv.steps.facts import EVALUATE, STEP

    sub = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    sub.command(name="trace", help="Causal tracing (Meng et al. 2022): noise the subject, restore one state at "
                                   "a time, measure how much of P(true object) comes back. Table fact_traces; "
                                   "heatmaps and ROME's verdict in the report.")(command(STEP))
    sub.command(name="locate")(locate)
    sub.command(name="edit")(edit)
    sub.command(name="evaluate", help=EVALUATE.help)(command(EVALUATE))
    return sub
