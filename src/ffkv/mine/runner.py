"""The `mine` step: one forward pass per batch, every prefix's coefficients at once, into TopKState."""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from ffkv.corpus.batching import pack, padding_share
from ffkv.mine.engine import (MineSettings, load_checkpoint, mine_batches, new_state,  # noqa: F401
                              save_checkpoint)
from ffkv.parse import parse_int_list  # noqa: F401  (re-exported for callers of the old path)
from ffkv.store.steps import Step, execute

CKPT = ".mine_checkpoint.npz"
TABLES = ("sentences", "triggers", "vocab")


def triggers_table(state: TopKState, sentences: pa.Table) -> pa.Table:
    """State -> the `triggers` table, with next_token looked up in the sentences."""
    sid_col = sentences.column("sentence_id").to_numpy()
    toks = sentences.column("token_ids").combine_chunks()
    flat = toks.values.to_numpy(zero_copy_only=False)
    offs = toks.offsets.to_numpy()
    row_of = np.full(int(sid_col.max()) + 1, -1, np.int64)
    row_of[sid_col] = np.arange(len(sid_col))
    parts = list(state.rows())
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    rows = row_of[cols["sentence_id"]]
    nxt = offs[rows] + cols["position"].astype(np.int64) + 1
    has = nxt < offs[rows + 1]
    next_tok = np.where(has, flat[np.minimum(nxt, len(flat) - 1)], 0).astype(np.int32)
    cols["next_token"] = pa.array(next_tok, mask=~has)
    return pa.table(cols)


def vocab_table(tok, n: int) -> pa.Table:
    """Token id -> display string, so readers (show, report, web) need no tokenizer."""
    ids = list(range(n))
    text = [tok.decode([i]) if i < len(tok) else "" for i in ids]
    raw = tok.convert_ids_to_tokens([i if i < len(tok) else 0 for i in ids])
    return pa.table({"token_id": pa.array(ids, pa.int32()), "text": text,
                     "token": [str(r) for r in raw]})


def mine(run, mm, s: MineSettings, checkpoint_every: float = 60.0, ray_address: str | None = None,
         shards: int = 1, show_progress: bool | None = None, log=print) -> dict:
    """Mine top-k triggers into `run`; resumes a killed run with the same settings."""
    out = execute(run, "mine", s, mm=mm, log=log, show_progress=show_progress,
                  checkpoint_every=checkpoint_every, ray_address=ray_address, shards=shards)
    if out.skipped:
        log(f"mine: {run.path} is already mined with these settings; nothing to do")
    return out.info


def _prepare(run, mm, s: MineSettings) -> None:
    """Record the model, split and tokenize the corpus (unless done for these settings), vocab."""
    from ffkv.corpus.prepare import prepare_sentences

    run.record_model(mm)
    run.manifest["lens"] = mm.lens.mode
    run.save()
    if not run.has_table("sentences") or run.manifest.get("corpora", {}).get("sentences", {}).get(
            "settings_key") != s.key():
        prepare_sentences(run, mm, s.corpus, s.max_sentences, seed=s.seed, field=s.field)
        run.manifest["corpora"]["sentences"]["settings_key"] = s.key()
        run.manifest["corpus"] = run.manifest["corpora"]["sentences"]
        run.manifest["counts"] = run.manifest["corpus"]["counts"]
        run.save()
    if not run.has_table("vocab"):
        run.write_table("vocab", vocab_table(mm.tok, mm.vocab_size))


def _mine_local(run, mm, s: MineSettings, state, token_lists, sids, batches, lengths,
                checkpoint_every: float, show_progress, log) -> int:
    """Mine the batches not yet in the checkpoint; returns the tokens mined now."""
    from ffkv.progress import progress

    ckpt = run.path / CKPT
    cursor = load_checkpoint(ckpt, state, s.key())
    if cursor:
        log(f"mine: resuming from checkpoint at batch {cursor}/{len(batches)}")
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
    return int(lengths.sum()) - done_tokens


def compute(ctx) -> dict:
    run, s, mm = ctx.run, ctx.settings, ctx.model()
    checkpoint_every = ctx.extra.get("checkpoint_every", 60.0)
    ray_address, shards = ctx.extra.get("ray_address"), ctx.extra.get("shards", 1)
    _prepare(run, mm, s)
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
        mined_tokens = _mine_local(run, mm, s, state, token_lists, sids, batches, lengths,
                                   checkpoint_every, ctx.show_progress, ctx.log)
    secs = time.time() - t0
    trig = triggers_table(state, run.read_table("sentences"))
    run.write_table("triggers", trig, row_group_size=100_000)
    (run.path / CKPT).unlink(missing_ok=True)
    return {"rows": trig.num_rows, "padding_share": round(padding_share(lengths, batches), 4),
            "tokens": int(lengths.sum()),
            "tokens_per_s": round(mined_tokens / secs, 1) if secs > 0 else None,
            "mine_seconds": round(secs, 2), "shards": shards if ray_address else 1}


STEP = Step(name="mine", settings=MineSettings, requires=(), tables=TABLES, compute=compute,
            refuse_other_settings=True)
