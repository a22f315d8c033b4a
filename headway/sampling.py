"""The target's processed next-token distribution: temperature, top-k, top-p, in HF ``generate``'s
order. Shared by the decoder's verification (``decode.sampling``) and the data stage's sampled
generation (``data.generation.sample_batch``), so both sample from the same distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def processed_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) probabilities after temperature, top-k, top-p (float32)."""
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - p.top_p  # the low tail whose mass is under 1 - top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x.softmax(-1)
