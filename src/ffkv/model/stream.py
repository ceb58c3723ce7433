"""Starting a forward pass at block K from a stored residual stream.

The stream entering block K (the output of block K−1) depends only on the tokens, so a reader
that keeps it for a corpus can later compute any layer ≥ K of those tokens running blocks K..
alone. `from_stream(mm, K, h)` arranges this inside the model's own forward: blocks 0..K−1 hand
their input on untouched (their work is skipped) and block K gets `h` instead; the embedding,
masks, rotary tables and per-layer attention types are still the model's own, so nothing here
is family-specific. Whether a model gives a full pass's numbers this way is checked once per
model and K (`resumes`). Its user: the memory browser's colours (`ffkv.web.residuals`).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch


class _Stop(Exception):
    pass


def block_output(mm):
    """How a decoder block of this model returns: None for a tensor, else the tuple's length (the
    model's loop reads either `out` or `out[0]`). Learned once from a one-token pass."""
    got = getattr(mm, "_ffkv_block_output", "?")
    if got != "?":
        return got
    seen = []

    def hook(mod, args, out):
        seen.append(len(out) if isinstance(out, tuple) else None)
        raise _Stop

    h = mm.blocks[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            x = torch.zeros((1, 1), dtype=torch.long, device=mm.device)
            mm.hf(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
    except _Stop:
        pass
    finally:
        h.remove()
    mm._ffkv_block_output = seen[0] if seen else None
    return mm._ffkv_block_output


@contextmanager
def from_stream(mm, start: int, h: torch.Tensor):
    """Within the block, a forward pass of `mm.hf` skips blocks 0..start−1 and feeds `h` (B, T, d),
    the stream entering block `start`, to block `start`. The batch's ids and mask must be those
    `h` was computed from (right padding: h's padded places are never read)."""
    n = block_output(mm)
    blocks = [mm.blocks[j] for j in range(start)]

    def passthrough(*args, **kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        return x if n is None else (x, *([None] * (n - 1)))

    def feed(mod, args, kwargs):
        y = h.to(dtype=(args[0] if args else kwargs["hidden_states"]).dtype)
        if args:
            return (y, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": y}

    hk = mm.blocks[start].register_forward_pre_hook(feed, with_kwargs=True)
    for b in blocks:
        b.forward = passthrough  # an instance attribute: the class's forward is back once it is deleted
    try:
        yield
    finally:
        hk.remove()
        for b in blocks:
            del b.forward


@torch.no_grad()
def stream(mm, ids: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """The residual stream entering block `start` (B, T, d) of a right-padded batch: block
    start−1's output, the forward stopped there."""
    got = {}

    def keep(layer, name, t):
        got["o"] = t

    mm.capture(ids, mask, layers=[start - 1], what=("o",), callback=keep)
    return got["o"]


def resumes(mm, start: int) -> bool:
    """Does `from_stream` at block `start` give a full pass's coefficients on this model? Checked
    once per model and start, on two random sequences of unequal length (so padding is in it)."""
    key = f"_ffkv_resumes_{start}"
    ok = getattr(mm, key, None)
    if ok is None:
        try:
            g = torch.Generator().manual_seed(0)
            seqs = [torch.randint(3, max(4, mm.vocab_size - 1), (n,), generator=g).tolist() for n in (9, 6)]
            ids, mask = mm.batch(seqs)
            layer = mm.n_layers - 1
            full = mm.capture(ids, mask, layers=[layer], what=("m",)).layers[layer]["m"]
            h = stream(mm, ids, mask, start)
            with from_stream(mm, start, h):
                got = mm.capture(ids, mask, layers=[layer], what=("m",)).layers[layer]["m"]
            real = mask.bool()
            a, b = full[real].float(), got[real].float()
            ok = bool(torch.allclose(a, b, rtol=1e-3, atol=1e-4 * max(1.0, float(a.abs().max()))))
        except Exception:  # noqa: BLE001 - any failure means: run every block
            ok = False
        setattr(mm, key, ok)
    return ok


def padded(rows: list[np.ndarray], T: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Streams of unequal length (n_i, d) right-padded with zeros into (B, T, d)."""
    d = rows[0].shape[1]
    out = np.zeros((len(rows), T, d), dtype=np.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out).to(device=device, dtype=dtype)
