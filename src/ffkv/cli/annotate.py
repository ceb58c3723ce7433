"""`ffkv annotate ...`: human annotation of key patterns (the paper's §3), in RUN/annotations.sqlite."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from ffkv.cli.options import JsonOpt, RunArg, SeedOpt, SignOpt, open_run, parse_sign, print_table
from ffkv.display import printable
from ffkv.errors import FfkvError
from ffkv.model import identity


def parse_pattern(spec: str) -> dict:
    """KIND:IDX[,IDX...]:DESCRIPTION, e.g. 'shallow:0,3,7:ends with "base"'."""
    from ffkv.parse import parse_ranges

    parts = spec.split(":", 2)
    if len(parts) != 3:
        raise FfkvError(f"--pattern {spec!r}: expected KIND:PREFIXES:DESCRIPTION, "
                        "e.g. 'shallow:0,3,7:ends with \"base\"'")
    kind, pre, desc = parts
    return {"description": desc, "kind": kind.strip().lower(),
            "prefixes": parse_ranges(pre, f"--pattern {spec!r}: prefixes")}


def _store(run_dir):
    from ffkv.store.annotations import AnnotationStore
    from ffkv.steps.lifecycle import require

    run = open_run(run_dir)
    require(run, "mine")
    return AnnotationStore(run)


def sample(run_dir: Path = RunArg,
           per_layer: int = typer.Option(10, "--per-layer", min=1, help="Keys per layer (the paper: 10)."),
           seed: int = SeedOpt, sign: str = SignOpt,
           prefixes: bool = typer.Option(False, "--prefixes", help="Also print each key's top-25 prefixes."),
           out: Optional[Path] = typer.Option(None, "--out", help="Write the sample with its prefixes as JSONL."),
           as_json: bool = JsonOpt):
    """Draw (and store) the seeded sample of keys to annotate, with their top-25 prefixes."""
    st = _store(run_dir)
    s = parse_sign(sign)
    keys = st.sample(per_layer, seed, s)
    recs = [{"layer": l, "dim": d, "sign": s} for l, d in keys]
    if prefixes or out:
        from ffkv.model.load import quiet_hf

        quiet_hf()
        tok = identity.open_model(st.run, device="cpu").tok
        for r in recs:
            r["prefixes"] = st.key_prefixes(r["layer"], r["dim"], tok, s)
    if out:
        from ffkv.atomic import atomic_write_bytes

        atomic_write_bytes(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode())
    if as_json:
        print(json.dumps(recs, indent=2, ensure_ascii=False))
        return
    print(f"sample: {len(recs)} keys ({per_layer} per layer, seed {seed}, sign {s:+d}) stored in {st.path}"
          + (f"; written to {out}" if out else ""))
    for r in recs:
        print(f"  key {r['layer']}/{r['dim']}")
        for p in r.get("prefixes", []) if prefixes else []:
            print(f"    [{p['index']:>2}] {p['coef']:+8.3f}  {printable(p['text'], newlines=False)}")


def add(run_dir: Path = RunArg,
        annotator: str = typer.Option(..., "--annotator", "-a", help="Who annotates."),
        layer: int = typer.Option(..., "--layer", "-l", min=0, max=2**31 - 1),
        dim: int = typer.Option(..., "--dim", "-d", min=0, max=2**31 - 1),
        pattern: Optional[List[str]] = typer.Option(None, "--pattern", "-p",
                                                    help="KIND:PREFIXES:DESCRIPTION, e.g. "
                                                         "'shallow:0,3,7-9:ends with \"base\"' (repeatable; "
                                                         "none = no pattern found)."),
        note: str = typer.Option("", "--note"), sign: str = SignOpt):
    """Save one annotation (replaces the annotator's previous one of that key)."""
    st = _store(run_dir)
    pats = [parse_pattern(p) for p in pattern or []]
    aid = st.add_annotation(annotator, layer, dim, pats, sign=parse_sign(sign), note=note)
    print(f"saved annotation {aid}: {printable(annotator, newlines=False)} on key {layer}/{dim}, {len(pats)} pattern(s)")


def list_(run_dir: Path = RunArg, annotator: Optional[str] = typer.Option(None, "--annotator", "-a"),
          layer: Optional[int] = typer.Option(None, "--layer", "-l"), as_json: bool = JsonOpt):
    """List stored annotations."""
    recs = _store(run_dir).list(annotator=annotator, layer=layer)
    if as_json:
        print(json.dumps(recs, indent=2, ensure_ascii=False))
        return
    for r in recs:
        print(f"{printable(r['annotator'], newlines=False)} key {r['layer']}/{r['dim']} "
              f"({len(r['patterns'])} patterns)")
        for p in r["patterns"]:
            print(f"    {p['kind']:<8} {printable(p['description'], newlines=False)}  prefixes {p['prefixes']}")
    print(f"{len(recs)} annotation(s)")


def export(run_dir: Path = RunArg,
           out: Optional[Path] = typer.Option(None, "--out", "-o", help="JSONL file (default: stdout).")):
    """Export every annotation as JSONL (one record per line)."""
    st = _store(run_dir)
    text = st.export(out)
    if out:
        print(f"exported {text.count(chr(10))} annotation(s) to {out}")
    else:
        print(text, end="")


def import_(run_dir: Path = RunArg,
            file: Path = typer.Argument(..., help="JSONL made by `ffkv annotate export`.")):
    """Import JSONL annotations (all or nothing; idempotent; a newer record replaces an older one)."""
    if not file.exists():
        raise FfkvError(f"{file} does not exist")
    c = _store(run_dir).import_(file)
    print("imported: " + ", ".join(f"{k} {v}" for k, v in c.items()))


def stats(run_dir: Path = RunArg, as_json: bool = JsonOpt):
    """Fig 2 from the human labels, patterns per key, agreement with `ffkv patterns` and
    between annotators."""
    from ffkv.defs import pct

    res = _store(run_dir).stats()
    if as_json:
        print(json.dumps(res, indent=2, default=str))
        return
    if not res["annotations"]:
        print("no annotations yet (see `ffkv annotate sample` and `ffkv annotate add`)")
        return
    print(f"{res['annotations']} annotation(s) of {res['keys']} key(s) by {len(res['annotators'])} "
          f"annotator(s); patterns per key {res['patterns_per_key']:.2f} (the paper: 3.6); keys with a "
          f"pattern {100 * res['keys_with_pattern']:.0f}%; prefixes covered {100 * res['prefixes_covered']:.0f}%")
    pct0 = lambda x: pct(x, 0)  # noqa: E731
    print_table("Fig 2 from human labels", res["fig2"],
                ["layer", "annotations", "shallow", "semantic", "both", "not_covered", "patterns_per_key"],
                {"shallow": pct0, "semantic": pct0, "both": pct0, "not_covered": pct0,
                 "patterns_per_key": lambda x: f"{x:.1f}"})
    for name in ("auto_vs_human", "inter_annotator"):
        v = res[name]
        if v:
            print(f"{name}: " + ", ".join(f"{k} {x:.3f}" if isinstance(x, float) else f"{k} {x}"
                                          for k, x in v.items()))


def register(app: typer.Typer) -> None:
    ann = typer.Typer(name="annotate", no_args_is_help=True, add_completion=False,
                      help="Human annotation of key patterns as in the paper's §3 "
                           "(store: RUN/annotations.sqlite).")
    app.add_typer(ann, name="annotate")
    for name, fn in (("sample", sample), ("add", add), ("list", list_), ("export", export),
                     ("import", import_), ("stats", stats)):
        ann.command(name)(fn)
