"""Pre-tokenized corpora: token ids read as they are, with no sentence splitter and no tokenizer call.

One row is one sequence (a sentence, or a window of a document); the trigger prefix of a
position is that row up to it, as with sentences. The kinds (`kind_of`):
  PATH.parquet[:COLUMN]   a list-of-integers column: COLUMN, else --field when given, else the
                          only such column, else input_ids or tokens (several others: refused)
  PATH.npy                a 2-D integer array (N, T): N rows of T tokens
  PATH.u16 | PATH.u32     a flat little-endian uint16 / uint32 token stream, cut into windows of
  PATH.bin:u16|u32        --context tokens (the last window keeps the remainder); `.bin` names no
                          width, so it needs the :u16 or :u32
  hf:NAME                 a Hugging Face dataset with an `input_ids` or `tokens` column (the names
                          SAELens accepts) and no text column named by --field

Which tokenizer made the ids (one convention, written by `write_parquet`): the key `tokenizer` of
the Parquet schema metadata (of an HF dataset: of its Arrow table, else a JSON object's
`tokenizer` in its description) holds JSON {"name": ..., "vocab_sha256": ...}; `vocab_sha256`
(`vocab_digest`) decides, a bare name must be the model tokenizer's own. Ids are checked before
any forward pass: negative, at or past the model's vocabulary, an empty file, a wrong dtype or
shape, no list-of-integers column, another tokenizer: one line (FfkvError).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ffkv.defs import CORPUS_CONTEXT as DEFAULT_CONTEXT
from ffkv.display import printable
from ffkv.errors import FfkvError
from ffkv.files import file_sha256

META_KEY = "tokenizer"
STREAMS = {".u16": "<u2", ".u32": "<u4"}  # suffix -> dtype of a flat token stream
WIDTHS = {"u16": "<u2", "u32": "<u4"}  # PATH.bin:WIDTH
HF_COLUMNS = ("input_ids", "tokens")


def kind_of(path: Path, arg: str) -> str | None:
    """The pre-tokenized kind of a corpus file (parquet, npy, u16, u32), or None for text."""
    suf = path.suffix.lower()
    if suf == ".parquet":
        return "parquet"
    if suf == ".npy":
        return "npy"
    if suf in STREAMS:
        return suf[1:]
    if suf == ".bin" and arg in WIDTHS:
        return arg
    return None


@dataclass
class TokenRows:
    """Rows of token ids as one flat array and its row offsets (row i: values[offsets[i]:offsets[i+1]])."""
    kind: str
    values: np.ndarray
    offsets: np.ndarray
    sha256: str
    meta: str | None = None  # the tokenizer metadata, as written
    details: dict = field(default_factory=dict)  # what the manifest records beside kind (column, context)
    where: str = ""

    @property
    def n_rows(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> list[int]:
        return self.values[self.offsets[i]:self.offsets[i + 1]].tolist()

    def check(self, tokenizer, vocab_size: int | None, max_length: int) -> None:
        """Refuse ids the model cannot read, or ids another tokenizer made (before any forward)."""
        check_tokenizer(self.meta, tokenizer, self.where)
        bound = min(len(tokenizer), vocab_size) if vocab_size else len(tokenizer)
        if len(self.values) and int(self.values.max()) >= bound:
            at = int(np.argmax(self.values >= bound))
            r = int(np.searchsorted(self.offsets, at, side="right")) - 1
            raise FfkvError(f"{self.where}: token id {int(self.values[at])} (row {r}) is outside the model's "
                            f"vocabulary 0..{bound - 1}; were these ids made by another tokenizer?")
        ctx = self.details.get("context")
        if ctx and ctx > max_length:
            raise FfkvError(f"--context {ctx} is longer than the model's context of {max_length} tokens")


def _where(path) -> str:
    return f"corpus {printable(str(path)[:200], newlines=False)}"


def _ids_checked(values: np.ndarray, offsets: np.ndarray, where: str) -> None:
    """Integer ids, at least one, none negative."""
    if values.dtype.kind not in "iu":
        raise FfkvError(f"{where}: token ids must be integers, not {values.dtype}")
    if len(values) == 0:
        raise FfkvError(f"{where} is empty: no token ids")
    if values.dtype.kind == "i" and int(values.min()) < 0:
        at = int(np.argmax(values < 0))
        r = int(np.searchsorted(offsets, at, side="right")) - 1
        raise FfkvError(f"{where}: negative token id {int(values[at])} (row {r})")


def _check_file(path: Path) -> None:
    if not os.path.exists(path):
        raise FfkvError(f"{_where(path)} does not exist")
    if path.is_dir():
        raise FfkvError(f"{_where(path)} is a folder; pass a file")
    if path.stat().st_size == 0:
        raise FfkvError(f"{_where(path)} is empty")


def read_tokens(path: Path, kind: str, column: str | None = None, context: int = DEFAULT_CONTEXT) -> TokenRows:
    """A pre-tokenized corpus file's rows, checked for what needs no model (dtype, shape, sign)."""
    _check_file(path)
    where = _where(path)
    try:
        if kind == "parquet":
            rows = _parquet(path, column, where)
        elif kind == "npy":
            rows = _npy(path, where)
        else:
            rows = _stream(path, kind, context, where)
    except OSError as e:
        raise FfkvError(f"cannot read {where}: {e.strerror or e}") from None
    rows.sha256, rows.where = file_sha256(path), where
    return rows


def read_some(path: Path, kind: str, want, column: str | None = None,
              context: int = DEFAULT_CONTEXT) -> tuple[np.ndarray, np.ndarray]:
    """Rows `want` (row indices, in that order) of a pre-tokenized file that `read_tokens` has
    read and checked whole elsewhere, as flat values and offsets, reading only what they need: a
    Parquet file's row groups that hold them, a .npy's or a stream's pages (memory-mapped). What a
    Ray actor decodes of its share of a corpus (`ffkv.steps.mine.distributed.Prepared`)."""
    want = np.asarray(want, np.int64)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as f:
            name = _int_list_column(f.schema_arrow, column, _where(path))
            starts = np.cumsum([0] + [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)])
            group = np.searchsorted(starts, want, side="right") - 1
            pieces, at = [], []
            for g in np.unique(group):
                sel = np.flatnonzero(group == g)
                col = f.read_row_group(int(g), columns=[name]).column(name)
                pieces.append(col.take(pa.array(want[sel] - starts[g])).combine_chunks())
                at.append(sel)
        if not pieces:
            return np.zeros(0, np.int32), np.zeros(1, np.int64)
        got = pa.chunked_array(pieces).take(pa.array(np.argsort(np.concatenate(at), kind="stable")))
        return flat_lists(got)
    if kind == "npy":
        a = np.load(path, mmap_mode="r", allow_pickle=False)
        rows = np.asarray(a[want])
        return rows.reshape(-1), np.arange(len(want) + 1, dtype=np.int64) * a.shape[1]
    values = np.memmap(path, dtype=np.dtype(WIDTHS[kind]), mode="r")
    return gather(values, windows(len(values), context), want)


def gather(values: np.ndarray, offsets: np.ndarray, want) -> tuple[np.ndarray, np.ndarray]:
    """Rows `want` of flat rows (row i: values[offsets[i]:offsets[i+1]]), in that order, as flat
    values and offsets: one fancy index, no list per row."""
    lo, hi = offsets[want], offsets[want + 1]
    offs = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
    return np.asarray(values[np.repeat(lo - offs[:-1], hi - lo) + np.arange(offs[-1])]), offs


def _parquet(path: Path, column: str | None, where: str) -> TokenRows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, ValueError) as e:
        raise FfkvError(f"{where} is not a readable Parquet file ({str(e).splitlines()[0][:120]})") from None
    name = _int_list_column(schema, column, where)
    try:
        col = pf.read(columns=[name]).column(name)
    except (pa.ArrowException, ValueError) as e:
        raise FfkvError(f"{where}: cannot read column {name!r} ({str(e).splitlines()[0][:120]})") from None
    meta = (schema.metadata or {}).get(META_KEY.encode())
    return _from_arrow(col, "parquet", meta.decode("utf-8", "replace") if meta else None, where,
                       {"column": name})


def _is_int_list(t) -> bool:
    import pyarrow as pa

    return ((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
            and pa.types.is_integer(t.value_type))


def _int_list_column(schema, column: str | None, where: str) -> str:
    """The named column, else the only list-of-integers column, else `input_ids` or `tokens`:
    an HF file also holds attention masks, labels and position ids as integer lists."""
    if column is not None:
        if column not in schema.names:
            raise FfkvError(f"{where} has no column {column!r} (its columns: "
                            f"{printable(', '.join(schema.names)[:160], newlines=False)})")
        if not _is_int_list(schema.field(column).type):
            raise FfkvError(f"{where}: column {column!r} holds {schema.field(column).type}, "
                            f"not lists of integer token ids")
        return column
    found = [f.name for f in schema if _is_int_list(f.type)]
    if len(found) == 1:
        return found[0]
    named = [c for c in HF_COLUMNS if c in found]
    if named:
        return named[0]
    if found:  # masks, labels and position ids are integer lists too: never guess which are the ids
        raise FfkvError(f"{where} has several list-of-integers columns "
                        f"({printable(', '.join(found)[:160], newlines=False)}) and none named "
                        f"{' or '.join(HF_COLUMNS)}; name the ids with --field COLUMN (or PATH.parquet:COLUMN)")
    raise FfkvError(f"{where} has no list-of-integers column (pre-tokenized ids); its columns: "
                    f"{printable(', '.join(f'{f.name} {f.type}' for f in schema)[:160] or 'none', newlines=False)}")


def flat_lists(col) -> tuple[np.ndarray, np.ndarray]:
    """A list-of-integers Arrow column as its flat values and row offsets (row i:
    values[offsets[i]:offsets[i+1]]): 4-8 bytes a token, where Python lists take about 36."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lengths = np.asarray(pc.list_value_length(arr), dtype=np.int64)
    return pc.list_flatten(arr).to_numpy(zero_copy_only=False), np.concatenate([[0], np.cumsum(lengths)])


def _from_arrow(col, kind: str, meta: str | None, where: str, details: dict) -> TokenRows:
    """A list-of-integers Arrow column as flat values and row offsets; no null rows or ids."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if len(arr) == 0:
        raise FfkvError(f"{where} is empty: no rows")
    if arr.null_count:
        raise FfkvError(f"{where}: row {int(np.argmax(np.asarray(arr.is_null())))} is null, not a list of token ids")
    flat = arr.flatten()
    if flat.null_count:
        offsets = flat_lists(arr)[1]
        at = int(np.argmax(np.asarray(flat.is_null())))
        raise FfkvError(f"{where}: row {int(np.searchsorted(offsets, at, side='right')) - 1} holds a null token id")
    values, offsets = flat_lists(arr)
    _ids_checked(values, offsets, where)
    return TokenRows(kind, values, offsets, "", meta, details)


def _npy(path: Path, where: str) -> TokenRows:
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001  (any bytes: pickles refused, zip, cut-short headers)
        raise FfkvError(f"{where} is not a readable NumPy .npy file ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(a, np.ndarray):
        raise FfkvError(f"{where} is not a .npy array")
    if a.dtype.kind not in "iu":
        raise FfkvError(f"{where}: token ids must be integers, not {a.dtype}")
    if a.ndim != 2:
        raise FfkvError(f"{where}: an array of shape (N, T) is needed (N rows of T token ids), not {a.shape}")
    n, t = a.shape
    values = np.ascontiguousarray(a).reshape(-1)
    offsets = np.arange(n + 1, dtype=np.int64) * t
    _ids_checked(values, offsets, where)
    return TokenRows("npy", values, offsets, "", None, {"shape": [int(n), int(t)]})


def windows(n: int, context: int) -> np.ndarray:
    """Row offsets of a flat stream of n tokens cut into windows of `context` (the last keeps the rest)."""
    return np.unique(np.append(np.arange(0, n, context, dtype=np.int64), n))


def _stream(path: Path, kind: str, context: int, where: str) -> TokenRows:
    dt = np.dtype(WIDTHS[kind])
    size = path.stat().st_size
    if size % dt.itemsize:
        raise FfkvError(f"{where}: {size:,} bytes is not a whole number of {kind} token ids "
                        f"({dt.itemsize} bytes each); is it another width?")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise FfkvError(f"--context must be a whole number of at least 1, not {context!r}")
    values = np.memmap(path, dtype=dt, mode="r")
    offsets = windows(len(values), context)
    _ids_checked(values, offsets, where)
    return TokenRows(kind, values, offsets, "", None, {"context": context})


def from_hf(ds, text_field: str, spec: str) -> TokenRows | None:
    """An HF dataset's ids when it has no text column `text_field` but an input_ids or tokens
    column of integer lists; None for a text dataset."""
    names = list(ds.column_names)
    if text_field in names and text_field not in HF_COLUMNS:
        return None
    col = text_field if text_field in names else next((c for c in HF_COLUMNS if c in names), None)
    if col is None:
        return None
    tbl = ds.with_format("arrow")[:]
    where = f"dataset {printable(spec[:200], newlines=False)}"
    if not _is_int_list(tbl.schema.field(col).type):
        return None
    meta = (tbl.schema.metadata or {}).get(META_KEY.encode())
    meta = meta.decode("utf-8", "replace") if meta else _description_meta(getattr(ds.info, "description", ""))
    rows = _from_arrow(tbl.column(col), "hf", meta, where, {"column": col})
    h = hashlib.sha256(np.ascontiguousarray(rows.values).tobytes())
    h.update(rows.offsets.tobytes())
    rows.sha256, rows.where = h.hexdigest(), where
    return rows


def _description_meta(desc) -> str | None:
    try:
        d = json.loads(desc or "")
    except ValueError:
        return None
    if isinstance(d, dict) and META_KEY in d:
        v = d[META_KEY]
        return v if isinstance(v, str) else json.dumps(v)
    return None


# -- which tokenizer -----------------------------------------------------------------------------
def vocab_digest(tokenizer) -> str:
    """sha256 of the vocabulary (every token string and its id): the same ids mean the same tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def tokenizer_meta(tokenizer) -> str:
    """The metadata value that names `tokenizer` (`META_KEY`), as `write_parquet` writes it."""
    return json.dumps({"name": str(getattr(tokenizer, "name_or_path", "") or ""),
                       "vocab_sha256": vocab_digest(tokenizer)})


def check_tokenizer(meta: str | None, tokenizer, where: str) -> None:
    """Refuse ids whose metadata names another tokenizer than the model's."""
    if meta is None:
        return
    try:
        m = json.loads(meta)
    except ValueError:
        m = meta
    if isinstance(m, dict):
        name, digest = m.get("name"), m.get("vocab_sha256")
    elif isinstance(m, str):
        name, digest = m, None
    else:
        raise FfkvError(f"{where}: its `{META_KEY}` metadata is neither a name nor "
                        f'{{"name": ..., "vocab_sha256": ...}}')
    shown = printable(str(name or "another tokenizer")[:120], newlines=False)
    if digest:
        if str(digest) != vocab_digest(tokenizer):
            raise FfkvError(f"{where} was tokenized by {shown} (vocabulary sha256 {str(digest)[:12]}…), not by "
                            f"the model's tokenizer; mine it with that model, or tokenize the text again")
        return
    ours = str(getattr(tokenizer, "name_or_path", "") or "")
    if name and str(name).lower() not in {ours.lower(), os.path.basename(ours.rstrip("/")).lower()}:
        raise FfkvError(f"{where} was tokenized by {shown}, not by the model's tokenizer "
                        f"({printable(ours[:120], newlines=False)}); if both have one vocabulary, write its "
                        f"vocab_sha256 in the `{META_KEY}` metadata (ffkv.corpus.tokens.write_parquet does)")


def write_parquet(path, rows, tokenizer=None, column: str = "input_ids") -> Path:
    """Token id rows as a Parquet corpus that `ffkv mine --corpus` reads, naming `tokenizer`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tbl = pa.table({column: pa.array([list(map(int, r)) for r in rows], pa.list_(pa.int32()))})
    if tokenizer is not None:
        tbl = tbl.replace_schema_metadata({META_KEY: tokenizer_meta(tokenizer)})
    pq.write_table(tbl, path)
    return Path(path)
