"""`ffkv normalize`: normalized vs unnormalized memories (softmax, ReLU, scaled ReLU) on the model's own FFNs."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelOpt, open_run, open_run_with_model


def _layers(text: Optional[str], what: str, none_ok: bool = False):
    from ffkv.parse import parse_ranges

    if text is None or text.strip() in ("", "all", "auto"):
        return None
    if none_ok and text.strip() == "none":
        return ()
    out = parse_ranges(text, what)
    if not out:
        from ffkv.errors import FfkvError

        raise FfkvError(f"{what} {text!r} selects nothing")
    return tuple(out)


def normalize(run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory (created if it has no manifest)."),
              corpus: Optional[str] = typer.Option(None, "--corpus", help="Held-out text: wikipedia:valid (default), a .tokens/.jsonl/.txt file, hf:NAME[:SPLIT]."),
              tokens: int = typer.Option(10_000, "--tokens", help="Tokens of the evaluation split (losses, concentration)."),
              fit_tokens: int = typer.Option(2_000, "--fit-tokens", help="Tokens of the fit split (τ and scales), from other documents."),
              sweep_tokens: int = typer.Option(3_000, "--sweep-tokens", help="The first evaluation tokens that also get the capacity sweep and the variance on the model (0: neither)."),
              layers: Optional[str] = typer.Option(None, "--layers", help="Layers to measure and substitute, e.g. 0-29 or 0,10,20 (default: all)."),
              capacity_layers: Optional[str] = typer.Option(None, "--capacity-layers", help="Layers of the capacity sweep (default: a low, a middle and a high one; none: no sweep)."),
              capacity_n: Optional[str] = typer.Option(None, "--capacity-n", help="Slot counts of the sweep, e.g. 16,64,256 (default: 16, 64, 256, … below d_m; d_m is always added)."),
              variance_repeats: int = typer.Option(4, "--variance-repeats", help="Random memory subsets per size for the variance on the model."),
              synthetic_draws: int = typer.Option(2_000, "--synthetic-draws", help="Samples per n of the synthetic variance check."),
              gamma: float = typer.Option(1.0, "--gamma", help="γ of the scaled ReLU in the variance measures."),
              seed: int = typer.Option(0, "--seed", help="Seed of the document order and of the random slot draws."),
              batch_tokens: int = typer.Option(1024, "--batch-tokens", help="Token budget of one forward batch (speed and memory only)."),
              force: bool = typer.Option(False, "--force", help="Redo the step even if it is done with the same settings."),
              as_json: bool = JsonOpt,
              model_name: Optional[str] = ModelOpt, device: str = DeviceOpt, dtype: str = DtypeOpt):
    """Softmax vs ReLU memories on the model's own FFNs: how concentrated the weights are (C1), the
    held-out loss with one layer's FFN replaced by a softmax memory or a scaled ReLU (C2, C5), a
    capacity sweep over n slots (C2), and the output variance against n, synthetic and on the model
    (C3, C4). Prints a verdict per claim."""
    from ffkv.errors import FfkvError
    from ffkv.experiments.normalize import NormalizeSettings
    from ffkv.parse import parse_ranges
    from ffkv.store.run import MANIFEST
    from ffkv.store.steps import execute

    if run_dir.exists() and not run_dir.is_dir():
        raise FfkvError(f"{run_dir} is a file, not a run directory")
    s = NormalizeSettings(corpus=corpus, tokens=tokens, fit_tokens=fit_tokens, sweep_tokens=sweep_tokens,
                          layers=_layers(layers, "--layers"),
                          capacity_layers=_layers(capacity_layers, "--capacity-layers", none_ok=True),
                          capacity_n=tuple(parse_ranges(capacity_n, "--capacity-n")) if capacity_n else None,
                          variance_repeats=variance_repeats, synthetic_draws=synthetic_draws, gamma=gamma,
                          seed=seed, batch_tokens=batch_tokens, dtype=dtype)
    from ffkv.experiments.normalize.step import record

    if (run_dir / MANIFEST).exists():
        record(open_run(run_dir), s)  # bad settings fail before a model is loaded
    run, mm = open_run_with_model(run_dir, model_name, device, dtype)
    out = execute(run, "normalize", s, mm=mm, model_name=model_name, device=device, dtype=dtype, force=force,
                  warn=lambda msg: print(f"ffkv: note: {msg}", file=sys.stderr))
    print_normalize(run, out, as_json)


def verdicts(run) -> dict:
    """{claim id: Verdict} from the run's tables."""
    from ffkv.report import normalize as N

    get = {t: run.read_table(t) if run.has_table(t) else None
           for t in ("normalize_layers", "normalize_capacity", "normalize_variance")}
    return {cid: fn(get[table]) for cid, (_, table, fn, _) in N.CLAIMS.items()}


def print_normalize(run, out, as_json: bool = False) -> None:
    if out.skipped:
        print(f"normalize: already done in {run.path} with these settings; summary below (--force to redo)",
              file=sys.stderr)
    vs = verdicts(run)
    if as_json:
        print(json.dumps({"status": out.status, "info": out.info,
                          "verdicts": {k: v._asdict() for k, v in vs.items()}}, indent=2, default=str))
        return
    _print_layers(run)
    for cid, v in vs.items():
        print(f"{cid[5:].upper()}: {v.verdict} — {v.measured}")
    info = out.info
    print(f"{info.get('eval_tokens')} evaluation tokens ({info.get('eval_sentences')} sentences), "
          f"{info.get('fit_tokens')} fit tokens; fit {info.get('seconds_fit')} s, substitution "
          f"{info.get('seconds_substitute')} s; tables normalize_* in {run.path}; criteria in the report "
          f"(`ffkv report {run.path}`) or with --json")


def _print_layers(run) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = run.read_table("normalize_layers").to_pylist()
    by = {(r["layer"], r["variant"]): r for r in rows}
    first = rows[0]
    t = Table(title=f"ffkv normalize: one FFN replaced at a time; intact loss {first['loss_intact']:.3f} nats "
                    f"(ppl {first['ppl_intact']:.2f}) on {first['tokens']} predicted tokens")
    for c in ("layer", "τ / RMS|m|", "softmax Δloss", "scaled ReLU Δloss", "entropy |m|", "entropy softmax",
              "top-10 |m|", "top-10 softmax", "softmax output err"):
        t.add_column(c, justify="right")
    for layer in sorted({r["layer"] for r in rows}):
        sm, rl = by[(layer, "softmax")], by[(layer, "scaled_relu")]
        t.add_row(str(layer), f"{sm['tau_rel']:.3g}", f"{sm['delta_loss']:+.3f} ± {sm['delta_loss_se']:.3f}",
                  f"{rl['delta_loss']:+.3f} ± {rl['delta_loss_se']:.3f}", f"{sm['entropy_m']:.2f}",
                  f"{sm['entropy_w']:.2f}", _pct(sm["top10_m"]), _pct(sm["top10_w"]), _pct(sm["eval_rel_err"]))
    Console(width=None if sys.stdout.isatty() else 200).print(t)


def _pct(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def register(app: typer.Typer) -> None:
    app.command()(normalize)
