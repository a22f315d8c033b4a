"""Training losses as pure functions. The Medusa label shift lives in ``medusa_labels`` only.

Notation: K heads, B rows, T positions, V vocabulary. Head k (0-based) at position t predicts
token t + k + ``offset`` (Medusa: offset 2, since the target's own head predicts t + 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def medusa_labels(input_ids: Tensor, loss_mask: Tensor, num_heads: int, ignore_index: int = IGNORE_INDEX,
                  offset: int = 2) -> Tensor:
    """(B, T) ids and loss mask -> (K, B, T) labels: ``labels[k, b, t] = input_ids[b, t + k + offset]``
    where that token exists and is target-written (``loss_mask`` 1), else ``ignore_index``."""
    B, T = input_ids.shape
    labels = torch.full((num_heads, B, T), ignore_index, dtype=torch.long, device=input_ids.device)
    for k in range(num_heads):
        s = k + offset  # shift of head k
        if s >= T:
            break
        ids = input_ids[:, s:]  # (B, T - s)
        labels[k, :, : T - s] = torch.where(loss_mask[:, s:].bool(), ids, torch.full_like(ids, ignore_index))
    return labels


def medusa_loss(head_logits: Tensor, labels: Tensor, weights: Tensor,
                ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Σ_k w_k · CE_k. head_logits (K, B, T, V), labels (K, B, T), weights (K,) ->
    (weighted loss (), per-head mean cross-entropy (K,)); a head with no labels contributes 0."""
    per_head = []
    for k in range(head_logits.shape[0]):
        ce = F.cross_entropy(head_logits[k].flatten(0, 1).float(), labels[k].flatten(),
                             ignore_index=ignore_index, reduction="sum")  # ()
        n = (labels[k] != ignore_index).sum().clamp(min=1)
        per_head.append(ce / n)
    per_head_t = torch.stack(per_head)  # (K,)
    return (weights.to(per_head_t) * per_head_t).sum(), per_head_t


def kl_to_target(head_logits: Tensor, target_logits: Tensor, labels: Tensor, weights: Tensor,
                 ignore_index: int = IGNORE_INDEX, offset: int = 2) -> tuple[Tensor, Tensor]:
    """Σ_k w_k · KL(p_target || q_head_k), averaged over positions with a label.

    Head k at t predicts token t+k+offset, whose distribution under the target is its logits at
    position t+k+offset-1. head_logits (K, B, T, V), target_logits (B, T, V), labels (K, B, T)
    (only their mask is used) -> (weighted KL (), per-head KL (K,))."""
    K, B, T, V = head_logits.shape
    per_head = []
    for k in range(K):
        s = k + offset - 1  # position of the target's prediction of the same token
        q = F.log_softmax(head_logits[k, :, : T - s].float(), dim=-1)  # (B, T-s, V)
        p = F.log_softmax(target_logits[:, s:].float().detach(), dim=-1)  # (B, T-s, V)
        kl = (p.exp() * (p - q)).sum(-1)  # (B, T-s)
        mask = (labels[k, :, : T - s] != ignore_index).to(kl.dtype)
        per_head.append((kl * mask).sum() / mask.sum().clamp(min=1))
    per_head_t = torch.stack(per_head)
    return (weights.to(per_head_t) * per_head_t).sum(), per_head_t


def next_token_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The target's own LM loss on target-written tokens: logits (B, T, V) -> mean CE ()."""
    labels = medusa_labels(input_ids, loss_mask, 1, ignore_index, offset=1)  # (1, B, T)
    return medusa_loss(logits[None], labels, torch.ones(1, device=logits.device), ignore_index)[0]
