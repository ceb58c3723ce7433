"""`ffkv mine` and `ffkv show`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, JsonOpt, LensOpt, ModelOpt, json_text, model, open_run
from ffkv.errors import FfkvError


def mine(out: Path = typer.Option(..., "--out", "-o", help="Run directory to create or resume."),
         model_name: Optional[str] = ModelOpt,
         corpus: str = typer.Option("wikipedia:train", "--corpus", "-c", help="Corpus source (see `ffkv corpus --help`). Default: the embedded Wikipedia's train split (compose holds out wikipedia:valid)."),
         max_sentences: Optional[int] = typer.Option(None, "--max-sentences", min=1, help="Cap on sentences (after a seeded shuffle of documents)."),
         field: str = typer.Option("text", "--field", help="JSONL field holding the text."),
         seed: int = typer.Option(0, "--seed", help="Seed of the document order."),
         layers: Optional[str] = typer.Option(None, "--layers", help="Layers to mine, e.g. 0,5,10-12. Default: all."),
         dims: Optional[str] = typer.Option(None, "--dims", help="Memory dims to mine, e.g. 0-99. Default: all."),
         top_k: int = typer.Option(50, "--top-k", "-t", min=1, max=10000, help="Trigger examples kept per key."),
         negative: bool = typer.Option(False, "--negative", help="Also keep the most negative coefficients (sign=-1)."),
         per_prefix: bool = typer.Option(False, "--per-prefix", help="Allow several prefixes of one sentence per key."),
         batch_tokens: str = typer.Option("auto", "--batch-tokens", help="Token budget per batch (length-packed; "
                                          "speed and memory only): auto (2,048 on a CPU; on CUDA sized from free "
                                          "memory and the model's shape) or a number >= 16."),
         stats: bool = typer.Option(True, "--stats/--no-stats", help="Also keep every key's activation statistics "
                                    "(histogram, density, quantile samples, positions) from the same pass."),
         samples_per_bin: int = typer.Option(5, "--samples-per-bin", min=0, max=1000,
                                             help="Quantile samples kept per key, sign and histogram bin."),
         checkpoint_every: float = typer.Option(60.0, "--checkpoint-every", min=0, help="Seconds between checkpoints."),
         ray: Optional[str] = typer.Option(None, "--ray", help="Mine shards on Ray: auto, local, or a cluster ADDRESS."),
         shards: int = typer.Option(2, "--shards", min=1, help="Number of shards with --ray."),
         force: bool = typer.Option(False, "--force", help="Mine again from scratch into the same run, with its "
                                    "own model and settings, replacing the step's tables (e.g. one that was "
                                    "damaged); without it a killed run resumes and a finished one is skipped."),
         overwrite: bool = typer.Option(False, "--overwrite", help="Start afresh in --out although it holds a run "
                                        "(or a damaged one): its manifest, checkpoint and tables are deleted first; "
                                        "annotations and files that are not ffkv's are kept."),
         device: str = DeviceOpt,
         dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on a CUDA device that supports it, "
                                   "float32 on a CPU; the manifest records the choice), float32, float16, bfloat16."),
         lens: str = LensOpt):
    """Find each key's top-t trigger prefixes in a corpus (the paper's §3.1).

    One forward pass per batch yields every prefix's coefficient (causal masking).
    Resumable: rerun the same command after a crash. Tables: sentences, triggers, vocab, and
    (unless --no-stats) key_stats, key_hist, key_samples. --out must be a new or empty folder,
    or a run of this model.
    """
    from ffkv.mine.runner import MineSettings, check_batch_tokens, mine as run_mine
    from ffkv.parse import parse_int_list

    batch_tokens = check_batch_tokens(batch_tokens)  # before the model loads
    mm = model(model_name, device, dtype, lens)
    s = MineSettings(corpus=corpus, max_sentences=max_sentences, seed=seed, field=field,
                     layers=parse_int_list(layers, mm.n_layers, "layers"),
                     dims=parse_int_list(dims, mm.d_m, "dims"), top_k=top_k, negative=negative,
                     per_prefix=per_prefix, batch_tokens=batch_tokens, stats=stats,
                     samples_per_bin=samples_per_bin)
    if out.exists() and not out.is_dir():
        raise FfkvError(f"--out {out} exists and is not a directory")
    run = open_run(out, create=True, overwrite=overwrite)
    info = run_mine(run, mm, s, checkpoint_every=checkpoint_every, ray_address=ray, shards=shards, force=force)
    print_mined(run, info)


def print_mined(run, info: dict) -> None:
    c = run.manifest.get("corpus", {}).get("counts", {})
    print(f"mined {c.get('sentences')} sentences ({c.get('tokens')} tokens, {c.get('truncated', 0)} truncated) "
          f"into {run.path}: {info.get('rows')} trigger rows, padding {info.get('padding_share', 0):.1%}, "
          f"{info.get('tokens_per_s')} tok/s")


def show(run_dir: Path = typer.Argument(..., metavar="RUN", help="A mined run directory."),
         layer: int = typer.Option(..., "--layer", "-l", help="Layer of the key."),
         dim: int = typer.Option(..., "--dim", "-d", help="Index of the key in its layer."),
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
    app.command()(mine)
    app.command()(show)
