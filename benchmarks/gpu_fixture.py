"""What a bare GPU box needs to run `ffkv mine` and `ffkv reproduce` end to end (issue 24), built
from files small enough to carry (`benchmarks/gpu_session.sh`).

    python benchmarks/gpu_fixture.py prepare .dev          # here: WikiText-2 train as token ids + tokenizer + Liger
    python benchmarks/gpu_fixture.py build .dev /tmp/w --tokens 20000000 [--layers 30]   # there

prepare needs the embedded SmolLM2 (its tokenizer, from the GGUF) and spaCy, and fetches Liger Kernel's
pure-Python wheel from the package index into .dev/liger (bench_forward_gpu.py's liger arm; the GPU box
has no network). build needs none of them:
it writes a random-weight SmolLM2-135M-shaped model folder (weights do not change the cost) with
that tokenizer, and a flat uint16 token stream of N tokens cycling WikiText-2 train (stream.u16),
plus a 200k-token held-out stream from its end (held.u16).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

WT2_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "corpora" / "wikitext-2" / "wiki.train.tokens"


def prepare(dev: Path) -> None:
    from transformers import AutoTokenizer

    from ffkv.corpus.sources import open_corpus, tokenize
    from ffkv.corpus.tokens import write_parquet
    from ffkv.model.load import resolve_default_model

    p = resolve_default_model()
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    tok.save_pretrained(dev / "tok")
    ids, _ = tokenize(tok, open_corpus(str(WT2_TRAIN)).sentences(None), 8192)
    write_parquet(dev / "wt2_train_ids.parquet", ids, tok)
    print(f"{dev}: tokenizer and {len(ids):,} sentences ({sum(map(len, ids)):,} tokens) of WikiText-2 train")
    liger(dev / "liger")


LIGER = "liger-kernel==0.8.5"  # fused Triton RMSNorm, RoPE and SwiGLU for HF models (needs torch, triton)


def liger(folder: Path) -> None:
    """Liger Kernel's package unpacked into `folder` (put on sys.path there), or a line saying why not."""
    import subprocess
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, LIGER],
                           capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            print(f"{folder}: not fetched ({(r.stderr.strip().splitlines() or ['no wheel'])[-1][:160]}); "
                  f"the probe's liger arm will be skipped")
            return
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(folder, [n for n in z.namelist() if n.startswith("liger_kernel/")])
    print(f"{folder}: {wheels[0].name} unpacked")


def build(dev: Path, out: Path, tokens: int, layers: int) -> None:
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out / "model")
    AutoTokenizer.from_pretrained(dev / "tok").save_pretrained(out / "model")
    v = pq.read_table(dev / "wt2_train_ids.parquet").column(0).combine_chunks().values.to_numpy().astype("<u2")
    np.tile(v, -(-tokens // len(v)))[:tokens].tofile(out / "stream.u16")
    v[-200_000:].tofile(out / "held.u16")
    print(f"{out}: model ({layers} layers), stream.u16 ({tokens:,} tokens), held.u16 (200,000 tokens)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "build"])
    ap.add_argument("dev", type=Path)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--layers", type=int, default=30)
    a = ap.parse_args()
    if a.what == "prepare":
        a.dev.mkdir(parents=True, exist_ok=True)
        prepare(a.dev)
    else:
        if a.out is None:
            sys.exit("gpu_fixture: build needs an output folder")
        a.out.mkdir(parents=True, exist_ok=True)
        build(a.dev, a.out, a.tokens, a.layers)
