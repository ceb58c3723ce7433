"""CLI for the keys experiments (paper §3): `mutate`, `patterns` and `annotate ...`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from ffkv.errors import FfkvError

RunArg = typer.Argument(..., metavar="RUN", help="A run directory made by `ffkv mine --out RUN`.")
DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu, cuda, cuda:N.")
DtypeOpt = typer.Option("auto", "--dtype", help="auto (float32), float32, float16, bfloat16.")
SignOpt = typer.Option("+", "--sign", help="Which triggers: + (top positive, the paper) or - (most negative).")
SeedOpt = typer.Option(0, "--seed", help="Seed of the key sample (and of the random mutation).")
JsonOpt = typer.Option(False, "--json", help="Print JSON for scripts.")


def parse_sign(s: str) -> int:
    v = str(s).strip().lower()
    if v in ("+", "+1", "1", "pos", "positive"):
        return 1
    if v in ("-", "-1", "neg", "negative"):
        return -1
    raise FfkvError(f"--sign must be + or - (got {s!r})")


def _open_run(path):
    from ffkv.store.run import Run

    return Run(path)


def _model(run, device, dtype):
    from ffkv.cli import quiet_hf

    quiet_hf()
    return run.open_model(device=device, dtype=dtype)


def _done_with(run, step: str, settings: dict, tables) -> bool:
    """Done with the same settings, its tables present, and not older than the mined triggers."""
    return (run.step_done(step) and run.settings(step) == settings
            and all(run.has_table(t) for t in tables)
            and run.step(step).get("finished", 0) >= run.step("mine").get("finished", 0))


def _print_table(title: str, rows: list[dict], cols: list[str], fmt: dict | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from rich.markup import escape

    fmt = fmt or {}
    t = Table(title=escape(title))
    for c in cols:
        t.add_column(escape(c))
    for r in rows:
        t.add_row(*[escape(fmt[c](r[c]) if c in fmt and r[c] is not None else str(r[c])) for c in cols])
    Console().print(t)


def register(app: typer.Typer) -> None:
    @app.command()
    def mutate(run_dir: Path = RunArg,
               keys_per_layer: int = typer.Option(10, "--keys-per-layer", min=0,
                                                  help="Keys sampled per layer (seeded); the paper used 100 "
                                                       "(a GPU setting); 0 = every mined key."),
               examples: int = typer.Option(50, "--examples", min=1, help="Top trigger examples per key."),
               sign: str = SignOpt, seed: int = SeedOpt,
               layers: Optional[List[int]] = typer.Option(None, "--layer", help="Only these layers (repeatable)."),
               batch_tokens: int = typer.Option(2048, "--batch-tokens", min=16,
                                                help="Padded tokens per re-scoring batch."),
               device: str = DeviceOpt, dtype: str = DtypeOpt,
               force: bool = typer.Option(False, "--force", help="Re-run even when done with these settings."),
               as_json: bool = JsonOpt):
        """Fig 3: remove the first, last or a random token of each key's top trigger examples and
        report the relative change of the key's coefficient per layer (tables `mutations`,
        `mutations_layers`)."""
        from ffkv.experiments import mutate as M

        run = _open_run(run_dir)
        run.require("mine", f"ffkv mine --out {run_dir}")
        s = parse_sign(sign)
        settings = M.settings_for(keys_per_layer, examples, s, seed, layers, dtype)
        if not force and _done_with(run, "mutate", settings, ["mutations", "mutations_layers"]):
            summary = run.read_table("mutations_layers").to_pylist()
            info = {"status": "already done", **{k: v for k, v in run.step("mutate").items()
                                                 if k not in ("status",)}}
        else:
            mm = _model(run, device, dtype)
            run.start_step("mutate", settings)
            res = M.mutate(run, mm, keys_per_layer=keys_per_layer, examples=examples, sign=s,
                           seed=seed, batch_tokens=batch_tokens, layers=layers)
            run.finish_step("mutate", **{k: v for k, v in res.stats.items() if k != "seconds"})
            summary = res.layers.to_pylist()
            info = {"status": "done", **res.stats}
        if as_json:
            print(json.dumps({**info, "layers": summary}, indent=2, default=str))
            return
        if info["status"] == "already done":
            print(f"mutate: already done with these settings in {run_dir} (use --force to re-run)")
        else:
            r = info["rescore"]
            print(f"mutate: {info['keys']} keys, {info['variants']:,} variants "
                  f"({info['examples_skipped']} one-token examples skipped) in {info['seconds']:.1f} s; "
                  f"{r['sequences_run']:,} sequences run for {r['requests']:,} requests")
        rows = []
        by = {(x["layer"], x["mutation"]): x for x in summary}
        for l in sorted({x["layer"] for x in summary}):
            row = {"layer": l}
            for m in M.MUTATIONS:
                x = by.get((l, m))
                row[m] = (f"{x['median']:+.2f} [{x['q25']:+.2f}, {x['q75']:+.2f}] mean {x['mean']:+.2f}"
                          if x and x["n"] else "-")
            rows.append(row)
        _print_table("relative change of the coefficient: median [q25, q75]", rows,
                     ["layer", *M.MUTATIONS])

    @app.command()
    def patterns(run_dir: Path = RunArg,
                 keys_per_layer: int = typer.Option(0, "--keys-per-layer", min=0,
                                                    help="Keys per layer for shallow patterns (seeded sample); "
                                                         "0 = every mined key."),
                 semantic_keys_per_layer: int = typer.Option(
                     10, "--semantic-keys-per-layer", min=0,
                     help="Keys per layer that also get semantic patterns (the nested seeded sample that "
                          "`ffkv annotate sample` gives annotators); 0 = all analysed keys. Embedding costs "
                          "about 1/70 s per prefix on a CPU."),
                 no_semantic: bool = typer.Option(False, "--no-semantic", help="Shallow patterns only."),
                 top: int = typer.Option(25, "--top", min=1, max=1000, help="Top prefixes per key (the paper: 25)."),
                 min_cover: int = typer.Option(3, "--min-cover", min=1, help="Prefixes a pattern must cover (the paper: 3)."),
                 alpha: float = typer.Option(1e-3, "--alpha", help="Significance of a shallow pattern against random "
                                                                   "corpus prefixes; 1 = keep all."),
                 background: int = typer.Option(2000, "--background", min=50, help="Random corpus prefixes for the baselines."),
                 sign: str = SignOpt, seed: int = SeedOpt,
                 device: str = DeviceOpt,
                 force: bool = typer.Option(False, "--force", help="Re-run even when done with these settings."),
                 as_json: bool = JsonOpt):
        """Automatic patterns in each key's top-25 prefixes: shallow (shared last words, suffixes,
        n-grams) and semantic (clusters of sentence embeddings); a label per key and Fig 2 for
        every key (tables `patterns`, `pattern_keys`, `patterns_fig2`)."""
        from ffkv.experiments import patterns as P

        run = _open_run(run_dir)
        run.require("mine", f"ffkv mine --out {run_dir}")
        s = parse_sign(sign)
        settings = P.settings_for(keys_per_layer, semantic_keys_per_layer, top, s, seed, min_cover, alpha,
                                  background, not no_semantic)
        tables = ["patterns", "pattern_keys", "patterns_fig2"]
        if not force and _done_with(run, "patterns", settings, tables):
            fig2 = run.read_table("patterns_fig2").to_pylist()
            labels = run.read_table("pattern_keys", columns=["label"]).column("label").to_pylist()
            info = {"status": "already done", **{k: v for k, v in run.step("patterns").items() if k != "status"}}
        else:
            mm = _model(run, "cpu", "auto")
            run.start_step("patterns", settings)
            emb = None
            if not no_semantic:
                from ffkv.model.load import resolve_device

                emb = P.Embedder(device=resolve_device(device))
            res = P.patterns(run, mm.tok, keys_per_layer=keys_per_layer,
                             semantic_keys_per_layer=semantic_keys_per_layer, top=top, sign=s, seed=seed,
                             min_cover=min_cover, alpha=alpha, background=background,
                             semantic=not no_semantic, embedder=emb)
            run.finish_step("patterns", **{k: v for k, v in res.stats.items() if k != "seconds"})
            fig2 = res.fig2.to_pylist()
            labels = res.keys.column("label").to_pylist()
            info = {"status": "done", **res.stats}
        from collections import Counter

        lab = Counter(labels)
        if as_json:
            print(json.dumps({**info, "labels": dict(lab), "fig2": fig2}, indent=2, default=str))
            return
        if info["status"] == "already done":
            print(f"patterns: already done with these settings in {run_dir} (use --force to re-run)")
        else:
            print(f"patterns: {info['keys']:,} keys ({info['semantic_keys']:,} with semantic patterns), "
                  f"{info['patterns']:,} patterns in {info['seconds']:.1f} s "
                  f"(embedding {info['embedding_seconds']:.1f} s)")
        print("key labels: " + ", ".join(f"{k} {lab.get(k, 0):,}" for k in P.LABELS))
        scope = "semantic_sample" if any(f["scope"] == "semantic_sample" for f in fig2) else "all"
        pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
        _print_table(f"Fig 2 (scope {scope}): share of top-{top} prefixes by pattern kind",
                     [f for f in fig2 if f["scope"] == scope],
                     ["layer", "keys", "shallow", "semantic", "both", "not_covered", "patterns_per_key"],
                     {"shallow": pct, "semantic": pct, "both": pct, "not_covered": pct,
                      "patterns_per_key": lambda x: f"{x:.1f}"})

    register_annotate(app)


def _parse_pattern(spec: str) -> dict:
    """KIND:IDX[,IDX...]:DESCRIPTION, e.g. 'shallow:0,3,7:ends with "base"'."""
    parts = spec.split(":", 2)
    if len(parts) != 3:
        raise FfkvError(f"--pattern {spec!r}: expected KIND:PREFIXES:DESCRIPTION, "
                        "e.g. 'shallow:0,3,7:ends with \"base\"'")
    kind, pre, desc = parts
    idx = []
    for x in pre.split(","):
        x = x.strip()
        if not x:
            continue
        try:
            if "-" in x[1:]:
                a, b = x.split("-", 1)
                idx += list(range(int(a), int(b) + 1))
            else:
                idx.append(int(x))
        except ValueError:
            raise FfkvError(f"--pattern {spec!r}: prefix {x!r} is not an integer or a range a-b") from None
    return {"description": desc, "kind": kind.strip().lower(), "prefixes": idx}


def register_annotate(app: typer.Typer) -> None:
    ann = typer.Typer(name="annotate", no_args_is_help=True, add_completion=False,
                      help="Human annotation of key patterns as in the paper's §3 "
                           "(store: RUN/annotations.sqlite).")
    app.add_typer(ann, name="annotate")

    def store(run_dir):
        from ffkv.store.annotations import AnnotationStore

        run = _open_run(run_dir)
        run.require("mine", f"ffkv mine --out {run_dir}")
        return AnnotationStore(run)

    @ann.command("sample")
    def sample(run_dir: Path = RunArg,
               per_layer: int = typer.Option(10, "--per-layer", min=1, help="Keys per layer (the paper: 10)."),
               seed: int = SeedOpt, sign: str = SignOpt,
               prefixes: bool = typer.Option(False, "--prefixes", help="Also print each key's top-25 prefixes."),
               out: Optional[Path] = typer.Option(None, "--out", help="Write the sample with its prefixes as JSONL."),
               as_json: bool = JsonOpt):
        """Draw (and store) the seeded sample of keys to annotate, with their top-25 prefixes."""
        st = store(run_dir)
        s = parse_sign(sign)
        keys = st.sample(per_layer, seed, s)
        recs = [{"layer": l, "dim": d, "sign": s} for l, d in keys]
        if prefixes or out:
            tok = _model(st.run, "cpu", "auto").tok
            for r in recs:
                r["prefixes"] = st.key_prefixes(r["layer"], r["dim"], tok, s)
        if out:
            from ffkv.store.run import atomic_write_bytes

            atomic_write_bytes(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode())
        if as_json:
            print(json.dumps(recs, indent=2, ensure_ascii=False))
            return
        print(f"sample: {len(recs)} keys ({per_layer} per layer, seed {seed}, sign {s:+d}) stored in {st.path}"
              + (f"; written to {out}" if out else ""))
        for r in recs:
            print(f"  key {r['layer']}/{r['dim']}")
            for p in r.get("prefixes", []) if prefixes else []:
                print(f"    [{p['index']:>2}] {p['coef']:+8.3f}  {p['text']}")

    @ann.command("add")
    def add(run_dir: Path = RunArg,
            annotator: str = typer.Option(..., "--annotator", "-a", help="Who annotates."),
            layer: int = typer.Option(..., "--layer", "-l"), dim: int = typer.Option(..., "--dim", "-d"),
            pattern: Optional[List[str]] = typer.Option(None, "--pattern", "-p",
                                                        help="KIND:PREFIXES:DESCRIPTION, e.g. "
                                                             "'shallow:0,3,7-9:ends with \"base\"' (repeatable; "
                                                             "none = no pattern found)."),
            note: str = typer.Option("", "--note"), sign: str = SignOpt):
        """Save one annotation (replaces the annotator's previous one of that key)."""
        st = store(run_dir)
        pats = [_parse_pattern(p) for p in pattern or []]
        aid = st.add_annotation(annotator, layer, dim, pats, sign=parse_sign(sign), note=note)
        print(f"saved annotation {aid}: {annotator} on key {layer}/{dim}, {len(pats)} pattern(s)")

    @ann.command("list")
    def list_(run_dir: Path = RunArg, annotator: Optional[str] = typer.Option(None, "--annotator", "-a"),
              layer: Optional[int] = typer.Option(None, "--layer", "-l"), as_json: bool = JsonOpt):
        """List stored annotations."""
        recs = store(run_dir).list(annotator=annotator, layer=layer)
        if as_json:
            print(json.dumps(recs, indent=2, ensure_ascii=False))
            return
        for r in recs:
            print(f"{r['annotator']} key {r['layer']}/{r['dim']} ({len(r['patterns'])} patterns)")
            for p in r["patterns"]:
                print(f"    {p['kind']:<8} {p['description']}  prefixes {p['prefixes']}")
        print(f"{len(recs)} annotation(s)")

    @ann.command("export")
    def export(run_dir: Path = RunArg,
               out: Optional[Path] = typer.Option(None, "--out", "-o", help="JSONL file (default: stdout).")):
        """Export every annotation as JSONL (one record per line)."""
        st = store(run_dir)
        text = st.export(out)
        if out:
            print(f"exported {text.count(chr(10))} annotation(s) to {out}")
        else:
            print(text, end="")

    @ann.command("import")
    def import_(run_dir: Path = RunArg,
                file: Path = typer.Argument(..., help="JSONL made by `ffkv annotate export`.")):
        """Import JSONL annotations (all or nothing; idempotent; a newer record replaces an older one)."""
        if not file.exists():
            raise FfkvError(f"{file} does not exist")
        c = store(run_dir).import_(file)
        print("imported: " + ", ".join(f"{k} {v}" for k, v in c.items()))

    @ann.command("stats")
    def stats(run_dir: Path = RunArg, as_json: bool = JsonOpt):
        """Fig 2 from the human labels, patterns per key, agreement with `ffkv patterns` and
        between annotators."""
        res = store(run_dir).stats()
        if as_json:
            print(json.dumps(res, indent=2, default=str))
            return
        if not res["annotations"]:
            print("no annotations yet (see `ffkv annotate sample` and `ffkv annotate add`)")
            return
        print(f"{res['annotations']} annotation(s) of {res['keys']} key(s) by {len(res['annotators'])} "
              f"annotator(s); patterns per key {res['patterns_per_key']:.2f} (the paper: 3.6); keys with a "
              f"pattern {100 * res['keys_with_pattern']:.0f}%; prefixes covered {100 * res['prefixes_covered']:.0f}%")
        pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
        _print_table("Fig 2 from human labels", res["fig2"],
                     ["layer", "annotations", "shallow", "semantic", "both", "not_covered", "patterns_per_key"],
                     {"shallow": pct, "semantic": pct, "both": pct, "not_covered": pct,
                      "patterns_per_key": lambda x: f"{x:.1f}"})
        for name in ("auto_vs_human", "inter_annotator"):
            v = res[name]
            if v:
                print(f"{name}: " + ", ".join(f"{k} {x:.3f}" if isinstance(x, float) else f"{k} {x}"
                                              for k, x in v.items()))
