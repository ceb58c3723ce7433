"""Direct logit attribution of memories: one definition for the explorer and `facts locate`."""
from __future__ import annotations

import torch


@torch.no_grad()
def direct_effects(mm, lens, m: torch.Tensor, layers, targets: torch.Tensor, scale) -> torch.Tensor:
    """(len(layers), d_m) coefficients at one position -> (len(layers), d_m, len(targets)) float32:
    each memory's share m_i·(v_i through `lens`)·scale of each target's logit, `scale` the lens's
    `logit_scale` at the final residual read (frozen there, so the shares of all writes add up)."""
    dirs = torch.stack([lens.contribution_logits(mm.values(l), targets) for l in layers]) * scale
    return (m.unsqueeze(-1) * dirs.to(m.dtype)).float()
