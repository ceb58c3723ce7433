"""What the browser's pages show, as plain data (the JSON API returns it as is): a memory, a
sentence (provenance), the run's overview by layer."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ffkv.store import query
from ffkv.web.measures import (EPS_HIST, FIRST_POSITION, dominant_sign, eps_shares, first_position, first_shares,
                               side_moments)
from ffkv.web.panels import step_columns
from ffkv.web.tables import MAX_TOP, MUTATIONS, PRECISION_K, NotFound, _f, position_buckets


class Pages:
    """The page data of a `Browser` (`b`)."""

    def __init__(self, b):
        self.b = b

    def memory(self, layer: int, dim: int, top: int = 25, all_samples: bool = True, hide_pos0: bool = False) -> dict:
        """Everything a memory page shows, as plain data (the JSON API returns it as is). With
        `hide_pos0` (`?pos0=hide`) its trigger rows and samples at position 0 are left out, and
        each list holds the `top` best of the rest."""
        self.b.check_key(layer, dim)
        top = max(1, min(int(top), MAX_TOP))
        mined = self.b.is_mined(layer, dim)
        values_rows = self.b.values.rows(layer, dim) if self.b.values is not None else []
        if not mined and not values_rows:
            raise NotFound(f"memory {layer}/{dim} has no triggers and no values in this run "
                           f"(mined: {len(self.b.keys):,} of {self.b.L * self.b.d_m:,} memories)")
        idx = self.b.trig.indices(layer, dim)
        trig = self.b.trig.table.take(pa.array(idx)).to_pylist()
        srows = self.b.trig_row[idx].tolist()
        muts: dict[tuple[int, int], dict] = {}
        if self.b.mutations is not None:
            for m in self.b.mutations.rows(layer, dim):
                muts.setdefault((m["sign"], m["rank"]), {})[m["mutation"]] = m["rel_change"]
        pats = self.b.patterns.rows(layer, dim) if self.b.patterns is not None else []
        covered: dict[tuple[int, int], list[int]] = {}
        for p in pats:
            for i in p["covered"] or []:
                covered.setdefault((p["sign"], i + 1), []).append(p["pattern_id"])
        ranks = {s: self.value_ranks(layer, dim, s) for s in (1, -1)}
        triggers: dict[str, list[dict]] = {"+": [], "-": []}
        n_pos0 = {"+": 0, "-": 0}  # stored trigger rows at position 0, per list
        for j in sorted(range(len(trig)), key=lambda j: (-trig[j]["sign"], trig[j]["rank"])):
            r, row = trig[j], srows[j]
            key = "+" if r["sign"] == 1 else "-"
            if r["position"] == 0:
                n_pos0[key] += 1
                if hide_pos0:
                    continue
            if len(triggers[key]) >= top:
                continue
            nt = r["next_token"]
            # the direction this trigger writes: +v when its coefficient is ≥ 0, else −v
            direction = 1 if (r["coef"] or 0) >= 0 else -1
            rk, bound, src = ranks[direction]
            badge = None
            if nt is not None and src is not None:
                badge = {"rank": rk.get(int(nt)), "bound": bound, "direction": direction, "source": src}
            triggers[key].append({
                **r, "prefix": self.b.prefix(row, r["position"]), "next_token_text": self.b.tok(nt),
                **self.b.doc_of(row), "badge": badge, "mutations": muts.get((r["sign"], r["rank"])),
                "patterns": covered.get((r["sign"], r["rank"]), []),
                "permalink": self.b.permalink(r["sentence_id"], r["position"])})
        views = self.vocab_views(layer, dim)
        vals = {}
        for v in values_rows:
            vals[v["kind"]] = {"max_prob": v["max_prob"], "entropy": v["entropy"],
                               "tokens": [{"token": int(t), "text": self.b.tok(t), "prob": float(p)}
                                          for t, p in zip(v["top_tokens"], v["top_probs"])]}
        agreement = self.b.agreement.rows(layer, dim) if self.b.agreement is not None else []
        agreement = agreement[0] if agreement else None
        if agreement is not None:
            agreement = {**agreement, "next_token_text": self.b.tok(agreement.get("next_token")),
                         "value_top_text": self.b.tok(agreement.get("value_top"))}
        pk = self.b.pattern_keys.rows(layer, dim) if self.b.pattern_keys is not None else []
        mut_summary = []
        if self.b.mutations is not None:
            mrows = self.b.mutations.rows(layer, dim)
            for kind in MUTATIONS:
                xs = np.array([m["rel_change"] for m in mrows if m["mutation"] == kind
                               and m["rel_change"] is not None and not math.isnan(m["rel_change"])])
                if len(xs):
                    mut_summary.append({"mutation": kind, "n": int(len(xs)), "mean": float(xs.mean()),
                                        "median": float(np.median(xs)), "share_lower": float((xs < 0).mean())})
        c = self.b.code(layer, dim)
        stats = self.key_statistics(layer, dim, all_samples)
        samples_pos0 = 0
        if hide_pos0 and stats:
            kept = [r for r in stats["samples"] if int(r["position"]) != 0]
            samples_pos0, stats["samples"] = len(stats["samples"]) - len(kept), kept
        share = first_shares(self.b)[c]
        prec = {"k": PRECISION_K, "value": _f(self.b._precision[0][c]), "neg_value": _f(self.b._precision[1][c])}
        return {
            "layer": layer, "dim": dim, "expert": self.b.expert_of(dim), "mined": mined, "lens": self.b.lens, "top": top,
            "model": self.b.model_id, "corpus_sha256": self.b.corpus_sha, "negative": self.b.negative,
            "dominant": dominant_sign(self.b, layer, dim),
            "first_position": {"first": bool(first_position(self.b)[c]),
                               "share": None if math.isnan(share) else float(share),
                               "threshold": FIRST_POSITION},
            "pos0": {"hidden": bool(hide_pos0), "triggers": n_pos0, "samples_hidden": samples_pos0},
            "triggers": triggers, "n_triggers": {"+": int(sum(1 for r in trig if r["sign"] == 1)),
                                                 "-": int(sum(1 for r in trig if r["sign"] == -1))},
            "values": vals, "vocab_views": views, "agreement": agreement,
            "precision": prec,
            "patterns": pats, "pattern_keys": pk, "mutations": mut_summary,
            "annotations": self.b.annotations(layer, dim),
            "stats": stats,
            "summary": self.b.summary(layer, dim),
            "similar": self.b.similar(layer, dim),
            "links": {**{k: {"layer": v[0], "dim": v[1]} for k, v in self.b.neighbours(layer, dim).items()}}
            if len(self.b.keys) else {},
        }

    def value_ranks(self, layer: int, dim: int, sign: int, lens: str | None = None):
        """token -> rank of a direction (+v: sign 1, −v: −1) and the bound below which ranks are
        known: from the token index when ready, else from the `values` table (top_k tokens)."""
        lens = lens or self.b.lens
        if self.b._index is not None and (lens, sign) in self.b._index.parts:
            got = self.b._index.of_memory(lens, sign, self.b.code(layer, dim))
            return {t: r for t, r, _ in got}, self.b._index.k, "index"
        if self.b.values is not None and lens == self.b.lens:
            kind = "value" if sign == 1 else "neg_value"
            for r in self.b.values.rows(layer, dim):
                if r["kind"] == kind:
                    out: dict[int, int] = {}
                    for j, t in enumerate(r["top_tokens"]):
                        out.setdefault(int(t), j)
                    return out, len(r["top_tokens"]), "values"
        return {}, 0, None

    def vocab_views(self, layer: int, dim: int, n: int = 10) -> dict:
        """Top tokens of +v and of −v (= the bottom of +v) under each lens the index has; without
        the index, the run's lens from the `values` table."""
        out = {"source": None, "k": None, "lenses": {}}
        idx = self.b._index
        if idx is not None:
            out["source"], out["k"] = idx.source, idx.k
            for ln in idx.lenses:
                out["lenses"][ln] = {
                    ("+v" if s == 1 else "-v"): [{"token": t, "text": self.b.tok(t), "rank": r, "prob": p}
                                                 for t, r, p in idx.of_memory(ln, s, self.b.code(layer, dim))[:n]]
                    for s in (1, -1)}
            return out
        if self.b.values is not None:
            out["source"], out["k"] = "values", self.b.values_top_k
            d = {}
            for v in self.b.values.rows(layer, dim):
                if v["kind"] in ("value", "neg_value"):
                    d["+v" if v["kind"] == "value" else "-v"] = [
                        {"token": int(t), "text": self.b.tok(t), "rank": j, "prob": float(p)}
                        for j, (t, p) in enumerate(zip(v["top_tokens"][:n], v["top_probs"][:n]))]
            if d:
                out["lenses"][self.b.lens] = d
        return out

    def key_statistics(self, layer: int, dim: int, all_samples: bool = True) -> dict | None:
        """The key-statistics tables of `ffkv mine` for one key (None when the run has none):
        summary rows per sign, the signed histogram, the positions of each sentence's best
        coefficient, and sample prefixes per histogram bin (strongest first)."""
        if self.b.key_stats is None and self.b.key_hist is None and self.b.key_samples is None:
            return None
        lay = self.b.hist_layout
        label = (lambda b: lay["labels"][b] if lay and 0 <= b < lay["n"] else f"bin {b}")  # noqa: E731
        out: dict = {"stats": [], "hist": None, "samples": [], "n_samples": 0}
        if self.b.key_stats is not None:
            for r in self.b.key_stats.rows(layer, dim):
                ph = r.pop("pos_hist", None)
                if ph is not None:
                    r["positions"] = [{"bucket": b, "count": int(c)} for b, c in zip(position_buckets(len(ph)), ph)]
                out["stats"].append(r)
        if self.b.key_hist is not None:
            rows = self.b.key_hist.rows(layer, dim)
            if rows:
                n = lay["n"] if lay else max(r["bin"] for r in rows) + 1
                counts = [0] * n
                for r in rows:
                    if 0 <= r["bin"] < n:
                        counts[r["bin"]] += int(r["count"])
                occ = [b for b, c in enumerate(counts) if c]
                zero = lay["sign"].index(0) if lay and 0 in lay["sign"] else None
                lo, hi = min(occ + ([zero] if zero is not None else [])), max(occ + ([zero] if zero is not None else []))
                out["hist"] = {"counts": counts, "labels": [label(b) for b in range(n)],
                               "sign": lay["sign"] if lay else None, "shown": [lo, hi], "total": sum(counts)}
                self._per_sign(out["stats"], counts)
        if self.b.key_samples is not None:
            rows = self.b.key_samples.rows(layer, dim)
            order = sorted(range(len(rows)), key=lambda j: (-(rows[j].get("sign") or 0),
                                                            -(rows[j].get("sign") or 1) * rows[j].get("bin", 0), j))
            out["n_samples"] = len(rows)
            seen = set()
            for j in order:
                r = rows[j]
                level = (r.get("sign"), r.get("bin"))
                if not all_samples and level in seen:
                    continue
                seen.add(level)
                try:
                    srow = self.b.sentence_row(int(r["sentence_id"]))
                except (NotFound, KeyError, TypeError):
                    continue
                out["samples"].append({**r, "level": label(int(r.get("bin", -1))),
                                       "prefix": self.b.prefix(srow, int(r["position"])),
                                       "permalink": self.b.permalink(r["sentence_id"], r["position"])})
        return out

    def _per_sign(self, stats: list[dict], counts: list[int]) -> None:
        """Each side's own mean and std (of m among its tokens, sign·m > 0) as side_mean, side_std
        and side_n on its row, estimated from the key's histogram (`ffkv.web.measures.side_moments`,
        the top bin capped at the row's exact max): `key_stats` holds mean and std over all tokens
        only (the same on both rows; kept as they are, exact)."""
        lay = self.b._lazy("_stats_layout", lambda: query.stats_layout(self.b.run) or {})
        if not lay.get("lo") or len(counts) != len(lay["lo"]):
            return
        top = {r["sign"]: abs(r["max"]) for r in stats if r.get("sign") in (1, -1) and r.get("max") is not None}
        mom = side_moments(counts, lay, top)
        for r in stats:
            if r.get("sign") in mom:
                m = mom[r["sign"]]
                r.update(side_mean=m["mean"], side_std=m["std"], side_n=m["n"], side_source="key_hist")

    def sentence(self, sid: int, pos: int | None = None, top: int = 200) -> dict:
        row = self.b.sentence_row(sid)
        toks = self.b.sentence_tokens(row)
        if pos is not None and not (0 <= pos < len(toks)):
            raise NotFound(f"sentence {sid} has {len(toks)} tokens; position {pos} does not exist")
        sel = np.nonzero(self.b.trig_row == row)[0]
        t = self.b.trig.table.take(pa.array(sel)).to_pylist() if len(sel) else []
        t.sort(key=lambda r: (r["position"] != pos, r["rank"], r["layer"], r["dim"]))
        return {"sentence_id": int(sid), **self.b.doc_of(row), "text": self.b._texts[row].as_py(),
                "tokens": [{"i": i, "token": int(x), "text": self.b.tok(x)} for i, x in enumerate(toks)],
                "position": pos, "corpus_source": self.b.corpus_source, "corpus_sha256": self.b.corpus_sha,
                "triggers": t[:top], "n_triggers": len(t)}

    def overview(self) -> dict:
        rows = [{"layer": l} for l in range(self.b.L)]
        mined = np.bincount(self.b.keys // self.b.d_m, minlength=self.b.L)
        for r in rows:
            r["mined"] = int(mined[r["layer"]])
        if self.b.values_layers is not None:
            for v in self.b.values_layers.to_pylist():
                if 0 <= v["layer"] < self.b.L:
                    rows[v["layer"]]["agreement"] = {k: v.get(k) for k in (
                        "agreement", "ci_low", "ci_high", "shuffled", "n", "n_agree", "rank_median")}
        if self.b.compose_layers is not None:
            for v in self.b.compose_layers.to_pylist():
                if v.get("lens", self.b.lens) == self.b.lens and 0 <= v["layer"] < self.b.L:
                    rows[v["layer"]]["active"] = {"mean": v.get("active_mean"), "eps": v.get("active_eps_mean"),
                                                  "eps_share": v.get("active_eps_mean"), "eps_value": v.get("eps"),
                                                  "eps_source": "compose"}
        elif self.b.key_stats is not None and ({"frac_active", "frac_pos"} & set(self.b.key_stats.table.column_names)):
            # the density of m > 0 per key (key_stats of `ffkv mine`), averaged over the layer's keys
            ks = self.b.key_stats.table
            col = "frac_active" if "frac_active" in ks.column_names else "frac_pos"
            if "sign" in ks.column_names:
                ks = ks.filter(pc.equal(ks.column("sign"), 1))
            lay = ks.column("layer").to_numpy()
            fp = ks.column(col).to_numpy(zero_copy_only=False).astype(np.float64)
            for l in range(self.b.L):
                x = fp[lay == l]
                if len(x):
                    rows[l]["active"] = {"mean": float(np.nanmean(x)), "eps": None, "source": "key_stats"}
            # the headline: share of tokens with |m| ≥ ε per key, from key_hist, averaged over the layer's keys
            es = eps_shares(self.b).reshape(self.b.L, self.b.d_m)
            for l in range(self.b.L):
                x = es[l][~np.isnan(es[l])]
                if len(x) and "active" in rows[l]:
                    rows[l]["active"].update(eps_share=float(x.mean()), eps_value=EPS_HIST, eps_source="key_hist")
        if self.b.patterns_fig2 is not None:
            f2 = self.b.patterns_fig2.to_pylist()
            scopes = {r["scope"] for r in f2}
            scope = "all" if "all" in scopes else (sorted(scopes)[0] if scopes else None)
            for v in f2:
                if v["scope"] == scope and 0 <= v["layer"] < self.b.L:
                    rows[v["layer"]]["patterns"] = {k: v.get(k) for k in (
                        "shallow", "semantic", "both", "not_covered", "keys", "patterns_per_key", "keys_with_pattern")}
                    rows[v["layer"]]["patterns"]["scope"] = scope
        cols = step_columns(self.b.run, self.b.L)
        for c in cols:
            for r, v in zip(rows, c.pop("cells")):
                r.setdefault("steps", {}).setdefault(c["step"], {})[c["title"]] = v
        ann = self.b.annotations()
        per = {}
        for a in ann:
            per.setdefault(a["layer"], set()).add((a["dim"], a["sign"]))
        for r in rows:
            r["annotated"] = len(per.get(r["layer"], ()))
        steps = {k: v.get("status") for k, v in (self.b.run.manifest.get("steps") or {}).items()}
        return {"run": self.b.name, "model": self.b.model_id, "layers": self.b.L, "d_m": self.b.d_m, "vocab": self.b.V,
                "lens": self.b.lens, "mined": int(len(self.b.keys)), "triggers": int(self.b.trig.table.num_rows),
                "negative": self.b.negative, "corpus_source": self.b.corpus_source, "corpus_sha256": self.b.corpus_sha,
                "sentences": int(len(self.b.sent_ids)), "steps": steps, "annotations": len(ann),
                "has_report": self.b.has_report, "index": self.b.index_status(), "rows": rows,
                "load_seconds": self.b.load_seconds, **({"step_columns": cols} if cols else {})}
