"""The `mine` step: one forward pass per batch, every prefix's coefficients at once, into the trackers.

The trackers (`ffkv.mine.trackers`) are registered here with the step: `TRACKERS` says which
tables each writes and whether a setting turns it off. The step's `tables` are those always
written; `done_info` requires the optional ones only when the step's info says they were made,
so runs mined before key statistics existed, or with --no-stats, stay done.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa

from ffkv.corpus.batching import pack, padding_share
from ffkv.mine.engine import (MineSettings, load_checkpoint, mine_batches, new_state,  # noqa: F401
                              save_checkpoint)
from ffkv.mine.topk import TopKState, triggers_table  # noqa: F401  (re-exported)
from ffkv.parse import parse_int_list  # noqa: F401  (re-exported for callers of the old path)
from ffkv.store.steps import Step, execute

CKPT = ".mine_checkpoint.npz"


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker of the mine step: the tables it writes, and whether the settings turn it on."""
    name: str
    tables: tuple[str, ...]
    enabled: Callable[[MineSettings], bool]


TRACKERS = (
    TrackerSpec("topk", ("triggers",), lambda s: True),
    TrackerSpec("stats", ("key_stats", "key_hist", "key_samples"), lambda s: s.stats),
)
TABLES = ("sentences", "triggers", "vocab")  # always written: the topk tracker's and the corpus
STATS_TABLES = next(spec.tables for spec in TRACKERS if spec.name == "stats")


class _FinishContext:
    """What trackers' `finish` may read: the run's sentences (read once, when asked)."""

    def __init__(self, run):
        self.run, self._sent = run, None

    def sentences(self):
        if self._sent is None:
            self._sent = self.run.read_table("sentences")
        return self._sent


def vocab_table(tok, n: int) -> pa.Table:
    """Token id -> display string, so readers (show, report, web) need no tokenizer."""
    ids = list(range(n))
    text = [tok.decode([i]) if i < len(tok) else "" for i in ids]
    raw = tok.convert_ids_to_tokens([i if i < len(tok) else 0 for i in ids])
    return pa.table({"token_id": pa.array(ids, pa.int32()), "text": text,
                     "token": [str(r) for r in raw]})


def mine(run, mm, s: MineSettings, checkpoint_every: float = 60.0, ray_address: str | None = None,
         shards: int = 1, show_progress: bool | None = None, log=print, force: bool = False) -> dict:
    """Mine top-k triggers (and key statistics) into `run`; resumes a killed run with the same
    settings. `force`: mine again from scratch (the corpus split and the whole pass), replacing
    every table of the step."""
    out = execute(run, "mine", s, mm=mm, log=log, show_progress=show_progress, force=force,
                  checkpoint_every=checkpoint_every, ray_address=ray_address, shards=shards)
    if out.skipped:
        log(f"mine: {run.path} is already mined with these settings; nothing to do")
    return out.info


def _prepare(run, mm, s: MineSettings, force: bool = False) -> None:
    """Record the model, split and tokenize the corpus (unless done for these settings and the
    table is whole), vocab (unless whole)."""
    from ffkv.corpus.prepare import prepare_sentences

    run.record_model(mm)
    run.manifest["lens"] = mm.lens.mode
    run.save()
    if force or run.table_problem("sentences") or run.manifest.get("corpora", {}).get("sentences", {}).get(
            "settings_key") != s.key():
        prepare_sentences(run, mm, s.corpus, s.max_sentences, seed=s.seed, field=s.field)
        run.manifest["corpora"]["sentences"]["settings_key"] = s.key()
        run.manifest["corpus"] = run.manifest["corpora"]["sentences"]
        run.manifest["counts"] = run.manifest["corpus"]["counts"]
        run.save()
    if force or run.table_problem("vocab"):
        run.write_table("vocab", vocab_table(mm.tok, mm.vocab_size))


def _mine_local(run, mm, s: MineSettings, state, token_lists, sids, batches, lengths,
                checkpoint_every: float, show_progress, log):
    """Mine the batches not yet in the checkpoint; returns the state and the tokens mined now."""
    from ffkv.progress import progress

    ckpt = run.path / CKPT
    cursor = load_checkpoint(ckpt, state, s.key(), log=log)
    if cursor:
        log(f"mine: resuming from checkpoint at batch {cursor}/{len(batches)}")
    elif ckpt.exists():
        state = new_state(mm, s)  # a checkpoint of other settings or trackers: maybe half loaded
    done_tokens = int(sum(lengths[b].sum() for b in batches[:cursor]))
    last = time.time()
    with progress(None if show_progress is None else not show_progress) as bar:
        task = bar.add_task("mine", total=len(lengths), completed=int(sum(len(b) for b in batches[:cursor])),
                            tokens=0)

        def on_batch(bi, ntok):
            nonlocal last
            bar.update(task, advance=len(batches[bi]), tokens=bar.tasks[task].fields["tokens"] + ntok)
            if time.time() - last >= checkpoint_every and bi + 1 < len(batches):
                save_checkpoint(ckpt, state, bi + 1, s.key())
                last = time.time()

        mine_batches(mm, state, token_lists, sids, [(i, batches[i]) for i in range(cursor, len(batches))],
                     on_batch)
    return state, int(lengths.sum()) - done_tokens


def compute(ctx) -> dict:
    run, s, mm = ctx.run, ctx.settings, ctx.model()
    if s.samples_per_bin < 0:
        from ffkv.errors import FfkvError

        raise FfkvError("--samples-per-bin must be 0 or more")
    checkpoint_every = ctx.extra.get("checkpoint_every", 60.0)
    ray_address, shards = ctx.extra.get("ray_address"), ctx.extra.get("shards", 1)
    if ctx.force:
        (run.path / CKPT).unlink(missing_ok=True)  # from scratch: no resume
    _prepare(run, mm, s, force=ctx.force)
    sent = run.read_table("sentences", columns=["sentence_id", "token_ids", "n_tokens"])
    token_lists = sent.column("token_ids").to_pylist()
    sids = sent.column("sentence_id").to_pylist()
    lengths = np.asarray(sent.column("n_tokens"))
    batches = pack(lengths, s.batch_tokens)
    t0 = time.time()
    state = new_state(mm, s)
    if ray_address:
        from ffkv.mine.distributed import mine_ray

        state = mine_ray(run, mm, s, token_lists, sids, batches, ray_address, shards, log=ctx.log)
        mined_tokens = int(lengths.sum())
    else:
        state, mined_tokens = _mine_local(run, mm, s, state, token_lists, sids, batches, lengths,
                                          checkpoint_every, ctx.show_progress, ctx.log)
    secs = time.time() - t0
    tables = state.finish(_FinishContext(run))
    trig = tables.pop("triggers")
    run.write_table("triggers", trig, row_group_size=100_000)
    for name, t in tables.items():  # key_stats, key_hist, key_samples: sorted by layer, dim
        run.write_table(name, t, row_group_size=100_000)
    (run.path / CKPT).unlink(missing_ok=True)
    info = {"rows": trig.num_rows, "padding_share": round(padding_share(lengths, batches), 4),
            "tokens": int(lengths.sum()),
            "tokens_per_s": round(mined_tokens / secs, 1) if secs > 0 else None,
            "mine_seconds": round(secs, 2), "shards": shards if ray_address else 1}
    if state.stats is not None:
        from ffkv.mine.stats import layout

        info["stats"] = {**layout(), "tables": list(STATS_TABLES), "samples_per_bin": s.samples_per_bin}
    else:
        info["stats"] = None
    return info


def done_info(run, st: dict) -> bool:
    """Done also needs the tables of the optional trackers that the step says it wrote."""
    stats = st.get("stats")
    return not stats or all(run.table_problem(t) is None for t in stats.get("tables", STATS_TABLES))


STEP = Step(name="mine", settings=MineSettings, requires=(), tables=TABLES, compute=compute,
            record=lambda run, s: s.record(), refuse_other_settings=True, done_info=done_info)
