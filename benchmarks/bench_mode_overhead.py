"""What the CPU's oneDNN mode (`ffkv.model.onednn.fast_products`) costs a forward it does not
speed up: a bf16 model, whose products it passes through, as on CUDA. The mode is a
TorchFunctionMode, a Python call on every torch op, so a host-bound forward pays for it; the steps
enter it through `products_of(mm)`, a no-op off the CPU. Prints both, side by side, in rounds.

    .venv/bin/python benchmarks/bench_mode_overhead.py [--layers 30] [--rounds 3]
"""
from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

from _common import out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=40)
    a = ap.parse_args()

    import torch
    import transformers as tf

    from ffkv.model.onednn import fast_products

    torch.set_num_threads(1)
    cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=192, num_hidden_layers=a.layers,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(5, 1000, (1, 4))

    def forward():
        with torch.no_grad():
            m(ids)

    def ms(ctx) -> float:
        t = time.perf_counter()
        with ctx():
            for _ in range(a.calls):
                forward()
        return (time.perf_counter() - t) / a.calls * 1e3

    for _ in range(5):
        forward()
    out(f"a host-bound {a.layers}-layer bf16 toy forward (4 tokens, one thread), {a.calls} calls a figure:")
    for r in range(a.rounds):
        plain, mode = ms(nullcontext), ms(fast_products)
        out(f"  round {r + 1}: plain {plain:.2f} ms, inside fast_products() {mode:.2f} ms ({mode / plain:.2f}x)")
    out(f"  fast_products('cuda') is a no-op: {isinstance(fast_products('cuda'), nullcontext)}")


if __name__ == "__main__":
    main()
