"""Which forward and trackers a mining pass runs, chosen by timing them on its own first batches.

Packed rows (`ffkv.mine.packing`) and the fused kernels (`ffkv.mine.fused_cuda`) give the same
tables as padded rows and the portable trackers; whether they are faster depends on the GPU, the
model's shape and the corpus's lengths. So on CUDA (FFKV_PACK and FFKV_TRITON unset, or `auto`)
a pass times each combination on real batches and keeps the fastest, as cuDNN's benchmark mode
picks its algorithms. Nothing is thrown away: the timed batches are mined by the arm that timed
them, and every arm's results are the same (packing checks the model first, the fused kernels
check themselves against the portable path).

A chunk's batches come sorted by length (`ffkv.corpus.batching.pack`), so its first batches hold
its shortest sentences, where packed rows gain most: timed there alone, the choice would not hold
for the rest. So the trial is in blocks: one untimed block of every arm at the start (compiles,
caches), then ROUNDS timed blocks spread over the chunk's batches, each block's arms on
neighbouring batches (alike in length), in alternating order; the batches between mine with the
first arm (padded rows, the portable trackers). The score is seconds per real token over all
blocks. A chunk too short for the blocks to spread runs them one after another, and the rest go on
in the next chunk.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

ROUNDS = 3  # timed blocks, after one untimed


@dataclass(frozen=True)
class Arm:
    pack: int | None  # tokens per packed row, None: padded rows
    fused: bool  # the fused Triton kernels (else the portable trackers)

    @property
    def name(self) -> str:
        rows = f"packed{self.pack}" if self.pack else "padded"
        return f"{rows}+fused" if self.fused else rows


class Tuner:
    """The arm of each batch of a pass: the trial's blocks while timing, then the fastest."""

    def __init__(self, arms: list[Arm], device=None):
        self.arms = list(arms)
        self.cuda = torch.device(device or "cpu").type == "cuda"
        self.device = device
        n = len(self.arms)
        self._blocks = ([[(a, False) for a in self.arms]]
                        + [[(a, True) for a in (self.arms if r % 2 == 0 else self.arms[::-1])] for r in range(ROUNDS)]
                        if n > 1 else [])
        self._left = sum(map(len, self._blocks))  # trial batches not yet mined
        self.seconds = {a: 0.0 for a in self.arms}
        self.tokens = {a: 0 for a in self.arms}
        self.batches = {a: 0 for a in self.arms}
        self.chosen: Arm | None = self.arms[0] if n == 1 else None

    def plan(self, n: int) -> list:
        """The slots of the next n batches (one call of `mine_batches`, in order): (arm, timed) for
        a trial batch, None for any other (`take`)."""
        slots: list = [None] * n
        blocks, self._blocks = self._blocks, []
        need = sum(map(len, blocks))
        if not blocks or n == 0:
            self._blocks = blocks
            return slots
        if need >= n:  # too few batches to spread the blocks: one after another, the rest later
            flat = [x for b in blocks for x in b]
            slots[:] = flat[:n]
            if flat[n:]:
                self._blocks = [flat[n:]]
            return slots
        first, rest = blocks[0], blocks[1:]
        slots[:len(first)] = first
        end = len(first)
        seg = (n - end) / max(1, len(rest))
        for i, b in enumerate(rest):  # each centred in its share of the batches after the first
            after = sum(map(len, rest[i + 1:]))
            start = min(max(end, round(len(first) + (i + 0.5) * seg - len(b) / 2)), n - after - len(b))
            slots[start:start + len(b)] = b
            end = start + len(b)
        return slots

    def take(self, slot) -> tuple[Arm, bool, bool]:
        """A slot of `plan` as (arm, timed, in the trial): a trial slot as planned; any other the
        chosen arm, chosen once every trial batch has been mined (until then, the first arm)."""
        if slot is not None:
            return slot[0], slot[1], True
        if self.chosen is None and self._left == 0:
            self.chosen = min(self.arms, key=lambda a: (self.seconds[a] / max(1, self.tokens[a]), self.arms.index(a)))
        return (self.chosen or self.arms[0]), False, False

    def start(self, timed: bool) -> float:
        if timed and self.cuda:  # the batch before must not count
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def done(self, arm: Arm, timed: bool, t0: float, tokens: int, trial: bool = False) -> None:
        """A batch of `arm` ended (started at `t0`, from `start`)."""
        if timed and self.cuda:
            torch.cuda.synchronize(self.device)
        self.add(arm, tokens, time.perf_counter() - t0 if timed else None, trial)

    def add(self, arm: Arm, tokens: int, seconds: float | None, trial: bool = False) -> None:
        """A batch of `arm` with its real tokens, its seconds where it was timed, and whether it
        was one of the trial's."""
        self.batches[arm] += 1
        self._left -= bool(trial)
        if seconds is not None:
            self.seconds[arm] += seconds
            self.tokens[arm] += int(tokens)

    @property
    def tuning(self) -> bool:
        return len(self.arms) > 1

    def record(self) -> dict | None:
        """For the manifest: each arm's timed throughput and batches, and the choice (None when
        there was nothing to choose)."""
        if not self.tuning:
            return None
        return {"chosen": self.chosen.name if self.chosen else None,
                "arms": [{"arm": a.name, "packed_rows": a.pack, "fused": a.fused, "batches": self.batches[a],
                          "timed_tokens": self.tokens[a],
                          "tokens_per_s": round(self.tokens[a] / self.seconds[a], 1) if self.seconds[a] > 0 else None}
                         for a in self.arms]}


def arms_for(mm) -> list[Arm]:
    """The combinations FFKV_PACK and FFKV_TRITON allow for this model on its device: a number
    fixes its switch, `auto` offers both sides (packed rows only where the model keeps packed
    sentences apart, the fused kernels only where they run and pass their check)."""
    from ffkv.mine import fused_cuda, packing

    dev = getattr(mm, "device", None) or "cpu"
    p = packing.setting(dev)
    if p is None:
        packs = [None]
    elif p == "auto":
        packs = [None, *packing.SIZES] if packing.accepts(mm) else [None]
    else:
        packs = [p if packing.accepts(mm) else None]
    f = fused_cuda.setting(dev)
    fused = [False]
    if f != "0" and fused_cuda.runs_here(dev) and fused_cuda.verify(dev):
        fused = [True] if f == "1" else [False, True]
    return [Arm(pk, fu) for pk, fu in itertools.product(packs, fused)]


def tuner_for(mm) -> Tuner:
    """The tuner of a mining pass over this model (one arm, untimed, where nothing is `auto`)."""
    return Tuner(arms_for(mm), getattr(mm, "device", None))


def how(mm, tuner, layers) -> dict:
    """How a pass ran, for the manifest: tokens per packed row (None: padded), the fused kernels,
    compiled blocks, and the tuner's figures (`ffkv.mine.tune`; None when nothing was timed)."""
    from ffkv.mine.compiled import accepted

    arm = tuner.chosen if tuner is not None else None
    return {"packed_rows": arm.pack if arm is not None else None,
            "fused_trackers": bool(arm is not None and arm.fused),
            "compiled_forward": accepted(mm, layers),
            "tuning": tuner.record() if tuner is not None else None}


def how_of_shards(hows: list[dict]) -> dict:
    """The shards' `how` as one record: what any shard did (the largest packed rows); each actor
    tunes on its own first batches, so their figures go in `shards_tuning`, in order of finishing."""
    return {"packed_rows": max((h["packed_rows"] for h in hows), key=lambda c: c or 0, default=None),
            "fused_trackers": any(h["fused_trackers"] for h in hows) if hows else None,
            "compiled_forward": any(h["compiled_forward"] for h in hows) if hows else None,
            "tuning": None, "shards_tuning": [h["tuning"] for h in hows if h.get("tuning")] or None}
