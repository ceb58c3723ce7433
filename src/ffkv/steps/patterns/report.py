"""The `patterns` step's report sections: Fig 2 (what kind of pattern a key's trigger prefixes share,
from the automatic labels, and from the run's human annotations when it has them) and Table 1
(example keys with their patterns and top prefixes). Read from `patterns_fig2`, `pattern_keys`,
`patterns` (`ffkv.steps.patterns.compute`) and `annotations.sqlite`."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ffkv.report.build import Builder, Section, prefix_html
from ffkv.report.html import esc, kv, table
from ffkv.report.stats import NA, Verdict
from ffkv.steps.patterns import figures as F
from ffkv.steps.patterns import verdicts as V
from ffkv.steps.patterns.paper import FIG2, FIG2_HUMAN, TABLE1

TABLE1_LAYERS = 4  # layers shown in Table 1, spread over the depth
TABLE1_KEYS = 2  # keys per layer
TABLE1_PREFIXES = 4  # trigger prefixes per key
TABLE1_PATTERNS = 4  # patterns shown per key


def sections(run, fig_dir) -> list:
    b = Builder.of(run, fig_dir)
    return [b.paper_section(FIG2, fig2), b.paper_section(FIG2_HUMAN, fig2_human), b.paper_section(TABLE1, table1)]


def differences(settings: dict) -> list[list[str]]:
    """Who labelled the patterns: the paper's experts, here `ffkv patterns`."""
    if not settings:
        return []
    return [["pattern labels", "human experts, 10 keys per layer",
             "automatic (ffkv patterns): shallow for every analysed key, semantic for "
             f"{settings.get('semantic_keys_per_layer', '?') or 'all'} per layer"
             + ("" if settings.get("semantic", True) else " (semantic off)"),
             "automatic labels are a proxy for the experts' reading"]]


def fig2(b: Builder) -> Section:
    (df,), miss = b.need("fig2", "patterns_fig2")
    ps = b.run.settings("patterns") or {}
    v = V.fig2(df, b.L, semantic_ran=ps.get("semantic", True))
    s = Section("fig2", v, missing=miss)
    if df is not None:
        s.figure = b.draw("fig2", F.fig2, df, title="Pattern kinds (automatic labels)")
        scope = "semantic_sample" if (df["scope"] == "semantic_sample").any() else "all"
        d = df[df["scope"] == scope].sort_values("layer")
        s.html = (f"<p>Scope <code>{esc(scope)}</code>: {int(d['keys'].sum()):,} keys, "
                  f"{int(d['prefixes'].sum()):,} prefixes; patterns per key "
                  f"{np.average(d['patterns_per_key'], weights=d['keys']):.2f} (paper 3.6); keys with "
                  f"≥1 pattern {np.average(d['keys_with_pattern'], weights=d['keys']):.0%} (paper: all).</p>")
    return s


def fig2_human(b: Builder) -> Section:
    path = b.run.path / "annotations.sqlite"
    if not path.exists():
        return Section("fig2_human", Verdict(NA, "needs human annotations", "no annotations.sqlite in the run"),
                       missing=f"No human annotations yet: draw the sample with `ffkv annotate sample "
                               f"{b.run.path}`, then record labels with `ffkv annotate add` (or import "
                               f"them with `ffkv annotate import`).")
    from ffkv.store.annotations import AnnotationStore

    st = AnnotationStore(b.run).stats()
    rows = pd.DataFrame(st.get("fig2") or [])
    v = V.fig2(rows, b.L, source="human")
    s = Section("fig2_human", v)
    if rows.empty:
        s.missing = f"annotations.sqlite has no annotations yet; add them with `ffkv annotate add {b.run.path} …`."
        return s
    s.figure = b.draw("fig2_human", F.fig2, rows, title="Pattern kinds (human labels)")
    pairs = [("annotations", st.get("annotations")), ("annotators", ", ".join(st.get("annotators") or [])),
             ("keys", st.get("keys")), ("patterns per key", st.get("patterns_per_key")),
             ("keys with ≥1 pattern", st.get("keys_with_pattern")),
             ("prefixes covered", st.get("prefixes_covered"))]
    avh = st.get("auto_vs_human") or {}
    for k in ("annotations", "key_label_agreement", "key_label_kappa", "prefix_category_agreement",
              "prefix_covered_kappa"):
        if k in avh:
            pairs.append((f"automatic vs human: {k.replace('_', ' ')}", avh[k]))
    s.html = kv(pairs)
    return s


def table1(b: Builder) -> Section:
    (pk, pt), miss = b.need("table1", "pattern_keys", "patterns")
    s = Section("table1", V.table1(pk), missing=miss)
    if miss or b.decoder is None or not b.run.has_table("triggers"):
        s.missing = s.missing or "Needs the `triggers` and `vocab` tables of `ffkv mine`."
        return s
    cand = pk[pk["n_patterns"] > 0].copy()
    if cand.empty:
        s.html = "<p>No analysed key has an automatic pattern.</p>"
        return s
    # Like the paper's examples: prefer keys with a semantic pattern, then keys for which both
    # analyses ran, then the best-covered ones.
    cand["_sem"] = cand["n_semantic"] > 0
    layers = sorted(cand["layer"].unique())
    picks = sorted({layers[int(round(i))] for i in np.linspace(0, len(layers) - 1, min(TABLE1_LAYERS, len(layers)))})
    keys = []
    for l in picks:
        c = cand[cand["layer"] == l].sort_values(["_sem", "semantic_done", "coverage", "n_patterns", "dim"],
                                                 ascending=[False, False, False, False, True])
        keys += c.head(TABLE1_KEYS)[["layer", "dim", "sign", "coverage", "label"]].to_dict("records")
    trig = b.run.read_table(
        "triggers", columns=["layer", "dim", "sign", "rank", "sentence_id", "position"],
        filters=[("layer", "in", sorted({int(k["layer"]) for k in keys})),
                 ("dim", "in", sorted({int(k["dim"]) for k in keys})),
                 ("rank", "<=", TABLE1_PREFIXES)]).to_pandas()
    sent = b.t.sentences(trig["sentence_id"])
    rows = []
    for k in keys:
        pats = pt[(pt["layer"] == k["layer"]) & (pt["dim"] == k["dim"]) & (pt["sign"] == k["sign"])]
        pats = pats.sort_values(["n_covered", "pattern_id"], ascending=[False, True])
        ptxt = "<br>".join(f"{esc(p.description)} <small>({esc(p.kind)}, {int(p.n_covered)} prefixes)</small>"
                           for p in pats.head(TABLE1_PATTERNS).itertuples())
        if len(pats) > TABLE1_PATTERNS:
            ptxt += f"<br><small>+{len(pats) - TABLE1_PATTERNS} more</small>"
        tr = trig[(trig["layer"] == k["layer"]) & (trig["dim"] == k["dim"]) & (trig["sign"] == k["sign"])]
        pre = []
        for r in tr.sort_values("rank").itertuples():
            ids = sent.get(int(r.sentence_id))
            if ids is not None:
                pre.append(prefix_html(*b.decoder.marked(ids, int(r.position))))
        key = f"layer {int(k['layer'])}, dim {int(k['dim'])}" + (" (−)" if k["sign"] < 0 else "")
        rows.append([key, f"{ptxt}<br><small>label: {esc(k['label'])}, coverage {k['coverage']:.0%}</small>",
                     "<br>".join(pre)])
    s.html = (f"<p>In {len(picks)} layers spread over the depth, {TABLE1_KEYS} keys each, picked as the paper's "
              f"examples were, for illustration: keys with a semantic pattern first, then keys for which both "
              f"analyses ran, then the best coverage of their top-25 prefixes by automatic patterns. Their top "
              f"{TABLE1_PREFIXES} trigger prefixes, with the trigger token <mark>marked</mark>.</p>" + table(["key", "patterns", "top trigger prefixes"], rows, raw={1, 2}))
    return s
