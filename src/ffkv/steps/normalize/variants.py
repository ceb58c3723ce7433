"""The normalized memories that stand in for a FFN, their fit, and how concentrated their weights are.

Every variant is a transform of one layer's coefficient vector m (d_m,) into m', and the layer's
output becomes `MemoryModel.ffn_from_memories(ℓ, m')` = m'·V + b:

- softmax: m' = s · softmax(m/τ); for a gated FFN (signed m) m' = s · sign(m) ⊙ softmax(|m|/τ).
  τ → 0 is the hard selection of the top memory (by m, or by |m| when gated).
- scaled_relu: m' = a / (γ·√(n/2)) with a_i = ReLU(x·k_i + b_i) for a plain FFN and
  a_i = ReLU(x·g_i)·(x·u_i) for a gated one: the activation replaced by a ReLU, the sign still
  carried by the up projection. (Applying ReLU to the signed vector itself, sign(m)·ReLU(|m|),
  would give back m, so the gated analogue replaces the activation, as C4 writes it.)
- original: m' = m restricted to the kept slots (the capacity sweep's reference).

A variant can keep only some slots (`keep`): a fixed random draw of n slots, or each token's
top n by |m|. Softmax then runs over the kept slots only.

Fit: the scale is one number per layer (and per n), chosen so that the output's RMS norm over the
fit tokens equals the original FFN output's, Σ‖s·z‖² = Σ‖y − b‖² (the layer-norm reading of
C5); τ is the grid value with the smallest relative squared error Σ‖s·z − y‖²/Σ‖y − b‖², which
with the norm matched is 2·(1 − cos), cos the pooled cosine of z and y − b.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

# τ as a multiple of the layer's RMS |m| over the fit tokens: 1/16 … 256 in half-octave steps (a
# gated FFN's output is best matched by a nearly flat softmax: sign(m)·softmax(|m|/τ) ≈
# (sign(m) + m/τ − …)/d_m for large τ, so the grid reaches far up)
TAU_GRID = tuple(2.0 ** (k / 2) for k in range(-8, 17))
TOPS = (1, 10, 100)  # top-k shares reported for concentration
KINDS = ("softmax", "scaled_relu", "original")
SELECTIONS = ("all", "random", "top")


@dataclass(frozen=True)
class Variant:
    """One way to replace layer `layer`'s FFN; `tau` and `scale` are filled in by the fit."""
    kind: str
    layer: int
    selection: str = "all"
    n: int = 0  # slots kept (d_m for "all")
    tau: float = float("nan")
    scale: float = 1.0
    gamma: float = float("nan")  # scaled_relu: scale = 1 / (gamma·√(n/2))

    @property
    def key(self) -> tuple:
        """(kind, layer, selection, n): what identifies the variant before and after the fit."""
        return (self.kind, self.layer, self.selection, self.n)

    def fitted(self, **kw) -> "Variant":
        return replace(self, **kw)


# ---- slot selection ------------------------------------------------------------------------------
def random_slots(d_m: int, n: int, seed: int, layer: int) -> torch.Tensor:
    """A fixed random draw of n of the d_m slots (bool (d_m,)), seeded by (seed, layer, n)."""
    keep = torch.zeros(d_m, dtype=torch.bool)
    keep[torch.from_numpy(np.random.default_rng([seed, layer, n]).choice(d_m, n, replace=False))] = True
    return keep


def top_slots(m: torch.Tensor, n: int) -> torch.Tensor:
    """Per token, the n slots of largest |m| (bool, the shape of m)."""
    keep = torch.zeros_like(m, dtype=torch.bool)
    return keep.scatter_(-1, m.abs().topk(n, dim=-1).indices, True)


def slots(v: Variant, m: torch.Tensor, d_m: int, seed: int) -> torch.Tensor | None:
    if v.selection == "all" or v.n >= d_m:
        return None
    if v.selection == "random":
        return random_slots(d_m, v.n, seed, v.layer).to(m.device)
    return top_slots(m, v.n)


# ---- weights -------------------------------------------------------------------------------------
def softmax_weights(m: torch.Tensor, tau: float, gated: bool, keep: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(m/τ) over the kept slots (0 elsewhere); gated: sign(m) ⊙ softmax(|m|/τ).
    τ ≤ 0 is the limit τ → 0: weight 1 on the top kept slot (the first one on a tie)."""
    a = m.abs() if gated else m
    if keep is not None:
        a = a.masked_fill(~keep, float("-inf"))
    if tau <= 0:
        w = torch.zeros_like(m).scatter_(-1, a.argmax(-1, keepdim=True), 1.0)
    else:
        w = torch.softmax(a / tau, dim=-1)
    return w * torch.sign(m) if gated else w


def relu_coefficients(mm, layer: int, x: torch.Tensor) -> torch.Tensor:
    """a (…, d_m): ReLU in place of the layer's activation, from the FFN input x
    (`MemoryModel.coefficients`, so a post-FFN norm's scale is the family's own)."""
    return mm.coefficients(layer, x, act=torch.relu)


@torch.no_grad()
def coefficients(mm, v: Variant, x: torch.Tensor | None, m: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """m' of variant `v` (fitted) for coefficients m and FFN input x."""
    keep = slots(v, m, mm.d_m, seed)
    if v.kind == "softmax":
        return v.scale * softmax_weights(m, v.tau, mm.gated, keep)
    if v.kind == "scaled_relu":
        return v.scale * relu_coefficients(mm, v.layer, x)
    if v.kind == "original":
        return m if keep is None else m * keep
    raise ValueError(v.kind)


def replacement(mm, v: Variant, seed: int = 0):
    """`replace(x, m) -> y'` for `tail._install`: the layer's output with variant `v`."""
    return lambda x, m: mm.ffn_from_memories(v.layer, coefficients(mm, v, x, m, seed))


# ---- concentration -------------------------------------------------------------------------------
def concentration(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row of weights w (…, d_m): p = |w|/Σ|w|; entropy (nats) and the share of the top 1, 10,
    100 slots (k capped at d_m). Rows with Σ|w| = 0 count as uniform."""
    a = w.abs().float()
    tot = a.sum(-1, keepdim=True, dtype=torch.float64)
    p = torch.where(tot > 0, a / tot.clamp_min(1e-300).float(), torch.full_like(a, 1.0 / a.shape[-1]))
    out = {"entropy": -torch.special.xlogy(p, p).sum(-1, dtype=torch.float64)}
    cs = p.topk(min(max(TOPS), p.shape[-1]), dim=-1).values.double().cumsum(-1)
    for k in TOPS:
        out[f"top{k}"] = cs[..., min(k, p.shape[-1]) - 1]
    return out


# ---- fit -----------------------------------------------------------------------------------------
@dataclass
class Sums:
    """Σ‖z‖², Σ<z, y>, Σ‖y‖² over tokens, for a candidate output z against the FFN output y − b."""
    zz: float = 0.0
    zy: float = 0.0
    yy: float = 0.0

    def add(self, z: torch.Tensor, y: torch.Tensor) -> None:
        self.zz += float((z * z).sum(dtype=torch.float64))
        self.zy += float((z * y).sum(dtype=torch.float64))
        self.yy += float((y * y).sum(dtype=torch.float64))

    def norm_scale(self) -> float:
        """s with Σ‖s·z‖² = Σ‖y‖²."""
        return math.sqrt(self.yy / self.zz) if self.zz > 0 else 0.0

    def rel_err(self, s: float = 1.0) -> float:
        """Σ‖s·z − y‖² / Σ‖y‖²."""
        return (s * s * self.zz - 2 * s * self.zy + self.yy) / self.yy if self.yy > 0 else float("nan")


@torch.no_grad()
def grid_sums(mm, layer: int, m: torch.Tensor, y: torch.Tensor, taus, sums: list[Sums], keep=None) -> None:
    """Add, for each τ of `taus`, z = softmax(m/τ)·V (as `softmax_weights`) against y to sums[τ].
    A fixed slot set (`keep` of shape (d_m,)) is sliced out, so its cost grows with n only."""
    V = mm.values(layer)
    if keep is not None and keep.dim() == 1:
        idx = keep.nonzero()[:, 0]
        m, V, keep = m[:, idx], V[idx], None
    a = m.abs() if mm.gated else m
    if keep is not None:
        a = a.masked_fill(~keep, float("-inf"))
    sign = torch.sign(m) if mm.gated else None
    for t, s in zip(taus, sums):
        w = torch.softmax(a / t, dim=-1)
        z = (w * sign if sign is not None else w) @ V
        s.zz += float((z * z).sum(dtype=torch.float64))
        s.zy += float((z * y).sum(dtype=torch.float64))
        s.yy += float((y * y).sum(dtype=torch.float64))


def best_tau(sums: list[Sums], taus) -> tuple[int, float, float]:
    """(index, τ, scale) of the grid point with the smallest relative error at its norm scale."""
    errs = [s.rel_err(s.norm_scale()) for s in sums]
    i = int(np.nanargmin(errs)) if not all(math.isnan(e) for e in errs) else 0
    return i, float(taus[i]), sums[i].norm_scale()
