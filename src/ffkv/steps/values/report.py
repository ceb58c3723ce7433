"""The `values` step's report sections: Figs 4-6 and Table 2 (the values read through the vocabulary,
and their agreement with their keys' triggers), each under the run's lens with the other lens's
verdict beside it. Read from the step's tables (columns in `ffkv.steps.values.compute`)."""
from __future__ import annotations

import pandas as pd

from ffkv.report.build import Builder, Section, prefix_html
from ffkv.report.html import esc, mem, table, tok
from ffkv.steps.values import figures as F
from ffkv.steps.values import verdicts as V
from ffkv.steps.values.paper import FIG4, FIG5, FIG6, TABLE2

TABLE2_ROWS = 20


def sections(run, fig_dir) -> list:
    b = Builder.of(run, fig_dir)
    return [b.paper_section(FIG4, fig4), b.paper_section(FIG5, fig5), b.paper_section(FIG6, fig6),
            b.paper_section(TABLE2, table2)]


def _read_lenses(b: Builder, s: Section, name: str, fn, *args) -> pd.DataFrame | None:
    """Read a values section under each lens (`values_lenses`, `values_fig6_lenses`,
    `values_table2_lenses`, from issue 14 on); returns that table, or None for older runs."""
    df = b.t.get(name)
    if df is None or "lens" not in df.columns:
        return None
    main = b.run.step_lens("values")
    b.read_lenses(s, fn, df, *args, main=main, detail=True)
    s.notes.append(f"Verdict under the {main} lens; the paper projected with the naive lens v·E, whose "
                   "verdict and numbers follow the measured line.")
    return df


def _figure(b: Builder, sid: str, name: str, lens_name: str, fn, *args) -> Section:
    """Figs 4-6: the run's lens's verdict, every lens's verdict, and one figure drawn with every lens."""
    (df,), miss = b.need(sid, name)
    s = Section(sid, fn(df, *args), missing=miss)
    both = _read_lenses(b, s, lens_name, fn, *args)
    if df is not None:
        s.figure = b.draw(sid, getattr(F, sid), df if both is None else both, primary=b.run.step_lens("values"))
    return s


def fig4(b: Builder) -> Section:
    return _figure(b, "fig4", "values_layers", "values_lenses", V.fig4, b.L)


def fig5(b: Builder) -> Section:
    return _figure(b, "fig5", "values_layers", "values_lenses", V.fig5, b.L)


def fig6(b: Builder) -> Section:
    return _figure(b, "fig6", "values_fig6", "values_fig6_lenses", V.fig6)


def table2(b: Builder) -> Section:
    (df,), miss = b.need("table2", "values_table2")
    L2 = b.L or (int(df["layer"].max()) + 1 if df is not None and len(df) else 1)
    s = Section("table2", V.table2(df, L2), missing=miss)
    _read_lenses(b, s, "values_table2_lenses", V.table2, L2)
    if df is None or df.empty:
        return s
    d = df.sort_values("position").head(TABLE2_ROWS)
    sent = b.t.sentences(d["example_sentence_id"])
    rows = []
    for r in d.itertuples():
        ex = ""
        ids = sent.get(int(r.example_sentence_id)) if not pd.isna(r.example_sentence_id) else None
        if ids is not None and b.decoder is not None:
            ex = prefix_html(*b.decoder.marked(ids, int(r.example_position)), chars=80)
        elif isinstance(r.example_text, str):
            ex = esc(r.example_text)
        rows.append([int(r.position), int(r.layer), mem(r.layer, r.dim, int(r.dim)), r.kind, float(r.max_prob),
                     tok(r.top_token_text), f"{int(r.n_agree)}/{int(r.n_examples)}", ex])
    s.html = (f"<p>The {len(d)} values with the highest max probability (of {len(df)} in "
              f"<code>values_table2</code>), the share of their key's top triggers whose next token is the "
              f"value's top token, and the best-ranked agreeing trigger.</p>"
              + table(["#", "layer", "dim", "kind", "max p", "top token", "agreeing triggers", "example"],
                      rows, num={0, 1, 2, 4}, raw={2, 5, 7}))
    return s
