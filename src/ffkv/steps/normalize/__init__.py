"""The `normalize` step as one unit: its settings (from which `ffkv normalize` is generated),
what the manifest records, its sizing inside `reproduce`, and its summary. The measures and the
tables' columns are in `ffkv.steps.normalize.compute` (the printed summary in `.summary`), imported
only when the step runs."""
from __future__ import annotations

from dataclasses import dataclass

from ffkv.errors import FfkvError
from ffkv.steps.settings import a_seed, at_least, between, budget, setting
from ffkv.steps.lifecycle import Step
from ffkv.steps import lazy

DEFAULT_CORPUS = "wikipedia:valid"
TABLES = ("normalize_sentences", "normalize_layers", "normalize_capacity", "normalize_variance")
CAPACITY_DEPTHS = (1 / 6, 1 / 2, 5 / 6)  # low, middle, high


def layer_list(what: str, none_ok: bool = False):
    """A parser of layer lists for `what` (all/auto/empty: None; `none`, when allowed: no layer)."""
    def parse(text):
        from ffkv.parse import parse_ranges

        if text is None or str(text).strip() in ("", "all", "auto"):
            return None
        if none_ok and str(text).strip() == "none":
            return ()
        out = parse_ranges(text, what)
        if not out:
            raise FfkvError(f"{what} {text!r} selects nothing")
        return tuple(out)
    return parse


def _slot_counts(text):
    from ffkv.parse import parse_ranges

    return tuple(parse_ranges(text, "--capacity-n")) if str(text).strip() else None


def _positive(v):
    return None if 0 < v < float("inf") else f"must be a positive finite number (got {v})"


def _each_at_least_1(v):
    return None if not v or min(v) >= 1 else f"every n must be at least 1 (got {min(v)})"


_budget = budget(1)  # --batch-tokens: parse, check


@dataclass(frozen=True)
class NormalizeSettings:
    """`ffkv normalize`'s options. All but `batch_tokens` (speed only) are recorded."""
    corpus: str | None = setting(None, "Held-out text: wikipedia:valid (default), a .tokens/.jsonl/.txt file, "
                                       "hf:NAME[:SPLIT].", reproduce="--compose-corpus")
    tokens: int = setting(10_000, "Tokens of the evaluation split (losses, concentration).", check=at_least(1))
    fit_tokens: int = setting(2_000, "Tokens of the fit split (τ and scales), from other documents.",
                              check=at_least(1))
    sweep_tokens: int = setting(3_000, "The first evaluation tokens that also get the capacity sweep and the "
                                       "variance on the model (0: neither).", check=at_least(0))
    layers: tuple[int, ...] | None = setting(None, "Layers to measure and substitute, e.g. 0-29 or 0,10,20 "
                                                   "(default: all).", parse=layer_list("--layers"))
    capacity_layers: tuple[int, ...] | None = setting(
        None, "Layers of the capacity sweep (default: a low, a middle and a high one; none: no sweep).",
        parse=layer_list("--capacity-layers", none_ok=True))
    capacity_n: tuple[int, ...] | None = setting(
        None, "Slot counts of the sweep, e.g. 16,64,256 (default: 16, 64, 256, … below d_m; d_m is always added).",
        parse=_slot_counts, check=_each_at_least_1)
    variance_repeats: int = setting(4, "Random memory subsets per size for the variance on the model.",
                                    check=between(2, 1_000))
    synthetic_draws: int = setting(2_000, "Samples per n of the synthetic variance check (at most 10^7: "
                                          "80 MB and minutes of draws).", check=between(10, 10_000_000))
    gamma: float = setting(1.0, "γ of the scaled ReLU in the variance measures.", check=_positive)
    seed: int = setting(0, "Seed of the document order and of the random slot draws.", check=a_seed)
    batch_tokens: int | str = setting("auto", "Token budget of one forward batch (speed and memory only): auto "
                                      "(1024 on a CPU; sized from free memory on CUDA) or a number.",
                                      check=_budget[1], parse=_budget[0], recorded=False)
    dtype: str = setting("auto", "The model's dtype (the command's --dtype).")


def default_capacity_layers(L: int) -> list[int]:
    return sorted({min(L - 1, max(0, round(q * L - 0.5))) for q in CAPACITY_DEPTHS})


def default_capacity_n(d_m: int) -> list[int]:
    out, n = [], 16
    while n < d_m:
        out.append(n)
        n *= 4
    return out


def reproduce_settings(n_layers: int, corpus: str | None = None, seed: int = 0,
                       dtype: str = "auto") -> NormalizeSettings:
    """What `ffkv reproduce` runs: sized to add ≤ 2 minutes on SmolLM2 on a 2-core CPU
    (`benchmarks/bench_normalize.py --only reproduce`). Every ⌈L/8⌉-th layer, the capacity sweep
    on the studied layers nearest to low, middle and high, fewer tokens and slot counts."""
    stride = -(-n_layers // 8)
    layers = tuple(range(0, n_layers, stride))
    cap = tuple(sorted({min(layers, key=lambda l: (abs(l - c), l)) for c in default_capacity_layers(n_layers)}))
    return NormalizeSettings(corpus=corpus, tokens=2_000, fit_tokens=600, sweep_tokens=600, layers=layers,
                             capacity_layers=cap, capacity_n=(16, 128, 1024), variance_repeats=2,
                             synthetic_draws=1_000, seed=seed, dtype=dtype)


def reproduce(r, mm) -> NormalizeSettings:
    """`ffkv reproduce`'s normalize: its ≤ 2-minute sizing, or the command's defaults (--preset full),
    on reproduce's held-out corpus (--compose-corpus) like compose."""
    if r.preset == "full":
        return NormalizeSettings(corpus=r.compose_corpus, seed=r.seed, dtype=r.dtype)
    return reproduce_settings(int(mm.n_layers), corpus=r.compose_corpus, seed=r.seed, dtype=r.dtype)


def record(run, s: NormalizeSettings) -> dict:
    """The manifest's settings; layers are checked against the run's model before any model loads."""
    L = (run.manifest.get("model") or {}).get("layers")
    if L:
        for what, ls in (("--layers", s.layers), ("--capacity-layers", s.capacity_layers)):
            bad = [l for l in ls or () if not 0 <= l < int(L)]
            if bad:
                raise FfkvError(f"{what}: layer(s) {bad} out of range 0..{int(L) - 1}")
    return {"corpus": s.corpus or DEFAULT_CORPUS, "tokens": s.tokens, "fit_tokens": s.fit_tokens,
            "sweep_tokens": s.sweep_tokens, "layers": sorted(s.layers) if s.layers else None,
            "capacity_layers": None if s.capacity_layers is None else sorted(s.capacity_layers),
            "capacity_n": sorted(s.capacity_n) if s.capacity_n else None,
            "variance_repeats": s.variance_repeats, "synthetic_draws": s.synthetic_draws,
            "gamma": float(s.gamma), "seed": s.seed, "dtype": s.dtype}


STEP = Step(name="normalize", settings=NormalizeSettings, requires=(), tables=TABLES,
            compute=lazy("ffkv.steps.normalize.compute:compute"), record=record, cli=True,
            summary=lazy("ffkv.steps.normalize.summary:summary"), reproduce=reproduce,
            sections=lazy("ffkv.steps.normalize.report:sections"),
            report_before_done=True,
            help="Softmax vs ReLU memories on the model's own FFNs: how concentrated the weights are (C1), the "
                 "held-out loss with one layer's FFN replaced by a softmax memory or a scaled ReLU (C2, C5), a "
                 "capacity sweep over n slots (C2), and the output variance against n, synthetic and on the "
                 "model (C3, C4). Prints a verdict per claim.")
