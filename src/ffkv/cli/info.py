"""`ffkv info`, `ffkv explain`, `ffkv corpus`: commands on a model or a corpus, not a run."""
from __future__ import annotations

import json
from typing import Optional

import typer

from ffkv.cli.options import DeviceOpt, DtypeOpt, LensOpt, ModelOpt, model
from ffkv.defs import CORPUS_CONTEXT
from ffkv.errors import FfkvError


def info(model_name: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="HF id, folder or .gguf; default: embedded SmolLM2."),
         as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")):
    """Describe a model as key-value memories: layers, d, d_m, activation, gating, vocabulary."""
    from ffkv.model.load import model_shape

    model_shape(model_name)  # an unsupported or broken model is refused before its weights load
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



def explain(text: str = typer.Argument(..., help="A prefix; ffkv explains the next-token prediction."),
            model_name: Optional[str] = ModelOpt, lens: str = LensOpt,
            top: int = typer.Option(3, "--top", min=1, help="Memories shown per layer."),
            suppress: Optional[str] = typer.Option(None, "--suppress", metavar="L:D[,L:D...]", help="Memories to edit: L:D scales memory D of layer L by --scale (default 0: suppress it); L:D*F scales it by F; L:D=V sets its coefficient to V."),
            scale: float = typer.Option(0.0, "--scale", help="Factor for the L:D items of --suppress (1 leaves them unchanged)."),
            at: str = typer.Option("last", "--at", help="Edit the coefficients at the last position or at all positions."),
            contrast: Optional[str] = typer.Option(None, "--contrast", metavar="TOKEN", help="A second token to read beside the prediction (text that is one token, e.g. ' London')."),
            truncate: Optional[str] = typer.Option(None, "--truncate", metavar="left|right", help="A text longer than the model's context is refused; left: keep its end, right: keep its start (said on stderr and in the JSON)."),
            pos: Optional[int] = typer.Option(None, "--pos", help="The position explained, 0-based (negative: from the end; default the last token): its prediction of the next token, read from the tokens up to it; --at last edits it."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
            device: str = DeviceOpt, dtype: str = DtypeOpt):
    """Explain one prediction layer by layer: residual, FFN and the memories that push it; optionally
    with chosen memories suppressed, scaled or set."""
    import sys

    from ffkv.defs import check_lens
    from ffkv.model.context import check_truncate, truncation_note
    from ffkv.model.load import model_shape
    from ffkv.parse import parse_interventions

    if at not in ("last", "all"):
        raise FfkvError(f"--at {at!r}: choose last or all")
    truncate = check_truncate(truncate)
    check_lens(lens)
    parse_interventions(suppress, scale=scale)  # the spec's form, before anything is read
    shape = model_shape(model_name) or {}  # its shape from the config: no weight loaded yet
    parse_interventions(suppress, shape.get("layers"), shape.get("d_m"), scale=scale)
    mm = model(model_name, device=device, dtype=dtype, lens=lens)
    from ffkv.web.explain import explain as run_explain  # torch: after the model's checks

    edits = parse_interventions(suppress, mm.n_layers, mm.d_m, scale=scale)
    res = run_explain(mm, text, top, edits, at=at, contrast=contrast, truncate=truncate, pos=pos)
    note = truncation_note(res["truncated"])
    if note:
        print(note, file=sys.stderr)
    if as_json:
        print(json.dumps(res, indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    after = res["intervened"]
    shown = text if pos is None else "".join(res["tokens"][:res["pos"] + 1])  # what the prediction reads
    t = Table(title=escape(f"{shown!r} → {res['prediction']!r} (p={res['p']:.2f}); lens={lens}"
                           + ("" if pos is None else f"; position {res['pos']} of {res['n_tokens']}")))
    cols = ["layer", "top(r)", "top(y)", "top(o)", "p(w|r)", "memories pushing w (dim: coef → value top)"]
    if after:
        cols += ["top(o) edited", "p(w|o) edited"]
    for c in cols:
        t.add_column(escape(c))
    for i, r in enumerate(res["layers"]):
        mem = "; ".join(f"{m['dim']}: {m['coef']:+.2f}→{m['value_top']!r}" for m in r["memories"])
        row = [str(r["layer"]), repr(r["top_r"]), repr(r["top_y"]), repr(r["top_o"]),
               f"{r['p_final_in_r']:.3f}", mem]
        if after:
            e = after["layers"][i]
            row += [repr(e["top_o"]), f"{e['lenses'][res['lens']]['o']['p']:.3f}"]
        t.add_row(*map(escape, row))
    con = Console()
    con.print(t)
    w = res["prediction"]
    lines = []
    if res["contrast"]:
        c = res["contrast"]
        lines.append(f"contrast {c['token']!r}: p={c['p']:.3f}, rank {c['rank'] + 1}"
                     + (f" → p={after['contrast']['p']:.3f}, rank {after['contrast']['rank'] + 1}" if after else ""))
    lines.append(f"contributions in {res['contrib_units']}")
    lines.append("strongest memories for " + repr(w) + " (layer:dim contribution): up "
                 + ", ".join(f"{m['layer']}:{m['dim']} {m['contrib']:+.2f}" for m in res["top_memories"]["up"])
                 + "; down " + ", ".join(f"{m['layer']}:{m['dim']} {m['contrib']:+.2f}"
                                         for m in res["top_memories"]["down"]))
    for e in res["interventions"]:
        lines.append(f"edit {e['edit']} at {res['at']}: coefficient {e['coef']:+.3f} → {e['coef_after']:+.3f}"
                     f" (its contribution to {w!r} was {e['contrib']:+.3f})")
    if after:
        lines.append(f"prediction {w!r} (p={res['p']:.3f}) → {after['prediction']!r} (p={after['p']:.3f}); "
                     f"p({w!r}) {res['p']:.3f} → {after['p_original']:.3f}, logit {res['logit']:+.3f} → "
                     f"{after['logit_original']:+.3f}" + (" (changed)" if res["changed"] else " (unchanged)"))
    for line in lines:
        con.print(escape(line), highlight=False)



def corpus(source: Optional[str] = typer.Argument(None, metavar="[SOURCE]", help="wikipedia (or wikipedia:train, wikipedia:valid), a .tokens/.jsonl/.txt file, hf:NAME (hf:NAME/CONFIG:SPLIT); token ids: a .parquet (PATH.parquet:COLUMN), an (N, T) .npy, a .u16/.u32 stream (PATH.bin:u16). Default: embedded Wikipedia."),
           model_name: Optional[str] = ModelOpt,
           max_sentences: Optional[int] = typer.Option(None, "--max-sentences", min=1, help="Cap on sentences."),
           field: str = typer.Option("text", "--field", help="JSONL field holding the text (a Parquet corpus: the column of token ids)."),
           context: int = typer.Option(CORPUS_CONTEXT, "--context", min=1, max=1 << 20, help="Window, in tokens, that a flat token stream (.u16, .u32, .bin:u16) is cut into."),
           seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed of the document order."),
           head: int = typer.Option(5, "--head", help="Sentences to print."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")):
    """Count a corpus as the model sees it: documents, sentences, tokens, truncations."""
    from ffkv.corpus.sources import open_corpus
    from ffkv.corpus.stream import SentenceStream
    from ffkv.display import printable
    from ffkv.progress import progress

    mm = model(model_name)
    src = open_corpus(source, field=field, seed=seed, context=context)
    # streamed as `ffkv mine` reads it (min_tokens=0: every sentence counts), so a corpus of any
    # size is counted in one chunk's memory
    stream = SentenceStream(src, mm.tok, mm.max_length, mm.vocab_size, max_sentences, min_tokens=0, workers=None)
    first: list[tuple[int, str]] = []
    with progress() as bar:
        task = bar.add_task("corpus", total=max_sentences, completed=0, tokens=0)
        for chunk in stream:
            first += list(zip(chunk.sentence_id[:max(0, head - len(first))].tolist(), chunk.text))
            bar.update(task, advance=len(chunk), tokens=stream.tokens)
    if not stream.sentences:
        raise FfkvError(f"corpus {src.spec!r} is empty: no sentences found")
    counts = {"source": src.spec, "kind": src.kind, **src.details, "sha256": src.sha256, **src.stats.as_dict(),
              "tokens": stream.tokens, "truncated": stream.truncated}
    if as_json:
        print(json.dumps({**counts, "head": [t for _, t in first]}, indent=2))
        return
    for k, v in counts.items():
        print(f"{k:>15}: {printable(str(v))}")
    for sid, text in first:
        print(f"  [{sid}] {printable(text, newlines=False)}")


def register(app: typer.Typer) -> None:
    app.command()(info)
    app.command()(explain)
    app.command()(corpus)
