"""`ffkv compose`: the paper's §5 (Figs 7-11 and last-layer cases) on held-out prefixes."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, DtypeOpt, ModelOpt, open_run_with_model


def compose(run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory (created if it has no manifest)."),
            corpus: Optional[str] = typer.Option(None, "--corpus", help="Held-out corpus: wikipedia:valid (default), a .tokens/.jsonl/.txt file, hf:NAME[:SPLIT]."),
            prefixes: int = typer.Option(4000, "--prefixes", "-n", help="Prefixes to sample, one per sentence (the paper: 4,000)."),
            seed: int = typer.Option(0, "--seed", help="Seed of the document order, the sentence sample and the positions."),
            eps: float = typer.Option(0.1, "--eps", help="Also count a memory active when |m_i| > eps (SiLU/GELU are rarely exactly 0)."),
            max_sentences: Optional[int] = typer.Option(None, "--max-sentences", help="Read at most this many sentences of the corpus."),
            batch_tokens: int = typer.Option(2048, "--batch-tokens", help="Token budget of one forward batch."),
            per_sentence: int = typer.Option(1, "--per-sentence", help="When the corpus has fewer usable sentences than --prefixes, take up to this many distinct positions of a sentence (a second one only after every sentence gave one). 1 (default): one per sentence, fewer prefixes."),
            lens: str = typer.Option("norm", "--lens", help="Lens shown first in the summary (both are always computed): naive or norm."),
            cases: int = typer.Option(5, "--cases", help="Last-layer cases to print (all are in compose_cases)."),
            force: bool = typer.Option(False, "--force", help="Redo the step even if it is done with the same settings."),
            model_name: Optional[str] = ModelOpt, device: str = DeviceOpt, dtype: str = DtypeOpt):
    """Figs 7-11: active memories, compositional layers, the residual's share of the decision,
    confidence per layer, the residual/ffn/agreement/composition breakdown, last-layer cases."""
    from ffkv.defs import check_lens
    from ffkv.errors import FfkvError
    from ffkv.experiments.compose import ComposeSettings

    if prefixes < 1:
        raise FfkvError(f"--prefixes must be at least 1 (got {prefixes})")
    check_lens(lens)
    if max_sentences is not None and max_sentences < 1:
        raise FfkvError(f"--max-sentences must be at least 1 (got {max_sentences})")
    if per_sentence < 1:
        raise FfkvError(f"--per-sentence must be at least 1 (got {per_sentence})")
    run, mm = open_run_with_model(run_dir, model_name, device, dtype)
    s = ComposeSettings(corpus=corpus, n_prefixes=prefixes, seed=seed, eps=eps, max_sentences=max_sentences,
                        batch_tokens=batch_tokens, per_sentence=per_sentence)
    out = run_compose_step(run, s, mm=mm, model_name=model_name, device=device, dtype=dtype, force=force)
    print_compose(run, out, lens, cases)


def run_compose_step(run, s, **kw):
    from ffkv.store.steps import execute

    return execute(run, "compose", s, warn=lambda msg: print(f"ffkv: note: {msg}", file=sys.stderr), **kw)


def print_compose(run, out, lens: str = "norm", cases: int = 5) -> None:
    from ffkv.experiments.compose import print_summary

    if out.skipped:
        print(f"compose: already done in {run.path} with these settings; summary below "
              f"(--force to redo)", file=sys.stderr)
    print_summary(run, lens=lens, cases=cases)


def register(app: typer.Typer) -> None:
    app.command()(compose)
