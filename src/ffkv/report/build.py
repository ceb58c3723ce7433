"""`build_report(run)`: one self-contained HTML file (plus PNG/SVG figures) from a run's tables.

Inputs are the public tables of the steps (see each step module's docstring): `patterns_fig2`,
`pattern_keys`, `patterns`, `mutations_layers`, `values_layers`, `values_rank_hist`, `values_fig6`,
`values_table2`, `compose_layers`, `compose_cases`, `triggers`, `sentences`, `vocab`, the
manifest, and `annotations.sqlite` when it exists. A missing table leaves its section with a
"not comparable" verdict and the command that creates it. Nothing is read from outside the run,
nothing is fetched: the paper's results are embedded (`ffkv.report.paper`).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ffkv import __version__
from ffkv.defs import lens_name
from ffkv.display import show_token
from ffkv.errors import FfkvError
from ffkv.report import figures as F
from ffkv.report import verdicts as V
from ffkv.report.html import chip, code, esc, img, kv, table, template, tok, verdict_line
from ffkv.report.paper import ORDER, PAPER, PAPER_MODEL
from ffkv.store import decode, query
from ffkv.store.run import Run, atomic_write_bytes

TABLE1_LAYERS = 4  # layers shown in Table 1, spread over the depth
TABLE1_KEYS = 2  # keys per layer
TABLE1_PREFIXES = 4  # trigger prefixes per key
TABLE1_PATTERNS = 4  # patterns shown per key
TABLE2_ROWS = 20
CASES_ROWS = 20
PREFIX_CHARS = 110  # characters of a prefix shown before its last token


@dataclass
class Section:
    id: str
    verdict: V.Verdict
    figure: dict | None = None  # {"png": Path, "svg": Path}
    html: str = ""  # tables and extra text
    notes: list[str] = field(default_factory=list)
    missing: str | None = None
    error: str | None = None
    extra: str = ""  # appended to the measured text (e.g. the other lens)
    lenses: dict[str, str] = field(default_factory=dict)  # lens -> verdict, when read under several


# ---- token decoding: `ffkv.store.decode` (one decoder for the report, `ffkv show` and the web) ----------
Decoder = decode.Decoder  # kept importable from here


def prefix_html(head: str, last: str, chars: int = PREFIX_CHARS) -> str:
    if len(head) > chars:
        head = "…" + head[-chars:]
    return f'<span class="prefix">{esc(head)}<mark>{esc(show_token(last, inline=True))}</mark></span>'


# ---- the run --------------------------------------------------------------------------------------------
class RunTables:
    def __init__(self, run: Run):
        self.run = run
        self._cache: dict[str, pd.DataFrame | None] = {}

    def get(self, name: str, columns=None) -> pd.DataFrame | None:
        key = name if columns is None else f"{name}:{','.join(columns)}"
        if key not in self._cache:
            self._cache[key] = (self.run.read_table(name, columns=columns).to_pandas()
                                if self.run.has_table(name) else None)
        return self._cache[key]

    def sentences(self, ids) -> dict[int, list[int]]:
        ids = [int(i) for i in ids if i is not None and not pd.isna(i)]
        if not ids or not self.run.has_table("sentences"):
            return {}
        t = query.sentences(self.run, ids, columns=["sentence_id", "token_ids"])
        return dict(zip(t.column("sentence_id").to_pylist(), t.column("token_ids").to_pylist()))


# ---- how this model differs from the paper's ---------------------------------------------------------------
def paper_layer_here(k: int, n_layers: int) -> int:
    """The 0-based layer of an `n_layers` model at the relative depth of the paper's layer k (1-based of 16)."""
    return int(min(n_layers - 1, max(0, round((k - 0.5) / 16 * n_layers - 0.5))))


def quantization(model: dict) -> str | None:
    ident = f"{model.get('model_id', '')} {model.get('path', '')}"
    if model.get("source") == "gguf" or "gguf" in ident.lower():
        m = re.search(r"\b(I?Q\d[A-Z0-9_]*|F16|BF16|F32)\b", ident, re.I)
        return f"{m.group(1).upper() if m else 'quantized'} GGUF"
    m = re.search(r"(gptq|awq|int8|int4|4bit|8bit|bnb)", ident, re.I)
    return m.group(1) if m else None


def model_differences(manifest: dict) -> tuple[list[list[str]], dict[str, list[str]]]:
    """Rows (property, paper, this run, where it matters) and notes per section id."""
    m = manifest.get("model") or {}
    notes: dict[str, list[str]] = {k: [] for k in PAPER}
    rows = [["model", PAPER_MODEL["name"], f"{m.get('model_id', '?')}", ""],
            ["architecture", PAPER_MODEL["architecture"], f"{m.get('architecture', '?')} ({m.get('class', '?')})", ""]]
    rows += _depth_rows(int(m.get("layers") or 0), notes)
    rows.append(["d / d_m", f"{PAPER_MODEL['d']} / {PAPER_MODEL['d_m']}", f"{m.get('d', '?')} / {m.get('d_m', '?')}",
                 "fewer memories per layer: counts in Fig 7 are shares of d_m"])
    rows.append(["memories", f"{PAPER_MODEL['memories']:,}", f"{m.get('memories', 0):,}", ""])
    rows.append(_ffn_row(m, notes))
    rows += _weights_and_vocabulary_rows(m, notes)
    rows.append(_corpus_row(manifest))
    rows.append(_lens_row(manifest.get("lens") or "norm", notes))
    rows += _settings_rows(manifest.get("settings") or {})
    return rows, notes


def _depth_rows(L: int, notes: dict) -> list[list[str]]:
    """The layer count, and how the paper's layers map onto this model's."""
    if not L:
        return []
    where = ""
    if L != 16:
        marks = ", ".join(f"{k}→{paper_layer_here(k, L)}" for k in (1, 5, 9, 10, 11, 16))
        where = (f"Layer-wise figures are read by relative depth (ℓ+½)/L. The paper's layer k (1-based) "
                 f"corresponds to this model's layer (0-based): {marks}.")
        depth_note = (f"This model has {L} layers (the paper's has 16): compare by relative depth; the "
                      f"paper's layer 10 ≈ layer {paper_layer_here(10, L)} here, its layer 11 ≈ layer "
                      f"{paper_layer_here(11, L)} (0-based).")
        for s in ("fig2", "fig2_human", "fig3", "fig4", "fig5", "fig7", "fig9", "table2"):
            notes[s].append(depth_note)
    return [["layers", "16", str(L), where]]


def _ffn_row(m: dict, notes: dict) -> list[str]:
    """The FFN's form (gated or not, activation) and what it changes in the figures."""
    act = str(m.get("activation") or "?")
    ffn_paper = "ReLU, m = ReLU(x·k) ≥ 0"
    if m.get("gated"):
        ffn_run = f"gated {act}: m = {act}(x·g)·(x·u), signed"
        why = ("A negative coefficient writes −v: directions are compared as sign·v (Figs 4–6, Table 2, Fig 8's "
               "signed form); m > 0 holds for about half the memories by symmetry, so Fig 7 is judged by n90, "
               "the fewest memories carrying 90% of Σ|m|·‖v‖.")
        notes["fig7"].append("Gated FFN: m = f(x·g)·(x·u) is signed through x·u, whose sign is symmetric, so "
                             "about 50% of memories have m > 0 for any input, which is not the paper's 'key fired' "
                             "count; the verdict uses the scale-free n90 instead.")
        notes["fig8"].append("Gated FFN: the verdict uses the signed form (a memory with m < 0 writes −v, "
                             "so its prediction is top(−v)); the paper's form (m > 0 only) is also drawn.")
        for s in ("fig4", "fig5", "fig6", "table2"):
            notes[s].append("Gated FFN: each value is read in the direction its key's top trigger writes "
                            "it (sign of the coefficient × v).")
        notes["fig3"].append("Gated FFN: coefficients are signed; the relative change is measured in the "
                             "trigger's own direction (−0.5 = lost half of it; below −1 = changed sign).")
    elif act.lower() not in V.RELU_LIKE:
        ffn_run = f"{act}, not gated"
        why = "m > 0 is not the same as 'the key fired' for this activation (Fig 7)."
        notes["fig7"].append(f"Activation {act}: coefficients are rarely exactly zero.")
    else:
        ffn_run = f"{act}, not gated"
        why = ("GELU is slightly negative for negative inputs; m > 0 still means a positive pre-activation."
               if "gelu" in act.lower() else "")
    return ["FFN", ffn_paper, ffn_run, why]


def _weights_and_vocabulary_rows(m: dict, notes: dict) -> list[list[str]]:
    q = quantization(m)
    rows = [["weights", PAPER_MODEL["weights"],
             (f"stored as {q}, dequantized to {m.get('dtype', 'float32')}" if q else str(m.get("dtype", "?"))),
             "quantization shifts coefficients and logits slightly; trends should not depend on it" if q else ""],
            ["vocabulary", PAPER_MODEL["vocabulary"],
             f"{m.get('vocab_size', 0):,} subword tokens ({m.get('tokenizer', '?')})",
             "the next token is often a word piece, which lowers agreement (Fig 4) and makes last-token "
             "patterns sub-word (Table 1, Fig 2)"]]
    for s in ("fig4", "table2", "table1"):
        notes[s].append("Subword vocabulary: the trigger's next token is often a piece of a word, not a word "
                        "as in the paper's word-level model.")
    return rows


def _corpus_row(manifest: dict) -> list[str]:
    corpus = (manifest.get("corpus") or {})
    counts = manifest.get("counts") or corpus.get("counts") or {}
    return ["trigger corpus", "WikiText-103 training set (the model's own training data)",
            f"{corpus.get('source', '?')}: {counts.get('sentences', '?'):,} sentences"
            if isinstance(counts.get("sentences"), int) else str(corpus.get("source", "?")),
            "a smaller corpus than the model's training data gives fewer, noisier trigger examples "
            "(Figs 2–6)"]


def _lens_row(lens: str, notes: dict) -> list[str]:
    if lens != "naive":
        for s in ("fig4", "fig5", "fig6", "fig8", "fig9", "fig10", "fig11"):
            notes[s].append(f"Projected with the {lens} lens; the paper used the naive projection h·E.")
    return ["lens", PAPER_MODEL["lens"], lens,
            "norm: through the model's final norm (at the last layer it gives the model's own logits); "
            "the compose figures draw both lenses, the verdicts use the run's" if lens != "naive" else ""]


def _settings_rows(settings: dict) -> list[list[str]]:
    """Where the run's sample sizes differ from the paper's (compose, mutate, patterns)."""
    rows = []
    cs = settings.get("compose") or {}
    if cs.get("prefixes"):
        rows.append(["compose prefixes", "4,000", f"{cs['prefixes']:,}",
                     "fewer prefixes: wider sampling error in Figs 7–11"])
    ms = settings.get("mutate") or {}
    if "keys_per_layer" in ms:
        rows.append(["mutated keys per layer", "100", str(ms["keys_per_layer"] or "all"), ""])
    ps = settings.get("patterns") or {}
    if ps:
        rows.append(["pattern labels", "human experts, 10 keys per layer",
                     "automatic (ffkv patterns): shallow for every analysed key, semantic for "
                     f"{ps.get('semantic_keys_per_layer', '?') or 'all'} per layer"
                     + ("" if ps.get("semantic", True) else " (semantic off)"),
                     "automatic labels are a proxy for the experts' reading"])
    return rows


# ---- sections --------------------------------------------------------------------------------------------
class Builder:
    def __init__(self, run: Run, fig_dir: Path, log=None):
        self.run = run
        self.t = RunTables(run)
        self.fig_dir = fig_dir
        self.log = log or (lambda *_: None)
        self.m = run.manifest.get("model") or {}
        self.L = int(self.m.get("layers") or 0) or None
        self.lens = run.manifest.get("lens") or "norm"
        self.problems: list[str] = []
        self._decoder: Decoder | None = None

    @property
    def decoder(self) -> Decoder | None:
        if self._decoder is None and self.run.has_table("vocab"):
            self._decoder = Decoder.of_frame(self.t.get("vocab"))
        return self._decoder

    def cmd(self, step: str) -> str:
        if step == "annotate":
            return f"ffkv annotate sample {self.run.path}` and `ffkv annotate add {self.run.path} …"
        return f"ffkv {step} {self.run.path}"

    def need(self, sid: str, *names: str) -> tuple[list[pd.DataFrame], str | None]:
        dfs = [self.t.get(n) for n in names]
        absent = [n for n, d in zip(names, dfs) if d is None]
        if absent:
            step = PAPER[sid]["step"]
            return dfs, (f"This section needs the {', '.join(f'`{a}`' for a in absent)} table"
                         f"{'s' if len(absent) > 1 else ''}; create {'them' if len(absent) > 1 else 'it'} "
                         f"with `{self.cmd(step)}`.")
        return dfs, None

    def draw(self, name: str, fn, *args, **kw) -> dict | None:
        fig = fn(*args, **kw)
        return F.save(fig, self.fig_dir, name)

    def read_lenses(self, s: Section, fn, df, *args, main: str | None = None, detail: bool = False, **kw) -> Section:
        """Judge `df` under every lens it holds besides `main` (the run's): each lens's verdict goes to
        `s.lenses` (verdicts.json) and to the measured line, with its numbers when `detail`. The paper
        projected with the naive lens, which is named as such."""
        lenses = list(dict.fromkeys(df["lens"])) if df is not None and "lens" in df.columns else []
        main = main or self.lens
        if len(lenses) < 2:
            return s
        s.lenses[main] = s.verdict.verdict
        for ln in lenses:
            if ln == main:
                continue
            v = fn(df, *args, lens=ln, **kw)
            s.lenses[ln] = v.verdict
            tag = lens_name(ln)
            said = f"{v.verdict} — {v.measured}" if detail else ("same verdict" if v.verdict == s.verdict.verdict
                                                                  else v.verdict)
            s.extra += f" ({tag}: {said})"
        return s

    # each returns a Section -----------------------------------------------------------------------------
    def fig2(self) -> Section:
        (df,), miss = self.need("fig2", "patterns_fig2")
        ps = self.run.settings("patterns") or {}
        v = V.fig2(df, self.L, semantic_ran=ps.get("semantic", True))
        s = Section("fig2", v, missing=miss)
        if df is not None:
            s.figure = self.draw("fig2", F.fig2, df, title="Pattern kinds (automatic labels)")
            scope = "semantic_sample" if (df["scope"] == "semantic_sample").any() else "all"
            d = df[df["scope"] == scope].sort_values("layer")
            s.html = (f"<p>Scope <code>{esc(scope)}</code>: {int(d['keys'].sum()):,} keys, "
                      f"{int(d['prefixes'].sum()):,} prefixes; patterns per key "
                      f"{np.average(d['patterns_per_key'], weights=d['keys']):.2f} (paper 3.6); keys with "
                      f"≥1 pattern {np.average(d['keys_with_pattern'], weights=d['keys']):.0%} (paper: all).</p>")
        return s

    def fig2_human(self) -> Section:
        path = self.run.path / "annotations.sqlite"
        if not path.exists():
            return Section("fig2_human", V.Verdict(V.NA, "needs human annotations", "no annotations.sqlite in the run"),
                           missing=f"No human annotations yet: draw the sample with `ffkv annotate sample "
                                   f"{self.run.path}`, then record labels with `ffkv annotate add` (or import "
                                   f"them with `ffkv annotate import`).")
        from ffkv.store.annotations import AnnotationStore

        st = AnnotationStore(self.run).stats()
        rows = pd.DataFrame(st.get("fig2") or [])
        v = V.fig2(rows, self.L, source="human")
        s = Section("fig2_human", v)
        if rows.empty:
            s.missing = f"annotations.sqlite has no annotations yet; add them with `ffkv annotate add {self.run.path} …`."
            return s
        s.figure = self.draw("fig2_human", F.fig2, rows, title="Pattern kinds (human labels)")
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

    def table1(self) -> Section:
        (pk, pt), miss = self.need("table1", "pattern_keys", "patterns")
        s = Section("table1", V.table1(pk), missing=miss)
        if miss or self.decoder is None or not self.run.has_table("triggers"):
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
        trig = self.run.read_table(
            "triggers", columns=["layer", "dim", "sign", "rank", "sentence_id", "position"],
            filters=[("layer", "in", sorted({int(k["layer"]) for k in keys})),
                     ("dim", "in", sorted({int(k["dim"]) for k in keys})),
                     ("rank", "<=", TABLE1_PREFIXES)]).to_pandas()
        sent = self.t.sentences(trig["sentence_id"])
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
                    pre.append(prefix_html(*self.decoder.marked(ids, int(r.position))))
            key = f"layer {int(k['layer'])}, dim {int(k['dim'])}" + (" (−)" if k["sign"] < 0 else "")
            rows.append([key, f"{ptxt}<br><small>label: {esc(k['label'])}, coverage {k['coverage']:.0%}</small>",
                         "<br>".join(pre)])
        s.html = (f"<p>In {len(picks)} layers spread over the depth, {TABLE1_KEYS} keys each, picked as the paper's "
                  f"examples were, for illustration: keys with a semantic pattern first, then keys for which both "
                  f"analyses ran, then the best coverage of their top-25 prefixes by automatic patterns. Their top "
                  f"{TABLE1_PREFIXES} trigger prefixes, with the trigger token <mark>marked</mark>.</p>" + table(["key", "patterns", "top trigger prefixes"], rows, raw={1, 2}))
        return s

    def _plain(self, sid: str, name: str, verdict, *vargs) -> Section:
        """A section that is one table's verdict and figure `F.<sid>`."""
        (df,), miss = self.need(sid, name)
        s = Section(sid, verdict(df, *vargs), missing=miss)
        if df is not None:
            s.figure = self.draw(sid, getattr(F, sid), df)
        return s

    def fig3(self) -> Section:
        return self._plain("fig3", "mutations_layers", V.fig3, self.L)

    def _values_lenses(self, s: Section, name: str, fn, *args) -> pd.DataFrame | None:
        """Read a values section under each lens (`values_lenses`, `values_fig6_lenses`,
        `values_table2_lenses`, from issue 14 on); returns that table, or None for older runs."""
        df = self.t.get(name)
        if df is None or "lens" not in df.columns:
            return None
        main = self.values_lens
        self.read_lenses(s, fn, df, *args, main=main, detail=True)
        s.notes.append(f"Verdict under the {main} lens; the paper projected with the naive lens v·E, whose "
                       "verdict and numbers follow the measured line.")
        return df

    @property
    def values_lens(self) -> str:
        return (self.run.settings("values") or {}).get("lens") or self.lens

    def _values_figure(self, sid: str, name: str, lens_name: str, fn, *args) -> Section:
        """Figs 4-6: the run's lens's verdict, every lens's verdict, and one figure drawn with every lens."""
        (df,), miss = self.need(sid, name)
        s = Section(sid, fn(df, *args), missing=miss)
        both = self._values_lenses(s, lens_name, fn, *args)
        if df is not None:
            s.figure = self.draw(sid, getattr(F, sid), df if both is None else both, primary=self.values_lens)
        return s

    def fig4(self) -> Section:
        return self._values_figure("fig4", "values_layers", "values_lenses", V.fig4, self.L)

    def fig5(self) -> Section:
        return self._values_figure("fig5", "values_layers", "values_lenses", V.fig5, self.L)

    def fig6(self) -> Section:
        return self._values_figure("fig6", "values_fig6", "values_fig6_lenses", V.fig6)

    def table2(self) -> Section:
        (df,), miss = self.need("table2", "values_table2")
        L2 = self.L or (int(df["layer"].max()) + 1 if df is not None and len(df) else 1)
        s = Section("table2", V.table2(df, L2), missing=miss)
        self._values_lenses(s, "values_table2_lenses", V.table2, L2)
        if df is None or df.empty:
            return s
        d = df.sort_values("position").head(TABLE2_ROWS)
        sent = self.t.sentences(d["example_sentence_id"])
        rows = []
        for r in d.itertuples():
            ex = ""
            ids = sent.get(int(r.example_sentence_id)) if not pd.isna(r.example_sentence_id) else None
            if ids is not None and self.decoder is not None:
                ex = prefix_html(*self.decoder.marked(ids, int(r.example_position)), chars=80)
            elif isinstance(r.example_text, str):
                ex = esc(r.example_text)
            rows.append([int(r.position), int(r.layer), int(r.dim), r.kind, float(r.max_prob), tok(r.top_token_text),
                         f"{int(r.n_agree)}/{int(r.n_examples)}", ex])
        s.html = (f"<p>The {len(d)} values with the highest max probability (of {len(df)} in "
                  f"<code>values_table2</code>), the share of their key's top triggers whose next token is the "
                  f"value's top token, and the best-ranked agreeing trigger.</p>"
                  + table(["#", "layer", "dim", "kind", "max p", "top token", "agreeing triggers", "example"],
                          rows, num={0, 1, 2, 4}, raw={5, 7}))
        return s

    def _compose(self, sid: str, vfn, ffn, *vargs, with_L=True, **vkw) -> Section:
        (df,), miss = self.need(sid, "compose_layers")
        args = (self.L,) if with_L else ()
        v = vfn(df, *vargs, *args, lens=self.lens, **vkw)
        s = Section(sid, v, missing=miss)
        if df is not None:
            self.read_lenses(s, vfn, df, *vargs, *args, **vkw)
            s.figure = self.draw(sid, ffn, df, primary=self.lens)
        return s

    def fig7(self) -> Section:
        (df,), miss = self.need("fig7", "compose_layers")
        v = V.fig7(df, self.m.get("activation"), bool(self.m.get("gated")), self.L, lens=self.lens)
        s = Section("fig7", v, missing=miss)
        if df is not None:
            s.figure = self.draw("fig7", F.fig7, df, primary=self.lens)
        return s

    def fig8(self) -> Section:
        return self._compose("fig8", V.fig8, F.fig8, with_L=False, gated=bool(self.m.get("gated")))

    def fig9(self) -> Section:
        return self._compose("fig9", V.fig9, F.fig9)

    def fig10(self) -> Section:
        return self._compose("fig10", V.fig10, F.fig10)

    def fig11(self) -> Section:
        return self._compose("fig11", V.fig11, F.fig11, with_L=False)

    def cases(self) -> Section:
        (df,), miss = self.need("cases", "compose_cases")
        s = Section("cases", V.cases(df, self.lens), missing=miss)
        if df is None or df.empty:
            return s
        d, lens = V._lens(df, self.lens)
        d = d.sort_values("sample_order").head(CASES_ROWS)
        rows = [[int(r.sample_order), esc("…" + r.prefix[-PREFIX_CHARS:] if len(r.prefix) > PREFIX_CHARS else r.prefix),
                 tok(r.top_r_token), tok(r.top_o_token), tok(r.top_y_token), r.category, tok(r.target_token),
                 float(r.p_final_in_r)] for r in d.itertuples()]
        s.html = (f"<p>The first {len(d)} last-layer cases in the table's seeded random order ({lens} lens): "
                  f"the residual's top token top(r), the layer output's top(o) (the model's prediction), the FFN's "
                  f"own top(y), and the true next token.</p>"
                  + table(["#", "prefix", "top(r)", "top(o)", "top(y)", "category", "target", "p(final | r)"],
                          rows, num={0, 7}, raw={1, 2, 3, 4, 6}))
        return s

    def beyond_the_paper(self) -> tuple[list[tuple[str, str, str]], list[dict]]:
        """Sections beyond the paper's figures: key activation profiles (`ffkv mine`'s key
        statistics; absent in runs mined before them) and normalized memories (`ffkv normalize`,
        only when the step ran). Returns ((id, title, html) sections, verdicts.json records)."""
        import importlib

        extra, records = [], []
        for sid, build, mod in (("keystats", self._keystats, "ffkv.report.keystats"),
                                ("normalize", self._normalize, "ffkv.report.normalize")):
            try:
                module = importlib.import_module(mod)
            except ImportError:  # an installation without that section's module: no section
                continue
            try:
                got = build(module)
            except Exception as e:  # noqa: BLE001 - a malformed table must not sink the whole report
                msg = f"{sid}: {type(e).__name__}: {e}"
                self.problems.append(msg)
                self.log(f"report: warning: {msg}")
                got = (sid, sid, f'<section id="{sid}"><h2>{esc(sid)}</h2><p class="error">{esc(msg)}</p></section>'), []
            if got is not None:
                extra.append(got[0])
                records += got[1]
        for got in self._step_sections():
            extra.append(got[0])
            records += got[1]
        return extra, records

    def _step_sections(self):
        """The sections of registered steps beyond the built-in ones (`Step.sections`), for the
        steps this run has done; one that fails is shown as its error, like any other section."""
        from ffkv.steps.registry import extensions

        for step in extensions():
            if step.sections is None or not self.run.step_done(step.name):
                continue
            try:
                secs = step.sections(self.run, self.fig_dir)
            except Exception as e:  # noqa: BLE001 - a plugin's bug must not sink the report
                msg = f"{step.name}: {type(e).__name__}: {e}"
                self.problems.append(msg)
                self.log(f"report: warning: {msg}")
                yield ((step.name, step.name, f'<section id="{esc(step.name)}"><h2>{esc(step.name)}</h2>'
                        f'<p class="error">{esc(msg)}</p></section>'), [])
                continue
            for sec in secs:
                html = (f'<section id="{esc(sec.id)}" class="figure-section beyond" data-section="{esc(sec.id)}">'
                        f"<h2>{esc(sec.title)}</h2>{sec.html}</section>")
                yield (sec.id, sec.title, html), [dict(v) for v in sec.verdicts]

    def _keystats(self, keystats):
        sec = keystats.section(self.run, self.fig_dir)
        if sec is None:
            return None
        figs = "".join(f'<figure>{img(f["png"], alt_text(sec["title"], f))}<figcaption class="files">Files: '
                       f'<a href="figures/{f["png"].name}">{esc(f["png"].name)}</a>, '
                       f'<a href="figures/{f["svg"].name}">{esc(f["svg"].name)}</a></figcaption></figure>'
                       for f in sec["figures"])
        html = (f'<section id="keystats" class="figure-section beyond" data-section="keystats"><h2>{esc(sec["title"])}</h2>'
                f"{figs}{sec['html']}</section>")
        return ("keystats", "Key activations", html), []

    def _normalize(self, N):
        if not self.run.step_done("normalize"):
            return None
        its = N.items(lambda name: self.t.get(name), self.fig_dir, gated=bool(self.m.get("gated")),
                      run_path=str(self.run.path))
        return ("normalize", "Normalized memories", N.section_html(its, "figures")), N.verdict_records(its)

    def sections(self) -> list[Section]:
        out = []
        for sid in ORDER:
            try:
                out.append(getattr(self, sid)())
            except FfkvError:
                raise
            except Exception as e:  # a malformed table must not sink the whole report
                msg = f"{sid}: {type(e).__name__}: {e}"
                self.problems.append(msg)
                self.log(f"report: warning: {msg}")
                out.append(Section(sid, V.Verdict(V.NA, "the section could not be built", str(e)), error=msg))
        return out


# ---- page -------------------------------------------------------------------------------------------------
def alt_text(title: str, figure: dict) -> str:
    """A figure's alt text: its title, then what it shows (`figures.describe`, saved with it)."""
    what = figure.get("alt") or ""
    return f"{title}. {what}" if what else title


def section_html(s: Section, notes: list[str], fig_rel: str) -> str:
    p = PAPER[s.id]
    parts = [f'<section id="{s.id}" class="figure-section" data-section="{s.id}">', f"<h2>{esc(p['title'])}</h2>"]
    paper = (f'<aside class="paper"><h3>The paper</h3><p>{esc(p["result"])}</p>'
             f'<p class="setup"><b>Measured:</b> {esc(p["measure"])}.<br><b>Setup:</b> {esc(p["setup"])}.</p></aside>')
    if s.figure:
        fig = (f'<figure>{img(s.figure["png"], alt_text(p["title"], s.figure))}<figcaption class="files">Files: '
               f'<a href="{fig_rel}/{s.figure["png"].name}">{esc(s.figure["png"].name)}</a>, '
               f'<a href="{fig_rel}/{s.figure["svg"].name}">{esc(s.figure["svg"].name)}</a></figcaption></figure>')
    elif s.missing or s.error:
        fig = (f'<div class="missing"><p>{code(s.missing or "")}</p>'
               f'{f"<p class=error>{esc(s.error)}</p>" if s.error else ""}</div>')
    else:
        fig = '<div class="tables">' + s.html + "</div>"
        s = Section(s.id, s.verdict, s.figure, "", s.notes, s.missing, s.error, s.extra, s.lenses)
    parts.append(f'<div class="cols">{fig}{paper}</div>')
    parts.append(verdict_line(s.verdict, s.extra))
    if notes:
        parts.append('<div class="notes"><b>Reading this with this model:</b><ul>'
                     + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul></div>")
    if s.html and (s.figure or s.missing or s.error):
        parts.append(s.html)
    parts.append("</section>")
    return "\n".join(parts)


def _when(t) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))
    except (TypeError, ValueError):
        return ""


def _settings_text(d: dict | None) -> str:
    if not d:
        return ""
    return ", ".join(f"{k}={v}" for k, v in d.items() if not k.endswith("sha256") and k != "mine_finished")


def manifest_html(run: Run) -> str:
    man = run.manifest
    m = man.get("model") or {}
    corpus = man.get("corpus") or {}
    counts = man.get("counts") or {}
    mine = man.get("steps", {}).get("mine", {})
    pairs = [("run", str(run.path)), ("ffkv version", man.get("ffkv_version")), ("created", man.get("created")),
             ("model", m.get("model_id")), ("source", m.get("source")),
             ("revision / file hash", (m.get("revision") or "")[:16]),
             ("architecture", f"{m.get('architecture')} ({m.get('class')})"),
             ("layers × d_m = memories", f"{m.get('layers')} × {m.get('d_m')} = {m.get('memories', 0):,}"),
             ("d, vocabulary", f"{m.get('d')}, {m.get('vocab_size', 0):,}"),
             ("activation", f"{m.get('activation')}{', gated' if m.get('gated') else ''}"),
             ("dtype, device", f"{m.get('dtype')}, {m.get('device')}"), ("lens", man.get("lens")),
             ("corpus", f"{corpus.get('source')} (sha256 {str(corpus.get('sha256') or '')[:12]})"),
             ("corpus counts", ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in counts.items())),
             ("trigger rows", mine.get("rows"))]
    for name, c in (man.get("corpora") or {}).items():
        if name != "sentences":
            pairs.append((f"corpus `{name}`", f"{c.get('source')}: " + ", ".join(
                f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in (c.get("counts") or {}).items())))
    steps = []
    total = 0.0
    for name, st in (man.get("steps") or {}).items():
        sec = st.get("seconds")
        total += float(sec or 0)
        steps.append([name, st.get("status"), float(sec) if sec is not None else None, _when(st.get("finished")),
                      _settings_text((man.get("settings") or {}).get(name))])
    steps.append(["total", "", total, "", ""])
    return ("<h3>Run</h3>" + kv(pairs) + "<h3>Steps</h3>"
            + table(["step", "status", "seconds", "finished", "settings"], steps, num={2})
            + "<details><summary>Full manifest.json</summary><pre>"
            + esc(json.dumps(man, indent=2, default=str)) + "</pre></details>")


def render(run: Run, sections: list[Section], diff_rows, notes, fig_rel: str, extra: list[tuple[str, str, str]] = (),
           lens: str | None = None, beyond: list[dict] = ()) -> str:
    """The page. `extra`: (id, title, html) sections beyond the paper's (key statistics, normalize),
    placed after the paper's figures. `lens`: the run's; the overview gives each other lens a column.
    `beyond`: the verdicts.json records of those sections (normalize's claims C1–C5, a plugin step's),
    listed in the overview after the paper's sections."""
    m = run.manifest.get("model") or {}
    counts = {v: sum(s.verdict.verdict == v for s in sections) for v in V.VERDICTS}
    others = [ln for ln in dict.fromkeys(k for s in sections for k in s.lenses) if ln != lens]
    claims = [r for r in beyond if r.get("id") and r.get("verdict")]
    short = lambda r: str(r.get("title") or r["id"]).split(" — ")[0]  # noqa: E731  "C1 — …" -> "C1"
    overview = table(["section", f"verdict ({lens} lens)" if others else "verdict"] + [lens_name(ln) for ln in others] + ["measured"],
                     [[f'<a href="#{s.id}">{esc(PAPER[s.id]["title"].split(" — ")[0])}</a>', chip(s.verdict.verdict),
                       *[chip(s.lenses[ln]) if ln in s.lenses else "" for ln in others], s.verdict.measured]
                      for s in sections]
                     + [[f'<a href="#{esc(r["id"])}">{esc(short(r))}</a>', chip(str(r["verdict"]), r.get("report_verdict")),
                         *[""] * len(others), r.get("measured") or ""] for r in claims],
                     raw=set(range(2 + len(others))))
    claims_line = ""
    if claims:
        said: dict[str, int] = {}
        for r in claims:
            said[str(r["verdict"])] = said.get(str(r["verdict"]), 0) + 1
        claims_line = (f" Beyond the paper, {len(claims)} claim{'s' if len(claims) > 1 else ''} "
                       f"({', '.join(esc(short(r)) for r in claims)}): "
                       + ", ".join(f"{n} {esc(v)}" for v, n in said.items()) + ".")
    toc = " ".join(f'<a href="#{s.id}">{esc(PAPER[s.id]["title"].split(" — ")[0])}</a>' for s in sections)
    toc += "".join(f' <a href="#{xid}">{esc(xtitle)}</a>' for xid, xtitle, _ in extra)
    body = [
        f'<nav class="toc">{toc} <a href="#model">Model</a> <a href="#manifest">Manifest</a></nav>',
        '<section id="overview"><h2>Overview</h2>'
        f"<p>{counts[V.SAME]} sections show the paper's trend, {counts[V.DIFFERS]} differ, "
        f"{counts[V.INCONCLUSIVE]} are inconclusive (the difference lies within its interval or cannot be told "
        f"apart from chance) and {counts[V.NA]} are not comparable. Each verdict is computed from the run's "
        f"tables by the criterion printed under its figure, against a chance baseline with a 95% interval; "
        f"layer-wise criteria compare parts of the network by relative depth.{claims_line}</p>"
        + overview + "</section>",
        '<section id="model"><h2>How this model differs from the paper\'s</h2>'
        + table(["", "paper", "this run", "where it matters"], diff_rows) + "</section>",
    ]
    body += [section_html(s, notes.get(s.id, []) + s.notes, fig_rel) for s in sections]
    body += [xhtml for _, _, xhtml in extra]
    body.append('<section id="manifest"><h2>Manifest</h2>' + manifest_html(run) + "</section>")
    return template().substitute(
        title=esc(f"ffkv report — {m.get('model_id', run.path.name)}"),
        subtitle=esc(f"Geva et al. (2021), 'Transformer Feed-Forward Layers Are Key-Value Memories', reproduced "
                     f"on {m.get('model_id', '?')} · run {run.path} · built {time.strftime('%Y-%m-%d %H:%M')}"),
        version=esc(__version__), body="\n".join(body))


def verdicts_json(sections: list[Section]) -> list[dict]:
    """The verdicts as data (verdicts.json beside the HTML): one record per section, in report order."""
    return [{"id": s.id, "title": PAPER[s.id]["title"], "verdict": s.verdict.verdict,
             "criterion": s.verdict.criterion, "measured": s.verdict.measured,
             "other_lens": s.extra.strip(" ()") or None, "lenses": s.lenses or None, "figure": s.figure["png"].name if s.figure else None,
             "missing": s.missing, "error": s.error} for s in sections]


def build(run_path, out: str | Path | None = None, log=None) -> tuple[Path, list[str]]:
    """`build_report`, also returning the problems met (sections that could not be built)."""
    run = Run(run_path)
    run.require("mine", f"ffkv mine --out {run.path}")
    if out is None:
        html_path = run.path / "report" / "index.html"
    else:
        out = Path(out)
        html_path = out if out.suffix.lower() in (".html", ".htm") else out / "index.html"
    fig_dir = html_path.parent / "figures"
    try:
        fig_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FfkvError(f"cannot write the report to {html_path.parent}: {e.strerror}") from None
    b = Builder(run, fig_dir, log=log)
    sections = b.sections()
    extra, records = b.beyond_the_paper()
    diff_rows, notes = model_differences(run.manifest)
    page = render(run, sections, diff_rows, notes, fig_rel="figures", extra=extra, lens=b.lens, beyond=records)
    atomic_write_bytes(html_path, page.encode("utf-8"))
    atomic_write_bytes(html_path.parent / "verdicts.json", json.dumps(verdicts_json(sections) + records, indent=2,
                                                                      ensure_ascii=False).encode("utf-8"))
    return html_path, b.problems


def build_report(run_path, out: str | Path | None = None, log=None) -> Path:
    """Build RUN/report/index.html (or `out`: a .html file, or a folder to hold index.html), the
    figures as PNG and SVG beside it in `figures/`, and `verdicts.json` (one record per section: id,
    title, verdict, criterion, measured, other_lens, lenses (lens -> verdict), figure, missing, error).
    Returns the HTML path. Raises FfkvError for a
    missing or unmined run. A section whose table is malformed is reported through `log` and shown
    as "not comparable" with the error, rather than failing the whole report."""
    return build(run_path, out, log)[0]
