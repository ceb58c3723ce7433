"""`build_report(run)`: one self-contained HTML file (plus PNG/SVG figures) from a run's tables.

The sections are the steps' (`Step.sections`, each built-in step's in `src/ffkv/steps/<name>/report.py`),
asked for in the registry's order: the paper's figures first, in the paper's order, then the sections
beyond it. Here: what they share (`Builder`: the run's tables, decoder, lens, the hint for a missing
table), how this model differs from the paper's, and the page (overview, contents, manifest). A
missing table leaves its section with a "not comparable" verdict and the command that creates it.
Nothing is read from outside the run, nothing is fetched: the paper's results are embedded (each
step's `paper.py`, `ffkv.report.paper`).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ffkv import __version__
from ffkv.defs import lens_name
from ffkv.display import show_token
from ffkv.errors import FfkvError
from ffkv.report import figures as F
from ffkv.report.html import chip, code, esc, img, kv, table, template, verdict_line
from ffkv.report.paper import MODEL_NOTES, PAPER_MODEL, Paper
from ffkv.report.stats import DIFFERS, INCONCLUSIVE, NA, RELU_LIKE, SAME, VERDICTS, Verdict
from ffkv.store import decode, query
from ffkv.store.run import Run, atomic_write_bytes

PREFIX_CHARS = 110  # characters of a prefix shown before its last token


@dataclass
class Section:
    id: str
    verdict: Verdict
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


def model_differences(manifest: dict, lens: str) -> tuple[list[list[str]], dict[str, str | None]]:
    """Rows (property, paper, this run, where it matters), and the ways this model differs that a
    section of the paper's may be read under (`Paper.notes`), in `MODEL_NOTES` order: each with its
    common note (None: each section says its own). `lens`: the run's. The rows of the steps' own
    settings (sample sizes) are each registered step's `Step.differences`."""
    from ffkv.steps.registry import ordered

    m = manifest.get("model") or {}
    notes: dict[str, str | None] = {}
    rows = [["model", PAPER_MODEL["name"], f"{m.get('model_id', '?')}", ""],
            ["architecture", PAPER_MODEL["architecture"], f"{m.get('architecture', '?')} ({m.get('class', '?')})", ""]]
    rows += _depth_rows(int(m.get("layers") or 0), notes)
    rows.append(["d / d_m", f"{PAPER_MODEL['d']} / {PAPER_MODEL['d_m']}", f"{m.get('d', '?')} / {m.get('d_m', '?')}",
                 "fewer memories per layer: counts in Fig 7 are shares of d_m"])
    rows.append(["memories", f"{PAPER_MODEL['memories']:,}", f"{m.get('memories', 0):,}", ""])
    if experts_text(m):
        rows.append(["mixture of experts", "no (one dense FFN per layer)", experts_text(m),
                     "a token reaches only its routed experts' memories (m = 0 elsewhere): "
                     "Fig 7's shares are of d_m, all experts counted"])
        notes["moe"] = None
    rows.append(_ffn_row(m, notes))
    rows += _weights_and_vocabulary_rows(m, notes)
    rows.append(_corpus_row(manifest))
    rows.append(_lens_row(lens, notes))
    settings = manifest.get("settings") or {}
    for step in ordered():
        if step.differences is not None:
            rows += step.differences(settings.get(step.name) or {})
    return rows, {k: notes[k] for k in MODEL_NOTES if k in notes}


def notes_for(entry: Paper, notes: dict[str, str | None], model: dict, lens: str) -> list[str]:
    """The notes under a section of the paper's: for each of `notes` (`model_differences`) that the
    section is read under, its own note (a format string over the model's fields) or the common one."""
    fields = {**model, "act": str(model.get("activation") or "?"), "lens": lens,
              "active_share": (model.get("memories_per_token") or 0) / (model.get("d_m") or 1)}
    out = []
    for k, common in notes.items():
        if k in entry.notes:
            own = entry.notes[k]
            if (text := own.format(**fields) if own is not None else common):
                out.append(text)
    return out


def experts_text(m: dict) -> str | None:
    """A mixture of experts' memories per layer, all experts counted, and how many a token reaches
    (the manifest's `ffkv.model.arch.MoE.moe_info`); None for a dense FFN."""
    if not m.get("experts"):
        return None
    E, de, ds, k = m["experts"], m.get("d_expert") or 0, m.get("d_shared_expert") or 0, m.get("experts_per_token")
    shared = f" + a shared expert of {ds:,}" if ds else ""
    return (f"{E} experts × {de:,}{shared} = {m.get('d_m', E * de + ds):,} memories per layer (all experts "
            f"counted); {m.get('memories_per_token', 0):,} active per token ({k} routed expert{'s' if k != 1 else ''}"
            f"{' and the shared one' if ds else ''})")


def _depth_rows(L: int, notes: dict) -> list[list[str]]:
    """The layer count, and how the paper's layers map onto this model's."""
    if not L:
        return []
    where = ""
    if L != 16:
        marks = ", ".join(f"{k}→{paper_layer_here(k, L)}" for k in (1, 5, 9, 10, 11, 16))
        where = (f"Layer-wise figures are read by relative depth (ℓ+½)/L. The paper's layer k (1-based) "
                 f"corresponds to this model's layer (0-based): {marks}.")
        notes["depth"] = (f"This model has {L} layers (the paper's has 16): compare by relative depth; the "
                          f"paper's layer 10 ≈ layer {paper_layer_here(10, L)} here, its layer 11 ≈ layer "
                          f"{paper_layer_here(11, L)} (0-based).")
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
        notes["gated"] = None
    elif act.lower() not in RELU_LIKE:
        ffn_run = f"{act}, not gated"
        why = "m > 0 is not the same as 'the key fired' for this activation (Fig 7)."
        notes["activation"] = None
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
    notes["subword"] = ("Subword vocabulary: the trigger's next token is often a piece of a word, not a word "
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
        notes["lens"] = f"Projected with the {lens} lens; the paper used the naive projection h·E."
    return ["lens", PAPER_MODEL["lens"], lens,
            "norm: through the model's final norm (at the last layer it gives the model's own logits); "
            "the compose figures draw both lenses, the verdicts use the run's" if lens != "naive" else ""]


# ---- sections --------------------------------------------------------------------------------------------
class Builder:
    """What the steps' report sections share while a report is built: the run's tables (each read
    once), its decoder and lens, the commands that make a missing table, drawing, and the problems
    met. The sections themselves are the steps' (`src/ffkv/steps/<name>/report.py`)."""

    def __init__(self, run: Run, fig_dir: Path, log=None):
        self.run = run
        self.t = RunTables(run)
        self.fig_dir = fig_dir
        self.log = log or (lambda *_: None)
        self.m = run.manifest.get("model") or {}
        self.L = int(self.m.get("layers") or 0) or None
        self.lens = run.lens
        self.problems: list[str] = []
        self._decoder: Decoder | None = None
        self._differences: tuple[list[list[str]], dict[str, str | None]] | None = None
        self.entries: dict[str, Paper] = {}  # the paper's sections asked for so far, by id

    @property
    def decoder(self) -> Decoder | None:
        if self._decoder is None and self.run.has_table("vocab"):
            self._decoder = Decoder.of_frame(self.t.get("vocab"))
        return self._decoder

    def need(self, sid: str, *names: str) -> tuple[list[pd.DataFrame], str | None]:
        """The tables `names` of section `sid`, and, when one is missing, the text naming the command
        of the registered step that writes it (`Step.tables`)."""
        from ffkv.steps.registry import command, ordered

        dfs = [self.t.get(n) for n in names]
        absent = [n for n, d in zip(names, dfs) if d is None]
        if absent:
            foreign = [(n, pr) for n in absent if self.run.table_path(n).exists()
                       and (pr := self.run.table_problem(n)) is not None]
            if foreign:  # a file with the table's name that the run does not vouch for: skipped, saying why
                n, pr = foreign[0]
                return dfs, f"This section is skipped: the `{n}` table of this run {pr}."
            step = next((s.name for s in ordered() if absent[0] in s.tables), None)
            how = f"`{command(step, self.run)}`" if step else "the step that writes it"
            return dfs, (f"This section needs the {', '.join(f'`{a}`' for a in absent)} table"
                         f"{'s' if len(absent) > 1 else ''}; create {'them' if len(absent) > 1 else 'it'} "
                         f"with {how}.")
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

    # ---- what a step's report module calls -------------------------------------------------------------
    @classmethod
    def of(cls, run: Run, fig_dir: Path) -> "Builder":
        """The builder of the report being built for `run` into `fig_dir` (so every step's sections
        share one read of each table, one decoder and one list of problems), else a new one."""
        b = _building
        if b is not None and b.run.path == run.path and Path(b.fig_dir) == Path(fig_dir):
            return b
        return cls(run, fig_dir)

    @property
    def differences(self) -> tuple[list[list[str]], dict[str, str | None]]:
        """How this model differs from the paper's (`model_differences`): the page's table, and the
        differences a section of the paper's may be read under."""
        if self._differences is None:
            self._differences = model_differences(self.run.manifest, self.lens)
        return self._differences

    def paper_section(self, entry: Paper, make):
        """One of the paper's figures as a `ReportSection`: what the paper says (`entry`, placed at
        `entry.place`) beside `make(builder) -> Section`, the run's verdict and figure. A malformed
        table does not sink the report: the section is then "not comparable" with the error."""
        from ffkv.steps import ReportSection

        sid = entry.id
        self.entries[sid] = entry
        try:
            s = make(self)
        except FfkvError:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed table must not sink the whole report
            msg = f"{sid}: {type(e).__name__}: {e}"
            self.problems.append(msg)
            self.log(f"report: warning: {msg}")
            s = Section(sid, Verdict(NA, "the section could not be built", str(e)), error=msg)
        notes = notes_for(entry, self.differences[1], self.m, self.lens) + s.notes
        return ReportSection(sid, entry.title, section_html(s, entry, notes, "figures"), (verdict_record(s, entry),),
                             short=entry.title.split(" — ")[0], whole=True, paper=s, place=entry.place)

    # ---- the report's sections: every step's, in the registry's order ----------------------------------
    def sections(self) -> tuple[list, list]:
        """(the paper's sections in the paper's order, the others in the registry's order), as
        `ffkv.steps.ReportSection`s, from each registered step's `sections`: once it has run, or
        always when it says so (`Step.report_before_done`: a section whose table is missing says
        which command makes it, and a user's error there, e.g. a damaged table, stops the report
        with its one line). Any other failure is shown as that step's section."""
        from ffkv.steps.registry import ordered

        global _building
        got = []
        before, _building = _building, self
        try:
            for step in ordered():
                if step.sections is None or not (step.report_before_done or self.run.step_done(step.name)):
                    continue
                try:
                    got += list(step.sections(self.run, self.fig_dir))
                except FfkvError:
                    if step.report_before_done:  # e.g. a damaged table: one line naming the command that rebuilds it
                        raise
                    got.append(self._failed(step.name))
                except Exception:  # noqa: BLE001 - one step's bug must not sink the report
                    got.append(self._failed(step.name))
        finally:
            _building = before
        paper = sorted((r for r in got if r.paper is not None), key=lambda r: r.place)
        return paper, [r for r in got if r.paper is None]

    def _failed(self, name: str):
        """The section of a step whose sections failed: its error (the exception being handled)."""
        import sys

        from ffkv.steps import ReportSection

        e = sys.exc_info()[1]
        msg = f"{name}: {type(e).__name__}: {e}"
        self.problems.append(msg)
        self.log(f"report: warning: {msg}")
        return ReportSection(name, name, f'<p class="error">{esc(msg)}</p>')


_building: Builder | None = None  # the builder of the report under way (`Builder.of`)


# ---- page -------------------------------------------------------------------------------------------------
def alt_text(title: str, figure: dict) -> str:
    """A figure's alt text: its title, then what it shows (`figures.describe`, saved with it)."""
    what = figure.get("alt") or ""
    return f"{title}. {what}" if what else title


def figure_html(figure: dict, title: str, fig_rel: str = "figures") -> str:
    """A saved figure (`figures.save`: PNG and SVG) embedded, with links to both files."""
    return (f'<figure>{img(figure["png"], alt_text(title, figure))}<figcaption class="files">Files: '
            f'<a href="{fig_rel}/{figure["png"].name}">{esc(figure["png"].name)}</a>, '
            f'<a href="{fig_rel}/{figure["svg"].name}">{esc(figure["svg"].name)}</a></figcaption></figure>')


def section_html(s: Section, p: Paper, notes: list[str], fig_rel: str) -> str:
    """A section of the paper's: the run's figure (or tables, or what is missing) beside what the
    paper says (`p`), the verdict, the notes on reading it with this model."""
    parts = [f'<section id="{s.id}" class="figure-section" data-section="{s.id}">', f"<h2>{esc(p.title)}</h2>"]
    paper = (f'<aside class="paper"><h3>The paper</h3><p>{esc(p.result)}</p>'
             f'<p class="setup"><b>Measured:</b> {esc(p.measure)}.<br><b>Setup:</b> {esc(p.setup)}.</p></aside>')
    if s.figure:
        fig = figure_html(s.figure, p.title, fig_rel)
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
             *([("experts", experts_text(m))] if experts_text(m) else []),
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


def render(run: Run, paper: list, extra: list, diff_rows, lens: str | None = None) -> str:
    """The page. `paper`: the sections of the paper's figures (`ffkv.steps.ReportSection`s with
    `paper` set), in the paper's order; `extra`: the sections beyond the paper (key statistics,
    normalize, an added step's), after them, their verdicts.json records (normalize's claims C1–C5,
    an added step's) listed in the overview after the paper's sections. `lens`: the run's; the
    overview gives each other lens a column."""
    sections = [r.paper for r in paper]
    beyond = [dict(v) for r in extra for v in r.verdicts]
    m = run.manifest.get("model") or {}
    counts = {v: sum(s.verdict.verdict == v for s in sections) for v in VERDICTS}
    others = [ln for ln in dict.fromkeys(k for s in sections for k in s.lenses) if ln != lens]
    claims = [r for r in beyond if r.get("id") and r.get("verdict")]
    short = lambda r: str(r.get("title") or r["id"]).split(" — ")[0]  # noqa: E731  "C1 — …" -> "C1"
    overview = table(["section", f"verdict ({lens} lens)" if others else "verdict"] + [lens_name(ln) for ln in others] + ["measured"],
                     [[f'<a href="#{s.id}">{esc(r.short or r.title)}</a>', chip(s.verdict.verdict),
                       *[chip(s.lenses[ln]) if ln in s.lenses else "" for ln in others], s.verdict.measured]
                      for r, s in zip(paper, sections)]
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
    toc = " ".join(f'<a href="#{r.id}">{esc(r.short or r.title)}</a>' for r in paper)
    toc += "".join(f' <a href="#{esc(r.id)}">{esc(r.short or r.title)}</a>' for r in extra)
    body = [
        f'<nav class="toc">{toc} <a href="#model">Model</a> <a href="#manifest">Manifest</a></nav>',
        '<section id="overview"><h2>Overview</h2>'
        f"<p>{counts[SAME]} sections show the paper's trend, {counts[DIFFERS]} differ, "
        f"{counts[INCONCLUSIVE]} are inconclusive (the difference lies within its interval or cannot be told "
        f"apart from chance) and {counts[NA]} are not comparable. Each verdict is computed from the run's "
        f"tables by the criterion printed under its figure, against a chance baseline with a 95% interval; "
        f"layer-wise criteria compare parts of the network by relative depth.{claims_line}</p>"
        + overview + "</section>",
        '<section id="model"><h2>How this model differs from the paper\'s</h2>'
        + table(["", "paper", "this run", "where it matters"], diff_rows) + "</section>",
    ]
    body += [r.html if r.whole else
             (f'<section id="{esc(r.id)}" class="figure-section beyond" data-section="{esc(r.id)}">'
              f"<h2>{esc(r.title)}</h2>{r.html}</section>") for r in paper + extra]
    body.append('<section id="manifest"><h2>Manifest</h2>' + manifest_html(run) + "</section>")
    return template().substitute(
        title=esc(f"ffkv report — {m.get('model_id', run.path.name)}"),
        subtitle=esc(f"Geva et al. (2021), 'Transformer Feed-Forward Layers Are Key-Value Memories', reproduced "
                     f"on {m.get('model_id', '?')} · run {run.path} · built {time.strftime('%Y-%m-%d %H:%M')}"),
        version=esc(__version__), body="\n".join(body))


def verdict_record(s: Section, p: Paper) -> dict:
    """A section of the paper's as data: its record in verdicts.json."""
    return {"id": s.id, "title": p.title, "verdict": s.verdict.verdict,
            "criterion": s.verdict.criterion, "measured": s.verdict.measured,
            "other_lens": s.extra.strip(" ()") or None, "lenses": s.lenses or None,
            "figure": s.figure["png"].name if s.figure else None, "missing": s.missing, "error": s.error}


def ignored_tables(run: Run) -> dict[str, list[str]]:
    """The files in the run with a table's name that it does not vouch for (`Run.table_problem`),
    by what is wrong with them: each is left out of every section."""
    out: dict[str, list[str]] = {}
    for p in sorted(run.path.glob("*.parquet")):
        if not p.name.startswith(".") and (pr := run.table_problem(p.stem)) is not None:
            out.setdefault(pr, []).append(p.stem)
    return out


def build(run_path, out: str | Path | None = None, log=None) -> tuple[Path, list[str]]:
    """`build_report`, also returning the problems met (sections that could not be built)."""
    from ffkv.steps.lifecycle import check_run

    run = Run(run_path)
    run.require("mine", f"ffkv mine --out {run.path}")
    check_run(run)  # a damaged table is one line naming its rebuild, not a report drawn from it
    for why, names in ignored_tables(run).items():  # files the manifest does not vouch for: named, never drawn
        (log or (lambda *_: None))(f"report: ignored {', '.join(f'`{n}`' for n in names)} in {run.path}: "
                                   f"{'each' if len(names) > 1 else 'it'} {why}")
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
    paper, extra = b.sections()
    page = render(run, paper, extra, b.differences[0], lens=b.lens)
    records = [dict(v) for r in paper + extra for v in r.verdicts]  # in report order
    atomic_write_bytes(html_path, page.encode("utf-8"))
    atomic_write_bytes(html_path.parent / "verdicts.json", json.dumps(records, indent=2,
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
