"""How a pass's mined layers are laid out for its trackers: in groups of layers side by side on
the key axis, each group one update (issue 24). A leaf: the trackers, their backends and the
batch planner (`ffkv.corpus.batching`) read it.
"""
from __future__ import annotations


def layer_groups(layers, size: int = 1) -> list[tuple[int, ...]]:
    """The mined layers in runs of `size`, each fed to the trackers as one update.

    Every tracker works key by key, so G layers side by side on the key axis are one update of
    G·n keys: the same work in 1/G of the kernel launches (issue 24; a small model is
    launch-bound on a GPU). Results do not depend on the grouping."""
    layers, size = list(layers), max(1, int(size))
    return [tuple(layers[i:i + size]) for i in range(0, len(layers), size)]


GROUP_KEYS = 16384  # keys per tracker update: SmolLM2's 30 layers of 1,536 in 3 updates of 10 layers


def group_size(keys: int, n_layers: int) -> int:
    """Layers per update for `keys` mined keys a layer: up to GROUP_KEYS keys side by side, the
    layers split into groups of near-equal size. Memory per token of a batch grows with it
    (`ffkv.corpus.batching.token_bytes`); the kernel launches per layer fall as 1/size."""
    most = max(1, min(max(1, n_layers), GROUP_KEYS // max(1, keys)))
    parts = -(-max(1, n_layers) // most)
    return -(-max(1, n_layers) // parts)


def unit_of(groups) -> dict[int, tuple[tuple[int, ...], int]]:
    """layer -> (its group, its index in the group): where a layer's keys sit in a tracker's state."""
    return {l: (g, i) for g in groups for i, l in enumerate(g)}
