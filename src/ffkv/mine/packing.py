"""Mining's forward over packed rows (FFKV_PACK=C tokens per row; auto, the default on CUDA, times it).

A mining batch of short sentences is some 2,000 right-padded rows of about 12 tokens. On a GPU,
attention then runs a tile per row and head, and took as long as all of the model's products in
a profile of the SmolLM2 shape (benchmarks/GPU.md). Packed, the same sentences sit side by side in
rows of C tokens, their position ids restarting at each sentence. Given position ids and no mask,
transformers finds the packed sequences itself and masks attention across them (as for packed
training batches), so every sentence's forward is its own. The captures are then put back in the
padded (B, T) layout that the trackers read, so nothing after the forward changes.

On CUDA, `ffkv mine` times packed rows of 128 and 256 tokens against padded rows on its first
batches and keeps the fastest (FFKV_PACK=auto, the default there: `ffkv.mine.tune`); on a CPU,
where they do not win (0.89-1.04x), rows stay padded unless FFKV_PACK=C asks. A model whose
forward does not keep packed sentences apart (found by running it: `refusal`) keeps padded rows.
"""
from __future__ import annotations

import numpy as np
import torch

from ffkv.errors import FfkvError, notice
from ffkv.mine import switches

ENV = "FFKV_PACK"
SIZES = (128, 256)  # the row lengths `auto` times (`ffkv.mine.tune`)


def setting(device=None) -> int | str | None:
    """FFKV_PACK as C (tokens per packed row), "auto" or None (padded rows); unset: "auto" on CUDA
    (timed against padded rows on the run's first batches), None elsewhere."""
    return switches.by_device(ENV, device, parse, None)[0]


def parse(raw: str, name: str = ENV) -> int | str | None:
    """A packing setting (FFKV_PACK's, or `ffkv mine --pack`'s, named `name` in the message)."""
    raw = str(raw).strip().lower()
    if raw in ("auto", "0"):
        return None if raw == "0" else raw
    try:
        c = int(raw)
    except ValueError:
        c = -1
    if c < 1:
        raise FfkvError(f"{name}: give the tokens per packed row as a whole number (e.g. 256), 0 for padded "
                        f"rows, or auto to time both on the run's first batches (the default on CUDA)")
    return c


def rows_tokens() -> int | None:
    """C from FFKV_PACK, None when unset, 0 or auto (auto is the tuner's: `ffkv.mine.tune`)."""
    c = setting()
    return c if isinstance(c, int) else None


@torch.no_grad()
def refusal(mm) -> str | None:
    """Why this model's forward cannot take packed rows, found by running it (None: it can).

    Whether a family honours restarting position ids and masks across packed sentences is up to
    its transformers code (ALiBi families, OPT and Falcon do not), and may change with the
    version: so the check's sentences (`ffkv.mine.selfcheck`) go through the model packed into
    one row and as padded rows, and agree at the first and last layers, or packing is refused."""
    from ffkv.mine.selfcheck import first_difference, sentences
    from ffkv.model.memories import pad_rows

    flat, lens = sentences(mm)
    dev = getattr(mm, "device", "cpu")
    layers = sorted({0, mm.n_layers - 1})
    p = Packed(flat, lens, mm.pad_id(), int(lens.sum()), dev)
    got = mm.capture(p.ids, None, layers=layers, what=("m",), position_ids=p.position_ids)
    ids, mask = pad_rows(flat, lens, mm.pad_id(), dev)
    want = mm.capture(ids, None, layers=layers, what=("m",))
    diff = first_difference(mm, {l: p.unpack(got[l]["m"]) for l in layers}, {l: want[l]["m"] for l in layers},
                            mask.bool())
    if diff:
        return f"its sentences see each other or lose their positions in a packed row (layer {diff[0]}: {diff[1]:.1e})"
    return None


def accepts(mm) -> bool:
    """Whether this model's forward keeps packed sentences apart (`refusal`, run once a model; a
    refusal is said once)."""
    why = mm.__dict__.get("_pack_refusal", False)
    if why is False:
        why = mm.__dict__["_pack_refusal"] = refusal(mm)
        if why:
            notice(f"{ENV}: padded rows for this model: {why}")
    return not why


def cap_for(mm) -> int | None:
    """C for this model, or None: FFKV_PACK unset (or auto: the tuner's), or the model fails the check."""
    c = rows_tokens()
    return c if c is not None and accepts(mm) else None


class Packed:
    """One batch's sentences in packed rows, and the way back to its padded (B, T) layout."""

    def __init__(self, flat: np.ndarray, lens, pad_id: int, cap: int, device):
        lens = np.asarray(lens, dtype=np.int64)
        B, T = len(lens), int(lens.max())
        cap = max(int(cap), T)
        # next-fit in the batch's order (length-sorted by `pack`, so rows fill well)
        row = np.empty(B, np.int64)
        off = np.empty(B, np.int64)
        r = fill = 0
        for i, n in enumerate(lens.tolist()):
            if fill + n > cap:
                r, fill = r + 1, 0
            row[i], off[i] = r, fill
            fill += n
        R, C = r + 1, int((off + lens).max())
        starts = np.cumsum(lens) - lens
        t = np.arange(int(lens.sum())) - np.repeat(starts, lens)
        dest = np.repeat(row * C + off, lens) + t  # flat packed slot of each real token
        ids = np.full(R * C, pad_id, np.int64)
        ids[dest] = flat
        pos = np.zeros(R * C, np.int64)  # a pad is a sequence of one (position 0): it sees itself only
        pos[dest] = t
        # padded (b, t) -> packed slot; a pad position reads its row's last real token (finite,
        # and the trackers never read it: they take the lengths and the mask)
        tt = np.minimum(np.arange(T)[None, :], lens[:, None] - 1)
        index = (row * C + off)[:, None] + tt
        dev = torch.device(device)
        pin = dev.type == "cuda"

        def put(a):
            t = torch.from_numpy(a)
            return t.pin_memory().to(dev, non_blocking=True) if pin else t.to(dev)

        self.ids, self.position_ids = put(ids.reshape(R, C)), put(pos.reshape(R, C))
        self.index = put(index.reshape(-1))
        self.shape = (B, T)
        self.rows = R

    def unpack(self, m: torch.Tensor) -> torch.Tensor:
        """(R, C, n) packed captures -> (B, T, n) in the padded layout."""
        return m.reshape(-1, m.shape[-1]).index_select(0, self.index).view(*self.shape, m.shape[-1])
