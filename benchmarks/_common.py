"""Shared bits for the benchmarks: the default model, WikiText sentences, peak RSS."""
from __future__ import annotations

import os
import resource
import sys
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


def wikitext_token_lists(mm, n: int, split: str = "valid"):
    from ffkv.corpus.sources import open_corpus, tokenize

    sents = open_corpus(str(WT2 / f"wiki.{split}.tokens")).sentences(n)
    ids, _ = tokenize(mm.tok, sents, mm.max_length)
    return ids


def peak_rss_mb() -> float:
    """Peak resident set of this process (VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak_rss() -> None:
    """Linux ≥ 4.0: writing 5 to clear_refs resets VmHWM to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def out(line: str) -> None:
    print(line, flush=True)
    sys.stdout.flush()
