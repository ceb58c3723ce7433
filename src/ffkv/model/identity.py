"""A run is one model's: what the manifest records of it, the check that a model is the run's,
and reopening it. Here, beside the model, so that `store` (the run directory) imports nothing
of the model."""
from __future__ import annotations

from ffkv.errors import FfkvError


def unembed_digest(mm) -> str:
    """sha256 of the unembedding E: two models with the same E read every value alike."""
    import hashlib

    import numpy as np

    e = mm.lens.E.detach().float().cpu().numpy()
    return hashlib.sha256(np.ascontiguousarray(e).tobytes()).hexdigest()


FFN_STRIDE = 16  # every 16th value vector of every layer: a fine-tune moves nearly all of them


def ffn_digest(mm) -> str:
    """sha256 of a strided sample of every layer's value vectors (rows 0, 16, 32, ... of V): a
    fine-tune that kept the embeddings (the same unembedding, shape and vocabulary) is another
    model all the same."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for layer in range(mm.n_layers):
        v = mm.values(layer)[::FFN_STRIDE].detach().float().cpu().numpy()
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


def model_record(mm) -> dict:
    """What a manifest records of its model: where it came from, its shape, and its unembedding's
    and FFN's digests."""
    return {**(mm.spec.as_dict() if mm.spec else {}), **mm.info(),
            "unembed_sha256": unembed_digest(mm), "ffn_sha256": ffn_digest(mm)}


def record_model(run, mm) -> None:
    run.manifest["model"] = model_record(mm)


def check_model(run, mm) -> None:
    """Refuse a model that is not the run's: another shape, vocabulary, unembedding or FFN
    weights, or another revision of the same model (one line naming both)."""
    rec = run.manifest.get("model")
    if not rec:
        return
    info = mm.info()
    ours, theirs = rec.get("model_id") or rec.get("model"), info["model"]
    if ours == theirs and mm.spec is not None and rec.get("revision") and mm.spec.revision \
            and rec["revision"] != mm.spec.revision:
        raise FfkvError(f"model mismatch: {run.path} was made with {ours} at revision "
                        f"{str(rec['revision'])[:12]}, this is revision {str(mm.spec.revision)[:12]}; "
                        f"use a new run folder, or the run's own model")
    for k in ("vocab_size", "layers", "d", "d_m"):
        if rec.get(k) is not None and rec[k] != info[k]:
            raise FfkvError(f"model mismatch: {run.path} was made with {ours} ({k}={rec[k]}), "
                            f"not {theirs} ({k}={info[k]}); use a new run folder, or the run's own model")
    if rec.get("unembed_sha256") and rec["unembed_sha256"] != unembed_digest(mm):
        raise FfkvError(f"model mismatch: {run.path} was made with {ours}, not {theirs} (their "
                        f"unembeddings differ); use a new run folder, or the run's own model")
    if rec.get("ffn_sha256") and rec["ffn_sha256"] != ffn_digest(mm):  # runs recorded before it: not checked
        raise FfkvError(f"model mismatch: {run.path} was made with {ours}, not {theirs} (the same shape and "
                        f"unembedding, but other FFN weights: a fine-tune?); use a new run folder, or the "
                        f"run's own model")


def open_model(run, model: str | None = None, device: str = "auto", dtype: str = "auto", lens: str | None = None):
    """The run's own model (or `model`, checked against the run's vocabulary and unembedding)."""
    from ffkv.model.memories import open_model as load

    mm = load(model if model is not None else run.model_arg(), device=device, dtype=dtype,
              lens=lens or run.lens)
    check_model(run, mm)
    return mm


# ---- one copy per process -------------------------------------------------------------------------
import threading  # noqa: E402

from collections import OrderedDict  # noqa: E402

SHARED_RUNS = 2  # runs whose model is kept: a process (a test worker) that opens many keeps few
_shared: OrderedDict = OrderedDict()  # run folder -> _Once of the run's model on the CPU
_locks: dict = {}  # run folder -> its forward lock
_guard = threading.Lock()


def forward_lock(run) -> threading.Lock:
    """The lock held around a forward of `shared_model(run)`: hooks are per model, so two threads
    must not run it at once."""
    with _guard:
        return _locks.setdefault(str(run.path), threading.Lock())


def shared_model(run):
    """The run's model on the CPU, opened once per process for every reader that does not edit it
    (the browser's pages, a step's memory-page panels): a second copy would double the server's
    memory and its first page's wait. The last SHARED_RUNS runs' models are kept (a browser also
    holds its own reference)."""
    key = str(run.path)
    with _guard:
        got = _shared.get(key)
        if got is None:
            got = _shared[key] = _Once()
        _shared.move_to_end(key)
        while len(_shared) > SHARED_RUNS:
            _shared.popitem(last=False)
    return got.get(lambda: _open_retrying(run))


def _open_retrying(run):
    import time

    for attempt in range(3):
        try:
            return open_model(run, device="cpu")
        except ImportError:
            # transformers' lazy imports can fail while another thread of a server is importing
            # the same modules for something else (seen on a fresh server's first pages)
            if attempt == 2:
                raise
            time.sleep(0.5)


class _Once:
    """A value made by the first caller; the others wait for it, and a failure is not kept."""

    def __init__(self):
        self._lock, self._value = threading.Lock(), None

    def get(self, make):
        if self._value is None:
            with self._lock:
                if self._value is None:
                    self._value = make()
        return self._value


def forget_shared(run) -> None:
    """Drop the shared copy (a test's or a closed browser's), so its memory can go."""
    with _guard:
        _shared.pop(str(run.path), None)
