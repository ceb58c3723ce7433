"""Running only the later tokens of rows whose first tokens are already computed.

Each row's first k tokens' keys and values are kept from one pass (`prefix_cache`); a later pass
feeds only the tokens after them, with explicit position ids, on that cache (`continued`). The
cache is right-padded: a row's columns past its own k are masked, so rows of different k share one
(B, heads, P, hd) tensor per layer and nothing is left-padded. Used where many passes share their
prefixes: mutate's rescoring (`ffkv.memories.rescore`, rows of other sentences' caches) and the
edits' target steps (`ffkv.steps.facts.edit`, the same rows every step). Whether a model gives a
full pass's numbers this way is checked once per model (`ffkv.memories.rescore.sharing_ok`); past
a sliding window it does not (`fits`).
"""
from __future__ import annotations

import numpy as np
import torch


def sliding_window(mm) -> int | None:
    """The attention window of the model's sliding-window layers, None where every layer sees its
    whole past. A continued cache's masked places (a row's columns past its own prefix) take places
    in such a window, so a continuation is exact only while the cache and the new tokens fit in it."""
    from ffkv.model.arch import text_config

    hf = getattr(mm, "hf", None)
    cfg = text_config(hf.config) if hf is not None else None
    w = getattr(cfg, "sliding_window", None)
    if not w:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return int(w) if any("sliding" in str(t) for t in types) else None
    return None if getattr(cfg, "use_sliding_window", True) is False else int(w)


def fits(mm, cached: int, new: int) -> bool:
    """Whether `new` tokens continued on a cache of `cached` columns give a full pass's numbers as
    far as the window goes: always without a sliding window, else while both fit in it."""
    w = sliding_window(mm)
    return w is None or cached + new <= w


def context(mm) -> int:
    """Positions the model has (`MemoryModel.max_length`); a model object without one: no limit."""
    return int(getattr(mm, "max_length", None) or np.iinfo(np.int64).max)


@torch.no_grad()
def prefix_cache(mm, ids: torch.Tensor, keep: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(keys, values)] per layer of each row's first keep[row] tokens of right-padded ids (B, T),
    cut to P = max(keep) columns."""
    from transformers import DynamicCache

    P = int(keep.max())
    dev = ids.device
    mask = (torch.arange(P, device=dev)[None] < keep.to(dev)[:, None]).long()
    cache = DynamicCache(config=mm.hf.config)
    mm.hf(input_ids=ids[:, :P], attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [(layer.keys[:, :, :P], layer.values[:, :, :P]) for layer in cache.layers]


def continued(past: list, kept: torch.Tensor, ids_new: torch.Tensor, mask_new: torch.Tensor,
              max_pos: int) -> dict:
    """The forward's keyword arguments that run ids_new (B, T), right-padded by mask_new, after each
    row's first kept[row] tokens, whose keys and values `past` holds ([(keys, values)] per layer,
    (B, heads, P, hd), columns past a row's kept masked). A row's real tokens sit at positions
    kept..kept+len-1 < the model's context; its padding, after them, would run past it when a longer
    row shares the batch (GPT-2's position table has no row there): padding takes the last
    position, masked and never read."""
    from transformers import DynamicCache

    dev = ids_new.device
    kk = kept.to(dev)
    P, T = int(past[0][0].shape[2]), ids_new.shape[1]
    am = torch.cat([(torch.arange(P, device=dev)[None] < kk[:, None]).to(mask_new.dtype), mask_new], 1)
    pos = (kk[:, None] + torch.arange(T, device=dev)[None]).clamp_(max=max_pos - 1)
    return {"input_ids": ids_new, "attention_mask": am, "past_key_values": DynamicCache(ddp_cache_data=past),
            "use_cache": True, "position_ids": pos}
