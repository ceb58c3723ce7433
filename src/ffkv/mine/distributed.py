"""Mining shards as Ray tasks; the driver merges their mergeable states (every tracker of
`ffkv.mine.trackers.MineState`: top-k triggers and key statistics).

Shards are contiguous slices of the single-process batch plan, so every batch has the same
composition as in a single-process run and the coefficients are bit-identical: float noise
between differently shaped batches cannot reorder near-ties. Each finished shard's state is
saved in the run, so a killed distributed run redoes only unfinished shards.
"""
from __future__ import annotations

import os
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
                # A private instance kept on loopback.
                os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
                ray.init(address="local", include_dashboard=False, log_to_driver=False,
                         _node_ip_address="127.0.0.1")
        else:
            ray.init(address=address, log_to_driver=False)
    except Exception as e:  # noqa: BLE001
        raise FfkvError(f"could not start or reach Ray at {address!r}: {str(e).splitlines()[0][:160]}") from None
    return ray


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, shards + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def mine_shard(model_arg, device, dtype, settings: dict, batch_tokens, batch_sids, threads: int | None = None):
    """Runs inside a Ray worker: load the model, mine its batches, return plain arrays."""
    import torch

    from ffkv.mine.engine import MineSettings, mine_batches, new_state
    from ffkv.model.memories import open_model

    if threads:
        torch.set_num_threads(threads)
    mm = open_model(model_arg, device=device, dtype=dtype)
    s = MineSettings(**settings)
    state = new_state(mm, s)
    token_lists = [t for b in batch_tokens for t in b]
    sids = [x for b in batch_sids for x in b]
    starts = np.cumsum([0] + [len(b) for b in batch_tokens])
    batches = [(i, np.arange(starts[i], starts[i + 1])) for i in range(len(batch_tokens))]
    mine_batches(mm, state, token_lists, sids, batches)
    return state.arrays()


def mine_ray(run, mm, s, token_lists, sids, batches, address: str, shards: int, log=print):
    from ffkv.mine.engine import new_state, save_npz
    from ffkv.progress import progress

    if shards < 1:
        raise FfkvError("--shards must be at least 1")
    ray = _init_ray(address)
    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    cpus = max(1, int(res.get("CPU", 1)))
    per_task_cpu = max(1, cpus // min(shards, cpus)) if not gpus else 1
    device = "cuda" if gpus else "cpu"
    remote = ray.remote(num_cpus=per_task_cpu, num_gpus=1 if gpus else 0)(mine_shard)
    shard_dir = Path(run.path) / ".mine_shards"
    shard_dir.mkdir(exist_ok=True)
    key = s.key()
    pending, state = {}, new_state(mm, s)
    dtype = str(mm.dtype).replace("torch.", "")
    for k, (a, b) in enumerate(shard_bounds(len(batches), shards)):
        f = shard_dir / f"{key}_{k}_of_{shards}.npz"
        if f.exists():
            with np.load(f, allow_pickle=False) as z:
                state.merge(new_state(mm, s).load_arrays(z))
            continue
        if a == b:
            continue
        bt = [[token_lists[i] for i in batches[j]] for j in range(a, b)]
        bs = [[sids[i] for i in batches[j]] for j in range(a, b)]
        ref = remote.remote(run.model_arg(), device, dtype, asdict(s), bt, bs, None if gpus else per_task_cpu)
        pending[ref] = (k, f)
    log(f"mine: {len(pending)} shard(s) on Ray ({cpus} CPU, {gpus} GPU)")
    with progress() as bar:
        task = bar.add_task("mine shards", total=len(pending))
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            k, f = pending.pop(done[0])
            try:
                arrs = ray.get(done[0])
            except Exception as e:  # noqa: BLE001
                raise FfkvError(f"shard {k} failed on Ray: {str(e).splitlines()[0][:200]}") from None
            save_npz(f, arrs)
            state.merge(new_state(mm, s).load_arrays(arrs))
            bar.advance(task)
    for f in shard_dir.glob("*.npz"):
        f.unlink()
    shard_dir.rmdir()
    return state
