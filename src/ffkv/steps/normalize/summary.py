"""What `ffkv normalize` prints: the per-layer table and a verdict per claim (C1-C5)."""
from __future__ import annotations

import json
import math
import sys


def verdicts(run) -> dict:
    """{claim id: Verdict} from the run's tables."""
    from ffkv.steps.normalize import report as N

    get = {t: run.read_table(t) if run.has_table(t) else None
           for t in ("normalize_layers", "normalize_capacity", "normalize_variance")}
    return {cid: fn(get[table]) for cid, (_, table, fn, _) in N.CLAIMS.items()}


def summary(run, out, s=None, as_json: bool = False) -> None:
    """The step's summary (`Step.summary`)."""
    print_normalize(run, out, as_json)


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
