"""`ffkv mine` and `ffkv show`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, DtypeOpt, JsonOpt, LensOpt, ModelOpt, model, open_run
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
         batch_tokens: int = typer.Option(2048, "--batch-tokens", min=16, help="Token budget per batch (length-packed)."),
         checkpoint_every: float = typer.Option(60.0, "--checkpoint-every", min=0, help="Seconds between checkpoints."),
         ray: Optional[str] = typer.Option(None, "--ray", help="Mine shards on Ray: auto, local, or a cluster ADDRESS."),
         shards: int = typer.Option(2, "--shards", min=1, help="Number of shards with --ray."),
         device: str = DeviceOpt, dtype: str = DtypeOpt, lens: str = LensOpt):
    """Find each key's top-t trigger prefixes in a corpus (the paper's §3.1).

    One forward pass per batch yields every prefix's coefficient (causal masking).
    Resumable: rerun the same command after a crash. Tables: sentences, triggers, vocab.
    """
    from ffkv.mine.runner import MineSettings, mine as run_mine
    from ffkv.parse import parse_int_list

    mm = model(model_name, device, dtype, lens)
    s = MineSettings(corpus=corpus, max_sentences=max_sentences, seed=seed, field=field,
                     layers=parse_int_list(layers, mm.n_layers, "layers"),
                     dims=parse_int_list(dims, mm.d_m, "dims"), top_k=top_k, negative=negative,
                     per_prefix=per_prefix, batch_tokens=batch_tokens)
    if out.exists() and not out.is_dir():
        raise FfkvError(f"--out {out} exists and is not a directory")
    run = open_run(out, create=True)
    info = run_mine(run, mm, s, checkpoint_every=checkpoint_every, ray_address=ray, shards=shards)
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
         as_json: bool = JsonOpt):
    """Print a key's top trigger prefixes, trigger token marked, coefficient beside each."""
    from ffkv.store.query import key_triggers
    from ffkv.store.steps import require

    if sign not in ("both", "+1", "1", "-1"):
        raise FfkvError("--sign must be +1, -1 or both")
    run = open_run(run_dir)
    require(run, "mine")
    rows = key_triggers(run, layer, dim, None if sign == "both" else int(sign), top)
    if as_json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return
    from rich.console import Console
    from rich.markup import escape

    con = Console(highlight=False)
    con.print(f"[bold]key {layer}/{dim}[/bold] ({run_dir})")
    for r in rows:
        pre = r["prefix_tokens"][:-1]
        if context:
            pre = pre[-context:]
        nt = repr(r["next_token_text"]) if r["next_token_text"] is not None else "(end)"
        con.print(f"{'+' if r['sign'] > 0 else '-'}{r['rank']:>3} {r['coef']:+9.3f}  "
                  f"{'…' if context and len(r['prefix_tokens']) - 1 > context else ''}"
                  f"{escape(''.join(pre))}[reverse]{escape(r['prefix_tokens'][-1])}[/reverse]"
                  f"  → {escape(nt)}")


def register(app: typer.Typer) -> None:
    app.command()(mine)
    app.command()(show)
