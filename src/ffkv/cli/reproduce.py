"""`ffkv reproduce`: the whole paper in one command."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, DtypeOpt


def reproduce(run_dir: Path = typer.Argument(Path("runs/default"), metavar="[RUN]", help="Run directory (created or resumed)."),
              model_name: Optional[str] = typer.Option(None, "--model", "-m", help="HF id, folder or .gguf (default: embedded SmolLM2), e.g. gpt2."),
              corpus: Optional[str] = typer.Option(None, "--corpus", "-c", help="Mining corpus (default wikipedia:train), e.g. wikitext-103:train or a file."),
              compose_corpus: Optional[str] = typer.Option(None, "--compose-corpus", help="Held-out corpus for compose and normalize (default wikipedia:valid)."),
              preset: str = typer.Option("default", "--preset", help="default (about 9 minutes on a 2-core CPU) or full (every sentence of the corpus, the paper's 4,000 prefixes (2 from some sentences) and 100 keys per layer, every layer for normalize; about 90 minutes on a 2-core CPU); flags below override it."),
              sentences: Optional[int] = typer.Option(None, "--sentences", min=1, help="Sentences to mine (default 1,500; the paper: all of WikiText-103 train)."),
              top_k: Optional[int] = typer.Option(None, "--top-k", min=1, help="Trigger examples per key (default 50)."),
              prefixes: Optional[int] = typer.Option(None, "--prefixes", min=1, help="Held-out prefixes for compose (default 1,000; the paper: 4,000)."),
              prefixes_per_sentence: Optional[int] = typer.Option(None, "--prefixes-per-sentence", min=1, help="Compose's --per-sentence: up to this many prefixes of one held-out sentence when sentences run short (default 1; full preset 2)."),
              keys_per_layer: Optional[int] = typer.Option(None, "--keys-per-layer", min=1, help="Keys per layer for mutate (default 3; the paper: 100)."),
              semantic_keys_per_layer: Optional[int] = typer.Option(None, "--semantic-keys-per-layer", min=0, help="Keys per layer given semantic patterns (default 10, as the paper)."),
              semantic: bool = typer.Option(True, "--semantic/--no-semantic", help="Semantic patterns too (needs the sentence encoder package); --no-semantic: shallow patterns only."),
              negative: Optional[bool] = typer.Option(None, "--negative/--no-negative", help="Mine most-negative triggers too (default: when the FFN is gated)."),
              seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed of every sample."),
              device: str = DeviceOpt, dtype: str = DtypeOpt):
    """Run every experiment of the paper (mine, values, compose, mutate, patterns, normalize) and build
    the report. The defaults take about 9 minutes on a 2-core CPU; a killed run resumes where it
    stopped. Compare two runs' verdicts with `ffkv verdicts RUN_A RUN_B`.

    Scale up for real studies, e.g. --sentences 1000000 --device cuda, --model gpt2,
    --corpus wikitext-103:train.
    """
    from ffkv.reproduce import preset as make_preset, reproduce as run_reproduce, summary_lines

    typed = {"sentences": sentences, "top_k": top_k, "prefixes": prefixes,
             "prefixes_per_sentence": prefixes_per_sentence, "keys_per_layer": keys_per_layer,
             "semantic_keys_per_layer": semantic_keys_per_layer}
    s = make_preset(preset, model=model_name, corpus=corpus, compose_corpus=compose_corpus, negative=negative,
                    semantic=semantic, device=device, dtype=dtype, seed=seed, **{k: v for k, v in typed.items() if v is not None})
    res = run_reproduce(run_dir, s, show=show_step)
    print()
    for line in summary_lines(run_dir, res["times"])[:10]:
        print(line)
    print(f"report: {res['report']}")


def show_step(step: str, run, out) -> None:
    """Print a step's outcome as its own command prints it (`Step.summary`)."""
    from ffkv.steps.registry import get

    st = get(step)
    if st.summary is not None:
        st.summary(run, out, None, False)
    else:
        print(f"{step}: {'already done' if out.skipped else 'done'}")


def register(app: typer.Typer) -> None:
    app.command()(reproduce)
