"""What `ffkv compose` prints: the per-layer summary, read back from the run's tables (so a skipped
step reprints it)."""
from __future__ import annotations

import json
import sys

import numpy as np

from ffkv.defs import check_lens, other_lens, pct
from ffkv.steps.compose import ComposeSettings
from ffkv.steps.compose.compute import CATEGORIES, SHORT_PREFIX


def summary(run, out, s: ComposeSettings | None = None, as_json: bool = False) -> None:
    s = s or ComposeSettings()
    if as_json:
        print(json.dumps({"status": out.status, "info": out.info}, indent=2, default=str))
        return
    if out.skipped:
        print(f"compose: already done in {run.path} with these settings; summary below (--force to redo)",
              file=sys.stderr)
    print_summary(run, lens=s.lens, cases=s.cases)


def _pct(x) -> str:
    """`defs.pct` without the % sign (the columns say %), "–" for a missing value."""
    return "–" if x is None or x != x else pct(x, 1)[:-1]


def print_summary(run, lens: str = "norm", cases: int = 5, console=None) -> None:
    """The per-layer summary, read back from the run's tables (so a skipped step reprints it)."""
    from rich.console import Console
    from rich.table import Table

    check_lens(lens)
    con = console or Console(width=None if sys.stdout.isatty() else 200)
    other = other_lens(lens)
    lay = run.read_table("compose_layers").to_pylist()
    by = {(r["lens"], r["layer"]): r for r in lay}
    L = max(r["layer"] for r in lay) + 1
    eps = lay[0]["eps"]
    info = run.step("compose")
    n = lay[0]["n_examples"]
    t = Table(title=f"ffkv compose: {n} prefixes, lens={lens} (other lens={other} in brackets); % of examples")
    for c in ("layer", "active m>0", f"active |m|>ε\nε={eps:g}", "mass top10%",
              "Fig8 no single\nmemory", "Fig9 top(r)=w", "Fig10 mean\np(w|r)", "residual", "ffn",
              "agreement", "composition"):
        t.add_column(c, justify="right")
    for l in range(L):
        a, b = by[(lens, l)], by[(other, l)]
        t.add_row(str(l), _pct(a["active_mean"]), _pct(a["active_eps_mean"]), _pct(a["mass_top10"]),
                  f"{_pct(a['fig8_no_single_memory'])} [{_pct(b['fig8_no_single_memory'])}]",
                  f"{_pct(a['r_matches_final'])} [{_pct(b['r_matches_final'])}]",
                  f"{a['p_final_mean']:.3f} [{b['p_final_mean']:.3f}]",
                  *(f"{_pct(a[c])} [{_pct(b[c])}]" for c in CATEGORIES))
    t.add_row("out", "", "", "", "", f"{_pct(by[(lens, L - 1)]['o_matches_final'])} "
              f"[{_pct(by[(other, L - 1)]['o_matches_final'])}]", "", "", "", "", "")
    con.print(t)
    mine = [by[(lens, l)] for l in range(L)]
    mean = lambda k: float(np.nanmean([r[k] for r in mine]))  # noqa: E731
    con.print(f"Fig 7: active memories per layer, mean over layers: {_pct(mean('active_mean'))}% with "
              f"m>0, {_pct(mean('active_eps_mean'))}% with |m|>ε (ε={eps:g}); the top 1%/10%/50% of "
              f"memories carry {_pct(mean('mass_top1'))}/{_pct(mean('mass_top10'))}/"
              f"{_pct(mean('mass_top50'))}% of Σ|m|·‖v‖.")
    con.print(f"Fig 8, signed form (|m|>ε, top(sign(m)·v)): no single memory has the layer's top "
              f"prediction in {_pct(mean('fig8_no_single_memory_eps'))}% of example-layers "
              f"(paper's form m>0: {_pct(mean('fig8_no_single_memory'))}%).")
    pooled = (info.get("fig8_pooled") or {}).get(lens, {})
    con.print(f"Fig 8: where some active memory (m>0) has the layer's top prediction "
              f"({pooled.get('fig8_matched', '?')} example-layers), the target is a stop word in "
              f"{_pct(pooled.get('fig8_matched_stop_share'))}% and the prefix is shorter than "
              f"{SHORT_PREFIX} tokens in {_pct(pooled.get('fig8_matched_short_share'))}% "
              f"(paper: 60% and 43%).")
    if run.has_table("compose_lens_effect"):
        con.print(_lens_effect_text({r["quantity"]: r for r in run.read_table("compose_lens_effect").to_pylist()}))
    if run.has_table("compose_cases") and cases > 0:
        cs = run.read_table("compose_cases").to_pylist()
        mine = [c for c in cs if c["lens"] == lens]
        con.print(f"Last layer: the FFN changes the residual's top prediction in {len(mine)} of {n} "
                  f"examples (table compose_cases, random order in sample_order); the first {min(cases, len(mine))}:")
        for c in mine[:cases]:
            pre = c["prefix"] if len(c["prefix"]) <= 80 else "…" + c["prefix"][-79:]
            con.print(f"  {pre!r}: {c['top_r_token']!r} → {c['top_o_token']!r} ({c['category']}; "
                      f"target {c['target_token']!r})", markup=False, highlight=False)
    if info.get("seconds_pass") is not None:
        con.print(f"{info.get('prefixes')} prefixes, {info.get('tokens')} tokens: pass "
                  f"{info['seconds_pass']} s ({info.get('tokens_per_second')} tok/s), value tops "
                  f"{info.get('seconds_value_tops')} s; tables in {run.path}")


def _lens_effect_text(eff: dict) -> str:
    """How much the lens changes each curve, from `compose_lens_effect` rows by quantity."""
    parts = []
    for q, label in (("r_matches_final", "Fig 9"), ("p_final_mean", "Fig 10 mean p"),
                     ("residual", "Fig 11 residual"), ("ffn", "ffn"),
                     ("agreement", "agreement"), ("composition", "composition")):
        e = eff[q]
        if q == "p_final_mean":  # a probability, not a share of examples
            parts.append(f"{label} by {e['mean_abs_diff']:.3f} on average "
                         f"(max {e['max_abs_diff']:.3f} at layer {e['layer_of_max']})")
            continue
        parts.append(f"{label} by {100 * e['mean_abs_diff']:.1f} points on average "
                     f"(max {100 * e['max_abs_diff']:.1f} at layer {e['layer_of_max']})")
    return ("Lens choice (naive vs norm) changes " + "; ".join(parts) + ". "
            f"The final prediction w differs in {_pct(eff['w_differs']['mean_abs_diff'])}% of "
            f"examples and the Fig 11 category in {_pct(eff['category_differs']['mean_abs_diff'])}% "
            f"of example-layers.")
