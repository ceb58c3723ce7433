"""The `compose` step's report sections: Figs 7-11 (how the memories of a layer compose, and how the
layers refine the prediction) and the last layer's cases, judged under the run's lens with the other
lens's verdict beside it. Read from `compose_layers` and `compose_cases` (`ffkv.steps.compose.compute`)."""
from __future__ import annotations

from ffkv.report.build import PREFIX_CHARS, Builder, Section
from ffkv.report.html import esc, table, tok
from ffkv.report.stats import on_lens
from ffkv.steps.compose import figures as F
from ffkv.steps.compose import verdicts as V
from ffkv.steps.compose.paper import CASES, FIG7, FIG8, FIG9, FIG10, FIG11

CASES_ROWS = 20


def sections(run, fig_dir) -> list:
    b = Builder.of(run, fig_dir)
    return [b.paper_section(FIG7, fig7), b.paper_section(FIG8, fig8), b.paper_section(FIG9, fig9),
            b.paper_section(FIG10, fig10), b.paper_section(FIG11, fig11), b.paper_section(CASES, cases)]


def differences(settings: dict) -> list[list[str]]:
    """The held-out prefixes, beside the paper's 4,000."""
    if not settings.get("prefixes"):
        return []
    return [["compose prefixes", "4,000", f"{settings['prefixes']:,}",
             "fewer prefixes: wider sampling error in Figs 7–11"]]


def _compose(b: Builder, sid: str, vfn, ffn, *vargs, with_L=True, **vkw) -> Section:
    (df,), miss = b.need(sid, "compose_layers")
    args = (b.L,) if with_L else ()
    v = vfn(df, *vargs, *args, lens=b.lens, **vkw)
    s = Section(sid, v, missing=miss)
    if df is not None:
        b.read_lenses(s, vfn, df, *vargs, *args, **vkw)
        s.figure = b.draw(sid, ffn, df, primary=b.lens)
    return s


def fig7(b: Builder) -> Section:
    (df,), miss = b.need("fig7", "compose_layers")
    v = V.fig7(df, b.m.get("activation"), bool(b.m.get("gated")), b.L, lens=b.lens)
    s = Section("fig7", v, missing=miss)
    if df is not None:
        s.figure = b.draw("fig7", F.fig7, df, primary=b.lens)
    return s


def fig8(b: Builder) -> Section:
    return _compose(b, "fig8", V.fig8, F.fig8, with_L=False, gated=bool(b.m.get("gated")))


def fig9(b: Builder) -> Section:
    return _compose(b, "fig9", V.fig9, F.fig9)


def fig10(b: Builder) -> Section:
    return _compose(b, "fig10", V.fig10, F.fig10)


def fig11(b: Builder) -> Section:
    return _compose(b, "fig11", V.fig11, F.fig11, with_L=False)


def cases(b: Builder) -> Section:
    (df,), miss = b.need("cases", "compose_cases")
    s = Section("cases", V.cases(df, b.lens), missing=miss)
    if df is None or df.empty:
        return s
    d, lens = on_lens(df, b.lens)
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
