"""The run's residual stream at mid-depth, kept once, so that a deep memory's colours run only the
blocks above it (issue 48 item 8).

A memory page's colours need m at every token of some 60 sentences, which costs a forward through
blocks 0..ℓ: on a 2-core CPU a layer-29 page of SmolLM2 took 2.5–3.6 s, about 1.4× the bare
products, so only less work could make it faster. The stream entering block K = L // 2 depends
only on the tokens, so the server computes it once for every sentence of the run, in a background
thread started by the first colours (pausing while a person's request runs, as the similar
memories do), and a page of a layer ≥ K then runs blocks K..ℓ from it (`ffkv.model.stream`):
at most half the model whatever the layer. Until it is ready, and for a model where starting at
block K does not reproduce a full pass (`resumes`), colours run every block as before.

It is stored in ffkv's cache folder (`FFKV_CACHE`), not the run (the server writes only
annotations into a run): float32, one row per token of the run's sentences in table order, under a
digest of the model's weights, the sentences' tokens and K, written whole or not at all. The next
server of the run reads it at once. A run whose stream would pass `FFKV_STREAM_MB` (default
1024 MB) gets none; `FFKV_STREAM=off` turns it off.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np

VERSION = 1
BATCH_TOKENS = 1024  # a build batch holds the model's lock: a page's colours wait at most one (SmolLM2: ~0.6 s)
DEFAULT_MB = 1024
MIN_LAYERS = 4  # a smaller model has little to skip


def middle(n_layers: int) -> int | None:
    """K: the block whose input is kept; pages of layers ≥ K start there."""
    return n_layers // 2 if n_layers >= MIN_LAYERS else None


def digest(mm, flat: np.ndarray, offsets: np.ndarray, start: int) -> str:
    """What the stream depends on: every weight (a strided sample of each tensor, with its name and
    shape), the tokens and their sentence bounds, the block and the dtype."""
    import torch

    h = hashlib.sha256(f"stream v{VERSION}|{start}|{mm.dtype}".encode())
    with torch.no_grad():
        for name, p in mm.hf.named_parameters():
            h.update(f"{name}{tuple(p.shape)}".encode())
            h.update(np.ascontiguousarray(p.detach().reshape(-1)[::61].float().cpu().numpy()).tobytes())
    h.update(np.ascontiguousarray(flat, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(offsets, dtype=np.int64).tobytes())
    return h.hexdigest()[:32]


class Streams:
    """One server's stream at block `start`: absent, building, ready, off (too big, turned off,
    too few layers, or the model does not resume there) or failed; `rows(i)` once ready."""

    def __init__(self, b, start: int | None = None):
        self.b = b
        self.lock = threading.Lock()
        self.status, self.why, self.seconds = "absent", "", 0.0
        self.start = start if start is not None else middle(b.L)
        self.arr = None
        if self.start is None:
            self.status, self.why = "off", f"{b.L} layers: too few to skip"
        elif os.environ.get("FFKV_STREAM", "").lower() in ("off", "0", "no"):
            self.status, self.why = "off", "FFKV_STREAM=off"

    def rows(self, row: int, end: int) -> np.ndarray:
        """The stream of sentence row `row`'s first `end` tokens (end, d)."""
        a = int(self.b.tok_offsets[row])
        return self.arr[a:a + end]

    def ready(self) -> bool:
        return self.status == "ready"

    def begin(self) -> None:
        """Read or build it in the background, once (a no-op after the first call)."""
        with self.lock:
            if self.status != "absent":
                return
            self.status = "building"
        threading.Thread(target=self._build, name="ffkv-stream", daemon=True).start()

    def wait(self, timeout: float = 600) -> None:
        """Begin (if needed) and wait; for tests and benchmarks."""
        self.begin()
        t = time.time()
        while self.status == "building" and time.time() - t < timeout:
            time.sleep(0.05)

    def _off(self, why: str) -> None:
        self.status, self.why = "off", why
        self.b.log(f"residual stream at block {self.start} not kept: {why}")

    def _build(self) -> None:
        from ffkv.files import cache_dir
        from ffkv.model.stream import resumes

        t0 = time.time()
        b = self.b
        try:
            mm = b.model()
            flat, offsets = np.asarray(b.tok_flat), np.asarray(b.tok_offsets)
            n, d = int(offsets[-1]), int(mm.d)
            mb = float(os.environ.get("FFKV_STREAM_MB", DEFAULT_MB))
            if n * d * 4 > mb * 2**20:
                return self._off(f"{n:,} tokens × {d} × 4 bytes is over FFKV_STREAM_MB={mb:g}")
            with b.model_lock:
                ok = resumes(mm, self.start)
            if not ok:
                return self._off("starting there does not reproduce a full pass on this model")
            path = cache_dir() / "streams" / f"{digest(mm, flat, offsets, self.start)}.npy"
            if path.exists():
                try:
                    arr = np.load(path, mmap_mode="r")
                    if arr.shape == (n, d) and arr.dtype == np.float32:
                        self._ready(arr, t0, f"read from {path}")
                        return
                except (OSError, ValueError):  # a damaged file is computed again
                    pass
            self._compute(mm, path, flat, offsets, n, d)
            self._ready(np.load(path, mmap_mode="r"), t0, f"computed ({n:,} tokens) and stored in {path}")
        except Exception as e:  # noqa: BLE001 - colours then run every block; logged
            self.status, self.why = "failed", " ".join(str(e).split())[:300] or type(e).__name__
            b.log(f"residual stream at block {self.start} failed: {self.why}")

    def _ready(self, arr, t0: float, how: str) -> None:
        self.arr, self.seconds, self.status = arr, round(time.time() - t0, 1), "ready"
        self.b.log(f"residual stream at block {self.start} {how} in {self.seconds} s")

    def _compute(self, mm, path: Path, flat, offsets, n: int, d: int) -> None:
        """Every sentence to block start−1, a batch at a time, each batch under the model's lock and
        after any request a person waits on; written to a temp file, then renamed."""
        import torch

        from ffkv.corpus.batching import pack
        from ffkv.model.onednn import products_of
        from ffkv.model.stream import stream

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(n, d))
            lens = np.diff(offsets)
            some = np.nonzero(lens > 0)[0]
            fg = getattr(self.b, "foreground", None)
            for idx in (some[i] for i in pack(lens[some], batch_tokens=BATCH_TOKENS, max_batch=64, ratio=1.5)):
                if fg is not None:
                    fg.wait()
                seqs = [flat[offsets[i]:offsets[i + 1]].tolist() for i in idx]
                with self.b.model_lock, torch.no_grad(), products_of(mm):
                    ids, mask = mm.batch(seqs)
                    h = stream(mm, ids, mask, self.start).float().cpu().numpy()
                for j, i in enumerate(idx):
                    out[offsets[i]:offsets[i + 1]] = h[j, :lens[i]]
            out.flush()
            del out
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()


_lock = threading.Lock()


def streams(b) -> Streams:
    """The browser's one `Streams`."""
    with _lock:
        if getattr(b, "_streams", None) is None:
            b._streams = Streams(b)
        return b._streams
