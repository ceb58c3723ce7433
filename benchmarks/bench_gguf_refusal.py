"""How fast an unsupported GGUF is refused (issue 25: ≤ 2 s, one line, no progress bar).

    .venv/bin/python benchmarks/bench_gguf_refusal.py [--repeats 5]

The file: the real Gemma 3 270M GGUF (253 MB, a 262,144-entry vocabulary in its header) with
its `general.architecture` rewritten from gemma3 to mamba2 (same length, so nothing else moves):
a well-formed GGUF of an architecture ffkv does not read; and the same file cut in half (its header
whole, its tensors short). Timed: `ffkv info FILE`, `ffkv mine --model FILE` and `ffkv info CUT` as
fresh processes (what a user waits for), beside `python -c "import ffkv"`
(the interpreter's own start, which no change to ffkv removes). Printed: the median and best
wall time of each, the median as a ratio to the 2 s goal. Without the Gemma 3 packages a small
GGUF with the same vocabulary size is written instead (said so).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import out

GOAL = 2.0


def unsupported_copy(d: Path) -> tuple[Path, str]:
    """The Gemma 3 GGUF with its architecture renamed to mamba2, or a small stand-in."""
    try:
        from ffkv.model import gemma3

        src = gemma3.resolve()
    except Exception as e:  # noqa: BLE001 - no packages: a written file instead
        return written(d), f"a written GGUF (Gemma 3 unavailable: {str(e)[:80]})"
    dst = d / "mamba2.gguf"
    shutil.copyfile(src, dst)
    old = b"general.architecture" + struct.pack("<IQ", 8, 6) + b"gemma3"
    with open(dst, "r+b") as f:
        head = f.read(1 << 20)
        at = head.find(old)
        assert at > 0, "general.architecture not found in the first MB"
        f.seek(at + len(old) - 6)
        f.write(b"mamba2")
    return dst, f"Gemma 3 270M GGUF ({dst.stat().st_size / 1e6:.0f} MB), architecture renamed to mamba2"


def written(d: Path) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    p = d / "mamba2.gguf"
    w = GGUFWriter(str(p), "mamba2")
    w.add_block_count(2)
    w.add_token_list([f"t{i}" for i in range(262_144)])
    w.add_tensor("token_embd.weight", np.zeros((4096, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return time.perf_counter() - t, res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        path, what = unsupported_copy(d)
        cut = d / "cut.gguf"
        with open(path, "rb") as src, open(cut, "wb") as dst:
            dst.write(src.read(path.stat().st_size // 2))
        env = {**os.environ, "FFKV_CACHE": str(d / "cache"), "HF_HUB_OFFLINE": "1"}
        py = sys.executable
        cmds = {"python -c 'import ffkv'": [py, "-c", "import ffkv"],
                "ffkv info FILE": [py, "-m", "ffkv.cli", "info", str(path)],
                "ffkv mine --model FILE": [py, "-m", "ffkv.cli", "mine", "--model", str(path),
                                           "--out", str(d / "run")],
                "ffkv info CUT": [py, "-m", "ffkv.cli", "info", str(cut)]}
        times = {k: [] for k in cmds}
        for _ in range(args.repeats + 1):  # rounds interleaved, the first a warm-up (page cache)
            for k, cmd in cmds.items():
                t, res = timed(cmd, env)
                times[k].append(t)
                if k != "python -c 'import ffkv'":
                    lines = res.stderr.strip().splitlines()
                    why = "is truncated" if "CUT" in k else "unsupported architecture"
                    assert res.returncode == 2 and len(lines) == 1 and why in lines[0], \
                        res.stderr[-500:]
        assert not (d / "cache").exists() or not any((d / "cache").rglob("*")), "something was cached"
        out(f"file: {what}")
        for k, ts in times.items():
            ts = ts[1:]
            med = statistics.median(ts)
            out(f"{k:<26} median {med:.2f} s, best {min(ts):.2f} s  ({med / GOAL:.2f} of the {GOAL:.0f} s goal)")
        out(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
