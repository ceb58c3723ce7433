"""Shared bits for the benchmarks: the default model, WikiText sentences, peak RSS."""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from pathlib import Path

import ffkv  # noqa: F401  first, so that its MKL_CBWR setting is in place before torch loads MKL

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FFKV_SHARED", ROOT.parent / "shared"))
WT2 = SHARED / "corpora" / "wikitext-2"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_default():
    import warnings

    warnings.filterwarnings("ignore")
    from ffkv.model.memories import open_model

    return open_model(None, device="cpu")


def first_layers(mm, n: int | None):
    """The model cut to its first `n` decoder blocks (a smaller benchmark of the same shapes), or mm."""
    if not n or n >= mm.n_layers:
        return mm
    from ffkv.model.arch import get_path
    from ffkv.model.memories import MemoryModel

    blocks = get_path(mm.hf, mm.arch.layers)
    del blocks[n:]
    cfg = getattr(mm.hf.config, "text_config", None) or mm.hf.config
    cfg.num_hidden_layers = n
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n]
    return MemoryModel(mm.hf, mm.tok, mm.spec)


def wikitext_token_lists(mm, n: int, split: str = "valid"):
    from ffkv.corpus.sources import open_corpus, tokenize

    sents = open_corpus(str(WT2 / f"wiki.{split}.tokens")).sentences(n)
    ids, _ = tokenize(mm.tok, sents, mm.max_length)
    return ids


def status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS: resident now, VmHWM: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_rss_mb() -> float:
    """Peak resident set of this process (VmHWM), in MB."""
    try:
        return status_kb("VmHWM") / 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    try:
        return status_kb("VmRSS") / 1024
    except (OSError, KeyError):
        return 0.0


def reset_peak_rss() -> bool:
    """Linux ≥ 4.0: writing 5 to clear_refs resets VmHWM to the current RSS. False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """The largest RSS seen every `dt` seconds (psutil): a cross-check of VmHWM."""

    def __init__(self, dt=0.05):
        super().__init__(daemon=True)
        import psutil

        self.p, self.dt, self.peak, self.stop = psutil.Process(), dt, 0, False

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, self.p.memory_info().rss)
            time.sleep(self.dt)


class PeakAbove:
    """`with PeakAbove() as peak:` the block's peak RSS above the RSS at its start, in GB: `peak.gb`
    from the kernel's high-water mark, reset on entry (NaN where it cannot be reset), and
    `peak.sampled_gb` from psutil sampling beside it."""

    def __enter__(self):
        self.base_kb = status_kb("VmRSS")
        self.ok = reset_peak_rss()
        self.sampler = Sampler()
        self.sampler.start()
        return self

    def __exit__(self, *exc):
        self.sampler.stop = True
        self.sampler.join()
        self.gb = (status_kb("VmHWM") - self.base_kb) / 1024 ** 2 if self.ok else float("nan")
        self.sampled_gb = (self.sampler.peak / 1024 - self.base_kb) / 1024 ** 2
        return False


def page_in(mm) -> None:
    """Touch every weight (a memory-mapped model is paged in), so a baseline holds the whole model."""
    import gc

    for p in mm.hf.parameters():
        float(p.detach().float().sum())
    gc.collect()


def out(line: str) -> None:
    print(line, flush=True)
    sys.stdout.flush()
