"""Target KV-cache bookkeeping: which cache a generation uses, the tree mask it needs, and what
it keeps after a tree verification. Dynamic and static caches share one commit/rollback rule:
the verify forward writes every tree node's KV after the prefix, then ``keep_accepted`` moves the
accepted entries into place and rolls the length back (``crop``; a static cache only moves its
length, the stale rows are overwritten by the next write and hidden by the mask until then).

Sliding-window layers (Mistral, Mixtral, Gemma 2/3) keep every entry too: transformers' sliding
cache layers drop all but the last ``window`` entries, which the keep-accepted moves cannot follow,
and transformers takes a 4-D mask as it is, window or not. So the cache is a full one for every
layer, and ``layer_masks`` gives the sliding layers the decoder's mask cut to the window."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from transformers import Cache, DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from .args import DecodeError

FULL, SLIDING = "full_attention", "sliding_attention"


def new_cache(config: Any, max_len: int | None = None) -> Cache:
    """A fresh target cache, every layer holding the whole sequence: dynamic (grows with the
    sequence), or with ``max_len`` a transformers ``StaticCache`` of that many positions (fixed
    shapes: what torch.compile and CUDA graphs want). A layer type other than full or
    sliding-window attention (chunked, linear or compressed attention) is refused."""
    types = getattr(config, "layer_types", None) or []
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        name = getattr(config, "model_type", "this target")
        raise DecodeError(f"{name} has {', '.join(other)} layers, whose cache the tree decoder cannot roll back; "
                          f"it verifies targets of full and sliding-window attention layers")
    if max_len is None:
        cache: Cache = DynamicCache(config=config)
        whole: Callable[[], Any] = DynamicLayer
    else:
        cache = StaticCache(config=config, max_cache_len=int(max_len))
        whole = functools.partial(StaticLayer, max_cache_len=int(max_len))
    # a sliding layer (still empty: layers allocate on first write) becomes a full one; the model keeps its window
    cache.layers = [whole() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Additive (B, 1, q, k) mask -> each query sees only the last ``window`` of its visible keys.
    A query's visible keys are its own history, one per logical position in order (prefix or row
    slots, then tree ancestors, then itself), so these are the positions p with q_pos - p < window:
    transformers' sliding window (``sliding_window_overlay``)."""
    visible = mask == 0
    from_end = visible.flip(-1).cumsum(-1).flip(-1)  # (B, 1, q, k): visible keys at or after each key
    return mask.masked_fill(visible & (from_end > window), torch.finfo(mask.dtype).min)


def layer_masks(config: Any, mask: torch.Tensor | None) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """The ``attention_mask`` a target forward takes for the decoder's 4-D ``mask``: as it is without
    sliding-window layers; cut to the window when every layer slides (one mask, as Mistral takes it);
    else transformers' per-layer-type mapping {full_attention: mask, sliding_attention: cut}."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or []
    if mask is None or window is None or (types and SLIDING not in types):
        return mask
    cut = window_mask(mask, int(window))
    return cut if not types or set(types) == {SLIDING} else {FULL: mask, SLIDING: cut}


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


def in_place(nodes: Sequence[int] | torch.Tensor) -> bool:
    """Accepted ``nodes`` 0, 1, .., m: already the first tree slots (every chain's path, and a tree's
    when nothing past the root or only first children were accepted), so nothing needs to move.
    A tensor is read to the host; the decoder passes the nodes it has read already."""
    nodes = nodes.tolist() if isinstance(nodes, torch.Tensor) else list(nodes)
    return nodes == list(range(len(nodes)))


def keep_accepted(cache: Cache, prefix_len: int, tree_size: int, nodes: torch.Tensor,
                  moved: bool | None = None) -> None:
    """The cache holds prefix + all ``tree_size`` tree nodes; keep the accepted ``nodes`` (sorted,
    root first) at contiguous positions ``prefix_len ..`` and crop the rest. ``moved``: whether the
    nodes leave the first tree slots (``not in_place(nodes)``; None: read them to find out)."""
    n = nodes.numel()
    if moved if moved is not None else not in_place(nodes):  # chains never move
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
