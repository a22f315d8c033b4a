"""P-EAGLE training layout as pure functions: which mask slots a batch trains and what each may see
(``train/peagle.py`` builds the loss and evaluation on them).

Index conventions are EAGLE's (``ttt.py``): sequence index t holds x_{t+1} and f_t at position t and
predicts x_{t+2}. Depth 0 is the real slot at every index (one causal pass over the sequence). A
*slot* (a, d), d = 1 .. K-1, is the d-th mask slot after anchor index a: position a + d, predicting
x_{a+d+2}; it sees the real slots 0..a and the slots (a, 1..d) of its own chain, which is what a
mask slot sees when the drafter drafts K tokens after index a (vLLM's parallel drafting, a causal
pass over [real slots, mask slots]).

Training keeps every depth-0 index but only some chains at depth d >= 1: speculators' "COD"
sampling keeps about ``ratio ** d`` (at least ``ratio_min``) of a row's answer positions at depth d,
each a chain already kept at depth d - 1, so deeper, rarer depths cost less. Here the kept chains are
the best-scoring candidates under one uniform draw per position (a pure function of seed, step and
the row's tokens, ``blocks.row_draws``), so the chains of depth d are nested in those of depth d - 1
by construction, and a resumed or multi-process run keeps the same ones.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .ttt import label_mask


def kept_per_depth(answers: int, num_depths: int, ratio: float, ratio_min: float, cap: int | None) -> list[int]:
    """How many chains depth d = 1 .. K-1 keeps for a row with ``answers`` labelled depth-0 indices:
    floor(answers * max(ratio ** d, ratio_min)), at least 1 (every depth trains), at most ``cap``."""
    out = []
    for d in range(1, num_depths):
        n = max(1, math.floor(answers * max(ratio ** d, ratio_min)))
        out.append(n if cap is None else min(n, cap))
    return out


def cod_slots(loss_mask: Tensor, draws: Tensor, num_depths: int, ratio: float, ratio_min: float,
              cap: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The mask slots a batch trains: loss_mask (B, T), draws (B, T) uniform -> (anchor (B, N) long,
    depth (B, N) long, ok (B, N) bool), N the largest row's count, padding slots (ok False) at anchor 0,
    depth 0. Depth d keeps the best-drawn chains among those kept at depth d - 1 whose token x_{a+d+2}
    is an answer token (depth 0 keeps every index whose x_{a+2} is one): every token a kept chain
    predicts is an answer token, as in decoding, where a chain starts at the last accepted token."""
    B, T = loss_mask.shape
    rows: list[tuple[Tensor, Tensor]] = []
    for b in range(B):
        kept = label_mask(loss_mask[b:b + 1], 2)[0]  # (T,) depth 0: x_{a+2} is an answer token
        answers = int(kept.sum())
        anchors, depths = [], []
        for d, n in enumerate(kept_per_depth(answers, num_depths, ratio, ratio_min, cap), start=1):
            cand = kept & label_mask(loss_mask[b:b + 1], d + 2)[0]  # (T,)
            n = min(n, int(cand.sum()))
            if n == 0:
                break
            pick = draws[b].masked_fill(~cand, -1.0).topk(n).indices.sort().values  # (n,)
            kept = torch.zeros_like(kept).index_fill_(0, pick, True)
            anchors.append(pick)
            depths.append(torch.full_like(pick, d))
        empty = loss_mask.new_zeros(0, dtype=torch.long)
        rows.append((torch.cat(anchors) if anchors else empty, torch.cat(depths) if depths else empty))
    N = max(1, max(a.numel() for a, _ in rows))
    anchor = loss_mask.new_zeros(B, N, dtype=torch.long)
    depth = torch.zeros_like(anchor)
    ok = torch.zeros(B, N, dtype=torch.bool, device=loss_mask.device)
    for b, (a, d) in enumerate(rows):
        anchor[b, :a.numel()], depth[b, :a.numel()], ok[b, :a.numel()] = a, d, True
    return anchor, depth, ok


def every_slot(rows: int, start: int, stop: int, num_depths: int, device: torch.device | str
               ) -> tuple[Tensor, Tensor, Tensor]:
    """Every chain anchored at indices start .. stop-1 with all its K - 1 mask slots, for ``rows`` rows
    (evaluation): (anchor, depth, ok) (rows, (stop - start) * (K - 1)), anchor-major."""
    a = torch.arange(start, stop, device=device).repeat_interleave(num_depths - 1)  # (C * (K-1),)
    d = torch.arange(1, num_depths, device=device).repeat(stop - start)
    return a.expand(rows, -1), d.expand(rows, -1), torch.ones(rows, a.numel(), dtype=torch.bool, device=device)


def slot_mask(anchor: Tensor, depth: Tensor, ok: Tensor, T: int, dtype: torch.dtype) -> Tensor:
    """Float additive (B, 1, N, T + N) for the slots after T real slots whose keys are cached: slot n
    sees real slots 0..anchor[n] and the kept slots of its own chain at depths 1..depth[n]. A padding
    slot sees real slot 0 only (a query that sees nothing would give NaN)."""
    real = torch.arange(T, device=anchor.device)[None, None, :] <= anchor[:, :, None]  # (B, N, T)
    chain = (anchor[:, :, None] == anchor[:, None, :]) & (depth[:, None, :] <= depth[:, :, None])  # (B, N, N)
    chain &= ok[:, None, :] & ok[:, :, None]
    visible = torch.cat([real, chain], dim=2)
    mask = torch.zeros(visible.shape, dtype=dtype, device=anchor.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]
