"""Which forward and trackers a mining pass runs, chosen by timing them on its own first batches.

Packed rows (`ffkv.mine.packing`) and the fused kernels (`ffkv.mine.fused_cuda`) give the same
tables as padded rows and the portable trackers; whether they are faster depends on the GPU, the
model's shape and the corpus's lengths. So on CUDA (FFKV_PACK and FFKV_TRITON unset, or `auto`)
a pass times each combination on real batches and keeps the fastest, as cuDNN's benchmark mode
picks its algorithms. Nothing is thrown away: the timed batches are mined by the arm that timed
them, and every arm's results are the same (packing checks the model first, the fused kernels
check themselves against the portable path).

The batches of a chunk come sorted by length, so neighbours are alike but not equal: after one
untimed round (compiles, caches) the arms run twice, in order and then in reverse, so that a
drift in the batches' lengths weighs on every arm alike; the score is seconds per real token.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

ROUNDS = 2  # timed rounds, after one untimed


@dataclass(frozen=True)
class Arm:
    pack: int | None  # tokens per packed row, None: padded rows
    fused: bool  # the fused Triton kernels (else the portable trackers)

    @property
    def name(self) -> str:
        rows = f"packed{self.pack}" if self.pack else "padded"
        return f"{rows}+fused" if self.fused else rows


class Tuner:
    """The arm of each batch of a pass: each arm in turn while timing, then the fastest."""

    def __init__(self, arms: list[Arm], device=None):
        self.arms = list(arms)
        self.cuda = torch.device(device or "cpu").type == "cuda"
        self.device = device
        n = len(self.arms)
        timed = [a for r in range(ROUNDS) for a in (self.arms if r % 2 == 0 else self.arms[::-1])]
        self._plan = [(a, False) for a in self.arms] + [(a, True) for a in timed] if n > 1 else []
        self.seconds = {a: 0.0 for a in self.arms}
        self.tokens = {a: 0 for a in self.arms}
        self.batches = {a: 0 for a in self.arms}
        self.chosen: Arm | None = self.arms[0] if n == 1 else None

    def next(self) -> tuple[Arm, bool]:
        """The next batch's arm, and whether it is timed."""
        if self._plan:
            return self._plan.pop(0)
        if self.chosen is None:  # every arm timed: keep the fastest
            self.chosen = min(self.arms, key=lambda a: (self.seconds[a] / max(1, self.tokens[a]), self.arms.index(a)))
        return self.chosen, False

    def start(self, timed: bool) -> float:
        if timed and self.cuda:  # the batch before must not count
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def done(self, arm: Arm, timed: bool, t0: float, tokens: int) -> None:
        """A batch of `arm` ended (started at `t0`, from `start`)."""
        if timed and self.cuda:
            torch.cuda.synchronize(self.device)
        self.add(arm, tokens, time.perf_counter() - t0 if timed else None)

    def add(self, arm: Arm, tokens: int, seconds: float | None) -> None:
        """A batch of `arm` with its real tokens, and its seconds where it was timed."""
        self.batches[arm] += 1
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
