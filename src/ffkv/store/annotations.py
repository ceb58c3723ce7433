"""Human annotations of key patterns, as the paper's experts made them (§3.1), in SQLite.

`annotations.sqlite` lives in the run directory, in WAL mode; every save is one transaction on its
own connection, so threads and processes can write at once (a busy writer waits, up to
`timeout` seconds). A browser form only calls this API.

What is stored (the paper's protocol): an annotator reads the top-25 trigger prefixes of a key
(prefix i = the key's trigger of rank i + 1, sign +1 unless stated; the same indexing as the
`patterns` table), writes down patterns, classifies each as shallow or semantic, and marks which
prefixes each pattern covers; a prefix may have several patterns, and an annotation may have none.

Records: one annotation per (annotator, layer, dim, sign). Saving again replaces it (patterns and
all) and keeps its `uid` and `created`; `updated` is the save time. Every record carries a uid
(uuid4 hex), so a JSONL export imports back into any store of a run with the same keys.
Import policy: a record whose (annotator, key) is new is added; an identical one is left alone;
a different one replaces the stored record only when its `updated` is later (last writer wins),
else the stored one is kept. Importing the same file twice changes nothing.

Validation (before anything is written, so a refused save or import writes nothing): the key must
have triggers in the run (`triggers` table, that sign); prefix indices are integers in
0..min(25, number of the key's triggers) − 1; a pattern needs a non-blank description, kind
shallow | semantic and at least one prefix; the annotator name is not blank. Problems raise
FfkvError with one line naming the field.

SQL schema (public: other tools may read it):
- annotations(id, uid UNIQUE, annotator, layer, dim, sign, note, created, updated),
  UNIQUE(annotator, layer, dim, sign)
- patterns(id, annotation_id → annotations ON DELETE CASCADE, idx (order in the annotation),
  description, kind CHECK IN ('shallow', 'semantic'))
- pattern_prefixes(pattern_id → patterns ON DELETE CASCADE, prefix CHECK 0..24), PRIMARY KEY both
- sample(layer, dim, sign, seed, per_layer): the keys handed to annotators (`sample()`)
- meta(key, value): schema version, top
"""
from __future__ import annotations

import json
import math
import sqlite3
import time
import uuid
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np

from ffkv.errors import FfkvError
from ffkv.store import query
from ffkv.store.labels import (CATEGORIES, KINDS, LABELS, TOP, category_counts, key_label,  # noqa: F401
                               layer_shares, prefix_categories)

FILENAME = "annotations.sqlite"
SCHEMA_VERSION = "1"

# The limits of one annotation, defined here once: `validate` applies them to every save (the
# browser's form, the JSON API, `ffkv annotate add` and `ffkv annotate import` alike), the form's
# maxlength attributes show them, and the web routes refuse a body over MAX_RECORD_BYTES (413).
MAX_NAME = 200  # characters of an annotator's name
MAX_NOTE = 5000  # characters of a note
MAX_DESCRIPTION = 2000  # characters of a pattern's description
MAX_PATTERNS = 20  # patterns in one annotation (the form's slots)
MAX_RECORD_BYTES = 256 * 1024  # bytes of one annotation as sent: a form or JSON body, or a line of an import
MAX_JSON_DEPTH = 16  # nesting of a JSON annotation (one needs 3: record, patterns, prefixes)
LIMITS = {"name": MAX_NAME, "note": MAX_NOTE, "description": MAX_DESCRIPTION, "patterns": MAX_PATTERNS,
          "record_bytes": MAX_RECORD_BYTES}

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS annotations(
  id INTEGER PRIMARY KEY,
  uid TEXT NOT NULL UNIQUE,
  annotator TEXT NOT NULL CHECK(length(trim(annotator)) > 0),
  layer INTEGER NOT NULL,
  dim INTEGER NOT NULL,
  sign INTEGER NOT NULL DEFAULT 1 CHECK(sign IN (1, -1)),
  note TEXT NOT NULL DEFAULT '',
  created REAL NOT NULL,
  updated REAL NOT NULL,
  UNIQUE(annotator, layer, dim, sign));
CREATE TABLE IF NOT EXISTS patterns(
  id INTEGER PRIMARY KEY,
  annotation_id INTEGER NOT NULL REFERENCES annotations(id) ON DELETE CASCADE,
  idx INTEGER NOT NULL,
  description TEXT NOT NULL CHECK(length(trim(description)) > 0),
  kind TEXT NOT NULL CHECK(kind IN ('shallow', 'semantic')),
  UNIQUE(annotation_id, idx));
CREATE TABLE IF NOT EXISTS pattern_prefixes(
  pattern_id INTEGER NOT NULL REFERENCES patterns(id) ON DELETE CASCADE,
  prefix INTEGER NOT NULL CHECK(prefix BETWEEN 0 AND {TOP - 1}),
  PRIMARY KEY(pattern_id, prefix));
CREATE TABLE IF NOT EXISTS sample(
  layer INTEGER NOT NULL, dim INTEGER NOT NULL, sign INTEGER NOT NULL,
  seed INTEGER NOT NULL, per_layer INTEGER NOT NULL,
  PRIMARY KEY(layer, dim, sign));
CREATE INDEX IF NOT EXISTS annotations_key ON annotations(layer, dim, sign);
CREATE INDEX IF NOT EXISTS patterns_annotation ON patterns(annotation_id);
"""


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class AnnotationStore:
    """The annotation store of one run. Every method opens its own connection: safe to share
    between threads, and to use from several processes at once."""

    def __init__(self, run, timeout: float = 60.0):
        from ffkv.store.run import Run

        self.run = run if isinstance(run, Run) else Run(run)
        self.path = Path(self.run.path) / FILENAME
        self.timeout = timeout
        self._counts: dict | None = None
        self._cache: dict[str, tuple] = {}  # table name -> (stat signature, what was read)
        self._init()

    # ---- connections -------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        with self._sqlite_errors():
            con = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            con.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
            con.execute("PRAGMA foreign_keys = ON")
            con.execute("PRAGMA synchronous = NORMAL")
        return con

    @contextmanager
    def _sqlite_errors(self):
        """A read-only or full disk, or a damaged file, is one line for the user, not a traceback."""
        try:
            yield
        except sqlite3.OperationalError as e:
            raise FfkvError(f"cannot use {self.path}: {e}") from None
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.IntegrityError):
                raise
            raise FfkvError(f"{self.path} is damaged or not an annotation store: {e}") from None

    @contextmanager
    def _write(self):
        """One write transaction (BEGIN IMMEDIATE takes the write lock at once)."""
        with closing(self._connect()) as con, self._sqlite_errors():
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def _init(self) -> None:
        with closing(self._connect()) as con, self._sqlite_errors():
            mode = con.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise FfkvError(f"{self.path}: SQLite refused WAL mode ({mode}); is the run on a "
                                "network file system?")
        with self._write() as con:
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    con.execute(stmt)
            con.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            con.execute("INSERT OR IGNORE INTO meta VALUES ('top', ?)", (str(TOP),))

    # ---- the run's keys ----------------------------------------------------------------------
    def _cached(self, name: str, read):
        """`read()` of the run's table `name`, kept while the table's file is unchanged (its mtime,
        size and inode): the browser asks for the statistics on every page of annotations, and
        reading the pattern tables each time took seconds on a real run. None when the table is
        absent."""
        try:
            st = self.run.table_path(name).stat()
        except OSError:
            self._cache.pop(name, None)
            return None
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        hit = self._cache.get(name)
        if hit is not None and hit[0] == sig:
            return hit[1]
        value = read()
        self._cache[name] = (sig, value)
        return value

    def trigger_counts(self) -> dict[tuple[int, int, int], int]:
        """(layer, dim, sign) -> number of triggers with rank ≤ 25 (prefixes an annotator sees)."""
        def read():
            import pyarrow.compute as pc

            t = self.run.read_table("triggers", columns=["layer", "dim", "sign", "rank"])
            t = t.filter(pc.less_equal(t.column("rank"), TOP))
            g = t.group_by(["layer", "dim", "sign"]).aggregate([("rank", "count")])
            return {(int(l), int(d), int(s)): int(c) for l, d, s, c in zip(
                g.column("layer").to_pylist(), g.column("dim").to_pylist(), g.column("sign").to_pylist(),
                g.column("rank_count").to_pylist())}

        counts = self._cached("triggers", read)
        if counts is None:
            raise FfkvError(f"run {self.run.path} has no `triggers` table; run `ffkv mine` first")
        return counts

    def n_prefixes(self, layer: int, dim: int, sign: int = 1) -> int:
        return self.trigger_counts().get((int(layer), int(dim), int(sign)), 0)

    # ---- validation ----------------------------------------------------------------------------
    def validate(self, annotator, layer, dim, patterns, sign=1, note="") -> tuple:
        """Checked and normalised (annotator, layer, dim, sign, note, patterns); raises FfkvError."""
        if not isinstance(annotator, str) or not annotator.strip():
            raise FfkvError("annotator: a non-empty name is required")
        if len(annotator.strip()) > MAX_NAME:
            raise FfkvError(f"annotator: the name is longer than {MAX_NAME} characters ({len(annotator.strip()):,})")
        if not _is_int(layer) or not _is_int(dim):
            raise FfkvError(f"key: layer and dim must be integers (got {layer!r}, {dim!r})")
        if sign not in (1, -1) or isinstance(sign, bool):
            raise FfkvError(f"key: sign must be 1 or -1 (got {sign!r})")
        n = self.n_prefixes(layer, dim, sign)
        if n == 0:
            raise FfkvError(f"unknown key: layer {layer}, dim {dim} has no triggers with sign "
                            f"{sign:+d} in run {self.run.path}")
        if not isinstance(note, str):
            raise FfkvError("note: must be text")
        if len(note) > MAX_NOTE:
            raise FfkvError(f"note: at most {MAX_NOTE:,} characters (got {len(note):,})")
        if not isinstance(patterns, (list, tuple)):
            raise FfkvError("patterns: must be a list of {description, kind, prefixes}")
        if len(patterns) > MAX_PATTERNS:
            raise FfkvError(f"patterns: at most {MAX_PATTERNS} in one annotation (got {len(patterns)})")
        out = []
        for j, p in enumerate(patterns):
            where = f"pattern {j + 1}"
            if not isinstance(p, dict):
                raise FfkvError(f"{where}: must be an object with description, kind and prefixes")
            extra = set(p) - {"description", "kind", "prefixes"}
            if extra:
                raise FfkvError(f"{where}: unknown field(s) {sorted(extra)}; expected description, kind, prefixes")
            desc = p.get("description")
            if not isinstance(desc, str) or not desc.strip():
                raise FfkvError(f"{where}: the description is empty")
            if len(desc) > MAX_DESCRIPTION:
                raise FfkvError(f"{where}: the description is longer than {MAX_DESCRIPTION:,} characters "
                                f"({len(desc):,})")
            kind = p.get("kind")
            if kind not in KINDS:
                got = "none given" if kind in (None, "") else f"got {str(kind)[:40]!r}"
                raise FfkvError(f"{where}: kind must be shallow or semantic ({got})")
            pre = p.get("prefixes")
            if not isinstance(pre, (list, tuple)) or not pre:
                raise FfkvError(f"{where}: list at least one covered prefix (indices 0..{min(n, TOP) - 1})")
            for i in pre:
                if not _is_int(i):
                    raise FfkvError(f"{where}: prefix index {i!r} is not an integer")
                if not 0 <= i < min(n, TOP):
                    raise FfkvError(f"{where}: prefix index {i} is outside 0..{min(n, TOP) - 1} "
                                    f"(key {layer}/{dim} has {n} top prefixes)")
            out.append({"description": desc.strip(), "kind": kind, "prefixes": sorted({int(i) for i in pre})})
        return annotator.strip(), int(layer), int(dim), int(sign), note, out

    # ---- writes ----------------------------------------------------------------------------------
    def add_annotation(self, annotator: str, layer: int, dim: int, patterns: list[dict],
                       sign: int = 1, note: str = "") -> int:
        """Save (create or replace) `annotator`'s annotation of key (layer, dim): one transaction.
        `patterns` = [{"description": str, "kind": "shallow"|"semantic", "prefixes": [int, ...]}].
        Returns the annotation's row id."""
        annotator, layer, dim, sign, note, pats = self.validate(annotator, layer, dim, patterns, sign, note)
        now = time.time()
        with self._write() as con:
            return self._put(con, annotator, layer, dim, sign, note, pats, None, now, now)

    save = add_annotation

    def _put(self, con, annotator, layer, dim, sign, note, pats, uid, created, updated) -> int:
        row = con.execute("SELECT id FROM annotations WHERE annotator=? AND layer=? AND dim=? AND sign=?",
                          (annotator, layer, dim, sign)).fetchone()
        if row:
            aid = row[0]
            con.execute("DELETE FROM patterns WHERE annotation_id=?", (aid,))
            if uid is None:
                con.execute("UPDATE annotations SET note=?, updated=? WHERE id=?", (note, updated, aid))
            else:
                con.execute("UPDATE annotations SET note=?, updated=?, created=?, uid=? WHERE id=?",
                            (note, updated, created, uid, aid))
        else:
            cur = con.execute("INSERT INTO annotations(uid, annotator, layer, dim, sign, note, created, updated) "
                              "VALUES (?,?,?,?,?,?,?,?)",
                              (uid or uuid.uuid4().hex, annotator, layer, dim, sign, note, created, updated))
            aid = cur.lastrowid
        for j, p in enumerate(pats):
            pid = con.execute("INSERT INTO patterns(annotation_id, idx, description, kind) VALUES (?,?,?,?)",
                              (aid, j, p["description"], p["kind"])).lastrowid
            con.executemany("INSERT INTO pattern_prefixes(pattern_id, prefix) VALUES (?,?)",
                            [(pid, i) for i in p["prefixes"]])
        return aid

    def delete(self, annotator: str, layer: int, dim: int, sign: int = 1) -> bool:
        with self._write() as con:
            cur = con.execute("DELETE FROM annotations WHERE annotator=? AND layer=? AND dim=? AND sign=?",
                              (annotator, int(layer), int(dim), int(sign)))
            return cur.rowcount > 0

    # ---- reads -----------------------------------------------------------------------------------
    def list(self, annotator: str | None = None, layer: int | None = None, dim: int | None = None,
             sign: int | None = None) -> list[dict]:
        """Annotations as export records, sorted by layer, dim, sign, annotator."""
        if any(v is not None and not -2 ** 63 <= v < 2 ** 63 for v in (layer, dim, sign)):
            return []  # no stored key has it (SQLite's integers are 64-bit: it would refuse the query)
        where, args = [], []
        for col, v in (("annotator", annotator), ("layer", layer), ("dim", dim), ("sign", sign)):
            if v is not None:
                where.append(f"a.{col} = ?")
                args.append(v)
        sql = ("SELECT a.id, a.uid, a.annotator, a.layer, a.dim, a.sign, a.note, a.created, a.updated, "
               "p.id, p.idx, p.description, p.kind FROM annotations a LEFT JOIN patterns p "
               "ON p.annotation_id = a.id" + (" WHERE " + " AND ".join(where) if where else "") +
               " ORDER BY a.layer, a.dim, a.sign DESC, a.annotator, p.idx")
        with closing(self._connect()) as con, self._sqlite_errors():
            con.execute("BEGIN")  # one snapshot for both queries
            rows = con.execute(sql, args).fetchall()
            pre: dict[int, list[int]] = {}
            for pid, i in con.execute("SELECT pattern_id, prefix FROM pattern_prefixes ORDER BY pattern_id, prefix"):
                pre.setdefault(pid, []).append(i)
            con.execute("COMMIT")
        out: dict[int, dict] = {}
        for aid, uid, ann, l, d, s, note, cr, up, pid, idx, desc, kind in rows:
            rec = out.setdefault(aid, {"uid": uid, "annotator": ann, "layer": l, "dim": d, "sign": s,
                                       "note": note, "created": cr, "updated": up, "patterns": []})
            if pid is not None:
                rec["patterns"].append({"description": desc, "kind": kind, "prefixes": pre.get(pid, [])})
        return list(out.values())

    def get(self, annotator: str, layer: int, dim: int, sign: int = 1) -> dict | None:
        r = self.list(annotator, layer, dim, sign)
        return r[0] if r else None

    def count(self) -> int:
        with closing(self._connect()) as con, self._sqlite_errors():
            return con.execute("SELECT count(*) FROM annotations").fetchone()[0]

    # ---- export / import -----------------------------------------------------------------------------
    def export(self, path=None) -> str:
        """JSONL, one annotation per line (the `list()` records). Writes `path` when given."""
        text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in self.list())
        if path is not None:
            from ffkv.store.run import atomic_write_bytes

            atomic_write_bytes(Path(path), text.encode())
        return text

    def import_(self, source) -> dict:
        """Import JSONL: a path, or the text itself (a string with a newline or starting with
        "{"). All records are validated first and written in one
        transaction: a bad record refuses the whole import. Returns counts of added, replaced,
        unchanged and kept (the stored record was newer)."""
        is_text = isinstance(source, str) and ("\n" in source or source.lstrip().startswith("{") or not source)
        if not is_text:
            p = Path(source)
            try:
                source = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise FfkvError(f"cannot read {p}: {e}") from None
        recs = []
        seen = set()
        from ffkv.store.jsonl import json_objects

        for n, line in enumerate(source.splitlines(), 1):
            size = len(line.encode("utf-8", "surrogatepass"))
            if size > MAX_RECORD_BYTES:
                raise FfkvError(f"import line {n}: {size:,} bytes, over the limit of {MAX_RECORD_BYTES:,} "
                                "for one annotation")
        for n, r in json_objects(source, "import"):
            missing = {"annotator", "layer", "dim", "patterns"} - set(r)
            if missing:
                raise FfkvError(f"import line {n}: missing field(s) {sorted(missing)}")
            try:
                ann, l, d, s, note, pats = self.validate(r["annotator"], r["layer"], r["dim"], r["patterns"],
                                                         r.get("sign", 1), r.get("note", ""))
            except FfkvError as e:
                raise FfkvError(f"import line {n}: {e}") from None
            uid = r.get("uid") or uuid.uuid4().hex
            if not isinstance(uid, str) or not 1 <= len(uid) <= 64:
                raise FfkvError(f"import line {n}: uid must be a short string")
            now = time.time()
            cr, up = r.get("created", now), r.get("updated", r.get("created", now))
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                       for x in (cr, up)):
                raise FfkvError(f"import line {n}: created/updated must be Unix times (numbers)")
            k = (ann, l, d, s)
            if k in seen:
                raise FfkvError(f"import line {n}: a second record for annotator {ann!r}, key {l}/{d}")
            seen.add(k)
            recs.append((n, ann, l, d, s, note, pats, uid, float(cr), float(up)))
        counts = {"added": 0, "replaced": 0, "unchanged": 0, "kept": 0}
        with self._write() as con:
            for n, ann, l, d, s, note, pats, uid, cr, up in recs:
                other = con.execute("SELECT annotator, layer, dim, sign FROM annotations WHERE uid=?",
                                    (uid,)).fetchone()
                if other and tuple(other) != (ann, l, d, s):
                    raise FfkvError(f"import line {n}: uid {uid} belongs to another record "
                                    f"({other[0]!r}, key {other[1]}/{other[2]}) in this store")
                row = con.execute("SELECT id, updated, note FROM annotations WHERE annotator=? AND layer=? "
                                  "AND dim=? AND sign=?", (ann, l, d, s)).fetchone()
                if row is None:
                    self._put(con, ann, l, d, s, note, pats, uid, cr, up)
                    counts["added"] += 1
                    continue
                if self._patterns_of(con, row[0]) == pats and row[2] == note:
                    counts["unchanged"] += 1
                elif up > row[1]:
                    self._put(con, ann, l, d, s, note, pats, uid, cr, up)
                    counts["replaced"] += 1
                else:
                    counts["kept"] += 1
        return counts

    @staticmethod
    def _patterns_of(con, aid: int) -> list[dict]:
        out = []
        for pid, desc, kind in con.execute("SELECT id, description, kind FROM patterns WHERE annotation_id=? "
                                           "ORDER BY idx", (aid,)).fetchall():
            pre = [r[0] for r in con.execute("SELECT prefix FROM pattern_prefixes WHERE pattern_id=? "
                                             "ORDER BY prefix", (pid,))]
            out.append({"description": desc, "kind": kind, "prefixes": pre})
        return out

    # ---- the sample handed to annotators --------------------------------------------------------------
    def sample(self, per_layer: int = 10, seed: int = 0, sign: int = 1) -> list[tuple[int, int]]:
        """The seeded sample of `per_layer` keys per layer (the paper: 10), stored in `sample`.
        The same nested sample as `ffkv patterns`' semantic sample and `ffkv mutate`."""
        keys = query.key_sample(self.run, per_layer, seed, sign)
        rows = [(int(l), int(d)) for l, ds in keys.items() for d in ds]
        with self._write() as con:
            con.execute("DELETE FROM sample WHERE sign=?", (sign,))
            con.executemany("INSERT INTO sample VALUES (?,?,?,?,?)",
                            [(l, d, sign, seed, per_layer) for l, d in rows])
        return rows

    def stored_sample(self, sign: int = 1) -> list[tuple[int, int]]:
        with closing(self._connect()) as con, self._sqlite_errors():
            return [tuple(r) for r in con.execute("SELECT layer, dim FROM sample WHERE sign=? ORDER BY layer, dim",
                                                  (sign,))]

    def key_prefixes(self, layer: int, dim: int, tok, sign: int = 1) -> list[dict]:
        """The key's top-25 prefixes as an annotator sees them: index, rank, text, coef, sentence."""
        t = self.run.read_table("triggers", columns=["layer", "dim", "sign", "rank", "coef", "sentence_id",
                                                     "position"],
                                filters=[("layer", "=", layer), ("dim", "=", dim), ("sign", "=", sign),
                                         ("rank", "<=", TOP)]).sort_by("rank").to_pylist()
        if not t:
            raise FfkvError(f"unknown key: layer {layer}, dim {dim} has no triggers with sign {sign:+d}")
        px = query.prefix_texts(self.run, tok, [r["sentence_id"] for r in t], [r["position"] for r in t])
        return [{"index": r["rank"] - 1, "rank": r["rank"], "text": text, "last_token": last,
                 "coef": r["coef"], "sentence_id": r["sentence_id"], "position": r["position"]}
                for r, (text, last) in zip(t, px)]

    # ---- statistics ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Fig 2 from human labels, patterns per key, automatic-vs-human and inter-annotator agreement."""
        recs = self.list()
        counts = self.trigger_counts()
        out: dict = {"annotations": len(recs), "annotators": sorted({r["annotator"] for r in recs}),
                     "keys": len({(r["layer"], r["dim"], r["sign"]) for r in recs})}
        cats = {}
        for r in recs:
            n = min(TOP, counts.get((r["layer"], r["dim"], r["sign"]), 0))
            cats[id(r)] = prefix_categories(r["patterns"], n)
        # Fig 2: every annotation counts (a key annotated twice counts twice)
        rows = layer_shares([r["layer"] for r in recs], [category_counts(cats[id(r)]) for r in recs],
                            [len(r["patterns"]) for r in recs])
        out["fig2"] = [{"layer": f["layer"], "annotations": f["n"], **{k: v for k, v in f.items()
                                                                       if k not in ("layer", "n")}}
                       for f in rows]
        npk = [len(r["patterns"]) for r in recs]
        out["patterns_per_key"] = float(np.mean(npk)) if recs else None
        out["keys_with_pattern"] = float(np.mean([x > 0 for x in npk])) if recs else None
        allc = [c for r in recs for c in cats[id(r)]]
        out["prefixes_covered"] = float(np.mean([c != "not_covered" for c in allc])) if allc else None
        out["auto_vs_human"] = self._auto_vs_human(recs, cats)
        out["inter_annotator"] = inter_annotator(recs, cats)
        return out

    def _auto_labels(self) -> tuple[dict, dict] | None:
        """The automatic labels (`ffkv patterns`): ({key: pattern_keys row}, {key: [patterns]}),
        read once per version of the tables (`_cached`); None without them."""
        def keys():
            return {(k["layer"], k["dim"], k["sign"]): k for k in self.run.read_table("pattern_keys").to_pylist()}

        def pats():
            out: dict = {}
            for p in self.run.read_table("patterns", columns=["layer", "dim", "sign", "kind", "covered"]).to_pylist():
                out.setdefault((p["layer"], p["dim"], p["sign"]), []).append(
                    {"kind": p["kind"], "prefixes": p["covered"]})
            return out

        auto_keys, auto_pats = self._cached("pattern_keys", keys), self._cached("patterns", pats)
        if auto_keys is None or auto_pats is None:
            return None
        return auto_keys, auto_pats

    def _auto_vs_human(self, recs, cats) -> dict | None:
        auto = self._auto_labels()
        if auto is None:
            return None
        auto_keys, auto_pats = auto
        key_h, key_a, pre_h, pre_a, cov_h, cov_a = [], [], [], [], [], []
        skipped = 0
        for r in recs:
            k = (r["layer"], r["dim"], r["sign"])
            ak = auto_keys.get(k)
            if ak is None or not ak["semantic_done"]:
                skipped += 1
                continue
            key_h.append(key_label(r["patterns"]))
            key_a.append(key_label(auto_pats.get(k, [])))
            hc = cats[id(r)]
            ac = prefix_categories(auto_pats.get(k, []), len(hc))
            pre_h += hc
            pre_a += ac
            cov_h += [c != "not_covered" for c in hc]
            cov_a += [c != "not_covered" for c in ac]
        if not key_h:
            return {"annotations": 0, "without_automatic_labels": skipped}
        return {"annotations": len(key_h), "without_automatic_labels": skipped,
                "key_label_agreement": agreement(key_h, key_a), "key_label_kappa": cohen_kappa(key_h, key_a),
                "prefix_category_agreement": agreement(pre_h, pre_a),
                "prefix_category_kappa": cohen_kappa(pre_h, pre_a),
                "prefix_covered_agreement": agreement(cov_h, cov_a),
                "prefix_covered_kappa": cohen_kappa(cov_h, cov_a),
                "human_coverage": float(np.mean(cov_h)), "automatic_coverage": float(np.mean(cov_a))}


# ---- agreement ----------------------------------------------------------------------------------------
def agreement(a, b) -> float:
    return float(np.mean([x == y for x, y in zip(a, b)])) if a else float("nan")


def cohen_kappa(a, b) -> float:
    """Cohen's kappa of two label lists; nan when chance agreement is 1 (a single label)."""
    if not a:
        return float("nan")
    labels = sorted(set(a) | set(b), key=str)
    po = agreement(a, b)
    n = len(a)
    pe = sum((sum(x == l for x in a) / n) * (sum(y == l for y in b) / n) for l in labels)
    return float("nan") if pe >= 1 else float((po - pe) / (1 - pe))


def inter_annotator(recs: list[dict], cats: dict) -> dict:
    """Pairwise agreement between annotators on keys that several annotated."""
    by_key: dict = {}
    for r in recs:
        by_key.setdefault((r["layer"], r["dim"], r["sign"]), []).append(r)
    key_a, key_b, pre_a, pre_b, jac = [], [], [], [], []
    multi = 0
    for rs in by_key.values():
        if len(rs) < 2:
            continue
        multi += 1
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                x, y = rs[i], rs[j]
                key_a.append(key_label(x["patterns"]))
                key_b.append(key_label(y["patterns"]))
                cx, cy = cats[id(x)], cats[id(y)]
                pre_a += cx
                pre_b += cy
                sx = {k for k, c in enumerate(cx) if c != "not_covered"}
                sy = {k for k, c in enumerate(cy) if c != "not_covered"}
                jac.append(len(sx & sy) / len(sx | sy) if sx | sy else 1.0)
    if not multi:
        return {"keys": 0, "pairs": 0}
    return {"keys": multi, "pairs": len(key_a), "key_label_agreement": agreement(key_a, key_b),
            "key_label_kappa": cohen_kappa(key_a, key_b),
            "prefix_category_agreement": agreement(pre_a, pre_b),
            "prefix_category_kappa": cohen_kappa(pre_a, pre_b),
            "covered_jaccard": float(np.mean(jac))}
