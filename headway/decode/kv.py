"""Target KV-cache bookkeeping after a tree verification."""

from __future__ import annotations

import torch
from transformers import Cache


def keep_accepted(cache: Cache, prefix_len: int, tree_size: int, nodes: torch.Tensor) -> None:
    """The cache holds prefix + all ``tree_size`` tree nodes; keep the accepted ``nodes`` (sorted,
    root first) at contiguous positions ``prefix_len ..`` and crop the rest."""
    n = nodes.numel()
    src = nodes + prefix_len
    for layer in cache.layers:
        # advanced indexing copies first, so overlapping source/destination is safe
        layer.keys[..., prefix_len:prefix_len + n, :] = layer.keys[..., src, :]
        layer.values[..., prefix_len:prefix_len + n, :] = layer.values[..., src, :]
    if tree_size > n:
        cache.crop(-(tree_size - n))
