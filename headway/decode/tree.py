"""Tree arithmetic: pure functions of a ``parents`` vector.

A draft tree of N nodes is ``parents`` (N,) int64 with ``parents[0] == -1`` (the root: the last
token already emitted) and ``parents[i] < i`` (topological order). Every buffer the verifier
needs — depth, ancestor mask, float attention mask, position ids, root-to-leaf paths — is
derived here, vectorised over nodes (loops run over depth levels only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def check_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless ``parents`` is a valid topologically ordered tree."""
    if parents.ndim != 1 or parents.numel() == 0:
        raise ValueError("parents must be a non-empty 1-D tensor")
    if parents[0] != -1 or (parents[1:] < 0).any():
        raise ValueError("node 0 must be the only root (parents[0] == -1)")
    if (parents[1:] >= torch.arange(1, parents.numel(), device=parents.device)).any():
        raise ValueError("parents must be topologically ordered: parents[i] < i")


def tree_depth(parents: torch.Tensor) -> torch.Tensor:
    """(N,) depth of each node; the root has depth 0."""
    depth = torch.zeros_like(parents)
    cur = parents.clone()
    while (cur >= 0).any():
        alive = cur >= 0
        depth += alive.long()
        cur = torch.where(alive, parents[cur.clamp(min=0)], cur)
    return depth


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(N, N) bool: ``[i, j]`` is True iff node j is node i itself or one of its ancestors."""
    N = parents.numel()
    idx = torch.arange(N, device=parents.device)
    anc = torch.zeros(N, N, dtype=torch.bool, device=parents.device)
    anc[idx, idx] = True
    cur = parents.clone()
    while (cur >= 0).any():
        alive = cur >= 0
        anc[idx[alive], cur[alive]] = True
        cur = torch.where(alive, parents[cur.clamp(min=0)], cur)
    return anc


def tree_attention_mask(parents: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, N, prefix_len + N) float additive mask: every node sees the whole prefix, itself and
    its ancestors (0), nothing else (dtype min). Float, not bool: eager attention reads a bool
    mask as values and silently gives wrong results."""
    anc = ancestor_mask(parents)
    return additive_mask(anc, prefix_len, dtype)


def additive_mask(visible: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Bool (N, N) visibility among new tokens -> float (1, 1, N, prefix_len + N), prefix visible."""
    N = visible.shape[0]
    out = torch.zeros(N, prefix_len + N, dtype=dtype, device=visible.device)
    out[:, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    return out[None, None]


def tree_position_ids(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """(1, N) position of each node: prefix length + depth."""
    return (tree_depth(parents) + prefix_len)[None]


def retrieve_indices(parents: torch.Tensor) -> torch.Tensor:
    """(n_leaves, max_depth + 1) node indices of every root-to-leaf path, padded with -1."""
    N = parents.numel()
    depth = tree_depth(parents)
    is_parent = torch.zeros(N, dtype=torch.bool, device=parents.device)
    is_parent[parents[parents >= 0]] = True
    leaves = (~is_parent).nonzero().squeeze(1)  # (n_leaves,)
    anc = ancestor_mask(parents)[leaves]  # (n_leaves, N)
    out = torch.full((leaves.numel(), int(depth.max()) + 1), -1, dtype=torch.long, device=parents.device)
    rows, cols = anc.nonzero(as_tuple=True)
    out[rows, depth[cols]] = cols
    return out


def first_children(parents: torch.Tensor) -> dict[int, int]:
    """node -> its first child, for nodes with children. Children come in rank order, so the first
    is the drafter's best guess (where a greedy walk most likely goes next)."""
    first: dict[int, int] = {}
    for i, p in enumerate(parents.tolist()[1:], start=1):
        first.setdefault(p, i)
    return first


@dataclass
class TreeBuffers:
    """Everything derived from one tree shape; built once per static shape, per step for dynamic trees."""

    parents: torch.Tensor  # (N,)
    depth: torch.Tensor  # (N,)
    visible: torch.Tensor  # (N, N) bool ancestor-or-self
    retrieve: torch.Tensor  # (n_leaves, D + 1)

    @classmethod
    def build(cls, parents: torch.Tensor) -> "TreeBuffers":
        parents = parents.long()
        return cls(parents, tree_depth(parents), ancestor_mask(parents), retrieve_indices(parents))

    @property
    def size(self) -> int:
        return self.parents.numel()

    @functools.cached_property
    def first_child(self) -> dict[int, int]:
        """``first_children`` of this tree, once per shape (read by on-demand verification)."""
        return first_children(self.parents)

    @property
    def max_depth(self) -> int:
        return self.retrieve.shape[1] - 1

    def to(self, device: torch.device) -> "TreeBuffers":
        return TreeBuffers(*(t.to(device) for t in (self.parents, self.depth, self.visible, self.retrieve)))
