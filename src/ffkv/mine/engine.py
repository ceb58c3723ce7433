"""The mining pass itself: state, one captured forward per batch, checkpoints.

Shared by the mine step's one-process pass (`ffkv.steps.mine.compute`) and its Ray workers
(`ffkv.steps.mine.distributed`). `s` is the step's `ffkv.steps.mine.MineSettings`, not imported:
the step imports the engine, never the other way.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
import json
import os
from pathlib import Path

import numpy as np
import torch

from ffkv.mine.groups import group_size
from ffkv.mine.topk import TopKState
from ffkv.mine.trackers import Batch, MineState


PACK_VERSION = 4  # 1: batches capped at 64 rows; 2: bounded by the token budget alone (issue 24);
# 3: packed within each chunk of the sentence stream (`ffkv.corpus.stream.CHUNK` rows); 4: the
# --ray driver's plan too (before, one length sort over the whole table: a killed Ray run's shard
# files of that plan must not pass for slices of this one)


def layout_key(s: MineSettings, batch_tokens: int) -> str:
    """Identity of a checkpoint or a Ray shard file: the settings plus the batch plan (a cursor
    counts batches, so it means something only under the same plan)."""
    blob = json.dumps({"key": s.key(), "batch_tokens": int(batch_tokens), "pack": PACK_VERSION,
                       "chunk": int(s.chunk_sentences)})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def group_for(mm, s: MineSettings) -> int:
    """Layers per tracker update (`ffkv.mine.groups.group_size`) for this model and settings."""
    layers = s.layers if s.layers is not None else list(range(mm.n_layers))
    return group_size(len(s.dims) if s.dims is not None else mm.d_m, len(layers))


def new_state(mm, s: MineSettings) -> MineState:
    """The trackers of one mining pass, on the model's device: top-k, key statistics unless off,
    the keys' second moment of the --covariance layers, and the sign regimes with --regimes."""
    from ffkv.mine.stats import KeyStats

    layers = s.layers if s.layers is not None else list(range(mm.n_layers))
    dev = getattr(mm, "device", None)
    group = group_for(mm, s)
    trackers = {"topk": TopKState(layers, s.dims, mm.d_m, s.top_k, negative=s.negative,
                                  per_prefix=s.per_prefix, device=dev, group=group)}
    if s.stats:
        trackers["stats"] = KeyStats(layers, s.dims, mm.d_m, signs=(1, -1) if s.negative else (1,),
                                     samples=s.samples_per_bin, device=dev,
                                     max_position=int(getattr(mm, "max_length", 1 << 15) or 1 << 15),
                                     group=group)
    if getattr(s, "covariance", None):
        from ffkv.mine.covariance import KeyCovariance

        trackers["covariance"] = KeyCovariance(layers, s.covariance, mm.d_m, device=dev, group=group)
    if getattr(s, "regimes", False):
        from ffkv.mine.regimes import SignRegimes

        trackers["regimes"] = SignRegimes(layers, s.dims, mm.d_m, device=dev, group=group)
    return MineState(trackers, layers, s.dims, device=dev)


class FlatTokens:
    """The sentences table's token_ids as one flat array and offsets (`ffkv.corpus.tokens.flat_lists`):
    row i is a view, so the host holds 4-8 bytes a token, not a Python int list per sentence."""

    def __init__(self, column=None, values=None, offsets=None):
        if column is not None:
            from ffkv.corpus.tokens import flat_lists

            values, offsets = flat_lists(column)
        self.values, self.offsets = values, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return self.values[self.offsets[i]:self.offsets[i + 1]]


def mine_batches(mm, state: MineState, token_lists, sids, batches, on_batch=None, compiled=None,
                 tuner=None, chunk: tuple[int, int] | None = None) -> MineState:
    """Feed batches (lists of indices into token_lists) through one captured pass each.

    With a `tuner` (`ffkv.mine.tune`, kept across a pass's calls), each batch runs in packed rows
    or padded, with the fused kernels or the portable trackers, as the tuner says; without one, as
    FFKV_PACK=C and FFKV_TRITON=1 say (`auto` is the tuner's: padded and portable here); `chunk`
    (the chunk's first global batch index, its batch count) places the batches in their chunk for
    the tuner's strata, where they are not the whole chunk (a resumed one). Through
    compiled blocks under FFKV_COMPILE=1 (`ffkv.mine.compiled`: `compiled`, else made here), or
    the tuner's under FFKV_COMPILE=auto."""
    from ffkv.mine import fused_cuda
    from ffkv.mine.compiled import compiled_for
    from ffkv.mine.packing import cap_for
    from ffkv.model.onednn import products_of

    cap0 = cap_for(mm) if tuner is None else None
    needs = tuple(getattr(state, "needs", ()))  # captures beside m (the gate's for --regimes)
    own = compiled is None and not needs
    if own:
        compiled = compiled_for(mm, state.layers)
    if needs:  # the compiled blocks tap m only: such a pass runs eagerly
        compiled = None

    blocks = [None if compiled is None or compiled.failed else compiled]  # this batch's (None: eager)
    broke = [False]  # the compiled forward failed in this batch (`CompiledBlocks.broke`)

    def forward(ids, batch, unpack=None, **fw):
        handed = set()  # layers whose coefficients the trackers have
        aux: dict = {}  # layer -> {name: capture} that came before its m

        def update(l, m):
            if l not in handed:
                handed.add(l)
                state.update(l, m if unpack is None else unpack(m), batch, aux.pop(l, None))

        def on_capture(l, name, t):
            if name == "m":
                update(l, t)
            else:
                aux.setdefault(l, {})[name] = t if unpack is None else unpack(t)

        if blocks[0] is not None:
            try:
                blocks[0].capture(ids, update, **fw)
                return
            except Exception as e:
                if not blocks[0].broke(e):
                    raise
                blocks[0], broke[0] = None, True  # the rest of the batch eagerly: no layer twice
        with products_of(mm):
            mm.capture(ids, None, layers=state.layers, what=(*needs, "m"), callback=on_capture, **fw)

    batches = list(batches)
    first = batches[0][0] - chunk[0] if chunk and batches else 0
    slots = tuner.plan(len(batches), first, chunk[1] if chunk else None) if tuner is not None else None
    try:
        for j, (bi, idx) in enumerate(batches):
            arm, timed, trial = tuner.take(slots[j]) if tuner is not None else (None, False, False)
            if tuner is not None and needs and arm is not None and arm.compiled:
                arm = tuner.broke(arm)  # no compiled arm for a pass that captures more than m
            if tuner is not None and tuner.compiles and not needs:  # FFKV_COMPILE=auto: the tuner's blocks, in or out
                ran, blocks[0] = tuner.forward_for(arm, mm, state.layers)
                timed, arm = timed and ran == arm, ran  # a refused compiled arm: its twin's batch, untimed
            cap = cap0 if arm is None else arm.pack
            t0 = tuner.start(timed) if tuner is not None else 0.0
            with fused_cuda.forced(None if arm is None else arm.fused):
                lens = _one_batch(mm, token_lists, sids, idx, cap, forward)
            if broke[0]:
                broke[0], timed = False, False
                if tuner is not None and arm is not None and arm.compiled:
                    arm = tuner.broke(arm)
            ntok = int(sum(lens))
            if tuner is not None:
                tuner.done(arm, timed, t0, ntok, trial)
            if on_batch is not None:
                on_batch(bi, ntok)
    finally:
        if own and compiled is not None:
            compiled.close()
    return state


def _one_batch(mm, token_lists, sids, idx, cap, forward) -> list[int]:
    """One batch's forward (packed rows of `cap` tokens, or padded rows) and its trackers'
    updates; returns its sentences' lengths."""
    from ffkv.mine.packing import Packed

    if cap:
        flat, lens = flat_rows(token_lists, idx)
        p = Packed(flat, lens, mm.pad_id(), cap, getattr(mm, "device", "cpu"))
        lens_t = torch.as_tensor(lens).to(p.ids.device, non_blocking=True)
        mask = torch.arange(p.shape[1], device=p.ids.device)[None, :] < lens_t[:, None]
        lens = lens.tolist()
        batch = Batch.from_lengths(lens, [sids[i] for i in idx], mask)
        # position ids and no mask: transformers masks attention across the packed sentences
        forward(p.ids, batch, p.unpack, position_ids=p.position_ids)
        return lens
    if isinstance(token_lists, FlatTokens):
        ids, mask, lens = batch_tensors(mm, token_lists, idx)
    else:
        seqs = [token_lists[i] for i in idx]
        ids, mask = mm.batch(seqs)
        lens = [len(x) for x in seqs]
    batch = Batch.from_lengths(lens, [sids[i] for i in idx], mask)
    # No attention mask: the rows are right-padded, so under causal attention no real token sees a
    # pad, and the model's outputs at real tokens are the same. With a padding mask, transformers
    # builds a 4D mask (no flash attention on CUDA) after reading the mask on the host (a sync a
    # batch). The trackers still take the mask, through `batch`.
    forward(ids, batch)
    return lens


def flat_rows(tokens, idx) -> tuple[np.ndarray, np.ndarray]:
    """Rows `idx` of `tokens` (FlatTokens, or lists) one after another, and their lengths."""
    if not isinstance(tokens, FlatTokens):
        seqs = [np.asarray(tokens[i], dtype=np.int64).reshape(-1) for i in idx]
        return np.concatenate(seqs), np.fromiter(map(len, seqs), np.int64, len(seqs))
    idx = np.asarray(idx, np.int64)
    start = tokens.offsets[idx]
    lens = tokens.offsets[idx + 1] - start
    cols = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return tokens.values[np.repeat(start, lens) + cols], lens


def batch_tensors(mm, tokens: FlatTokens, idx):
    """`MemoryModel.batch` of flat rows, in numpy (no Python list per row): (ids, mask, lengths)."""
    from ffkv.model.memories import pad_rows

    flat, lens = flat_rows(tokens, idx)
    ids, mask = pad_rows(flat, lens, mm.pad_id(), getattr(mm, "device", "cpu"))
    return ids, mask, lens.tolist()


def save_npz(path: Path, arrays: dict) -> None:
    """np.savez to a temp file, fsync, rename: a reader never sees half a checkpoint.

    Ctrl-C is held off while it writes and acted on right after: a KeyboardInterrupt inside
    np.savez left its zip writer half closed, and closing it again on the closed file raised a
    ValueError (a traceback, not the one-line "interrupted")."""
    from ffkv.store.run import staged

    with _sigint_held():
        with staged(path) as tmp, open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a name
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())


@contextmanager
def _sigint_held():
    """SIGINT received inside is remembered, not raised, and handled as it would have been once
    the block ends (any thread may take the signal; Python handles it in the main thread, so a
    handler swap, not a signal mask, is what holds it off). Off the main thread: nothing held."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    prev = signal.signal(signal.SIGINT, lambda sig, frame: got.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
        if got:
            if callable(prev):
                prev(signal.SIGINT, None)  # Python's default: KeyboardInterrupt, here
            elif prev == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


def save_checkpoint(path: Path, state: MineState, cursor: int, key: str, batch_tokens: int | None = None) -> None:
    extra = {} if batch_tokens is None else {"__batch_tokens": np.array([int(batch_tokens)])}
    save_npz(path, {"__cursor": np.array([cursor]), "__key": np.frombuffer(key.encode(), np.uint8),
                    **extra, **state.arrays()})


def checkpoint_batch_tokens(path: Path) -> int | None:
    """The budget a checkpoint was mined under (None: no checkpoint, or one without it), so that
    `--batch-tokens auto` resumes under the plan it started with, whatever memory is free now."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return int(z["__batch_tokens"][0]) if "__batch_tokens" in z.files else None
    except Exception:  # noqa: BLE001  (a damaged checkpoint: load_checkpoint decides)
        return None


def load_checkpoint(path: Path, state: MineState, key: str, log=None) -> int:
    """Restore `state` from a checkpoint of the same settings; returns the next batch index.

    A checkpoint without every tracker's arrays (written by an ffkv before key statistics) cannot
    continue them: mining starts over."""
    if not path.exists():
        return 0
    with np.load(path, allow_pickle=False) as z:
        if bytes(z["__key"]).decode() != key:
            return 0
        try:
            state.load_arrays(z)
        except KeyError:
            if log is not None:
                log("mine: the checkpoint lacks the key statistics (an older ffkv); starting over")
            return 0
        return int(z["__cursor"][0])
