"""Grouped-query attention for tree verification, without copying keys and values per head.

A verify forward attends n tree tokens to the whole cache with a custom 4-D mask. transformers'
``sdpa`` path then expands every key/value head to its query heads (``repeat_kv``: two copies of
the cache per layer) and runs PyTorch's CPU flash kernel, which is slow at a few dozen queries. Here
the query heads that share a key/value head are stacked as rows of one matrix, so each layer is two
batched matmuls over the cache as stored, and a softmax in between: on SmolLM2 (9 query heads on 3
key/value heads, 64 dims, a 200-token cache), 2 threads, 24 queries 208 us a layer against 318 us,
48 queries 428 against 686 (``experiments/tree_attention.py``).

It is registered with transformers' ``AttentionInterface`` under ``headway_tree`` and switched on
only around the decoder's target forwards (``tree_attention(model)``), where the target's
implementation is ``sdpa``; every other call (one query, more than ``MAX_QUERIES``, a boolean or
no mask, dropout, soft-capping, sliding windows, attention biases, gradients) goes to
transformers' own ``sdpa_attention_forward``. The user's model is left as it was outside them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

NAME = "headway_tree"
MAX_QUERIES = 256  # past this (a long prompt's prefill) the (queries x keys) scores are big: flash's tiles win
_registered = False


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for (B, H, q, D) queries on (B, Hkv, k, D) keys and values,
    query head h reading key/value head h // (H / Hkv) (``repeat_kv``'s order); ``mask`` additive,
    broadcastable to (B, 1, q, k). Returns (B, q, H, D), the layout attention functions return."""
    b, h, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = h // hkv
    rows = query.reshape(b, hkv, g * q, d)  # the g heads of one key/value head, stacked
    scores = torch.matmul(rows, key.transpose(-1, -2)).view(b, h, q, k)
    scores = scores.mul_(scale).add_(mask[:, :, :, :k])
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(b, hkv, g * q, k), value)  # (B, Hkv, g*q, D)
    return out.view(b, h, q, d).transpose(1, 2).contiguous()


def tree_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: ``grouped_attention`` for a float 4-D mask over several
    queries with grouped key/value heads, transformers' sdpa path for anything else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    plain = (groups > 1 and 1 < query.shape[2] <= MAX_QUERIES
             and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.is_floating_point()
             and not dropout and key.shape[-1] == value.shape[-1]
             and query.shape[1] == key.shape[1] * groups and not torch.is_grad_enabled()
             and all(kwargs.get(a) is None for a in ("softcap", "sliding_window", "position_bias", "s_aux", "sinks"))
             and not kwargs.get("output_attentions"))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return grouped_attention(query, key, value, attention_mask, scale), None


def register() -> None:
    """Register ``headway_tree`` with transformers (attention and mask functions; idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, tree_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # masks it builds itself: sdpa's format
    _registered = True


def _plain_sdpa(model: nn.Module) -> Any:
    """The model's config where it uses sdpa and has no sub-configs (plain decoder-only LMs), else None."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "sub_configs", None) or \
            getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    return config


@contextlib.contextmanager
def tree_attention(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, ``model`` (an sdpa decoder-only LM) attends with ``tree_attention_forward``;
    restored after, after an error too. A no-op for other implementations or with ``enabled`` False."""
    config = _plain_sdpa(model) if enabled else None
    if config is None:
        yield
        return
    register()
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
