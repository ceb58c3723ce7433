"""Substitute one layer's FFN and rerun only the layers above it, from the cached residual stream.

`intact(mm, ids, mask)` runs the model once and keeps, for every decoder block, the arguments it
was called with (the residual stream entering it, plus the attention mask, position embeddings,
… exactly as the model built them) and the last block's output. `tail(mm, cache, ℓ, replace)`
then calls blocks ℓ..L−1 with those same arguments, starting from the cached stream entering
block ℓ; `replace(x, m)` gives the FFN output of layer ℓ from the FFN input x and the memory
coefficients m (return None to keep the model's own output). Nothing depends on the
architecture: the blocks are the model's own modules, called as the model calls them, so with
no replacement the final hidden state is bit-identical to the full forward's (a test).

Since o_ℓ = r_ℓ + y_ℓ holds for every supported architecture (the FFN output is added to the
residual stream as it is), `tail_delta` skips block ℓ itself: it adds y' − y to the cached output
of block ℓ and runs blocks ℓ+1..L−1; tests hold it equal to the hook path.

`token_nll` reads the model's own head (`Lens.model_logits`: final norm, unembedding, soft-cap) on the
predicted positions only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

Replace = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass
class Cache:
    """One batch's intact forward: per block, (args, kwargs) of its call; the final hidden state."""
    calls: list = field(default_factory=list)
    final: torch.Tensor | None = None

    def stream(self, layer: int) -> torch.Tensor:
        """The residual stream entering block `layer` (B, T, d)."""
        args, kwargs = self.calls[layer]
        return args[0] if args else kwargs["hidden_states"]


def _hidden(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def intact(mm, ids: torch.Tensor, mask: torch.Tensor, callback=None, what=("m",)) -> Cache:
    """One forward pass (no logits) keeping every block's call; `callback(layer, name, t)` gets
    the captures of `what` at every layer (see `MemoryModel.capture`)."""
    L = mm.n_layers
    cache = Cache(calls=[None] * L)
    hooks = []

    def keep_call(l):
        def hook(mod, args, kwargs):
            cache.calls[l] = (args, dict(kwargs))
        return hook

    def keep_final(mod, args, out):
        cache.final = _hidden(out)

    try:
        for l, blk in enumerate(mm.blocks):
            hooks.append(blk.register_forward_pre_hook(keep_call(l), with_kwargs=True))
        hooks.append(mm.blocks[L - 1].register_forward_hook(keep_final))
        if callback is None:
            mm.capture(ids, mask, layers=[L - 1], what=())
        else:
            mm.capture(ids, mask, layers=range(L), what=what, callback=callback)
    finally:
        for h in hooks:
            h.remove()
    return cache


def _install(mm, layer: int, replace: Replace, shape) -> list:
    """Hooks under which layer `layer`'s FFN adds replace(x, m) instead of its own output: the
    family's own seam (`MemoryModel.replace_ffn`), so a post-FFN norm's scale and gain, or a
    residual multiplier, stay where the model puts them."""
    return mm.replace_ffn(layer, replace, list(shape))


def run_blocks(mm, cache: Cache, start: int, h: torch.Tensor) -> torch.Tensor:
    """Blocks start..L−1 on the stream h, each called with its cached arguments."""
    for j in range(start, mm.n_layers):
        args, kwargs = cache.calls[j]
        h = _hidden(mm.blocks[j](h, *args[1:], **kwargs) if args else
                    mm.blocks[j](**{**kwargs, "hidden_states": h}))
    return h


@torch.no_grad()
def tail(mm, cache: Cache, layer: int, replace: Replace | None = None) -> torch.Tensor:
    """The final hidden state (B, T, d) with layer `layer`'s FFN output replaced by a hook,
    recomputing blocks layer..L−1 from the cached stream entering block `layer`."""
    hooks = _install(mm, layer, replace, cache.stream(layer).shape[:2]) if replace is not None else []
    try:
        return run_blocks(mm, cache, layer, cache.stream(layer))
    finally:
        for hk in hooks:
            hk.remove()


@torch.no_grad()
def tail_delta(mm, cache: Cache, layer: int, delta: torch.Tensor | None) -> torch.Tensor:
    """The same from layer `layer`'s output: o_ℓ = r_ℓ + y_ℓ becomes o_ℓ + (y' − y), so only blocks
    layer+1..L−1 run. `delta` = y' − y (B, T, d); None keeps o_ℓ (bit-identical logits)."""
    o = cache.stream(layer + 1) if layer + 1 < mm.n_layers else cache.final
    return run_blocks(mm, cache, layer + 1, o if delta is None else o + delta)


@dataclass
class Targets:
    """The predicted positions of a right-padded batch: row b, position t predicts ids[b, t + 1]."""
    rows: torch.Tensor  # (N,) batch row
    pos: torch.Tensor  # (N,) position
    target: torch.Tensor  # (N,) token id

    @classmethod
    def of(cls, ids: torch.Tensor, mask: torch.Tensor) -> "Targets":
        ok = (mask[:, 1:] > 0) & (mask[:, :-1] > 0)
        rows, pos = ok.nonzero(as_tuple=True)
        return cls(rows, pos, ids[rows, pos + 1])


@torch.no_grad()
def token_nll(mm, h: torch.Tensor, tg: Targets, chunk: int = 512) -> torch.Tensor:
    """−log p(target | prefix) per predicted position (N,), float32, from the final hidden state:
    the model's final norm and output embedding, a chunk of rows at a time."""
    hv = h[tg.rows, tg.pos]
    out = torch.empty(len(tg.target), dtype=torch.float32, device=h.device)
    for s in range(0, len(out), chunk):
        z = mm.lens.model_logits(hv[s:s + chunk]).float()  # the model's own head: soft-cap, logit scale
        out[s:s + chunk] = torch.logsumexp(z, -1) - z.gather(-1, tg.target[s:s + chunk, None])[:, 0]
    return out
