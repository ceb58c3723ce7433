"""`ffkv show`: one key of a mined run, its triggers and activation statistics."""
from __future__ import annotations

from pathlib import Path

import typer

from ffkv.cli.options import JsonOpt, json_text, open_run
from ffkv.errors import FfkvError


def show(run_dir: Path = typer.Argument(..., metavar="RUN", help="A mined run directory."),
         layer: int = typer.Option(..., "--layer", "-l", min=0, max=2**31 - 1, help="Layer of the key."),
         dim: int = typer.Option(..., "--dim", "-d", min=0, max=2**31 - 1, help="Index of the key in its layer."),
         sign: str = typer.Option("both", "--sign", help="+1, -1 or both."),
         top: int = typer.Option(10, "--top", "-n", min=1, help="Prefixes to print."),
         context: int = typer.Option(12, "--context", help="Tokens of the prefix shown before the trigger token (0: all)."),
         samples: int = typer.Option(1, "--samples", min=0, help="Quantile samples shown per histogram bin (0: none)."),
         as_json: bool = JsonOpt):
    """Print a key's top trigger prefixes, trigger token marked, coefficient beside each; then its
    activation statistics and quantile samples (runs mined with statistics)."""
    from ffkv.store.query import key_hist, key_samples, key_stats, key_triggers
    from ffkv.steps.lifecycle import require

    if sign not in ("both", "+1", "1", "-1"):
        raise FfkvError("--sign must be +1, -1 or both")
    run = open_run(run_dir)
    require(run, "mine")
    rows = key_triggers(run, layer, dim, None if sign == "both" else int(sign), top)
    if as_json:
        print(json_text(rows))
        return
    from rich.console import Console
    from rich.markup import escape

    from ffkv.display import printable

    con = Console(highlight=False)
    con.print(f"[bold]key {layer}/{dim}[/bold] ({escape(printable(str(run_dir)))})")

    def safe(text: str) -> str:  # corpus and vocabulary text: escapes shown, never sent to the terminal
        return escape(printable(text, newlines=False))

    def prefix(toks) -> str:
        pre = toks[:-1][-context:] if context else toks[:-1]
        return (f"{'…' if context and len(toks) - 1 > context else ''}"
                f"{safe(''.join(pre))}[reverse]{safe(toks[-1])}[/reverse]")

    for r in rows:
        nt = f"'{printable(r['next_token_text'], newlines=False)}'" if r["next_token_text"] is not None else "(end)"
        con.print(f"{'+' if r['sign'] > 0 else '-'}{r['rank']:>3} {r['coef']:+9.3f}  {prefix(r['prefix_tokens'])}"
                  f"  → {escape(nt)}")
    signs = None if sign == "both" else {int(sign)}
    st = [r for r in key_stats(run, layer, dim) if signs is None or r["sign"] in signs]
    if not st:
        con.print("[dim]no activation statistics in this run (mined before they existed, or with --no-stats)[/dim]")
        return
    hist = key_hist(run, layer, dim)
    for r in st:
        con.print(stats_line(r))
    if samples:
        smp = [x for x in key_samples(run, layer, dim) if signs is None or x["sign"] in signs]
        shown: dict[tuple[int, int], int] = {}
        for x in smp:
            k = (x["sign"], x["bin"])
            if shown.get(k, 0) >= samples:
                continue
            if k not in shown:
                con.print(f"[bold]{bin_label(hist, x['bin'])}[/bold]  {hist['count'][x['bin']]:,} tokens")
            shown[k] = shown.get(k, 0) + 1
            con.print(f"      {x['coef']:+9.3f}  {prefix(x['prefix_tokens'])}")


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3g}"


def stats_line(r: dict) -> str:
    """One line of a key's statistics on one side (a `key_stats` row)."""
    side = "m > 0" if r["sign"] > 0 else "m < 0"
    ph = r.get("pos_hist") or []
    return (f"stats {'+' if r['sign'] > 0 else '-'}: density {r['frac_active']:.1%} ({side}), "
            f"strong {r['frac_strong']:.2%} (|m| > 10% of {_g(r['max'])}), mean {r['mean']:+.3g} ± {r['std']:.3g} "
            f"over {r['count']:,} tokens; p50/p90/p99 {_g(r['p50'])}/{_g(r['p90'])}/{_g(r['p99'])} (histogram); "
            f"best on the first token in {r['first_share']:.0%} of {r['sentences']:,} sentences"
            + (f" (positions 0|1|2-3|4-7|8+: {'|'.join(str(v) for v in ph[:4] + [sum(ph[4:])])})" if ph else ""))


def bin_label(hist: dict, b: int) -> str:
    """'bin 33: m in [0.5, 1)' (negative side: 'm in (-1, -0.5]')."""
    lo, hi, sg = hist["lo"][b], hist["hi"][b], hist["sign"][b]
    h = "inf" if hi is None else f"{hi:g}"
    if sg == 0:
        return f"bin {b}: |m| < {h}"
    if sg > 0:
        return f"bin {b}: m in [{lo:g}, {h})"
    return f"bin {b}: m in ({'-inf' if hi is None else f'{-hi:g}'}, {-lo:g}]"


def register(app: typer.Typer) -> None:
    app.command()(show)
