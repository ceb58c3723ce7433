"""Annotations as the browser reads and writes them (`ffkv.store.annotations.AnnotationStore`,
i.e. `annotations.sqlite`, the browser's only write), and the one-line summaries that show them."""
from __future__ import annotations

import threading

import numpy as np

from ffkv.web.tables import ANNOTATE_TOP


class Notes:
    """The annotations of a `Browser` (`b`): its store, opened on first use."""

    def __init__(self, b):
        self.b = b
        self._store = None
        self._store_lock = threading.Lock()

    def store(self, create: bool = True):
        """The run's AnnotationStore (None when there is none yet and `create` is False)."""
        if self._store is None:
            if not create and not (self.b.path / "annotations.sqlite").exists():
                return None
            with self._store_lock:
                if self._store is None:
                    from ffkv.store.annotations import AnnotationStore

                    self._store = AnnotationStore(self.b.run)
        return self._store

    def annotations(self, layer=None, dim=None) -> list[dict]:
        st = self.store(create=False)
        if st is None:
            return []
        kw = {k: v for k, v in (("layer", layer), ("dim", dim)) if v is not None}
        return st.list(**kw)

    def annotate(self, annotator, layer, dim, patterns, sign=1, note="") -> dict:
        st = self.store()
        st.add_annotation(annotator, layer, dim, patterns, sign=sign, note=note)
        return next(r for r in st.list(layer=layer, dim=dim)
                    if r["annotator"] == annotator.strip() and r["sign"] == sign)

    def annotation_stats(self) -> dict | None:
        st = self.store(create=False)
        return st.stats() if st is not None else None

    def n_prefixes(self, layer: int, dim: int, sign: int) -> int:
        idx = self.b.trig.indices(layer, dim)
        return int(((self.b.trig_sign[idx] == sign) & (self.b.trig_rank[idx] <= ANNOTATE_TOP)).sum())

    def annotation_parts(self) -> dict[int, dict]:
        """Per memory code, the annotations part of its one-line summary (`ffkv.web.summary.annotation_part`)."""
        from ffkv.web.summary import annotation_part

        by: dict[int, list[dict]] = {}
        for a in self.annotations():
            by.setdefault(self.b.code(a["layer"], a["dim"]), []).append(a)
        return {c: p for c, recs in by.items() if (p := annotation_part(recs)) is not None}

    def summary(self, layer: int, dim: int) -> str:
        """A memory's one-line summary of measurements (`ffkv.web.summary.summary_line`)."""
        return self.b.summaries.line(self.b.code(layer, dim), self.annotation_parts().get(self.b.code(layer, dim)))

    def add_summaries(self, rows: list[dict]) -> list[dict]:
        """Set `summary` on rows that carry layer and dim (search results, layer lists), their
        first-position badge (`first_position`, `first_share`: `ffkv.web.measures.first_position`),
        and `expert` in a mixture of experts (`RunTables.expert_of`)."""
        from ffkv.web.measures import first_position, first_shares

        ann = self.annotation_parts() if rows else {}
        fp, fs = (first_position(self.b), first_shares(self.b)) if rows else (None, None)
        for r in rows:
            c = self.b.code(r["layer"], r["dim"])
            r["summary"] = self.b.summaries.line(c, ann.get(c))
            r["first_position"] = bool(fp[c])
            r["first_share"] = None if np.isnan(fs[c]) else float(fs[c])
            if self.b.moe is not None:
                r["expert"] = self.b.expert_of(r["dim"])
        return rows
