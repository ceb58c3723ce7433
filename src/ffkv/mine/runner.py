"""Mining: one forward pass per batch, every prefix's coefficients at once, into TopKState."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from ffkv.corpus.batching import pack, padding_share
from ffkv.errors import FfkvError
from ffkv.mine.topk import TopKState

CKPT = ".mine_checkpoint.npz"


@dataclass
class MineSettings:
    corpus: str | None = None
    max_sentences: int | None = None
    seed: int = 0
    field: str = "text"
    layers: list[int] | None = None
    dims: list[int] | None = None
    top_k: int = 50
    negative: bool = False
    per_prefix: bool = False
    batch_tokens: int = 2048

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def parse_int_list(text: str | None, upper: int, what: str) -> list[int] | None:
    """'0,3,5-7' -> [0, 3, 5, 6, 7]; checks the range."""
    if text is None or text.strip() in ("", "all"):
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part[1:]:
                a, b = part.split("-", 1)
                out.update(range(int(a), int(b) + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise FfkvError(f"--{what} {text!r}: expected numbers like 0,3,5-7") from None
    bad = sorted(x for x in out if not 0 <= x < upper)
    if bad:
        raise FfkvError(f"--{what} {bad[:5]} out of range 0..{upper - 1}")
    return sorted(out)


def new_state(mm, s: MineSettings) -> TopKState:
    layers = s.layers if s.layers is not None else list(range(mm.n_layers))
    return TopKState(layers, s.dims, mm.d_m, s.top_k, negative=s.negative, per_prefix=s.per_prefix)


def mine_batches(mm, state: TopKState, token_lists, sids, batches, on_batch=None) -> TopKState:
    """Feed batches (lists of indices into token_lists) through one captured pass each."""
    for bi, idx in batches:
        seqs = [token_lists[i] for i in idx]
        ids, mask = mm.batch(seqs)
        bsids = torch.as_tensor([sids[i] for i in idx], dtype=torch.long)
        mbool = mask.bool()
        mm.capture(ids, mask, layers=state.layers, what=("m",),
                   callback=lambda l, name, m: state.update(l, m, mbool, bsids))
        if on_batch is not None:
            on_batch(bi, sum(map(len, seqs)))
    return state


def _save_ckpt(path: Path, state: TopKState, cursor: int, key: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    np.savez(tmp, __cursor=np.array([cursor]), __key=np.frombuffer(key.encode(), np.uint8),
             **state.arrays())
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_ckpt(path: Path, state: TopKState, key: str) -> int:
    if not path.exists():
        return 0
    with np.load(path, allow_pickle=False) as z:
        if bytes(z["__key"]).decode() != key:
            return 0
        state.load_arrays(z)
        return int(z["__cursor"][0])


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
    from ffkv.corpus.prepare import prepare_sentences
    from ffkv.progress import progress

    prev = run.settings("mine")
    if prev is not None and prev != asdict(s):
        diff = {k: (prev.get(k), v) for k, v in asdict(s).items() if prev.get(k) != v}
        raise FfkvError(f"{run.path} was mined with other settings {diff} (run, new); "
                        f"use a new --out, or repeat the run's own settings to resume")
    if run.step_done("mine"):
        log(f"mine: {run.path} is already mined with these settings; nothing to do")
        return run.step("mine")
    if run.manifest.get("model"):
        run.check_model(mm)
    run.record_model(mm)
    run.manifest["lens"] = mm.lens.mode
    run.start_step("mine", asdict(s))
    if not run.has_table("sentences") or run.manifest.get("corpora", {}).get("sentences", {}).get(
            "settings_key") != s.key():
        prepare_sentences(run, mm, s.corpus, s.max_sentences, seed=s.seed, field=s.field)
        run.manifest["corpora"]["sentences"]["settings_key"] = s.key()
        run.manifest["corpus"] = run.manifest["corpora"]["sentences"]
        run.manifest["counts"] = run.manifest["corpus"]["counts"]
        run.save()
    if not run.has_table("vocab"):
        run.write_table("vocab", vocab_table(mm.tok, mm.vocab_size))
    sent = run.read_table("sentences", columns=["sentence_id", "token_ids", "n_tokens"])
    token_lists = sent.column("token_ids").to_pylist()
    sids = sent.column("sentence_id").to_pylist()
    lengths = np.asarray(sent.column("n_tokens"))
    batches = pack(lengths, s.batch_tokens)
    pad = padding_share(lengths, batches)
    total_tokens = int(lengths.sum())
    t0 = time.time()
    state = new_state(mm, s)
    if ray_address:
        from ffkv.mine.distributed import mine_ray

        state = mine_ray(run, mm, s, token_lists, sids, batches, ray_address, shards, log=log)
    else:
        ckpt = run.path / CKPT
        cursor = _load_ckpt(ckpt, state, s.key())
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
                    _save_ckpt(ckpt, state, bi + 1, s.key())
                    last = time.time()

            mine_batches(mm, state, token_lists, sids,
                         [(i, batches[i]) for i in range(cursor, len(batches))], on_batch)
        total_tokens -= done_tokens
    secs = time.time() - t0
    trig = triggers_table(state, run.read_table("sentences"))
    run.write_table("triggers", trig, row_group_size=100_000)
    (run.path / CKPT).unlink(missing_ok=True)
    info = {"rows": trig.num_rows, "padding_share": round(pad, 4), "tokens": int(lengths.sum()),
            "tokens_per_s": round(total_tokens / secs, 1) if secs > 0 else None,
            "mine_seconds": round(secs, 2), "shards": shards if ray_address else 1}
    run.finish_step("mine", **info)
    return run.step("mine")
