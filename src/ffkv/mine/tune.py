"""Which forward and trackers a mining pass runs, chosen by timing them on its own first batches.

Packed rows (`ffkv.mine.packing`) and the fused kernels (`ffkv.mine.fused_cuda`) give the same
tables as padded rows and the portable trackers; whether they are faster depends on the GPU, the
model's shape and the corpus's lengths. So on CUDA (FFKV_PACK and FFKV_TRITON unset, or `auto`)
a pass times each combination on real batches and keeps the fastest, as cuDNN's benchmark mode
picks its algorithms. Nothing is thrown away: the timed batches are mined by the arm that timed
them, and every arm's results are the same (packing checks the model first, the fused kernels
check themselves against the portable path).

A chunk's batches come sorted by length (`ffkv.corpus.batching.pack`): its first batches hold its
shortest sentences, where packed rows gain most, its last ones the longest. Arms timed on
different parts of a chunk would be compared on different sentences. So each chunk's batches are
cut into STRATA equal strata by their place in it (first quarter, second, ...), and every arm is
timed on one batch of every stratum, in the first chunks that have room (the arms of one stratum
on neighbouring batches, in alternating order from chunk to chunk); each arm's first batch, before
that, is untimed (compiles, caches). Other batches mine with the first arm (padded rows, the
portable trackers) until every arm has been timed everywhere; then the arm of fewest seconds per
real token mines the rest. Chunks of a few batches (a GPU's budget over short sentences) fill a
stratum or two each, and the trial spans several.

Under FFKV_COMPILE=auto a second trial follows, from the next chunk on (where auto is CUDA's
default, from the first chunk after `compiled.PAYS_AFTER_S` of mining): the chosen arm against its
twin through compiled blocks (`ffkv.mine.compiled`), strata alike. Compiling costs seconds per
kind of batch (padded, packed with and without a mask), so only the winner's twin is timed, its
first batch (the compile) untimed; a model that refuses compiled blocks leaves it out, said once.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

STRATA = 4  # parts of a chunk (by place, so by length) on which every arm is timed once


@dataclass(frozen=True)
class Arm:
    pack: int | None  # tokens per packed row, None: padded rows
    fused: bool  # the fused Triton kernels (else the portable trackers)
    compiled: bool = False  # the blocks through torch.compile (FFKV_COMPILE=auto's second trial)

    @property
    def name(self) -> str:
        rows = f"packed{self.pack}" if self.pack else "padded"
        return rows + ("+fused" if self.fused else "") + ("+compiled" if self.compiled else "")


class Tuner:
    """The arm of each batch of a pass: the trial's while timing, then the fastest."""

    def __init__(self, arms: list[Arm], device=None, then_compile: bool = False, compile_after: float = 0.0,
                 clock=time.perf_counter):
        self.arms = list(arms)  # every arm timed in the pass (the record's)
        self.compile_after = float(compile_after)  # seconds of the pass before the compiled trial
        self._clock, self._t0 = clock, None  # the pass's first planned batch
        self._trial = list(arms)  # the arms of the trial under way
        self.cuda = torch.device(device or "cpu").type == "cuda"
        self.device = device
        self.compiles = bool(then_compile)  # the tuner puts compiled blocks in and out (`forward_for`)
        self._twin = self.compiles  # the compiled trial is still to come
        self.blocks = None  # the compiled blocks in place now
        self.base: Arm | None = None  # the first trial's choice, while the compiled trial runs
        tuning = len(self.arms) > 1
        self._warm = list(self.arms) if tuning else []  # arms whose untimed first batch is still to come
        self._need: set | None = None  # (arm, stratum) not yet timed; made at the trial's first chunk
        self._strata = STRATA
        self._pending = 0  # trial batches planned, not yet mined
        self._chunks = 0
        self.seconds = {a: 0.0 for a in self.arms}
        self.tokens = {a: 0 for a in self.arms}
        self.batches = {a: 0 for a in self.arms}
        self.chosen: Arm | None = None if tuning else self.arms[0]

    @property
    def tuning(self) -> bool:
        return len(self.arms) > 1 or self._twin

    def _start_twin(self) -> None:
        """The second trial: the chosen arm against its compiled twin."""
        self._twin = False
        if self.chosen.compiled:
            return
        twin = Arm(self.chosen.pack, self.chosen.fused, True)
        self.base = self.chosen
        self.arms.append(twin)
        self.seconds[twin], self.tokens[twin], self.batches[twin] = 0.0, 0, 0
        self._trial, self._warm = [self.chosen, twin], [twin]
        self._need, self._chunks, self.chosen = None, 0, None

    def drop(self, arm: Arm) -> None:
        """`arm` cannot run here (its model refuses compiled blocks): out of the trial."""
        if arm in self._trial and len(self._trial) > 1:
            self._trial.remove(arm)
            self._warm = [a for a in self._warm if a != arm]
            if len(self._trial) == 1:  # nothing left to compare
                self._need = set()
            elif self._need is not None:
                self._need = {x for x in self._need if x[0] != arm}

    def forward_for(self, arm: Arm, mm, layers):
        """(the arm that runs, the compiled blocks it runs through or None) for a batch of `arm`:
        the tuner's blocks put in place, or taken out for an eager arm. A compiled arm that the
        model refuses (`compiled_for`'s check, said once) leaves the trial and its batch runs as
        the arm it twins."""
        if not arm.compiled:
            self.close()
            return arm, None
        if self.blocks is None:
            from ffkv.mine.compiled import compiled_for

            self.blocks = compiled_for(mm, layers, force=True)
            if self.blocks is None:  # refused: now, or after it was chosen (it failed mid-pass)
                return self.forward_for(self.broke(arm), mm, layers)
        return arm, self.blocks

    def broke(self, arm: Arm) -> Arm:
        """The compiled blocks cannot run `arm` (refused by their check, or failed in a batch:
        `CompiledBlocks.broke`, now out): the compiled arm leaves the trial and the choice, and
        its batch runs or counts as its eager twin, which is returned."""
        self.blocks = None
        self.drop(arm)
        twin = Arm(arm.pack, arm.fused)
        if self.chosen == arm:
            self.chosen = twin
        return twin

    def close(self) -> None:
        """Compiled blocks out: the model's own forward again."""
        if self.blocks is not None:
            self.blocks.close()
            self.blocks = None

    def plan(self, n: int, first: int = 0, size: int | None = None) -> list:
        """The slots of the next n batches (one chunk's, in order): (arm, timed) for a trial
        batch, None for any other (`take`). The batches are places first .. first + n - 1 of a
        chunk of `size` (default n: the whole chunk; a resumed chunk starts at its cursor)."""
        slots: list = [None] * n
        size = n if size is None else max(int(size), first + n)
        if n and self._t0 is None:
            self._t0 = self._clock()
        if n and self.chosen is not None and self._twin and self._clock() - self._t0 >= self.compile_after:
            self._start_twin()
        if not self.tuning or n == 0 or self.chosen is not None:
            return slots
        if self._need is None:  # a pass whose chunks hold fewer batches: fewer strata
            self._strata = min(STRATA, size)
            self._need = {(a, q) for a in self._trial for q in range(self._strata)}
        j0 = 0
        while self._warm and j0 < n:
            slots[j0] = (self._warm.pop(0), False)
            j0 += 1
        order = self._trial if self._chunks % 2 == 0 else self._trial[::-1]
        self._chunks += 1
        S = self._strata
        for q in range(S):
            places = [j for j in range(j0, n) if (first + j) * S // size == q]
            for j, a in zip(places, [a for a in order if (a, q) in self._need]):
                slots[j] = (a, True)
                self._need.discard((a, q))
        self._pending += sum(s is not None for s in slots)
        return slots

    def take(self, slot) -> tuple[Arm, bool, bool]:
        """A slot of `plan` as (arm, timed, in the trial): a trial slot as planned; any other the
        chosen arm, chosen once every trial batch has been mined (until then, the first arm)."""
        if slot is not None:
            return slot[0], slot[1], True
        if self.chosen is None and not self._warm and self._need == set() and self._pending == 0:
            self.chosen = min(self._trial,
                              key=lambda a: (self.seconds[a] / max(1, self.tokens[a]), self._trial.index(a)))
        return (self.chosen or self._trial[0]), False, False

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
        self._pending -= bool(trial)
        if seconds is not None:
            self.seconds[arm] += seconds
            self.tokens[arm] += int(tokens)

    def record(self) -> dict | None:
        """For the manifest: each arm's timed throughput and batches, and the choice (None when
        there was nothing to choose)."""
        if len(self.arms) < 2:
            return None
        chosen = self.chosen or self.base  # a pass that ended in the compiled trial mined on with the first choice
        return {"chosen": chosen.name if chosen else None,
                "arms": [{"arm": a.name, "packed_rows": a.pack, "fused": a.fused, "compiled": a.compiled,
                          "batches": self.batches[a],
                          "timed_tokens": self.tokens[a],
                          "tokens_per_s": round(self.tokens[a] / self.seconds[a], 1) if self.seconds[a] > 0 else None}
                         for a in self.arms]}


def arms_for(mm, log=None) -> list[Arm]:
    """The combinations FFKV_PACK and FFKV_TRITON allow for this model on its device: a number
    fixes its switch, `auto` offers both sides (packed rows only where the model keeps packed
    sentences apart, the fused kernels only where they run and pass their check)."""
    from ffkv.mine import fused_cuda, packing, selfcheck

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
    if f != "0" and fused_cuda.runs_here(dev):
        if log is not None and not selfcheck.checked(dev):
            log("mine: checking the fused kernels against the portable path (the first time on this GPU, "
                "Triton compiles them)")
        if selfcheck.verify(dev):
            fused = [True] if f == "1" else [False, True]
    return [Arm(pk, fu) for pk, fu in itertools.product(packs, fused)]


def tuner_for(mm, log=None) -> Tuner:
    """The tuner of a mining pass over this model (one arm, untimed, where nothing is `auto`)."""
    from ffkv.mine import compiled

    dev = getattr(mm, "device", None)
    after = compiled.trial_after(dev)
    return Tuner(arms_for(mm, log), dev, then_compile=after is not None, compile_after=after or 0.0)


def how(mm, tuner, layers) -> dict:
    """How a pass ran, for the manifest: tokens per packed row (None: padded), the fused kernels,
    compiled blocks, and the tuner's figures (`ffkv.mine.tune`; None when nothing was timed)."""
    from ffkv.mine.compiled import accepted

    arm = (tuner.chosen or tuner.base) if tuner is not None else None
    return {"packed_rows": arm.pack if arm is not None else None,
            "fused_trackers": bool(arm is not None and arm.fused),
            "compiled_forward": accepted(mm, layers) or bool(arm is not None and arm.compiled),
            "tuning": tuner.record() if tuner is not None else None}


def how_of_shards(hows: list[dict]) -> dict:
    """The shards' `how` as one record: what any shard did (the largest packed rows); each actor
    tunes on its own first batches, so their figures go in `shards_tuning`, in order of finishing."""
    return {"packed_rows": max((h["packed_rows"] for h in hows), key=lambda c: c or 0, default=None),
            "fused_trackers": any(h["fused_trackers"] for h in hows) if hows else None,
            "compiled_forward": any(h["compiled_forward"] for h in hows) if hows else None,
            "tuning": None, "shards_tuning": [h["tuning"] for h in hows if h.get("tuning")] or None}
