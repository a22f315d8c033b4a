"""Tree arithmetic: pure functions of a ``parents`` vector.

A draft tree of N nodes is ``parents`` (N,) int64 with ``parents[0] == -1`` (the root: the last
token already emitted) and ``parents[i] < i`` (topological order). Every buffer the verifier
needs — depth, ancestor mask, float attention mask, position ids, root-to-leaf paths — is
derived here, vectorised over nodes (loops run over depth levels only; with the depth bound known
ahead, as for a step's dynamic tree, without a host read).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

import torch


def check_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless ``parents`` is a valid topologically ordered tree."""
    if parents.ndim != 1 or parents.numel() == 0:
        raise ValueError("parents must be a non-empty 1-D tensor")
    if parents[0] != -1 or (parents[1:] < 0).any():
        raise ValueError("node 0 must be the only root (parents[0] == -1)")
    if (parents[1:] >= torch.arange(1, parents.numel(), device=parents.device)).any():
        raise ValueError("parents must be topologically ordered: parents[i] < i")


def ancestors(parents: torch.Tensor, levels: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Walk every node up the tree at once: per step up, (alive (N,), ancestor (N,)), each node's
    ancestor that many steps up (alive where it has one; -1 past the root). ``levels``: a bound on the
    depth known ahead, walked without a host read; None: until no node has an ancestor left (one read
    per level: for trees built once, such as static shapes)."""
    cur = parents.clone()
    for _ in range(parents.numel() if levels is None else levels):
        alive = cur >= 0
        if levels is None and not alive.any():
            return
        yield alive, cur
        cur = torch.where(alive, parents[cur.clamp(min=0)], cur)


def tree_depth(parents: torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """(N,) depth of each node; the root has depth 0 (``levels``: as ``ancestors``)."""
    depth = torch.zeros_like(parents)
    for alive, _ in ancestors(parents, levels):
        depth += alive.long()
    return depth


def ancestor_mask(parents: torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """(N, N) bool: ``[i, j]`` is True iff node j is node i itself or one of its ancestors."""
    N = parents.numel()
    idx = torch.arange(N, device=parents.device)
    anc = torch.eye(N, dtype=torch.bool, device=parents.device)
    for alive, cur in ancestors(parents, levels):
        anc[idx, cur.clamp(min=0)] |= alive  # a node past the root writes False over column 0: no change
    return anc


def tree_attention_mask(parents: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, N, prefix_len + N) float additive mask: every node sees the whole prefix, itself and
    its ancestors (0), nothing else (dtype min). Float, not bool: eager attention reads a bool
    mask as values and silently gives wrong results."""
    return tree_mask(ancestor_mask(parents), prefix_len, dtype)


def tree_mask(visible: torch.Tensor, prefix_len: int, dtype: torch.dtype, kv_len: int | None = None) -> torch.Tensor:
    """Bool (N, N) visibility among the tree's nodes -> float additive (1, 1, N, kv_len): the prefix
    visible, the tree as ``visible`` says, and (static cache) every slot past the tree hidden.
    ``kv_len`` defaults to prefix_len + N (a dynamic cache's length after the write)."""
    N = visible.shape[0]
    kv_len = prefix_len + N if kv_len is None else kv_len
    low = torch.finfo(dtype).min
    out = torch.full((N, kv_len), low, dtype=dtype, device=visible.device)  # (N, kv_len)
    out[:, :prefix_len] = 0
    out[:, prefix_len:prefix_len + N].masked_fill_(visible, 0)
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


def root_paths(parents: torch.Tensor, depth: torch.Tensor, levels: int) -> torch.Tensor:
    """(N, levels + 1) every node's root path (node indices by depth, root first), padded with -1:
    the leaves' rows are ``retrieve_indices``' paths, the others prefixes of them. ``levels`` bounds
    the depth; no host read (a tree built every step: a dynamic one)."""
    N = parents.numel()
    out = torch.full((N, levels + 2), -1, dtype=torch.long, device=parents.device)  # the last column: a bin
    out.scatter_(1, depth[:, None], torch.arange(N, device=parents.device)[:, None])
    for alive, cur in ancestors(parents, levels):
        out.scatter_(1, torch.where(alive, depth[cur.clamp(min=0)], levels + 1)[:, None], cur[:, None])
    return out[:, :levels + 1]


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
    retrieve: torch.Tensor  # (n_paths, D + 1) root paths covering every leaf, padded with -1

    @classmethod
    def build(cls, parents: torch.Tensor, levels: int | None = None) -> "TreeBuffers":
        """``levels``: a bound on the tree's depth, known ahead; the buffers then cost no host read
        (``retrieve`` holds every node's root path, ``root_paths``, and ``max_depth`` is the bound)."""
        parents = parents.long()
        depth = tree_depth(parents, levels)
        paths = retrieve_indices(parents) if levels is None else root_paths(parents, depth, levels)
        return cls(parents, depth, ancestor_mask(parents, levels), paths)

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
