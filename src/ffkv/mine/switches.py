"""How a mining pass runs, not what it finds: FFKV_PACK, FFKV_TRITON, FFKV_COMPILE (and
FFKV_NUMBA, FFKV_ONEDNN). Each is read here, from `ffkv mine`'s flags for the pass under way
(`over`), else from the environment. The flags used to be written into os.environ for the pass,
which every other thread of a library caller saw too; a context variable keeps them to the pass's
own thread (and to Ray's actors, whose environment `current` fills)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar

NAMES = ("FFKV_PACK", "FFKV_TRITON", "FFKV_COMPILE", "FFKV_NUMBA", "FFKV_ONEDNN")
_OVER: ContextVar[dict] = ContextVar("ffkv_switches", default={})


def read(name: str, default: str = "") -> str:
    """The switch's text: the pass's flag, else the environment's, else `default`."""
    got = _OVER.get().get(name)
    return got if got is not None else os.environ.get(name, default)


@contextmanager
def over(values: dict):
    """Within (this thread and what it calls): these switches' values over the environment's."""
    token = _OVER.set({**_OVER.get(), **{k: str(v) for k, v in values.items() if v is not None}})
    try:
        yield
    finally:
        _OVER.reset(token)


def on_off_auto(raw, name: str, meaning: str) -> str:
    """A 0 / 1 / auto switch's value (FFKV_TRITON's, FFKV_COMPILE's, or their flags', named
    `name`); anything else is one FfkvError line: `name`, then what the values mean."""
    from ffkv.errors import FfkvError

    raw = str(raw).strip().lower()
    if raw not in ("0", "1", "auto"):
        raise FfkvError(f"{name}: {meaning}")
    return raw


def by_device(name: str, device, parse, off):
    """A switch whose unset value is the device's: "auto" on CUDA (timed there on the run's own
    batches), `off` elsewhere; a set value goes through `parse`, whose message names the variable.
    Returns (value, whether it was set), read once."""
    raw = read(name).strip()
    if raw == "":
        import torch

        return ("auto" if device is not None and torch.device(device).type == "cuda" else off), False
    return parse(raw, f"{name}={raw!r}"), True


def current() -> dict:
    """Every switch set here, flags over the environment: what a Ray actor's environment gets."""
    return {k: v for k in NAMES if (v := read(k, None)) is not None}


_numba_ok: bool | None = None


def numba_here(device) -> bool:
    """The numba CPU kernels run here: a CPU device, numba importable (a missing or broken install
    falls back to the portable torch path), FFKV_NUMBA not 0. One gate for the miner's trackers
    and the steps' row kernels."""
    global _numba_ok
    import torch

    if read("FFKV_NUMBA", "1").strip() == "0" or torch.device(device).type != "cpu":
        return False
    if _numba_ok is None:
        try:
            import numba  # noqa: F401
            _numba_ok = True
        except Exception:  # noqa: BLE001  (an install that does not match numpy, say)
            _numba_ok = False
    return _numba_ok
