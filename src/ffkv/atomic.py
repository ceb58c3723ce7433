"""Writing a file so that a reader sees the old one or the new one, never half: the one place
for temp-then-rename, the temp names a killed writer leaves, and the disk errors a user causes.
Beneath both `store` (tables, manifest) and `model` (the dequantized cache)."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path

from ffkv.errors import FfkvError


def writing(path) -> "contextlib.AbstractContextManager":
    """Turn the OS errors a user can cause (read-only or full disk, no permission) into one line."""
    return _Writing(Path(path))


class _Writing:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if et is not None and issubclass(et, OSError):
            if e.errno in USER_ERRNOS:
                raise FfkvError(f"cannot write {self.path}: {os.strerror(e.errno)}") from None
            why = next((w for w in USER_MESSAGES if w in str(e)), None)
            if why:  # pyarrow's IO errors carry the text but no errno
                raise FfkvError(f"cannot write {self.path}: {why}") from None
        return False


USER_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EISDIR,
               errno.ENOTDIR}


USER_MESSAGES = ("No space left on device", "Read-only file system", "Permission denied", "Disk quota exceeded")


TMP_RE = re.compile(r"^\..+\.tmp(\d+)$")


def tmp_path(path: Path) -> Path:
    """Where a write to `path` is staged: hidden, and tagged with our pid so that `sweep_temps`
    can tell a killed writer's leftover from a live writer's file."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def sweep_temps(folder: Path) -> list[Path]:
    """Delete the staged writes of processes that no longer run (a SIGKILL skips every `finally`)."""
    gone = []
    for p in Path(folder).glob(".*.tmp*"):
        m = TMP_RE.match(p.name)
        if m and not p.is_symlink() and not _alive(int(m.group(1))):
            _remove(p)
            gone.append(p)
    return gone


@contextlib.contextmanager
def staged(path: Path):
    """The one way ffkv writes a result: into the yielded temp path (a file or a folder), which
    then replaces `path` in one rename; on any failure it is removed, and a disk the user made
    full or read-only is one line (`writing`)."""
    path = Path(path)
    tmp = tmp_path(path)
    with writing(path):
        try:
            yield tmp
            os.replace(tmp, path)
        finally:
            _remove(tmp)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Temp file + fsync + rename: a reader sees the old file or the new one, never half."""
    path = Path(path)
    if path.is_dir():
        raise FfkvError(f"{path} is a directory; give a file name")
    with staged(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=False, default=str).encode())
