"""Evaluation metrics: per-head accuracy and the simulated chain acceptance length τ.

Stats are *sums* with fixed shapes so they can be added over batches and processes;
``summarize_heads`` turns the totals into the numbers written to the model card.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .losses import IGNORE_INDEX


def chain_acceptance(correct: Tensor) -> Tensor:
    """Tokens a chain decoder with greedy verification emits per step.

    correct (K, N) bool: head k's top-1 equals the true continuation at position n (only
    positions where all K labels exist). Returns (N,) long: the number of leading heads that
    are right, plus 1 for the target's bonus token.
    """
    return correct.long().cumprod(dim=0).sum(dim=0) + 1


def medusa_eval_stats(head_logits: Tensor, labels: Tensor, topk: int = 5,
                      ignore_index: int = IGNORE_INDEX) -> dict[str, Tensor]:
    """head_logits (K, B, T, V), labels (K, B, T) -> summed counts:
    ``count``/``top1``/``topk`` (K,) per head, ``chain_hist`` (K+1,) positions by accepted length
    (index a = a heads accepted, τ contribution a+1)."""
    K = head_logits.shape[0]
    valid = labels != ignore_index  # (K, B, T)
    k = min(topk, head_logits.shape[-1])
    top = head_logits.topk(k, dim=-1).indices  # (K, B, T, k)
    hit1 = (top[..., 0] == labels) & valid  # (K, B, T)
    hitk = (top == labels[..., None]).any(-1) & valid
    full = valid.all(dim=0)  # (B, T): positions where every head has a label
    accepted = chain_acceptance(hit1[:, full]) - 1  # (N,) accepted draft tokens
    hist = torch.bincount(accepted, minlength=K + 1)[: K + 1]
    return {"count": valid.sum(dim=(1, 2)), "top1": hit1.sum(dim=(1, 2)), "topk": hitk.sum(dim=(1, 2)),
            "chain_hist": hist}


def draft_vocab_stats(t2d: Tensor, input_ids: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """Answer tokens (loss_mask 1) inside a draft vocabulary: t2d (V,) bool, input_ids / loss_mask
    (B, T) -> ``vocab_in`` / ``vocab_tokens`` (1,) sums. Their ratio is a ceiling on top-1 accuracy."""
    answer = loss_mask.bool()  # (B, T)
    return {"vocab_in": (t2d[input_ids] & answer).sum().float().reshape(1),
            "vocab_tokens": answer.sum().float().reshape(1)}


def tau_from_hist(hist: Tensor) -> float:
    """Mean tokens per step from a histogram of accepted lengths (index a -> a + 1 tokens)."""
    n = float(hist.sum())
    if n == 0:
        return float("nan")
    return float((hist.double() * torch.arange(1, hist.numel() + 1, dtype=torch.double)).sum()) / n


def summarize_heads(stats: dict[str, Tensor], topk: int = 5) -> dict[str, Any]:
    """Summed stats -> per-head top-1 / top-k accuracy, τ, positions evaluated (and the draft
    vocabulary's coverage of answer tokens when ``draft_vocab_stats`` were added)."""
    count = stats["count"].double().clamp(min=1)
    hist = stats["chain_hist"].cpu()
    out = {"top1": [round(float(x), 4) for x in (stats["top1"].double() / count)],
           f"top{topk}": [round(float(x), 4) for x in (stats["topk"].double() / count)],
           "tau": round(tau_from_hist(hist), 4),
           "accept_hist": [int(x) for x in hist],
           "positions": int(hist.sum()),
           "tokens": [int(x) for x in stats["count"]]}
    if "vocab_in" in stats:  # reduced draft vocabulary: share of held-out answer tokens it can express
        share = stats["vocab_in"].sum() / stats["vocab_tokens"].sum().clamp(min=1)
        out["draft_vocab_coverage"] = round(float(share), 4)
    return out


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN / infinite float replaced by None (JSON null), in nested dicts,
    lists and tuples: what ``json.dumps(..., allow_nan=False)`` accepts. Python's json writes bare
    ``NaN`` / ``Infinity`` otherwise, which strict readers (jq, JavaScript, pandas' ujson) reject."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
