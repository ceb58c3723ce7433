"""The facts steps' report sections: ROME's causal-tracing heatmaps averaged over the traced facts
with the verdict on ROME's finding (`fact_traces`), and the editors' scores (`fact_scores`).
Imported only when a report is built; drawn once the step has run."""
from __future__ import annotations

import numpy as np

from ffkv.report.html import esc, table
from ffkv.steps import ReportSection


def heatmaps(run):
    """Per kind the (6, L) mean indirect effect over facts by ROME's rows (`trace.GROUPS`), pooled
    as `trace.summary` pools them, read back from the table."""
    from ffkv.steps.facts.trace import GROUPS
    from ffkv.store import query

    t = query.table(run, "fact_traces", columns=["kind", "grp", "layer", "effect"]).to_pandas()
    L = int(t["layer"].max()) + 1 if len(t) else 0
    out = {}
    for kind, g in t[t["grp"] >= 0].groupby("kind", sort=False):
        m = g.groupby(["grp", "layer"])["effect"].mean()
        a = np.full((len(GROUPS), L), np.nan)
        for (gi, l), v in m.items():
            a[int(gi), int(l)] = v
        out[kind] = a
    return out


def figure(maps: dict):
    from ffkv.report.figures import new_panels, styled
    from ffkv.steps.facts.trace import GROUPS

    titles = {"hidden": "the residual stream restored", "ffn": "the FFN's output restored (window)",
              "attn": "attention's output restored (window)"}
    cmaps = {"hidden": "Purples", "ffn": "Greens", "attn": "Reds"}

    @styled
    def draw():
        fig, axes = new_panels(len(maps), size=(4.0 * len(maps), 3.2))
        axes = axes if isinstance(axes, (list, tuple, np.ndarray)) else [axes]
        for ax, (k, a) in zip(axes, maps.items()):
            im = ax.imshow(a, aspect="auto", cmap=cmaps.get(k, "viridis"), interpolation="nearest")
            ax.set_yticks(range(len(GROUPS)), [g if ax is axes[0] else "" for g in GROUPS], fontsize=7)
            ax.set_xlabel("layer")
            ax.set_title(f"IE: {titles.get(k, k)}", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.05)
        return fig

    return draw()


def sections(run, fig_dir) -> list:
    from ffkv.report.build import figure_html
    from ffkv.report.figures import save

    info = run.step("facts") or {}
    maps = heatmaps(run)
    if not maps:
        return []
    fig = figure_html(save(figure(maps), fig_dir, "fact_traces"), "Causal tracing: mean indirect effect by layer")
    rows, verdicts = [], []
    for kind, v in (info.get("verdicts") or {}).items():
        rows.append([kind, v["verdict"], f"{v['difference']:+.4f}", f"[{v['low']:+.4f}, {v['high']:+.4f}]",
                     v["facts_judged"], v["peak_layer"], f"{v['peak_depth']:.2f}"])
        verdicts.append({"id": f"facts_trace_{kind}", "claim": "ROME: the effect peaks at the last subject token",
                         "verdict": v["verdict"], "kind": kind, "low": v["low"], "high": v["high"]})
    note = (f"<p>{info.get('facts', 0)} facts; P(true object) clean {info.get('p_clean', float('nan')):.3f}, with the "
            f"subject noised {info.get('p_corrupt', float('nan')):.3f} (noise {esc(str((run.manifest.get('settings') or {}).get('facts', {}).get('noise', 3)))}"
            f" × σ, σ = {info.get('sigma', float('nan')):.4g}). Each cell: P with one state restored at that token "
            f"and layer, less P corrupted (Meng et al. 2022). Verdict: the mean over layers of the effect at the "
            f"last subject token less that at the subject's other tokens, 95% bootstrap interval over facts.</p>")
    html = fig + note + (table(["restored", "verdict", "difference", "interval", "facts", "peak layer", "peak depth"],
                               rows, num={2, 4, 5, 6}) if rows else "")
    return [ReportSection("facts_trace", "Where facts are recalled: causal tracing", html, verdicts=tuple(verdicts),
                          short="Causal tracing")]


def evaluate_sections(run, fig_dir) -> list:
    info = run.step("facts_evaluate") or {}
    scores = info.get("scores") or {}
    if not scores:
        return []

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.1f}%"

    rows = [[m, pct(a["efficacy"]), pct(a["generalization"]), pct(a["specificity"]), pct(a["score"]),
             "n/a" if a["fluency"] is None else f"{a['fluency']:.2f}"] for m, a in scores.items()]
    note = (f"<p>{info.get('facts')} known facts; ROME and values at layer {info.get('layer')}, MEMIT at layers "
            f"{info.get('memit_layers', [0])[0]}–{info.get('memit_layers', [0])[-1]}. Efficacy, generalization "
            "and specificity (EasyEdit: rewrite_acc, rephrase_acc, locality) as ROME defines them; score their "
            "harmonic mean; fluency the bigram/trigram entropy of greedy generations (ngram_entropy).</p>")
    html = note + table(["method", "efficacy", "generalization", "specificity", "score", "fluency"], rows,
                        num={1, 2, 3, 4, 5})
    return [ReportSection("facts_evaluate", "Editing facts: ROME, MEMIT and the values alone", html,
                          short="Fact edits")]
