"""Mining shards as Ray tasks; the driver merges their mergeable states (every tracker of
`ffkv.mine.trackers.MineState`: top-k triggers and key statistics).

Shards are contiguous slices of the single-process batch plan, so every batch has the same
composition as in a single-process run and the coefficients are bit-identical: float noise
between differently shaped batches cannot reorder near-ties. Actors (one per GPU, or per share
of the CPUs) load the model once and read their shards' rows of the `sentences` table
themselves: the driver sends row indices, not tokens (the rows themselves only to a node that
cannot see the run's folder). Each finished shard's state is saved in the run, so a killed
distributed run redoes only unfinished shards.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ffkv.errors import FfkvError


def _init_ray(address: str):
    try:
        import ray
    except ImportError:
        raise FfkvError("--ray needs `pip install ray`") from None
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        if address in ("local", "auto"):
            if address == "auto" and os.environ.get("RAY_ADDRESS"):
                ray.init(address="auto", log_to_driver=False)
            else:
                # A private instance kept on loopback. Its actors are the job the user asked for,
                # not background work: Ray starts workers at niceness 15, and beside any busy
                # process they got a tenth of a core here (a 48 s pass took 7 minutes)
                os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
                os.environ.setdefault("RAY_worker_niceness", "0")
                ray.init(address="local", include_dashboard=False, log_to_driver=False,
                         _node_ip_address="127.0.0.1")
        else:
            ray.init(address=address, log_to_driver=False)
    except Exception as e:  # noqa: BLE001
        raise FfkvError(f"could not start or reach Ray at {address!r}: {str(e).splitlines()[0][:160]}") from None
    return ray


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ray_reason(e: BaseException) -> str:
    """What went wrong inside a Ray error, in one line: Ray's own first line names the actor and
    pid, while the user's reason (an FfkvError of the actor's model load, say) is the remote
    traceback's last line."""
    lines = [l.strip() for l in _ANSI.sub("", str(e)).splitlines() if l.strip()]
    if not lines:
        return type(e).__name__
    last = lines[-1]
    if len(lines) > 1 and ": " in last:  # a remote traceback's "module.Error: message"
        name, msg = last.split(": ", 1)
        last = msg if name.rsplit(".", 1)[-1] == "FfkvError" else f"{name.rsplit('.', 1)[-1]}: {msg}"
    return last[:300]


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, shards + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


DEFAULT_CPU_SHARDS = 2  # --shards on a cluster without GPUs, as before shards followed the GPUs


def default_shards(gpus: int) -> int:
    """--shards left out: one shard per GPU of the cluster (one actor each), else 2."""
    return int(gpus) if gpus else DEFAULT_CPU_SHARDS


def read_rows(sentences_path, batch_rows):
    """The sentences table's rows of each batch (a table of sentence_id and token_ids per batch):
    what a shard reads for itself, only the row groups that hold its rows (None when the run's
    folder is not visible from this node)."""
    import pyarrow.parquet as pq

    if not Path(sentences_path).is_file():
        return None
    rows = [np.asarray(r, np.int64) for r in batch_rows]
    if not any(len(r) for r in rows):
        return [None for _ in rows]
    lo = min(int(r.min()) for r in rows if len(r))
    hi = max(int(r.max()) for r in rows if len(r)) + 1
    with pq.ParquetFile(sentences_path) as f:
        meta = f.metadata
        starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        g0, g1 = int(np.searchsorted(starts, lo, "right")) - 1, int(np.searchsorted(starts, hi, "left"))
        t = f.read_row_groups(list(range(g0, g1)), columns=["sentence_id", "token_ids"])
    return [t.take(r - int(starts[g0])) for r in rows]


class ShardMiner:
    """A Ray actor: one per GPU (or per CPU share); loads the model once and mines shard after
    shard of the batch plan, each from the rows it reads itself."""

    def __init__(self, model_arg, device, dtype, settings: dict, threads: int | None = None):
        import torch

        from ffkv.model.memories import open_model
        from ffkv.steps.mine import MineSettings

        if threads:
            torch.set_num_threads(threads)
        self.mm = open_model(model_arg, device=device, dtype=dtype)
        self.s = MineSettings(**settings)
        self.tuner = None  # made at the first shard, kept for the next ones (`ffkv.mine.tune`)

    def mine(self, k: int, sentences_path, batch_rows, sent=None, places=None):
        """Shard k: batch_rows (row indices of the sentences table, per batch); `sent` carries the
        rows' (token lists, sentence ids) when the driver had to send them; `places` each batch's
        (index in the plan, its chunk's first batch, the chunk's batch count), so that the tuner
        times its arms on the strata of the one-process pass's chunks. Returns (k, arrays, how it
        ran: `how`), or (k, None, None) when the table is out of this node's reach."""
        got = sent if sent is not None else read_rows(sentences_path, batch_rows)
        if got is None:
            return k, None, None
        return self._mine_rows(k, got, places)

    def prepare_and_mine(self, k: int, corpus: dict, first: int, source_rows, batch_rows, part: str,
                         places=None):
        """Shard k from the corpus itself (a pre-tokenized file): its chunks from chunk `first` on,
        whose sentences are the file's rows `source_rows`, read (those rows only) and decoded here,
        written to `part` (their rows of the run's `sentences` table, a row group a chunk), then
        mined; `batch_rows` index the shard's own rows. (k, None, None) where the corpus or the
        run's folder is out of this node's reach: the driver prepares the shard then."""
        import pyarrow as pa

        from ffkv.corpus.stream import SCHEMA

        if not Path(corpus["spec"]).is_file() or not Path(part).parent.is_dir():
            return k, None, None
        tables = prepared_tables(corpus, self.mm, first, source_rows)
        write_part(part, tables)
        rows = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
        return self._mine_rows(k, [rows.take(np.asarray(r, np.int64)) for r in batch_rows], places)

    def _mine_rows(self, k: int, got: list, places):
        from contextlib import closing

        import pyarrow as pa

        from ffkv.mine.compiled import mining_forward
        from ffkv.mine.engine import FlatTokens, mine_batches, new_state
        from ffkv.mine.tune import how, tuner_for

        kept = [i for i, t in enumerate(got) if t is not None and t.num_rows]
        got = [got[i] for i in kept]
        state = new_state(self.mm, self.s)
        if got:
            rows = pa.concat_tables(got)
            tokens = FlatTokens(rows.column("token_ids"))  # 4-8 bytes a token, no list per sentence
            sids = rows.column("sentence_id").to_numpy()
            starts = np.cumsum([0] + [t.num_rows for t in got])
            batches = [(i, np.arange(starts[i], starts[i + 1])) for i in range(len(got))]
            if self.tuner is None:
                self.tuner = tuner_for(self.mm)
            with mining_forward(self.mm, state.layers) as compiled, closing(self.tuner):  # as the one-process pass
                for part, chunk in by_chunk(batches, None if places is None else [places[i] for i in kept]):
                    state = mine_batches(self.mm, state, tokens, sids, part, compiled=compiled, tuner=self.tuner,
                                         chunk=chunk)
        return k, state.arrays(), how(self.mm, self.tuner, state.layers)


def prepared_tables(corpus: dict, mm, first: int, source_rows) -> list:
    """A shard's chunks of `sentences` (from chunk `first` on), from the corpus file's rows
    `source_rows` alone (`Prepared.corpus` names the file; the driver has checked it whole)."""
    from ffkv.corpus.stream import chunks_of
    from ffkv.corpus.tokens import read_some

    vals, offs = read_some(Path(corpus["spec"]), corpus["kind"], source_rows, corpus["column"], corpus["context"])
    return [c.table() for c in chunks_of(mm.tok, mm.max_length, source_rows, vals, offs, first, corpus["chunk"])]


def write_part(path, tables: list) -> None:
    """A shard's rows of `sentences` (a row group a chunk), whole or not at all."""
    import pyarrow.parquet as pq

    from ffkv.corpus.stream import SCHEMA
    from ffkv.store.run import staged

    with staged(Path(path)) as tmp:
        with pq.ParquetWriter(tmp, SCHEMA, compression="zstd") as w:
            for t in tables:
                w.write_table(t, row_group_size=max(t.num_rows, 1))


class Prepared:
    """A Ray pass whose actors prepare their own rows (issue 24 item 4): a pre-tokenized corpus
    file whose rows are known from its offsets (`SentenceStream.rows_plan`), so that the driver
    plans every batch without decoding a row. Shards are whole chunks; each actor decodes its
    chunks and writes them as a part of `sentences`, which the driver joins, in order, at the end."""

    def __init__(self, corpus: dict, stream, chunks: list, joined=None):
        self.corpus, self.stream, self.chunks = corpus, stream, chunks  # chunks: (first batch, count)
        self.joined = joined  # called once `sentences` is whole (the manifest's corpus record)

    def shards(self, n: int) -> list[tuple[int, int, int, int]]:
        """(first chunk, end chunk, first batch, end batch) per shard: whole chunks, as even as may be."""
        out = []
        for c0, c1 in shard_bounds(len(self.chunks), n):
            b0 = self.chunks[c0][0] if c0 < len(self.chunks) else sum(c[1] for c in self.chunks)
            b1 = self.chunks[c1 - 1][0] + self.chunks[c1 - 1][1] if c1 > c0 else b0
            out.append((c0, c1, b0, b1))
        return out

    def first_row(self, c: int) -> int:
        return c * self.corpus["chunk"]

    def source_rows(self, c0: int, c1: int) -> np.ndarray:
        """The corpus file's rows of chunks c0..c1-1's sentences, in sentence order."""
        return self.stream.order[self.first_row(c0):self.first_row(c1)]

    def prepare_here(self, mm, c0: int, c1: int, part) -> None:
        """A shard's part made by the driver (its actor could not reach the corpus or the run)."""
        write_part(part, prepared_tables(self.corpus, mm, c0, self.source_rows(c0, c1)))

    def join(self, run, parts: list) -> None:
        """The parts, in order, as the run's `sentences` table (a row group a chunk, as one process writes it)."""
        import pyarrow.parquet as pq

        from ffkv.corpus.stream import SCHEMA

        with run.table_writer("sentences", SCHEMA) as write:
            for p in parts:
                with pq.ParquetFile(p) as f:
                    for g in range(f.num_row_groups):
                        write(f.read_row_group(g))
        if self.joined is not None:
            self.joined()  # before the parts go: a kill after this finds `sentences` whole


def by_chunk(batches, places):
    """A shard's batches ((i, rows), in plan order) cut where their chunk changes, each run with
    its chunk's (first batch, batch count) and the batches renumbered by their place in the plan;
    without places, one run and no chunk."""
    if places is None:
        yield batches, None
        return
    j = 0
    while j < len(batches):
        chunk = (int(places[j][1]), int(places[j][2]))
        e = j
        while e < len(batches) and (int(places[e][1]), int(places[e][2])) == chunk:
            e += 1
        yield [(int(places[i][0]), batches[i][1]) for i in range(j, e)], chunk
        j = e


def mine_ray(run, mm, s, batches, address: str, shards: int | None, log=print, chunks=None,
             prep: Prepared | None = None):
    """Shards of the batch plan on Ray actors; finished shards are saved in the run, so a killed
    run redoes only the others. `chunks`: the plan's chunks as (first batch, batch count), for the
    actors' tuners. `prep`: the actors prepare their own rows (`Prepared`), and the run's
    `sentences` table is joined from their parts before the shards' files go. Returns the merged
    state, the number of shards, and how the shards mined now ran (`how`, one per shard)."""
    from ffkv.mine.engine import new_state, save_npz
    from ffkv.progress import progress

    if shards is not None and shards < 1:
        raise FfkvError("--shards must be at least 1")
    ray = _init_ray(address)
    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    cpus = max(1, int(res.get("CPU", 1)))
    shards = default_shards(gpus) if shards is None else int(shards)
    per_task_cpu = max(1, cpus // min(shards, cpus)) if not gpus else 1
    device = "cuda" if gpus else "cpu"
    shard_dir = Path(run.path) / ".mine_shards"
    shard_dir.mkdir(exist_ok=True)
    key = s.key()
    todo, state = [], new_state(mm, s)
    chunk_of = None if chunks is None else [(c0, n) for c0, n in chunks for _ in range(n)]
    cut = prep.shards(shards) if prep is not None else None  # (first chunk, end chunk, first batch, end batch)
    bounds = [(b0, b1) for _, _, b0, b1 in cut] if cut is not None else shard_bounds(len(batches), shards)
    parts = [shard_dir / f"{key}_{k}_of_{shards}.sentences.parquet" for k in range(shards)]
    for k, (a, b) in enumerate(bounds):
        f = shard_dir / f"{key}_{k}_of_{shards}.npz"
        if f.exists() and (prep is None or parts[k].exists()):
            with np.load(f, allow_pickle=False) as z:
                state.merge(new_state(mm, s).load_arrays(z))
        elif a < b or prep is not None:
            where = [(j, *chunk_of[j]) for j in range(a, b)] if chunk_of is not None else None
            rows = [np.asarray(batches[j]) for j in range(a, b)]
            if prep is not None:  # the shard's own rows, from its first chunk's
                first = prep.first_row(cut[k][0])
                rows = [r - first for r in rows]
            todo.append((k, f, [np.asarray(r, np.int64) for r in rows], where))
    n_actors = min(len(todo), gpus if gpus else max(1, cpus // per_task_cpu))
    log(f"mine: {len(todo)} shard(s) on Ray ({cpus} CPU, {gpus} GPU), {n_actors} actor(s)"
        + (", each preparing its own rows" if prep is not None else ""))
    if gpus and mm.device.type != "cuda":  # the plan and the actors' dtype are the driver's
        log(f"mine: note: this driver runs on the {mm.device.type}, and the GPU actors mine in its dtype "
            f"({str(mm.dtype).replace('torch.', '')}) and with its batch plan (a CPU's budget, unless "
            "--batch-tokens was given); on a cluster whose head has no GPU, pass --dtype bfloat16 and "
            "--batch-tokens (32768, say), or run ffkv on a GPU node")
    hows = []
    if todo:
        from ffkv.mine import switches

        env = switches.current()  # the pass's flags over the driver's environment: a cluster's workers
        # do not inherit the driver's
        actor = ray.remote(num_cpus=per_task_cpu, num_gpus=1 if gpus else 0,
                           **({"runtime_env": {"env_vars": env}} if env else {}))(ShardMiner)
        args = (run.model_arg(), device, str(mm.dtype).replace("torch.", ""), asdict(s),
                None if gpus else per_task_cpu)
        actors = [actor.remote(*args) for _ in range(n_actors)]
        files = {k: f for k, f, _, _ in todo}
        sent_path = str(run.table_path("sentences"))
        jobs = {k: rows for k, _, rows, _ in todo}
        places = {k: w for k, _, _, w in todo}
        if prep is None:
            first = again = None
        else:
            def first(a, k):
                c0, c1 = cut[k][:2]
                return a.prepare_and_mine.remote(k, prep.corpus, c0, prep.source_rows(c0, c1), jobs[k],
                                                 str(parts[k]), places[k])

            def again(k):  # out of the actor's reach: the driver prepares the part and sends its rows
                prep.prepare_here(mm, cut[k][0], cut[k][1], parts[k])
                return read_rows(parts[k], jobs[k])
        try:
            with progress() as bar:
                task = bar.add_task("mine shards", total=len(todo))
                for k, arrs, h in _drain(ray, actors, jobs, sent_path, places, first, again):
                    hows.append(h)
                    save_npz(files[k], arrs)
                    state.merge(new_state(mm, s).load_arrays(arrs))
                    bar.advance(task)
        finally:
            for a in actors:
                ray.kill(a)
    if prep is not None:
        prep.join(run, parts)
    for f in shard_dir.glob("*.npz"):
        f.unlink()
    for f in shard_dir.glob("*.parquet"):
        f.unlink()
    shard_dir.rmdir()
    return state, shards, hows


def _drain(ray, actors, jobs: dict, sent_path: str, places: dict | None = None, first=None, again=None):
    """Hand shards (k -> their batches' row indices; `places`: k -> their places in the plan) to
    idle actors; yield (k, arrays, `how`) as each finishes. A shard's first try is `first(actor,
    k)` where given (else the actor reads its rows of `sent_path`); one whose actor could not
    reach its input (another node's disk) is sent again with its rows (`again(k)`, else read from
    `sent_path`)."""
    queue = [(k, None) for k in jobs]
    idle, pending = list(actors), {}
    while queue or pending:
        while queue and idle:
            k, sent = queue.pop(0)
            a = idle.pop()
            if sent is None and first is not None:
                pending[first(a, k)] = a
            else:
                pending[a.mine.remote(k, sent_path, jobs[k], sent, (places or {}).get(k))] = a
        done, _ = ray.wait(list(pending), num_returns=1)
        idle.append(pending.pop(done[0]))
        try:
            k, arrs, h = ray.get(done[0])
        except Exception as e:  # noqa: BLE001
            raise FfkvError(f"a shard failed on Ray: {ray_reason(e)}") from None
        if arrs is None:
            queue.append((k, again(k) if again is not None else read_rows(sent_path, jobs[k])))
        else:
            yield k, arrs, h
