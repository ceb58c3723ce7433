"""`ffkv info`, `ffkv explain`, `ffkv corpus`: commands on a model or a corpus, not a run."""
from __future__ import annotations

import json
from typing import Optional

import typer

from ffkv.cli.options import LensOpt, ModelOpt, model


def register(app: typer.Typer) -> None:
    @app.command()
    def info(model_name: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="HF id, folder or .gguf; default: embedded SmolLM2."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")):
        """Describe a model as key-value memories: layers, d, d_m, activation, gating, vocabulary."""
        mm = model(model_name)
        inf = mm.info()
        if as_json:
            print(json.dumps(inf, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(show_header=False, title="ffkv info")
        for k, v in inf.items():
            t.add_row(k, str(v))
        t.add_row("memories (detail)", f"{inf['layers']} layers × {inf['d_m']} = {inf['memories']:,}")
        Console().print(t)


    @app.command()
    def explain(text: str = typer.Argument(..., help="A prefix; ffkv explains the next-token prediction."),
                model_name: Optional[str] = ModelOpt, lens: str = LensOpt,
                top: int = typer.Option(3, "--top", help="Memories shown per layer."),
                as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")):
        """Explain one prediction layer by layer: residual, FFN and the memories that push it."""
        from ffkv.experiments.explain import explain as run_explain

        res = run_explain(model(model_name, lens=lens), text, top)
        if as_json:
            print(json.dumps(res, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{text!r} → {res['prediction']!r} (p={res['p']:.2f}); lens={lens}")
        for c in ("layer", "top(r)", "top(y)", "top(o)", "p(w|r)", "memories pushing w (dim: coef → value top)"):
            t.add_column(c)
        for r in res["layers"]:
            mem = "; ".join(f"{m['dim']}: {m['coef']:+.2f}→{m['value_top']!r}" for m in r["memories"])
            t.add_row(str(r["layer"]), repr(r["top_r"]), repr(r["top_y"]), repr(r["top_o"]),
                      f"{r['p_final_in_r']:.3f}", mem)
        Console().print(t)


    @app.command()
    def corpus(source: Optional[str] = typer.Argument(None, metavar="[SOURCE]", help="wikipedia[:train|valid], a .tokens/.jsonl/.txt file, hf:NAME[/CONFIG][:SPLIT]. Default: embedded Wikipedia."),
               model_name: Optional[str] = ModelOpt,
               max_sentences: Optional[int] = typer.Option(None, "--max-sentences", min=1, help="Cap on sentences."),
               field: str = typer.Option("text", "--field", help="JSONL field holding the text."),
               seed: int = typer.Option(0, "--seed", help="Seed of the document order."),
               head: int = typer.Option(5, "--head", help="Sentences to print."),
               as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")):
        """Count a corpus as the model sees it: documents, sentences, tokens, truncations."""
        from ffkv.corpus.sources import open_corpus, tokenize

        mm = model(model_name)
        src = open_corpus(source, field=field, seed=seed)
        sents = src.sentences(max_sentences=max_sentences)
        ids, n_trunc = tokenize(mm.tok, sents, mm.max_length)
        counts = {"source": src.spec, "sha256": src.sha256, **src.stats.as_dict(),
                  "tokens": sum(map(len, ids)), "truncated": n_trunc}
        if as_json:
            print(json.dumps({**counts, "head": [s.text for s in sents[:head]]}, indent=2))
            return
        for k, v in counts.items():
            print(f"{k:>15}: {v}")
        for s in sents[:head]:
            print(f"  [{s.sentence_id}] {s.text}")
