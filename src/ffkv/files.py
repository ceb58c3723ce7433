"""Where ffkv keeps what it builds once (the cache folder) and a file's digest: beneath model/ and
corpus/, which both need them, so that neither imports the other's loader."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ffkv.errors import FfkvError

CACHE_ENV = "FFKV_CACHE"


def cache_dir() -> Path:
    """`$FFKV_CACHE`, else ~/.cache/ffkv. An empty or relative FFKV_CACHE is refused in one line:
    it would be the folder the user stands in, and a model conversion (hundreds of MB) or the
    neighbour tables would land there."""
    v = os.environ.get(CACHE_ENV)
    if v is None:
        return Path.home() / ".cache" / "ffkv"
    p = Path(v).expanduser()
    if not v.strip() or not p.is_absolute():
        raise FfkvError(f"{CACHE_ENV} must be an absolute folder (got {v!r}); set it to one, or unset it "
                        f"for ~/.cache/ffkv")
    return p


def file_sha256(path: Path, _memo: dict = {}) -> str:
    """The sha256 of a file's bytes, read once per (size, mtime) in a process."""
    path = Path(path)
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _memo[key] = h.hexdigest()
    return _memo[key]
