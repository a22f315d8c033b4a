"""Objective terms the EAGLE-3 and DFlash losses can add, as pure functions (docs/training.md,
"Objectives"): HASS's Top-K distillation, GRIFFIN's token alignment, and the expected accepted
length of a chain. Each is off by default; the losses call them only when an option asks.

Notation: p is the target's distribution (renormalised on the draft vocabulary), q the drafter's,
both over the same N rows and Vd columns; a *chain* is the drafts of one start position at depths
0, 1, ... (EAGLE-3's unrolled steps at one index, DFlash's slots of one block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Terms:
    """The extra terms of one loss, as the option sections name them (all off by default)."""

    topk_weight: float = 0.0  # HASS: weight of ``topk_distill`` per depth
    topk_k: int = 10  # its K
    align_topk: int = 0  # GRIFFIN: score depth d only where depths < d hit their label in the top-k (0 = off)
    chain_weight: float = 0.0  # weight of -expected_accepted over each chain

    @classmethod
    def of(cls, opts: Any) -> "Terms":
        """From an option section (``EagleOptions``, ``DFlashOptions``) that carries the four fields."""
        return cls(opts.topk_weight, opts.topk_k, opts.align_topk, opts.chain_weight)


def topk_distill(target_p: Tensor, logq: Tensor, k: int) -> Tensor:
    """HASS's Top-K distillation loss per row (Zhang et al., ICLR 2025, eq. "L_Top-K"):
    -Σ_{x ∈ top-K(p)} p(x) · log q(x), over the K tokens the target finds likeliest.

    target_p (N, Vd) probabilities, logq (N, Vd) the drafter's log-probabilities -> (N,)."""
    top = target_p.topk(min(k, target_p.shape[-1]), dim=-1).indices  # (N, K)
    return -(target_p.gather(-1, top) * logq.gather(-1, top)).sum(-1)


@torch.no_grad()
def in_topk(logits: Tensor, labels: Tensor, k: int) -> Tensor:
    """(N,) bool: ``labels`` (N,) (draft ids, -1 = none) is among the ``k`` likeliest rows of
    ``logits`` (N, Vd): a tree with k children per node would draft it (GRIFFIN's criterion)."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # (N, k)
    return (top == labels[:, None]).any(-1) & (labels >= 0)


def reached(hits: Tensor) -> Tensor:
    """GRIFFIN's loss mask along a chain: (..., D) bool hits at depths 0..D-1 -> (..., D) bool,
    True at depth d iff every depth < d was a hit (decoding reaches depth d only through them)."""
    ones = torch.ones_like(hits[..., :1])
    return torch.cat([ones, hits[..., :-1]], dim=-1).long().cumprod(-1).bool()


def expected_accepted(probs: Tensor) -> Tensor:
    """Σ_d Π_{i ≤ d} probs[..., i]: the expected number of drafts a chain gets accepted when depth
    i is accepted with probability probs[..., i] given the depths before it. (..., D) -> (...)."""
    return probs.cumprod(-1).sum(-1)


__all__ = ["Terms", "expected_accepted", "in_topk", "reached", "topk_distill"]
