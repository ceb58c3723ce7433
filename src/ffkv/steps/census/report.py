"""The census's report section: the class shares by depth (`census_layers`), as a figure and a
table. Imported only when a report is built; drawn once the step has run."""
from __future__ import annotations

import threading
from collections import OrderedDict

from ffkv.report.html import table
from ffkv.steps import ReportSection
from ffkv.steps.census.compute import IO_CLASSES, VOCAB_CLASSES

# what the figure draws, each a share of the layer's memories (dead and rare: of its mined ones)
LINES = (("dead", "dead", "C7", "-"), ("rare", "rare", "C7", ":"), ("prediction", "prediction", "C2", "-"),
         ("suppression", "suppression", "C3", "-"), ("partition", "partition", "C4", "-"),
         ("enrichment", "enrichment", "C0", "--"), ("depletion", "depletion", "C1", "--"),
         ("token_detector", "token detector", "C5", "-."), ("positional", "positional", "C8", "-."))
DETECTOR_SHARES = ("token_detector", "ngram_detector", "self_suppressing", "positional")


def figure(df):
    from ffkv.report.figures import finish, new_figure, styled

    @styled
    def draw():
        fig, ax = new_figure()
        for col, label, color, style in LINES:
            if col in df.columns and df[col].notna().any():
                ax.plot(df["layer"], df[col] * 100, style, marker="o", ms=3, color=color, label=label)
        return finish(fig, ax, df["layer"], "% of the layer's memories", "Memory census by depth")

    return draw()


def sections(run, fig_dir) -> list:
    from ffkv.report.build import figure_html
    from ffkv.report.figures import save
    from ffkv.store import query

    t = query.table(run, "census_layers")
    df = t.to_pandas()
    rec = (run.manifest.get("settings") or {}).get("census") or {}
    cols = ["dead", "rare", *VOCAB_CLASSES, *IO_CLASSES, *[c for c in DETECTOR_SHARES if c in df.columns]]
    rows = [[r["layer"], r["memories"], *[("n/a" if r[c] is None else f"{100 * r[c]:.1f}%") for c in cols]]
            for r in t.to_pylist()]
    note = (f"<p>Shares of each layer's memories (dead and rare: of its mined memories; enrichment and "
            f"depletion without their conditional kinds). Thresholds: |m| &gt; {rec.get('eps', 0):g} (read as "
            f"|m| ≥ {rec.get('eps_used', 0):g}, the key histogram's edge), rare below {rec.get('rare', 1e-4):g} "
            f"of the tokens, excess kurtosis &gt; {rec.get('kurtosis', 10):g}, variance · d &gt; "
            f"{rec.get('partition', 2):g}, |cos| &gt; {rec.get('cos', 0.1):g}, {rec.get('lens', 'norm')} lens; "
            f"detectors: top-token (bigram) share of the positive triggers ≥ {rec.get('detector', 0.5):g} with "
            f"≥ {rec.get('min_triggers', 5)} triggers (of the memories with triggers), self-suppressing: the "
            f"token in the value's lowest {100 * rec.get('self_suppress', 0.01):g}% (of the detectors); "
            f"positional: pos_hist's TV from chance ≥ {rec.get('positional', 0.5):g} and above twice a shuffled "
            f"draw's (of the mined); "
            f"definitions in <code>ffkv.steps.census.compute</code>.</p>")
    fig = figure_html(save(figure(df), fig_dir, "census_depth"), "Memory census by depth") if len(df) else ""
    html = fig + note + table(["layer", "memories", *[c.replace("_", " ") for c in cols]], rows,
                              num=set(range(2 + len(cols))))
    recs = verdict_records(df, run)
    html += chance_note(df) + verdicts_html(recs)
    return [ReportSection("census", "Memory census by depth", html, recs, short="Census")]


def verdict_records(df, run) -> tuple:
    """The census's verdicts (`ffkv.steps.census.verdicts`) as verdicts.json records."""
    from ffkv.steps.census import verdicts as V

    m = run.manifest.get("model") or {}
    return tuple({"id": vid, "title": V.TITLES[vid], "verdict": v.verdict, "criterion": v.criterion,
                  "measured": v.measured, "other_lens": None, "lenses": None,
                  "figure": "census_depth.png" if len(df) else None, "missing": None, "error": None}
                 for vid, v in V.records(df, m.get("layers"), m.get("activation")))


def chance_note(df) -> str:
    """The chance shares the verdicts compare with (absent in a census from before them)."""
    from ffkv.steps.census.compute import CHANCE_COLUMNS

    have = [c for c in CHANCE_COLUMNS if c in df.columns and df[c].notna().any()]
    if not have:
        return ""
    parts = [f"{c.removesuffix('_chance')} {100 * df[c].mean():.2f}%" for c in have]
    return ("<p>Chance shares (mean over the layers): " + ", ".join(parts) + " — the vocabulary classes of "
            "random directions, the input-output classes of each layer's values shuffled among its memories.</p>")


def verdicts_html(recs) -> str:
    from ffkv.report.html import chip, esc

    return "".join(f'<div class="claim" id="{esc(r["id"])}"><h3>{esc(r["title"])} {chip(r["verdict"])}</h3>'
                   f'<p>{esc(r["measured"])}</p><p class="criterion">{esc(r["criterion"])}</p></div>' for r in recs)


ROWS = 256  # memories whose census rows `_row` keeps
_rows: OrderedDict = OrderedDict()  # (run folder, census.parquet's version, layer, dim) -> row or None
_rows_lock = threading.Lock()


def _row(run, layer: int, dim: int) -> dict | None:
    """Memory (layer, dim)'s census row, None without one. A memory page asks for it twice (`panels`
    and `later_label`) and its later panels once more, so the row is kept for the last `ROWS`
    memories, under the census file's version (inode, size, mtime: the step writes a new file and
    renames it into place), so a census run again is read again. The run vouches for the table on
    every call (`query.trusted`), kept or not."""
    from ffkv.store import query

    query.trusted(run, "census")
    st = query.path(run, "census").stat()  # before the read: a file replaced meanwhile is read again next time
    key = (str(run.path), st.st_ino, st.st_size, st.st_mtime_ns, int(layer), int(dim))
    with _rows_lock:
        if key in _rows:
            _rows.move_to_end(key)
            got = _rows[key]
            return None if got is None else dict(got)
    rows = query.table(run, "census", filters=[("layer", "=", int(layer)), ("dim", "=", int(dim))]).to_pylist()
    got = rows[0] if rows else None
    with _rows_lock:
        _rows[key] = got
        while len(_rows) > ROWS:
            _rows.popitem(last=False)
    return None if got is None else dict(got)


def panels(run, layer: int, dim: int) -> list:
    """The memory page's census panel: its classes with the numbers behind them (read from the
    census table, no forward). The sign regimes' panels come later (`later_panels`)."""
    r = _row(run, layer, dim)
    return [] if r is None else [_census_panel(run, r)]


def later_panels(run, layer: int, dim: int) -> list:
    """For a gated FFN's memory that is not dead, its sign regimes' panels (`regime_panels`: a model
    forward over about a hundred sentences, so the page draws them after itself and its colours)."""
    r = _row(run, layer, dim)
    # a dead memory (never active over the mined tokens, whose sentences are the ones searched) has no
    # example in any regime: its census panel says it is dead
    return [] if r is None or r["dead"] else regime_panels(run, layer, dim)


def later_label(run, layer: int, dim: int) -> str:
    """What `later_panels` computes for this memory, "" when nothing (no forward: the run's model
    and the census row only)."""
    from ffkv.steps.census import regimes as R

    if not R.applies(run):
        return ""
    r = _row(run, layer, dim)
    return "" if r is None or r["dead"] else "the sign-regime panels"


def _census_panel(run, r: dict):
    from ffkv.steps import Panel

    rec = (run.manifest.get("settings") or {}).get("census") or {}
    vocab = [c for c in VOCAB_CLASSES if r[c]] or ["none"]
    activity = ("not mined" if r["tokens"] is None else
                f"active on {r['active']:,} of {r['tokens']:,} tokens (|m| ≥ {rec.get('eps_used', 0):g})"
                + (": dead" if r["dead"] else ": rare" if r["rare"] else ""))
    cos = ", ".join(f"{name} {r[c]:+.3f}" for c, name in (("cos_gate_in", "cos(gate, in)"),
                                                        ("cos_gate_out", "cos(gate, out)"),
                                                        ("cos_in_out", "cos(in, out)")) if r[c] is not None)
    return Panel("Census", ("measure", "class", "numbers"), (
        ("activity", "dead" if r["dead"] else "rare" if r["rare"] else "alive" if r["tokens"] is not None else "",
         activity),
        ("vocabulary moments", ", ".join(vocab),
         f"skew {r['skew']:+.3f}, excess kurtosis {r['kurtosis']:.3f}, variance {r['variance']:.3g}"),
        ("input-output", r["io_class"].replace("_", " "), cos),
        *_detector_rows(r)),
        note="cos(W_U, v) over the vocabulary (Gurnee et al.), key-value cosines (after Gerstner & Schütze); "
             "definitions in ffkv.steps.census.compute.")


def _detector_rows(r: dict) -> list:
    """The panel's token-detector and position rows (absent in a census from before them)."""
    out = []
    if r.get("token_detector") is not None:
        kind = "n-gram detector" if r["ngram_detector"] else "token detector" if r["token_detector"] else "none"
        nums = (f"top token {r['top_token']} on {100 * r['token_share']:.0f}% of {r['n_triggers']} positive "
                f"triggers, top bigram on {100 * r['ngram_share']:.0f}%")
        if r["self_rank"] is not None:
            nums += f"; the token's rank from the value's low end {r['self_rank']:,}"
            kind += ", self-suppressing" if r["self_suppressing"] else ""
        out.append(("detector", kind, nums))
    if r.get("pos_tv") is not None:
        out.append(("position", "positional" if r["positional"] else "none",
                    f"TV from chance positions {r['pos_tv']:.3f} (shuffled: {r['pos_tv_chance']:.3f})"))
    if r.get("regime") is not None:
        out.append(("sign regime", REGIME_NAMES[r["regime"]],
                    "activation mass by (gate, input) sign: " + ", ".join(
                        f"{REGIME_NAMES[k]} {100 * r['regime_' + k]:.0f}%" for k in REGIME_NAMES)))
    return out


def _regime_names() -> dict:
    from ffkv.mine.regimes import REGIMES

    return {k: v.replace("-", "−") for k, v in REGIMES.items()}  # shown with a true minus


REGIME_NAMES = _regime_names()
REGIME_SHARES = "Sign regimes over the searched tokens"
REGIME_EXAMPLES = "Sign regimes: strongest examples"
EXAMPLE_COLUMNS = ("regime", "(gate, input)", "example", "sentence_id", "position", "i", "token", "m", "gate",
                   "input")


def regime_panels(run, layer: int, dim: int) -> list:
    """A gated memory's sign regimes recomputed over a bounded set of the run's sentences
    (`ffkv.steps.census.regimes`): the regimes' shares of the activation mass over the searched
    tokens, and each regime's strongest examples, one row per token shown (`EXAMPLE_COLUMNS`: m,
    gate and input at that token; `position` is the example's own token), drawn by the census's
    panel partial. None for an ungated FFN; a failure is the panel's note."""
    from ffkv.steps import Panel
    from ffkv.steps.census import regimes as R

    if not R.applies(run):
        return []
    try:
        got = R.memory_regimes(run, layer, dim)
    except Exception as e:  # noqa: BLE001 - the census's own panel stays
        return [Panel(REGIME_SHARES, (), (), note=f"could not recompute the sign regimes: {type(e).__name__}: {e}")]
    s = got["searched"]
    searched = (f"Searched: this memory's {s['top']} top-trigger sentences (ranks ≤ {s['top_rank']} of each list) "
                f"and {s['sample']} more of a seeded sample of the run's {s['sentences']:,} sentences (the same for "
                f"every memory), the first {s['max_tokens']} tokens of each: {got['tokens']:,} tokens, "
                f"{got['active']:,} with m ≠ 0.")
    shares = Panel(REGIME_SHARES, ("regime", "(gate, input)", "tokens with m ≠ 0", "share of Σ|m|", "examples shown"),
                   tuple((k, REGIME_NAMES[k], got["counts"][k], got["shares"][k], len(got["examples"][k]))
                         for k in REGIME_NAMES),
                   note=searched + " A token's regime is the sign of its gate pre-activation g and of its input "
                        "u (m = f(g)·u); its share is of the activation mass Σ|m| (they sum to 1); the census's "
                        "regime_* shares count every mined token.")
    vocab = R.vocab(run)
    rows = []
    for k in REGIME_NAMES:
        for n, ex in enumerate(got["examples"][k], 1):
            for j, (t, (m, g, u)) in enumerate(zip(ex["tokens"], ex["values"])):
                rows.append((k, REGIME_NAMES[k], n, ex["sentence_id"], ex["position"], ex["start"] + j,
                             vocab[t] if 0 <= t < len(vocab) else f"<{t}>", m, g, u))
    examples = Panel(REGIME_EXAMPLES, EXAMPLE_COLUMNS, tuple(rows),
                     note=f"Each regime's {R.PER_REGIME} strongest examples by |m| among the searched tokens, one "
                          f"per sentence; m, gate g and input u at the example's token, and at each token shown "
                          f"on hover. Tinted by m, each sign relative to its largest |m| in this panel.")
    return [shares, examples]


OVERVIEW = ("dead", "prediction", "suppression", "partition", "enrichment", "depletion")


def overview(run) -> dict:
    """The browser overview's census columns: per layer, the share of its memories in each of
    `OVERVIEW` (dead: of its mined memories), from `census_layers`."""
    from ffkv.store import query

    t = query.table(run, "census_layers", columns=["layer", *OVERVIEW]).to_pylist()
    return {f"census: {c}": {r["layer"]: r[c] for r in t} for c in OVERVIEW}
