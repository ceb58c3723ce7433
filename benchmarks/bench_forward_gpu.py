"""Where a faster mining forward could come from (issue 24): the same batches through several forwards.

    PYTHONPATH=src python3 benchmarks/bench_forward_gpu.py --corpus ids.parquet --tokens 1000000 --liger .dev/liger

Mining cannot beat its own forward, and on an H100 the SmolLM2 shape's forward ran below the 400k
tok/s goal. This probe times, on the same length-sorted batches (budget as `ffkv mine` sizes it),
interleaved batch by batch, the base model to its last layer (no LM head, as mining stops there):

  stock     right-padded rows and no mask, as mining runs it;
  packedN   the batch's sequences in rows of N tokens (--pack-len; one arm a length) as `ffkv mine`
            packs them under FFKV_PACK (`ffkv.mine.packing`: position ids restart, no mask, so
            transformers masks across the sentences): a tenth of the rows for WikiText's short
            sentences, so attention launches far fewer tiny tiles;
  liger     Liger Kernel's fused RMSNorm, RoPE and SwiGLU on a copy of the model (--liger: a
            folder holding the liger_kernel package; CUDA only);
  compiled  torch.compile of every decoder layer (dynamic shapes; its compile time is printed);
  X+packedN Liger's or the compiled model on packed rows (do the gains add up?).

--arms picks the arms beside stock (default packed,liger,compiled).

For each arm: tok/s, its ratio to stock, and its last hidden states at real tokens against
stock's (max |diff| / max |stock|: a faster forward is worth having only if it computes the same
thing). Then one stock batch profiled: device time by op, and the shares of attention, matrix
products and everything else. An arm that cannot run here (no CUDA for Liger, a compile error)
says why and is left out. Imports neither spaCy, Ray nor DuckDB.
"""
from __future__ import annotations

import argparse
import copy
from contextlib import nullcontext
import os
import sys
import time

from _common import out

import torch  # noqa: E402  (after _common, which imports ffkv first)

from bench_gpu import SHAPES, build_shape, corpus_ids, default_tokenizer, stream  # noqa: E402
from ffkv.mine.engine import flat_rows  # noqa: E402
from ffkv.mine.packing import Packed  # noqa: E402


def gather_real(h, lengths):
    """(N, d) hidden states of the real tokens of a padded (B, T, d) batch, sequence by sequence."""
    return torch.cat([h[b, :n] for b, n in enumerate(lengths)])


def liger_arm(hf, folder: str):
    """A copy of `hf` with Liger's kernels, and the module globals they swap (restored here, so
    the other arms run stock; `swapped` puts them back around this arm's calls)."""
    sys.path.insert(0, os.path.abspath(folder))
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    mod = sys.modules[type(hf).__module__]
    before = dict(vars(mod))
    model = copy.deepcopy(hf)
    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
    theirs = {k: v for k, v in vars(mod).items() if before.get(k) is not v}
    for k in theirs:
        setattr(mod, k, before[k]) if k in before else delattr(mod, k)
    return model, mod, theirs


class swapped:
    def __init__(self, mod, values):
        self.mod, self.values = mod, values

    def __enter__(self):
        self.old = {k: getattr(self.mod, k, None) for k in self.values}
        for k, v in self.values.items():
            setattr(self.mod, k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(self.mod, k, v)


def profile(base, ids, cuda: bool) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), prof(activities=acts) as p:
        base(input_ids=ids, use_cache=False)
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    ev = [e for e in p.key_averages() if getattr(e, attr, 0) > 0]
    ev.sort(key=lambda e: -getattr(e, attr))
    total = sum(getattr(e, attr) for e in ev) or 1
    groups = {"attention": 0.0, "matrix products": 0.0, "the rest": 0.0}
    for e in ev:
        n = e.key.lower()
        g = ("attention" if any(w in n for w in ("attention", "flash", "fmha", "sdpa", "efficient")) else
             "matrix products" if any(w in n for w in ("gemm", "mm", "matmul", "linear", "cutlass", "sm90", "nvjet"))
             else "the rest")
        groups[g] += getattr(e, attr)
    out(f"profile of one stock batch ({'device' if cuda else 'CPU'} time {total / 1e3:.1f} ms): "
        + ", ".join(f"{k} {v / total:.0%}" for k, v in groups.items()))
    for e in ev[:12]:
        out(f"  {getattr(e, attr) / 1e3:8.2f} ms  {e.count:6d} calls  {e.key[:90]}")


def main(a) -> None:
    from ffkv.corpus.batching import pack
    from ffkv.steps.mine import MineSettings
    from ffkv.steps.mine.compute import resolve_batch_tokens
    from ffkv.model.load import resolve_dtype

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = resolve_dtype(a.dtype, device)
    mm = build_shape(a.shape, device, dtype)
    ids, _ = corpus_ids(a.corpus, mm, default_tokenizer)
    toks = stream(ids, a.tokens, mm.max_length or 8192)
    lengths = [len(t) for t in toks]
    bt = resolve_batch_tokens(mm, MineSettings(batch_tokens=a.batch_tokens))
    batches = pack(lengths, bt)
    ntok = sum(lengths)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out(f"bench_forward_gpu: random-weight {a.shape} shape, {str(dtype).replace('torch.', '')} on "
        f"{torch.cuda.get_device_name(0) if cuda else 'CPU (' + str(torch.get_num_threads()) + ' threads)'} "
        f"(torch {torch.__version__}); {ntok:,} tokens in {len(toks):,} sequences, {len(batches)} batches of "
        f"up to {bt} tokens; packed rows of {', '.join(map(str, a.pack_len))} tokens")
    pad = mm.pad_id()
    stock_base = mm.hf.model
    want = set(a.arms)
    arms = {"stock": stock_base}  # the forward of each arm's model; "X+packedN" runs X on packed rows
    names = ["stock"] + ([f"packed{n}" for n in a.pack_len] if "packed" in want else [])
    ctx = {}
    if a.liger and "liger" in want:
        if not cuda:
            out("liger: skipped (its kernels need a CUDA device)")
        else:
            try:
                lm, mod, theirs = liger_arm(mm.hf, a.liger)
                arms["liger"], ctx["liger"] = lm.model, swapped(mod, theirs)
                names += ["liger"] + ([f"liger+packed{max(a.pack_len)}"] if "packed" in want else [])
                out(f"liger: Liger Kernel {_version('liger_kernel')} on a copy; module globals swapped in its "
                    f"calls only: {sorted(theirs) or 'none'}")
            except Exception as e:  # noqa: BLE001  (a probe: say why, run the other arms)
                out(f"liger: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
    if "compiled" in want:
        cm = copy.deepcopy(mm.hf)
        for layer in cm.model.layers:
            layer.compile(dynamic=True)
        arms["compiled"] = cm.model
        names += ["compiled", f"compiled+packed{max(a.pack_len)}"]

    def run(arm, b):
        base, _, pack = arm.partition("+")
        if base.startswith("packed"):
            base, pack = "stock", base
        if pack:  # `ffkv.mine.packing`, as `ffkv mine` packs rows under FFKV_PACK
            p = Packed(*flat_rows(toks, b), pad, int(pack[6:]), device)
            kw = dict(input_ids=p.ids, position_ids=p.position_ids)
        else:
            p = None
            kw = dict(input_ids=mm.batch([toks[i] for i in b])[0].to(device))
        with torch.no_grad(), ctx.get(base, nullcontext()):
            h = arms[base](use_cache=False, **kw).last_hidden_state
        rows = h.shape[0]
        return (p.unpack(h) if p is not None else h), rows, [lengths[i] for i in b]

    # correctness and warm-up (compile included) on the first two batches, untimed
    ref = None
    for name in list(names):
        t0 = time.perf_counter()
        try:
            for b in batches[:2]:
                h, rows, lens = run(name, b)
                sync()
                if b is batches[0]:
                    got = gather_real(h, lens).float()
                    if name == "stock":
                        ref = got
                        out(f"stock: rows of {h.shape[1]} tokens, {rows} rows in the first batch")
                    else:
                        err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                        said = f", {rows} rows in the first batch" if "packed" in name else ""
                        out(f"{name}: last hidden states at real tokens, max |diff| / max |stock| = {err:.2e}{said}")
        except Exception as e:  # noqa: BLE001
            out(f"{name}: left out ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            names.remove(name)
            continue
        if name.startswith("compiled"):
            out(f"{name}: warm-up (compile) {time.perf_counter() - t0:.1f} s over two batches")
    secs = {k: 0.0 for k in names}
    timed = batches[2:] or batches
    tokens = sum(lengths[i] for b in timed for i in b)
    for bi, b in enumerate(timed):
        for arm in (names if bi % 2 == 0 else names[::-1]):
            sync()
            t0 = time.perf_counter()
            run(arm, b)
            sync()
            secs[arm] += time.perf_counter() - t0
    base = secs["stock"]
    out(f"throughput over {tokens:,} tokens ({len(timed)} batches): " + "; ".join(
        f"{k} {tokens / v:,.0f} tok/s ({base / v:.2f}x)" for k, v in secs.items()))
    profile(stock_base, mm.batch([toks[i] for i in timed[0]])[0].to(device), cuda)


def _version(pkg: str) -> str:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001  (a folder on sys.path, not an installed distribution)
        return getattr(sys.modules.get(pkg), "__version__", "(folder)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--corpus", default=None, help="a Parquet file of token id lists, or a text corpus spec")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--batch-tokens", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--pack-len", default="128,256", help="tokens per packed row, one arm each (default 128,256)")
    ap.add_argument("--liger", default=None, help="a folder holding the liger_kernel package (CUDA only)")
    ap.add_argument("--arms", default="packed,liger,compiled",
                    help="arms beside stock, comma-separated (default packed,liger,compiled; the compile can take "
                         "a minute, so a short lease may time it in a second run: --arms compiled)")
    a = ap.parse_args()
    a.arms = [x for x in a.arms.split(",") if x]
    if set(a.arms) - {"stock", "packed", "liger", "compiled"}:
        print(f"bench_forward_gpu: --arms takes packed, liger and compiled, not {a.arms}", file=sys.stderr)
        sys.exit(2)
    try:
        a.pack_len = [int(x) for x in a.pack_len.split(",") if x]
    except ValueError:
        a.pack_len = []
    if a.tokens < 1 or not a.pack_len or min(a.pack_len) < 1:
        print("bench_forward_gpu: --tokens and each --pack-len must be whole numbers of at least 1", file=sys.stderr)
        sys.exit(2)
    main(a)
