"""Each verdict function on constructed tables whose right answer is known: "same trend",
"differs" and "inconclusive" (and "not comparable" where the paper's measure does not apply)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ffkv.report import stats as S
from ffkv.report.stats import DIFFERS, INCONCLUSIVE, NA, SAME
from ffkv.steps.compose import verdicts as compose
from ffkv.steps.mutate import verdicts as mutate
from ffkv.steps.patterns import verdicts as patterns
from ffkv.steps.values import verdicts as values


def layers_frame(n: int, **cols) -> pd.DataFrame:
    """One row per layer; each column value is a function of the relative depth t in [0, 1]."""
    t = np.linspace(0, 1, n)
    return pd.DataFrame({"layer": np.arange(n, dtype=np.int16), **{k: f(t) for k, f in cols.items()}})


# ---- thirds by relative depth -------------------------------------------------------------------
@pytest.mark.parametrize("n, bottom, top", [
    (16, [0, 1, 2, 3, 4], [11, 12, 13, 14, 15]),
    (30, list(range(10)), list(range(20, 30))),
    (3, [0], [2]),
    (2, [0], [1]),
])
def test_thirds_by_relative_depth(n, bottom, top):
    b, m, t = S.thirds(range(n), n)
    assert b == bottom and t == top
    assert sorted(b + m + t) == list(range(n))


def test_thirds_use_the_model_depth_not_the_tables_layers():
    # only layers 0..3 of a 30-layer model were analysed: no top third
    b, m, t = S.thirds([0, 1, 2, 3], 30)
    assert b == [0, 1, 2, 3] and t == []


def test_spearman():
    assert S.spearman([1, 2, 3, 4], [10, 20, 25, 40]) == pytest.approx(1.0)
    assert S.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(S.spearman([1, 2, 3], [0, 0, 0]))


def test_missing_table_is_not_comparable_and_names_the_command():
    for fn, args, cmd in [(patterns.fig2, (), "patterns"), (mutate.fig3, (), "mutate"), (values.fig4, (), "values"),
                          (values.fig5, (), "values"), (values.fig6, (), "values"), (values.table2, (16,), "values"),
                          (compose.fig7, ("relu", False), "compose"), (compose.fig8, (), "compose"),
                          (compose.fig9, (), "compose"), (compose.fig10, (), "compose"), (compose.fig11, (), "compose"),
                          (compose.cases, (), "compose"), (patterns.table1, (), "patterns")]:
        v = fn(None, *args)
        assert v.verdict == NA, fn.__name__
        assert f"ffkv {cmd} RUN" in v.criterion, fn.__name__


# ---- Fig 2 --------------------------------------------------------------------------------------------
def fig2_table(n, shallow, semantic, scope=True):
    df = layers_frame(n, shallow=shallow, semantic=semantic, both=lambda t: 0.05 + 0 * t)
    df["not_covered"] = 1 - df[["shallow", "semantic", "both"]].sum(axis=1)
    df["prefixes"] = 250
    df["keys"] = 10
    if scope:
        df["scope"] = "semantic_sample"
        other = df.copy()
        other["scope"] = "all"  # the opposite trend in the other scope must be ignored
        other["shallow"], other["semantic"] = df["semantic"], df["shallow"]
        df = pd.concat([df, other])
    return df


def test_fig2_same_trend():
    v = patterns.fig2(fig2_table(16, lambda t: 0.6 - 0.4 * t, lambda t: 0.05 + 0.4 * t))
    assert v.verdict == SAME
    assert "shallow only" in v.measured


def test_fig2_differs_when_semantic_does_not_rise():
    v = patterns.fig2(fig2_table(30, lambda t: 0.6 - 0.4 * t, lambda t: 0.3 - 0.2 * t))
    assert v.verdict == DIFFERS


def test_fig2_differs_when_shallow_rises():
    assert patterns.fig2(fig2_table(16, lambda t: 0.2 + 0.3 * t, lambda t: 0.05 + 0.3 * t)).verdict == DIFFERS


def test_fig2_human_rows_and_no_semantic():
    rows = fig2_table(16, lambda t: 0.6 - 0.4 * t, lambda t: 0.05 + 0.4 * t, scope=False).to_dict("records")
    assert patterns.fig2(rows, source="human").verdict == SAME
    assert patterns.fig2(pa.Table.from_pylist(rows)).verdict == SAME
    v = patterns.fig2(rows, semantic_ran=False)
    assert v.verdict == NA and "no-semantic" in v.measured


def test_fig2_weights_layers_by_prefixes():
    df = fig2_table(3, lambda t: 0.5 + 0 * t, lambda t: 0.1 + 0 * t, scope=False)
    assert patterns.fig2(df).verdict == INCONCLUSIVE  # flat: neither share moves, a difference of 0 ± its interval
    # two bottom-third layers... only one per third for 3 layers; weights matter with several layers
    df = fig2_table(6, lambda t: 0.5 + 0 * t, lambda t: 0.1 + 0 * t, scope=False)
    df.loc[df.layer == 0, ["shallow", "semantic"]] = [0.9, 0.0]
    df.loc[df.layer == 1, ["shallow", "semantic"]] = [0.1, 0.2]
    df.loc[df.layer == 0, "prefixes"] = 1000  # layer 0 dominates the bottom third
    df.loc[df.layer == 1, "prefixes"] = 10
    # bottom pooled shallow ≈ 0.89 > top 0.5; semantic bottom ≈ 0.002 < top 0.1
    assert patterns.fig2(df).verdict == SAME


# ---- Fig 3 --------------------------------------------------------------------------------------------
def mutations_layers(n, first, last, random):
    rows = []
    for l in range(n):
        for m, v in (("first", first), ("last", last), ("random", random)):
            rows.append({"layer": l, "mutation": m, "n": 50, "n_skipped": 0, "mean": v, "q25": v - 0.1,
                         "median": v, "q75": v + 0.1, "share_lower": 0.9})
    return pd.DataFrame(rows)


def test_fig3_same_trend():
    v = mutate.fig3(mutations_layers(16, first=-0.05, last=-0.6, random=-0.2))
    assert v.verdict == SAME
    assert "last -0.60" in v.measured


def test_fig3_differs():
    assert mutate.fig3(mutations_layers(16, first=-0.6, last=-0.1, random=-0.2)).verdict == DIFFERS


def test_fig3_inconclusive_when_one_layer_flips_the_average():
    df = mutations_layers(4, first=-0.1, last=-0.3, random=-0.2)
    # one layer where the first token matters enormously flips the average, but last < first in 3
    # of 4 layers: the sign test cannot tell (p = 0.625)
    df.loc[(df.layer == 0) & (df.mutation == "first"), "median"] = -2.0
    v = mutate.fig3(df)
    assert v.verdict == INCONCLUSIVE and "3 of 4" in v.measured


# ---- Fig 4 --------------------------------------------------------------------------------------------
def values_layers(n, agree, shuffled=lambda t: 0.001 + 0 * t, rank=lambda t: 1000 - 900 * t):
    df = layers_frame(n, agreement=agree, shuffled=shuffled, rank_median=rank)
    df["n"] = 4000
    df["n_agree"] = (df["agreement"] * df["n"]).round().astype(int)
    df["agreement"] = df["n_agree"] / df["n"]
    df["shuffled_rank_median"] = 20000.0
    return df


def test_fig4_same_trend():
    assert values.fig4(values_layers(16, lambda t: np.where(t > 0.6, 0.035 * t, 0.0))).verdict == SAME


def test_fig4_inconclusive_when_flat_at_chance():
    v = values.fig4(values_layers(16, lambda t: 0.0 * t, shuffled=lambda t: 0.0 * t))
    assert v.verdict == INCONCLUSIVE and "not above it" in v.measured
    # zero agreement where chance gives 0.1% of 20,000: clearly below chance
    assert values.fig4(values_layers(16, lambda t: 0.0 * t)).verdict == DIFFERS


def test_fig4_inconclusive_when_rising_but_not_above_chance():
    # a significant rise that stays inside the shuffled baseline's reach
    v = values.fig4(values_layers(16, lambda t: 0.001 + 0.004 * t, shuffled=lambda t: 0.0045 + 0 * t))
    assert v.verdict == INCONCLUSIVE


def test_fig4_lens_column():
    a = values_layers(16, lambda t: np.where(t > 0.6, 0.035 * t, 0.0))
    b = values_layers(16, lambda t: 0.03 * (1 - t))
    a.insert(0, "lens", "naive")
    b.insert(0, "lens", "norm")
    df = pd.concat([a, b])
    assert values.fig4(df, lens="naive").verdict == SAME and values.fig4(df, lens="norm").verdict == DIFFERS


def test_fig4_differs_when_below_shuffled_baseline():
    v = values.fig4(values_layers(16, lambda t: 0.001 + 0.004 * t, shuffled=lambda t: 0.02 + 0 * t))
    assert v.verdict == DIFFERS


def test_fig4_differs_when_it_falls():
    assert values.fig4(values_layers(30, lambda t: 0.03 * (1 - t))).verdict == DIFFERS


def test_fig4_layers_without_evaluated_memories_are_skipped():
    df = values_layers(16, lambda t: 0.03 * t)
    df.loc[df.layer >= 11, ["n", "n_agree"]] = 0
    assert values.fig4(df).verdict == NA


# ---- Fig 5 --------------------------------------------------------------------------------------------
def test_fig5_same_trend():
    assert values.fig5(values_layers(16, lambda t: 0 * t, rank=lambda t: 5000 - 4900 * t)).verdict == SAME


def test_fig5_differs():
    assert values.fig5(values_layers(16, lambda t: 0 * t, rank=lambda t: 100 + 4900 * t)).verdict == DIFFERS


def test_fig5_inconclusive_when_flat_or_not_better_than_shuffled():
    noisy = lambda t: 17500 + 200 * np.sin(40 * t)  # flat up to noise: the layers cannot tell
    assert values.fig5(values_layers(30, lambda t: 0 * t, rank=noisy)).verdict == INCONCLUSIVE
    df = values_layers(16, lambda t: 0 * t, rank=lambda t: 30000 - 4900 * t)
    v = values.fig5(df)  # falls, but stays above the shuffled pairing's 20,000
    assert v.verdict == INCONCLUSIVE and "beaten in 0%" in v.measured


# ---- Fig 6 --------------------------------------------------------------------------------------------
def fig6_table(agree, n=100):
    b = np.arange(10)
    agree = np.asarray(agree, float)
    return pd.DataFrame({"bin": b, "lo": b / 10, "hi": (b + 1) / 10, "n": n, "n_agree": np.round(agree * n),
                         "agreement": agree, "ci_low": 0.0, "ci_high": 1.0, "mean_max_prob": (b + 0.5) / 10})


def test_fig6_same_trend():
    assert values.fig6(fig6_table([0, 0, 0, 0, 0.001, 0.002, 0.002, 0.01, 0.03, 0.08])).verdict == SAME


def test_fig6_differs_when_falling():
    assert values.fig6(fig6_table([0.08, 0.03, 0.01, 0.01, 0.01, 0, 0, 0, 0, 0])).verdict == DIFFERS


def test_fig6_inconclusive_when_flat():
    v = values.fig6(fig6_table([0.0] * 10))
    assert v.verdict == INCONCLUSIVE and "constant" in v.measured


def test_fig6_differs_when_only_the_end_points_rise():
    # highest bin significantly above the lowest, but agreement mostly falls across the bins: ρ < 0
    agree = [0.01, 0.09, 0.08, 0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.02]
    assert values.fig6(fig6_table(agree, n=100_000)).verdict == DIFFERS
    assert values.fig6(fig6_table(agree, n=100)).verdict == INCONCLUSIVE  # 1 vs 2 of 100: within the interval


# ---- Table 2 ------------------------------------------------------------------------------------------
def table2_rows(layers):
    return pd.DataFrame({"position": np.arange(1, len(layers) + 1), "layer": layers,
                         "n_agree": [1 if i % 2 else 0 for i in range(len(layers))]})


def test_table2_same_trend():
    # 30 layers: the paper's upper part (depth ≥ 10/16) is layers 19..29
    v = values.table2(table2_rows([29] * 60 + [20] * 30 + [3] * 10), 30)
    assert v.verdict == SAME
    assert "90 of 100" in v.measured and "50 of 100 have" in v.measured


def test_table2_differs():
    assert values.table2(table2_rows([0] * 50 + [10] * 30 + [25] * 20), 30).verdict == DIFFERS


def test_table2_upper_part_of_the_paper():
    v = values.table2(table2_rows([10] * 80 + [9] * 20), 16)  # 0-based 10 = the paper's layer 11
    assert v.verdict == SAME and "layers 10–15" in v.criterion


def test_table2_inconclusive_near_half():
    v = values.table2(table2_rows([10] * 51 + [9] * 49), 16)  # 51%: its interval holds 50%
    assert v.verdict == INCONCLUSIVE


# ---- Fig 7 --------------------------------------------------------------------------------------------
def compose_layers(n, lenses=("norm",), **cols):
    frames = []
    for lens in lenses:
        df = layers_frame(n, **cols)
        df.insert(0, "lens", lens)
        df["n_examples"] = 4000
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def test_fig7_same_trend_for_relu():
    dip = lambda t: 0.4 - 0.5 * t * (1 - t) * 1.2  # 40% at the ends, lowest in the middle
    df = compose_layers(16, active_mean=dip, active_eps_mean=dip)
    assert compose.fig7(df, "relu", gated=False).verdict == SAME


def test_fig7_differs_without_a_dip():
    df = compose_layers(16, active_mean=lambda t: 0.1 + 0.3 * t, active_eps_mean=lambda t: 0.1 + 0.3 * t)
    assert compose.fig7(df, "relu", gated=False).verdict == DIFFERS


def test_fig7_differs_when_almost_everything_fires():
    dip = lambda t: 0.9 - 0.1 * t * (1 - t)
    assert compose.fig7(compose_layers(16, active_mean=dip, active_eps_mean=dip), "gelu_new", gated=False).verdict == DIFFERS


def test_fig7_not_comparable_for_gated_silu():
    dip = lambda t: 0.4 - 0.5 * t * (1 - t) * 1.2  # would pass for ReLU
    v = compose.fig7(compose_layers(30, active_mean=dip, active_eps_mean=dip), "silu", gated=True)
    assert v.verdict == NA and "symmetric" in v.criterion and "%" in v.measured


def n90_layers(n, n90):
    return compose_layers(n, n90_mean=n90, n90_median=n90, active_mean=lambda t: 0.5 + 0 * t,
                          active_eps_mean=lambda t: 0.3 + 0 * t).assign(d_m=1536)


def test_fig7_scale_free_same_trend_even_for_gated():
    dip = lambda t: 600 - 1000 * t * (1 - t)  # 600 at the ends, 350 in the middle
    v = compose.fig7(n90_layers(30, dip), "silu", gated=True)
    assert v.verdict == SAME and "n90" in v.criterion


def test_fig7_scale_free_differs_with_few_memories():
    dip = lambda t: 60 - 100 * t * (1 - t)
    assert compose.fig7(n90_layers(30, dip), "silu", gated=True).verdict == DIFFERS


def test_fig7_scale_free_inconclusive_without_a_clear_dip():
    flat = lambda t: 500 + 20 * np.sin(50 * t)
    assert compose.fig7(n90_layers(30, flat), "relu", gated=False).verdict == INCONCLUSIVE


# ---- Fig 8 --------------------------------------------------------------------------------------------
def fig8_variants(n, obs, shuffled, gated=True):
    col = "fig8_no_match_rel" if gated else "fig8_no_single_memory"
    sh = "fig8_shuffled_rel" if gated else "fig8_shuffled_paper"
    cols = {c: (lambda t: 0.5 + 0 * t) for c in ("fig8_no_single_memory", "fig8_no_single_memory_eps",
                                                 "fig8_no_match_signed", "fig8_no_match_code", "fig8_no_match_rel",
                                                 "fig8_shuffled_paper", "fig8_shuffled_signed",
                                                 "fig8_shuffled_code", "fig8_shuffled_rel")}
    cols[col], cols[sh] = obs, shuffled
    df = compose_layers(n, **cols)
    df["fig8_shuffled_n"] = df["n_examples"]
    df["fig8_hub_share"] = 0.3
    df["fig8_no_match_rel_nohub"] = 0.8
    return df


def test_fig8_variants_same_trend_against_the_shuffled_baseline():
    v = compose.fig8(fig8_variants(30, lambda t: 0.75 + 0 * t, lambda t: 0.9 + 0 * t), gated=True)
    assert v.verdict == SAME
    assert "code" in v.measured and "hub" in v.measured and "top(o" in v.criterion


def test_fig8_variants_differ_below_the_papers_share():
    v = compose.fig8(fig8_variants(30, lambda t: 0.4 + 0 * t, lambda t: 0.9 + 0 * t), gated=True)
    assert v.verdict == DIFFERS


def test_fig8_variants_inconclusive_at_chance():
    v = compose.fig8(fig8_variants(30, lambda t: 0.7 + 0 * t, lambda t: 0.7 + 0 * t, gated=False), gated=False)
    assert v.verdict == INCONCLUSIVE

def test_fig8_same_trend():
    df = compose_layers(16, fig8_no_single_memory=lambda t: 0.7 + 0.2 * t,
                        fig8_no_single_memory_eps=lambda t: 0.1 + 0 * t)
    assert compose.fig8(df).verdict == SAME  # paper's form for a ReLU model; the eps column is ignored


def test_fig8_differs():
    df = compose_layers(16, fig8_no_single_memory=lambda t: np.where(t > 0.5, 0.4, 0.9),
                        fig8_no_single_memory_eps=lambda t: 0.9 + 0 * t)
    assert compose.fig8(df).verdict == DIFFERS


def test_fig8_gated_uses_the_signed_form():
    df = compose_layers(30, fig8_no_single_memory=lambda t: 0.3 + 0 * t,
                        fig8_no_single_memory_eps=lambda t: 0.8 + 0 * t)
    assert compose.fig8(df, gated=True).verdict == SAME
    assert compose.fig8(df, gated=False).verdict == DIFFERS


def test_fig8_threshold_widens_with_few_examples():
    df = compose_layers(16, fig8_no_single_memory=lambda t: 0.62 + 0 * t,
                        fig8_no_single_memory_eps=lambda t: 0.62 + 0 * t)
    assert compose.fig8(df).verdict == DIFFERS  # n = 4000: 0.62 is below 0.68 − 2·SE ≈ 0.665
    df["n_examples"] = 100
    assert compose.fig8(df).verdict == SAME  # n = 100: threshold ≈ 0.587


# ---- Figs 9–11: lens handling -----------------------------------------------------------------------
def test_fig9_same_trend():
    df = compose_layers(16, r_matches_final=lambda t: 0.3 + 0.6 * t ** 3, o_matches_final=lambda t: 0.4 + 0.6 * t)
    assert compose.fig9(df).verdict == SAME


def test_fig9_differs_when_not_rising():
    df = compose_layers(16, r_matches_final=lambda t: 0.5 - 0.3 * t, o_matches_final=lambda t: 0.4 + 0.6 * t)
    assert compose.fig9(df).verdict == DIFFERS


def test_fig9_differs_when_the_level_is_far_from_a_third():
    df = compose_layers(16, r_matches_final=lambda t: 0.05 + 0.9 * t ** 3, o_matches_final=lambda t: 0.4 + 0.6 * t)
    v = compose.fig9(df)
    assert v.verdict == DIFFERS and "level" in v.measured


def test_fig9_inconclusive_when_flat():
    df = compose_layers(16, r_matches_final=lambda t: 0.33 + 0 * t, o_matches_final=lambda t: 0.4 + 0.6 * t)
    assert compose.fig9(df).verdict == INCONCLUSIVE


def test_fig9_differs_when_the_end_point_is_not_one():
    df = compose_layers(16, r_matches_final=lambda t: 0.3 + 0.6 * t, o_matches_final=lambda t: 0.4 + 0.5 * t)
    assert compose.fig9(df).verdict == DIFFERS


def test_fig10_same_trend_and_lens_choice():
    up, down = (lambda t: 0.05 + 0.5 * t), (lambda t: 0.5 - 0.4 * t)
    a = compose_layers(16, lenses=("naive",), p_final_mean=down)
    b = compose_layers(16, lenses=("norm",), p_final_mean=up)
    df = pd.concat([a, b])
    assert compose.fig10(df, lens="norm").verdict == SAME
    assert compose.fig10(df, lens="naive").verdict == DIFFERS
    assert compose.fig10(df).verdict == SAME  # default: the norm lens


def test_fig10_inconclusive_when_flat():
    df = compose_layers(16, p_final_mean=lambda t: 0.2 + 0.01 * np.sin(40 * t))
    assert compose.fig10(df).verdict == INCONCLUSIVE


@pytest.mark.parametrize("residual, agreement, composition, ffn, verdict", [
    (0.5, 0.3, 0.15, 0.05, SAME),
    (0.3, 0.2, 0.3, 0.2, INCONCLUSIVE),  # residual share at one half: no majority either way
    (0.5, 0.3, 0.05, 0.15, DIFFERS),  # the FFN alone beats composition
    (0.2, 0.1, 0.6, 0.1, DIFFERS),  # no residual majority
])
def test_fig11(residual, agreement, composition, ffn, verdict):
    shares = dict(residual=residual, agreement=agreement, composition=composition, ffn=ffn)
    df = compose_layers(16, **{k: (lambda t, v=v: v + 0 * t) for k, v in shares.items()})
    assert compose.fig11(df).verdict == verdict


def test_interval_helpers_against_closed_forms():
    d, lo, hi = S.diff_ci(30, 100, 10, 100)
    se = np.sqrt(0.3 * 0.7 / 100 + 0.1 * 0.9 / 100)
    assert (d, lo, hi) == pytest.approx((0.2, 0.2 - 1.959964 * se, 0.2 + 1.959964 * se), rel=1e-5)
    lo, hi = S.wilson_ci(0, 49152)
    assert lo == 0 and hi == pytest.approx(1.959964 ** 2 / (49152 + 1.959964 ** 2), rel=1e-4)
    assert S.by_test(*S.layers_test([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])) == DIFFERS
    assert S.by_test(*S.layers_test([1], [6])) == INCONCLUSIVE




# ---- qualitative sections -----------------------------------------------------------------------------
def test_cases_and_table1_are_read_not_judged():
    c = pd.DataFrame({"lens": ["norm"] * 4 + ["naive"], "category": ["composition"] * 3 + ["ffn"] * 2})
    v = compose.cases(c, lens="norm")
    assert v.verdict == NA and "4 last-layer cases" in v.measured and "75.0%" in v.measured
    pk = pd.DataFrame({"n_patterns": [0, 1, 3, 2]})
    v = patterns.table1(pk)
    assert v.verdict == NA and "75.0%" in v.measured
