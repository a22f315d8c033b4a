"""Target KV-cache bookkeeping: which cache a generation uses, the tree mask it needs, and what
it keeps after a tree verification. Dynamic and static caches share one commit/rollback rule:
the verify forward writes every tree node's KV after the prefix, then ``keep_accepted`` moves the
accepted entries into place and rolls the length back (``crop``; a static cache only moves its
length, the stale rows are overwritten by the next write and hidden by the mask until then)."""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, StaticCache


def new_cache(config: object, max_len: int | None = None) -> Cache:
    """A fresh target cache: dynamic (grows with the sequence), or with ``max_len`` a transformers
    ``StaticCache`` of that many positions (fixed shapes: what torch.compile and CUDA graphs want)."""
    if max_len is None:
        return DynamicCache(config=config)
    return StaticCache(config=config, max_cache_len=int(max_len))


def static_length(cache: Cache) -> int | None:
    """The preallocated length of a static cache; None for a dynamic one."""
    if isinstance(cache, StaticCache):
        return int(cache.layers[0].max_cache_len)
    return None


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


def keep_accepted(cache: Cache, prefix_len: int, tree_size: int, nodes: torch.Tensor) -> None:
    """The cache holds prefix + all ``tree_size`` tree nodes; keep the accepted ``nodes`` (sorted,
    root first) at contiguous positions ``prefix_len ..`` and crop the rest."""
    n = nodes.numel()
    for layer in cache.layers:
        src = nodes.to(layer.keys.device) + prefix_len  # under a device_map each layer has its own device
        # advanced indexing copies first, so overlapping source/destination is safe; in place, so a
        # static cache keeps its (compile-visible) storage
        layer.keys[..., prefix_len:prefix_len + n, :] = layer.keys[..., src, :]
        layer.values[..., prefix_len:prefix_len + n, :] = layer.values[..., src, :]
    if tree_size > n:
        drop_last(cache, tree_size - n)


def drop_last(cache: Cache, count: int) -> None:
    """Remove the last ``count`` entries of every layer: ``Cache.crop(-count)``. Static layers of
    releases before ~5.2x have no ``crop``; theirs is the same move, the length counter stepped back
    in place (a compiled graph holds its address), the stale rows overwritten by the next write."""
    if count <= 0:
        return
    for layer in cache.layers:  # what Cache.crop does, layer by layer
        if hasattr(layer, "crop"):
            layer.crop(-count)
        else:
            layer.cumulative_length.sub_(count)
