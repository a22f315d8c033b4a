"""Batches: padding variable-length rows, and the one target forward every head kind trains on.

``target_batch`` is shared by online training, evaluation and (through ``headway features``)
offline feature extraction, so what a drafter sees never depends on the route.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn


@dataclass
class TargetBatch:
    """What the target gives each step (all tensors on the target's device)."""

    input_ids: Tensor  # (B, T) long, right-padded
    attention_mask: Tensor  # (B, T) long, 1 on real tokens
    loss_mask: Tensor  # (B, T) long, 1 on target-written tokens, 0 on prompt and padding
    hidden: dict[int, Tensor]  # HF hidden_states index -> (B, T, H); -1 = final post-norm
    logits: Tensor | None = None  # (B, T, V), when the task needs them
    ref_logits: Tensor | None = None  # (B, T, V) of the unadapted target (adapter disabled), Medusa-2 only


def collate(rows: Sequence[dict[str, Any]], pad_id: int = 0, max_length: int | None = None) -> dict[str, Tensor]:
    """Rows with ``input_ids`` / ``loss_mask`` lists -> right-padded (B, T) long tensors."""
    ids = [list(r["input_ids"])[:max_length] for r in rows]
    masks = [list(r["loss_mask"])[:max_length] for r in rows]
    T = max(len(x) for x in ids)
    out = {"input_ids": torch.full((len(rows), T), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros(len(rows), T, dtype=torch.long),
           "loss_mask": torch.zeros(len(rows), T, dtype=torch.long)}
    for i, (x, m) in enumerate(zip(ids, masks)):
        if len(m) != len(x):
            raise ValueError(f"row {i}: input_ids has {len(x)} tokens but loss_mask has {len(m)}")
        out["input_ids"][i, : len(x)] = torch.tensor(x, dtype=torch.long)
        out["attention_mask"][i, : len(x)] = 1
        out["loss_mask"][i, : len(x)] = torch.tensor(m, dtype=torch.long)
    return out


def _forward(target: nn.Module, input_ids: Tensor, attention_mask: Tensor, need_logits: bool) -> Any:
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask,
                              "output_hidden_states": True, "use_cache": False}
    if not need_logits:
        kwargs["logits_to_keep"] = 1  # skip the (B, T, V) projection nobody reads
    return target(**kwargs)


def target_batch(target: nn.Module, batch: dict[str, Tensor], layers: Sequence[int], need_logits: bool,
                 need_ref: bool = False, grad: bool = False) -> TargetBatch:
    """Run the target once on a collated batch.

    ``layers`` are HF ``hidden_states`` indices (-1 = final post-norm state). ``grad`` keeps the
    graph (Medusa-2, where the target's LoRA trains); ``need_ref`` adds the logits of the same
    model with its PEFT adapter disabled, without grad. Without grad or logits the hidden states
    come from ``headway.data.features.target_features``, the forward ``headway features`` stores,
    so online and offline training see the same features (tests/test_train_batch.py checks the
    two routes agree).
    """
    device = next(target.parameters()).device
    ids = batch["input_ids"].to(device)  # (B, T)
    attn = batch["attention_mask"].to(device)
    logits = None
    if grad or need_logits:
        with contextlib.nullcontext() if grad else torch.no_grad():
            out = _forward(target, ids, attn, need_logits)
        hs = out.hidden_states  # L + 1 tensors of (B, T, H)
        hidden = {i: hs[i] for i in layers}
        logits = out.logits if need_logits else None
    else:  # the same forward `headway features` stores (no lm_head); clone out of inference mode
        from ..data.features import layer_key, target_features

        specs = {i: "final" if i == -1 else i for i in layers}
        feats = target_features(target, ids, attn, list(specs.values()))
        hidden = {i: feats[layer_key(spec)].clone() for i, spec in specs.items()}
    ref = None
    if need_ref:
        with torch.no_grad(), target.disable_adapter():
            ref = _forward(target, ids, attn, True).logits
    return TargetBatch(input_ids=ids, attention_mask=attn, loss_mask=batch["loss_mask"].to(device),
                       hidden=hidden, logits=logits, ref_logits=ref)
