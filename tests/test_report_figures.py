"""The report's figures and markup (issue 26, item 9): C1–C5 in the overview, PNGs at 2× with legible
text, no overlapping tick labels, no "0" on a log axis, legends outside the axes, the paper's levels
drawn, alt text that says what a figure shows, whitespace tokens as ␣, a dark scheme with enough
contrast. The report itself is built from test_report's tiny run (`tiny_run`, `report`)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from test_normalize import _capacity, _variance
from test_normalize import _layers as _layers_of
from test_report import FIGURES, copy_run, report, tiny_run  # noqa: F401  (session fixtures)

CLAIMS = ["norm_c1", "norm_c2", "norm_c3", "norm_c4", "norm_c5"]


def _layers(delta):
    """test_normalize's constructed `normalize_layers`, with the column C1's figure reads too."""
    return _layers_of(delta).assign(top10_diff_se=0.01)


def _normalized_run(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run with the normalize step done, its tables constructed: C1 holds, C2
    holds, C3 and C4 do not hold, C5 does not hold."""
    import pyarrow as pa

    from ffkv.store.run import Run

    run = copy_run(tiny_run, tmp_path / "run", ["sentences", "triggers", "vocab", "key_stats", "key_hist",
                                                "key_samples"], ["mine"])
    man = json.loads((run / "manifest.json").read_text())
    man["steps"]["normalize"] = {"status": "done", "seconds": 1.0}
    (run / "manifest.json").write_text(json.dumps(man))
    r = Run(run)
    r.write_table("normalize_layers", pa.Table.from_pandas(_layers([1.0, 2.0, 0.5]), preserve_index=False))
    r.write_table("normalize_capacity", pa.Table.from_pandas(
        _capacity([(16, 0.1), (64, 0.3), (256, 0.6), (1024, 0.9), (1536, 1.0)]), preserve_index=False))
    r.write_table("normalize_variance", pa.Table.from_pandas(_variance(0.5, layers=8), preserve_index=False))
    r.save()  # the tables' records: a reader trusts only what the manifest records
    return run


@pytest.fixture(scope="module")
def normalized(tiny_run, tmp_path_factory):  # noqa: F811
    from ffkv.report.build import build

    tmp = tmp_path_factory.mktemp("normalized")
    run = _normalized_run(tiny_run, tmp)
    out, problems = build(run, tmp / "out" / "index.html")
    assert problems == []
    return out


def _overview(page: str) -> str:
    return page[page.index('<section id="overview">'):page.index('<section id="model">')]


# ---- the overview ----------------------------------------------------------------------------------
def test_overview_lists_the_claims_with_their_verdicts(normalized):
    from ffkv.steps.normalize import report as N

    page = normalized.read_text()
    ov = _overview(page)
    recs = {r["id"]: r for r in json.loads((normalized.parent / "verdicts.json").read_text())}
    assert [i for i in recs if i.startswith("norm_")] == CLAIMS  # records as they were
    want = {"norm_c1": N.HOLDS, "norm_c2": N.HOLDS, "norm_c3": N.NOT_HOLDS, "norm_c4": N.NOT_HOLDS,
            "norm_c5": N.NOT_HOLDS}
    for cid, verdict in want.items():
        assert recs[cid]["verdict"] == verdict
        row = re.search(rf'<tr><td><a href="#{cid}">(C\d)</a></td><td><span class="chip ([a-z-]+)">([^<]+)</span>', ov)
        assert row, cid
        assert row.group(1) == f"C{cid[-1]}" and row.group(3) == verdict
        assert row.group(2) == ("v-same" if verdict == N.HOLDS else "v-differs")
        assert f'id="{cid}"' in page  # the link lands on the claim's section
    assert "Beyond the paper, 5 claims" in ov and "2 holds" in ov and "3 does not hold" in ov


def test_overview_without_normalize_has_no_claims(report):  # noqa: F811
    assert "norm_c" not in _overview(report.read_text())


# ---- figure files --------------------------------------------------------------------------------------
def _png_size(p: Path) -> tuple[int, int]:
    from ffkv.report.html import png_size

    return png_size(p.read_bytes())


def test_pngs_are_twice_the_layout_size_and_shown_at_it(normalized):
    from ffkv.report import figures as F

    figs = normalized.parent / "figures"
    svgs = sorted(figs.glob("*.svg"))
    assert len(svgs) >= 5 + 2 and F.SCALE == 2
    page = normalized.read_text()
    for svg in svgs:
        png = svg.with_suffix(".png")
        w, h = _png_size(png)
        # the SVG's size is the figure's, in points (72 per inch)
        m = re.search(r'<svg[^>]* width="([0-9.]+)pt" height="([0-9.]+)pt"', svg.read_text())
        win, hin = float(m.group(1)) / 72, float(m.group(2)) / 72
        assert abs(w - win * F.DPI * 2) <= 2 and abs(h - hin * F.DPI * 2) <= 2, (png.name, w, h, win, hin)
        assert w >= 2 * 576 - 2 or png.name.startswith("keystats_hist")
    # the page shows each at its 1× size
    for m in re.finditer(r'<img src="data:image/png;base64,[^"]+" width="(\d+)" height="(\d+)"', page):
        assert int(m.group(1)) in range(500, 900)


def _all_figures(tiny_run):  # noqa: F811
    """Every figure the report draws, from the tiny run's tables and constructed normalize tables."""
    from ffkv.steps.compose import figures as compose
    from ffkv.steps.mine import report as K
    from ffkv.steps.mutate import figures as mutate
    from ffkv.steps.normalize import report as N
    from ffkv.steps.patterns import figures as patterns
    from ffkv.steps.values import figures as values
    from ffkv.store.run import Run

    run = Run(tiny_run)
    t = lambda n: run.read_table(n).to_pandas()  # noqa: E731
    out = {"fig2": patterns.fig2(t("patterns_fig2")), "fig3": mutate.fig3(t("mutations_layers")),
           "fig4": values.fig4(t("values_layers")), "fig5": values.fig5(t("values_layers")),
           "fig6": values.fig6(t("values_fig6"))}
    for f in ("fig7", "fig8", "fig9", "fig10", "fig11"):
        out[f] = getattr(compose, f)(t("compose_layers"), primary="norm")
    c = K.content(run)
    out["keystats_density"] = K.density_figure(c["per_key"])
    out["keystats_hist"] = K.histograms_figure(c["keys"], c["layout"])
    out["norm_c1"] = N.fig_concentration(_layers([1.0, 2.0, 0.5]))
    out["norm_c2"] = N.fig_capacity(_capacity([(16, 0.1), (64, 0.3), (256, 0.6), (1024, 0.9), (1536, 1.0)]))
    out["norm_c3"] = N.fig_variance(_variance(0.5, layers=8), "raw")
    out["norm_c4"] = N.fig_variance(_variance(0.5, layers=8), "scaled")
    out["norm_c5"] = N.fig_substitution(_layers([1.0, 2.0, 0.5]))
    for fig in out.values():
        fig.canvas.draw()
    return out


@pytest.fixture(scope="module")
def figures(tiny_run):  # noqa: F811
    return _all_figures(tiny_run)


def _tick_labels(ax, which: str):
    """The tick labels drawn (inside the view, with text), with their rendered boxes."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    lo, hi = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    r = ax.figure.canvas.get_renderer()
    out = []
    for tick in axis.get_major_ticks():
        if tick.label1.get_visible() and tick.label1.get_text() and lo <= tick.get_loc() <= hi:
            out.append((tick.label1.get_text(), tick.label1.get_window_extent(r)))
    return out


def test_no_tick_labels_overlap_on_c2(figures):
    fig = figures["norm_c2"]
    for ax in fig.axes:
        labels = _tick_labels(ax, "x")
        assert [t for t, _ in labels][-1] == "1536"  # the largest n stays named
        for (ta, a), (tb, b) in zip(labels, labels[1:]):
            assert not a.overlaps(b), (ta, tb)


def test_no_tick_labels_overlap_anywhere(figures):
    for name, fig in figures.items():
        for ax in fig.axes:
            for which in ("x", "y"):
                labels = _tick_labels(ax, which)
                for i, (ta, a) in enumerate(labels):
                    for tb, b in labels[i + 1:]:
                        assert not a.overlaps(b), (name, which, ta, tb)


def test_no_zero_tick_on_a_log_axis(figures):
    for name, fig in figures.items():
        for ax in fig.axes:
            for which in ("x", "y"):
                axis = ax.xaxis if which == "x" else ax.yaxis
                if axis.get_scale() != "log":
                    continue
                texts = [re.sub(r"[$\\{}]|mathdefault", "", t) for t, _ in _tick_labels(ax, which)]
                assert "0" not in texts, (name, which, texts)


def test_text_is_at_least_9_points(figures):
    from matplotlib.text import Text

    for name, fig in figures.items():
        for t in fig.findobj(Text):
            if t.get_visible() and t.get_text().strip():
                assert t.get_fontsize() >= 9, (name, t.get_text(), t.get_fontsize())


def test_titles_and_legends_fit_and_legends_cover_no_data(figures):
    """Nothing is clipped at the figure's edge; a legend sits outside every axes (below them)."""
    for name, fig in figures.items():
        r = fig.canvas.get_renderer()
        W, H = fig.bbox.width, fig.bbox.height
        for ax in fig.axes:
            for t in (ax.title, ax.xaxis.label, ax.yaxis.label):
                if t.get_text():
                    bb = t.get_window_extent(r)
                    assert bb.x0 >= -1 and bb.x1 <= W + 1 and bb.y0 >= -1 and bb.y1 <= H + 1, (name, t.get_text())
            leg = ax.get_legend()
            if leg is not None and name in ("fig5", "fig8"):
                raise AssertionError(f"{name}: the legend is inside the axes")
        for leg in fig.legends:
            lb = leg.get_window_extent(r)
            assert lb.y0 >= -1 and lb.x0 >= -1 and lb.x1 <= W + 1, name
            for ax in fig.axes:
                assert not lb.overlaps(ax.get_window_extent(r)), (name, "legend over an axes")


def test_c3_c4_legend_or_colour_bar_names_every_line(figures):
    """C3/C4's right panel: each layer's line is named, by the legend or a colour bar of the layers."""
    for name in ("norm_c3", "norm_c4"):
        fig = figures[name]
        right = fig.axes[1]
        layer_lines = [l for l in right.get_lines() if len(l.get_xdata()) > 1 and l.get_linestyle() == "-"]
        assert len(layer_lines) == 8
        bars = [a for a in fig.axes if a.get_label() == "<colorbar>"]
        named = {t for t in right.get_legend_handles_labels()[1] if t.startswith("layer")}
        assert len(named) == 8 or (bars and "layer" in bars[0].get_ylabel()), name


def test_paper_levels_are_drawn(figures):
    from ffkv.steps.compose import paper as compose
    from ffkv.steps.patterns import paper as patterns
    from ffkv.steps.values import paper as values

    REFERENCE = {e.id: e.reference for m in (patterns, values, compose) for e in vars(m).values()
                 if getattr(e, "reference", None)}
    assert sorted(REFERENCE) == ["fig2", "fig4", "fig7", "fig8", "fig9"]
    for sid, ref in REFERENCE.items():
        ax = figures[sid].axes[0]
        labels = ax.get_legend_handles_labels()[1]
        assert ref["label"] in labels, sid
        if "line" in ref:
            ys = [l.get_ydata()[0] for l in ax.get_lines() if l.get_label() == ref["label"]]
            assert ys and np.isclose(ys[0], ref["line"]), sid
    assert np.isclose(REFERENCE["fig9"]["line"], 100 / 3) and REFERENCE["fig8"]["line"] == 68
    assert REFERENCE["fig4"]["line"] == 3.5


def test_key_density_figure_shows_a_distribution(figures):
    """The density figure is histograms over keys (not per-layer lines that coincide)."""
    fig = figures["keystats_density"]
    a1, a2 = fig.axes[:2]
    assert "% of the keys" in a1.get_ylabel() and a2.get_xscale() == "log"
    assert len(a1.patches) >= 1  # step histograms


# ---- the page ----------------------------------------------------------------------------------
def test_alt_texts_say_what_each_figure_shows(report):  # noqa: F811
    page = report.read_text()
    alts = re.findall(r'<img src="data:image/png;base64,[^"]+"[^>]* alt="([^"]*)"', page)
    assert len(alts) == len(FIGURES) + 2
    for alt in alts:
        assert len(alt) > 120 and "axis" in alt and ("series" in alt or "bar chart" in alt), alt
    fig9 = page[page.index('id="fig9"'):page.index('id="fig10"')]
    alt9 = re.search(r' alt="([^"]*)"', fig9).group(1)
    assert "layer (0-based)" in alt9 and "% of examples" in alt9 and "about a third" in alt9


def test_describe_names_axes_series_and_reference():
    from ffkv.report import figures as F
    from ffkv.steps.compose import figures as compose

    df = pd.DataFrame({"layer": [0, 1, 2], "r_matches_final": [0.2, 0.5, 0.9], "o_matches_final": [1.0, 1.0, 1.0]})
    alt = F.describe(compose.fig9(df))
    assert "line chart" in alt and "x axis: layer (0-based)" in alt and "y axis: % of examples" in alt
    assert "top(r_ℓ) = final (20 to 100)" in alt and "reference: paper: about a third" in alt


def test_whitespace_token_is_shown_as_open_box_in_table1():
    """Table 1's marked trigger, and every token cell, show a whitespace token as ␣ (never empty)."""
    from ffkv.report.build import prefix_html
    from ffkv.report.html import tok

    assert "<mark>␣</mark>" in prefix_html("The cat sat on", " ")
    assert "<mark>␣␣</mark>" in prefix_html("The cat sat on", "  ")
    assert "<mark>↵</mark>" in prefix_html("The cat sat on", "\n")
    assert "<mark> the</mark>" in prefix_html("In", " the")  # inline, a word runs on
    assert tok(" ") == '<span class="tok">␣</span>' and tok(" the") == '<span class="tok">␣the</span>'
    assert tok("") == '<span class="tok">∅</span>' and tok("\n") == '<span class="tok">↵</span>'


def test_whitespace_trigger_in_table1_of_a_built_report(tiny_run, tmp_path):  # noqa: F811
    """A constructed case: a key whose top trigger ends on a whitespace-only token; Table 1 marks it ␣."""
    import pyarrow as pa

    from ffkv.report.build import build
    from ffkv.store.run import Run

    tables = ["sentences", "triggers", "vocab", "pattern_keys", "patterns"]
    run = copy_run(tiny_run, tmp_path / "run", tables, ["mine", "patterns"])
    r = Run(run)
    vocab = r.read_table("vocab").to_pandas()
    spaces = vocab[vocab["text"] == " "]
    if spaces.empty:
        pytest.skip("the tokenizer has no single-space token")
    ws_id = int(spaces["token_id"].iloc[0])
    trig = r.read_table("triggers").to_pandas()
    pk = r.read_table("pattern_keys").to_pandas()
    pk = pk[pk["n_patterns"] > 0].sort_values(["layer", "dim"])
    sent_t = r.read_table("sentences")
    sent = sent_t.to_pandas()
    for k in pk.itertuples():  # every analysed key's top trigger ends on a whitespace token now
        top = trig[(trig.layer == k.layer) & (trig.dim == k.dim) & (trig.sign == k.sign) & (trig["rank"] == 1)]
        for t in top.itertuples():
            i = sent.index[sent.sentence_id == t.sentence_id][0]
            ids = np.asarray(sent.at[i, "token_ids"], np.int32).copy()
            ids[int(t.position)] = ws_id
            sent.at[i, "token_ids"] = ids
    r.write_table("sentences", pa.Table.from_pandas(sent, schema=sent_t.schema, preserve_index=False))
    r.save()  # the new table's record (a report refuses a table other than the one recorded)
    out, problems = build(run, tmp_path / "out.html")
    page = out.read_text()
    t1 = page[page.index('id="table1"'):page.index('id="fig3"')]
    assert "<mark>␣</mark>" in t1 and "<mark></mark>" not in t1 and "<mark> </mark>" not in t1


# ---- the stylesheet ------------------------------------------------------------------------------
def _luminance(hex_: str) -> float:
    h = hex_.lstrip("#")
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    rgb = [int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: str, b: str) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_dark_scheme_is_honoured_with_enough_contrast():
    from importlib import resources

    css = resources.files("ffkv.report").joinpath("template.html").read_text(encoding="utf-8")
    assert "@media (prefers-color-scheme: dark)" in css
    dark = css[css.index("@media (prefers-color-scheme: dark)"):]

    def prop(sel: str, name: str, where: str = dark) -> str:
        m = re.search(r"(?:^|[\n{}])\s*" + re.escape(sel) + r"\s*\{([^}]*)\}", where)
        assert m, sel
        v = re.search(rf"(?<![-\w]){name}\s*:\s*(#[0-9a-fA-F]{{3,6}})", m.group(1))
        assert v, (sel, name)
        return v.group(1)

    text, page_bg, box = prop("body", "color"), prop("body", "background"), prop("section", "background")
    pairs = [(text, page_bg), (text, box), (text, prop("th", "background")), (text, prop("aside.paper", "background")),
             (prop("figcaption, .files", "color"), box), (prop("aside.paper .setup", "color"), prop("aside.paper", "background")),
             (prop(".criterion", "color"), prop(".v-same", "background")),
             (prop(".criterion", "color"), prop(".v-differs", "background")),
             (prop(".criterion", "color"), prop(".v-inconclusive", "background")),
             (prop(".criterion", "color"), prop(".v-na", "background")),
             (prop(".notes", "color"), prop(".notes", "background")), (prop(".missing", "color"), box),
             (prop("mark", "color"), prop("mark", "background")), (text, prop(".tok", "background")),
             (prop("a", "color"), box), (prop("a:visited", "color"), box),
             (prop("header.top p", "color"), prop("header.top", "background")),
             (prop(".kv td:first-child", "color"), box), (prop("details > summary", "color"), box)]
    for fg, bg in pairs:
        assert contrast(fg, bg) >= 4.5, (fg, bg, round(contrast(fg, bg), 2))
    light_links = css[:css.index("@media (prefers-color-scheme: dark)")]
    assert contrast(prop("a", "color", light_links), "#ffffff") >= 4.5
