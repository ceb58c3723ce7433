"""Which memories hold a fact: rank every memory (layer, dim) at one position of a prompt by its
effect on P(true object) at the last token, three ways, and check a ranking by ablating it.

- "direct": the memory's direct share of the object's logit, m_i·(v_i through the lens)·scale
  (`ffkv.memories.attribution.direct_effects`, the explorer's number). At the last token it is
  exact direct logit attribution; at an earlier position (the subject's last token) it reads the
  object's logit the lens gives there (the memory cannot reach the last token's logits directly).
- "grad": gradient × coefficient, m_i·∂P/∂m_i, every layer from one forward and one backward.
- "ig": integrated gradients over one layer's coefficients (Dai et al. 2022): that layer's m at
  the position scaled from 0 to m in `steps` Riemann steps, the others as computed;
  m_i·mean_k ∂P(α_k m)/∂m_i, α_k = k/steps. One batched forward per layer.

P is the softmax probability of the object's first token at the last position. Coefficients are
edited where ffkv's interventions edit them (`MemoryModel.editing`: after a post-FFN norm, the
token's norm scale kept), so "grad" and the ablation check move the same m. A mixture of experts
adds only the dims an edit changed, which a zero perturbation never does: "grad" and "ig" refuse
it (the direct effect works).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ffkv.errors import FfkvError

METHODS = ("direct", "grad", "ig")
IG_STEPS = 20  # Dai et al.'s Riemann steps


@dataclass
class Ranking:
    """Every memory's score at one position by one method; `top(k)` the k most supportive."""
    method: str
    position: int
    scores: np.ndarray  # (L, d_m) float64: effect on P(true) (direct: logit units)

    def top(self, k: int) -> list[tuple[int, int, float]]:
        flat = self.scores.ravel()
        k = min(k, flat.size)
        idx = np.argpartition(-flat, k - 1)[:k]
        idx = idx[np.argsort(-flat[idx], kind="stable")]
        d_m = self.scores.shape[1]
        return [(int(i // d_m), int(i % d_m), float(flat[i])) for i in idx]


@dataclass
class Ablation:
    """P(true) with the top k memories suppressed (m = 0 at the position), beside k random
    memories of the same layers (`draws` seeded draws): the check that a ranking means something."""
    k: int
    p_clean: float
    p_top: float
    p_random: np.ndarray = field(repr=False)  # (draws,)

    @property
    def drop_top(self) -> float:
        return self.p_clean - self.p_top

    @property
    def drop_random(self) -> float:
        return float(self.p_clean - self.p_random.mean())

    def interval(self, q: float = 0.95) -> tuple[float, float]:
        d = self.p_clean - self.p_random
        return float(np.quantile(d, (1 - q) / 2)), float(np.quantile(d, (1 + q) / 2))


def _ids(input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    return ids[None] if ids.dim() == 1 else ids


def _check(mm, ids: torch.Tensor, position: int, target: int) -> int:
    T = ids.shape[1]
    pos = position if position >= 0 else T + position
    if not 0 <= pos < T:
        raise FfkvError(f"position {position} outside the prompt's {T} tokens")
    if not 0 <= target < mm.vocab_size:
        raise FfkvError(f"target token {target} outside the vocabulary (0..{mm.vocab_size - 1})")
    return pos


def p_true(mm, input_ids, target: int, logits: torch.Tensor | None = None) -> torch.Tensor:
    """P(target) at the last position of each row."""
    if logits is None:
        with torch.no_grad():
            logits = mm.hf(input_ids=_ids(input_ids).to(mm.device), use_cache=False).logits
    return torch.softmax(logits[:, -1].float(), -1)[:, target]


def _grad_pass(mm, ids, pos, target, layers, alpha=None, scaled=None):
    """One forward (rows of `alpha` scale layer `scaled`'s m at pos) and a backward of ΣP: each
    layer's ∂P/∂m at pos per row, and its m at pos (unscaled)."""
    B = 1 if alpha is None else len(alpha)
    delta = {l: torch.zeros(B, mm.d_m, device=mm.device, dtype=mm.dtype, requires_grad=True) for l in layers}
    seen: dict[int, torch.Tensor] = {}

    def make(l):
        def fn(m):
            seen[l] = m[0, pos].detach().float()
            row = m[:, pos]
            if l == scaled:
                row = row * alpha.to(m.dtype)[:, None]
            out = m.clone()
            out[:, pos] = row + delta[l]
            return out
        return fn

    with torch.enable_grad(), mm.editing({l: make(l) for l in layers}):
        logits = mm.hf(input_ids=ids.expand(B, -1).to(mm.device), use_cache=False).logits
        p = p_true(mm, ids, target, logits)
        grads = torch.autograd.grad(p.sum(), [delta[l] for l in layers])  # not the weights' gradients
    return {l: g.float() for l, g in zip(layers, grads)}, seen


def rank(mm, input_ids, target: int, position: int = -1, method: str = "direct", *, lens: str | None = None,
         layers=None, steps: int = IG_STEPS, show_progress: bool | None = None) -> Ranking:
    """Every memory's effect on P(target) at `position` (default the last token) by `method`."""
    if method not in METHODS:
        raise FfkvError(f"locate method {method!r}: choose from {', '.join(METHODS)}")
    ids = _ids(input_ids)
    pos = _check(mm, ids, position, target)
    layers = list(range(mm.n_layers)) if layers is None else sorted(set(layers))
    scores = np.zeros((mm.n_layers, mm.d_m))
    if method == "direct":
        from ffkv.memories.attribution import direct_effects
        from ffkv.model.memories import lens_for

        cap = mm.capture(ids.to(mm.device), layers=sorted(set(layers) | {mm.n_layers - 1}), what=("m", "o"))
        lz = lens_for(mm, lens or mm.lens.name)
        scale = lz.logit_scale(cap[mm.n_layers - 1]["o"][0, pos])
        m = torch.stack([cap[l]["m"][0, pos] for l in layers])
        eff = direct_effects(mm, lz, m, layers, torch.tensor([target], device=mm.device), scale)[..., 0]
        scores[layers] = eff.double().cpu().numpy()
        return Ranking(method, pos, scores)
    if mm.arch.moe_info(mm.blocks[0]):
        raise FfkvError(f"locate --method {method}: a mixture of experts adds only the dims an edit changes, "
                        "so its gradients are not defined here; use --method direct")
    if method == "grad":
        g, m = _grad_pass(mm, ids, pos, target, layers)
        for l in layers:
            scores[l] = (g[l][0] * m[l]).double().cpu().numpy()
        return Ranking(method, pos, scores)
    from ffkv.progress import progress

    alpha = torch.arange(1, steps + 1, dtype=torch.float32, device=mm.device) / steps
    with progress(disable=None if show_progress is None else not show_progress) as bar:
        task = bar.add_task("integrated gradients (layers)", total=len(layers))
        for l in layers:
            g, m = _grad_pass(mm, ids, pos, target, [l], alpha=alpha, scaled=l)
            scores[l] = (g[l].mean(0) * m[l]).double().cpu().numpy()
            bar.advance(task)
    return Ranking(method, pos, scores)


def matchable(ranking: Ranking, d_m: int, k: int) -> int:
    """The largest k' ≤ k whose top k' memories leave, in every layer, as many others to draw the
    random control from (n of a layer's d_m taken, n more drawn from the d_m − n left)."""
    taken: dict[int, int] = {}
    for i, (l, _, _) in enumerate(ranking.top(k)):
        taken[l] = taken.get(l, 0) + 1
        if 2 * taken[l] > d_m:
            return i
    return min(k, ranking.scores.size)


def ablate(mm, input_ids, target: int, ranking: Ranking, ks=(1, 5, 10, 20), *, draws: int = 10,
           seed: int = 0) -> list[Ablation]:
    """Suppress the ranking's top k memories at its position, and k random memories drawn from
    the same layers (as many per layer), for each k: P(true) each time."""
    d_m = ranking.scores.shape[1]
    most = matchable(ranking, d_m, max(ks, default=0))
    if ks and max(ks) > most:
        raise FfkvError(f"ablate {max(ks)}: the top {max(ks)} memories take so many of one layer's {d_m} "
                        f"that as many random others of that layer cannot be drawn; ablate at most {most}")
    ids = _ids(input_ids).to(mm.device)
    at = torch.tensor([ranking.position])
    p0 = float(p_true(mm, ids, target)[0])
    rng = np.random.default_rng(seed)
    out = []
    for k in ks:
        top = ranking.top(k)

        def p_without(mems):
            with mm.intervene([(l, d, "scale", 0.0) for l, d in mems], at="last", last=at):
                return float(p_true(mm, ids, target)[0])

        chosen = {(l, d) for l, d, _ in top}
        rand = []
        for _ in range(draws):
            mems = []
            for l in sorted({l for l, _, _ in top}):
                n = sum(1 for a, _, _ in top if a == l)
                pool = np.setdiff1d(np.arange(mm.d_m), [d for a, d in chosen if a == l])
                mems += [(l, int(d)) for d in rng.choice(pool, size=n, replace=False)]
            rand.append(p_without(mems))
        out.append(Ablation(k, p0, p_without([(l, d) for l, d, _ in top]), np.array(rand)))
    return out
