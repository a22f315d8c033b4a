"""What a verify forward costs, and how many draft nodes are worth verifying.

A tree of N tokens costs one target forward whose time grows with N (on a 2-core CPU a 24-token
verify takes about twice a 1-token forward; on a GPU about the same as one). An adaptive dynamic
tree (``adaptive-K-D-N``) spends that budget step by step: the drafter's calibrated cumulative
probability of a node is the chance it is accepted, so keeping the best n candidates is expected
to emit ``1 + sum of their probabilities`` tokens (the target's own token included), and the step
keeps the n that maximises expected tokens per second of the step. Confident steps verify deep
trees, unsure ones a few nodes. Which nodes are verified never changes what is emitted.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch

from ..hardware import sync
from .kv import drop_last, new_cache
from .node_logits import PREFETCH_ROWS
from .tree import tree_mask

# token counts timed for a cost curve; the rest are interpolated (the linear kernels switch at
# powers of two and the buckets between them, ``headway.kernels.BUCKETS``)
CURVE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def interpolate(curve: dict[int, float], n: int) -> float:
    """Piecewise-linear value of ``curve`` (token count -> seconds) at ``n``; proportional past the end."""
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)
    return curve[xs[-1]] * n / xs[-1]


def cost_by_size(curve: dict[int, float], max_nodes: int) -> torch.Tensor:
    """(max_nodes,) seconds of a verify over 1..max_nodes tokens (index n - 1), interpolated and made
    non-decreasing (a timing that dips at a bigger size is noise, or a padding quirk a smaller tree
    could run the same way)."""
    costs = torch.tensor([interpolate(curve, n) for n in range(1, max_nodes + 1)], dtype=torch.float64)
    return costs.cummax(0).values


def best_size(gains: torch.Tensor, costs: torch.Tensor) -> int:
    """How many tokens to verify: the n in 1..len(costs) with the most expected tokens per second.

    ``gains`` (m,): the acceptance probabilities of the candidates in the order they would join the
    tree (best first; the root, always kept, excluded); ``costs`` (>= 1 entries): seconds of a whole
    step that verifies 1, 2, ... tokens. n tokens are the root and the first n - 1 candidates, so they
    emit ``1 + gains[:n-1].sum()`` tokens on average. Ties go to the smaller tree."""
    n = min(costs.numel(), gains.numel() + 1)
    expected = torch.cat([gains.new_ones(1), 1 + gains[: n - 1].double().cumsum(0)])  # (n,) for 1..n tokens
    rate = expected / costs[:n].double()
    return int(rate.argmax()) + 1  # argmax returns the first of equal maxima


def forward_cost(rt: Any, sizes: Sequence[int], prefix_len: int = 128, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one verify forward of ``rt`` (a ``decode.runtime.Runtime``) over n tree tokens on a
    ``prefix_len`` cache, for each n in ``sizes``: the same linear kernels and lm_head rows as its
    verify forward. One prefill; each forward's entries are cropped off after it; the sizes take
    turns, ``repeats`` rounds."""
    dev = rt.device
    sizes = sorted(set(sizes))
    prefix_len = max(1, min(prefix_len, rt.max_positions - sizes[-1] - 1))
    gen = torch.Generator(device=dev).manual_seed(0)  # private: timing never moves a user's seeded global RNG
    vocab = int(rt.target.config.vocab_size)
    lazy = rt.uses_lazy_logits()
    cache = new_cache(rt.target.config)  # a full cache: sliding-window layers' would refuse the crops
    with torch.inference_mode():
        rt.forward(torch.randint(3, vocab, (1, prefix_len), device=dev, generator=gen), cache, **rt.last_logits_only())
        masks = {n: tree_mask(torch.ones(n, n, dtype=torch.bool, device=dev).tril(), prefix_len, rt.dtype)
                 for n in sizes}
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeats):  # sizes interleaved: a machine whose speed drifts slows every size alike
            for n in sizes:
                # cost depends on the token count, not on the tree's shape: time a causal block of n tokens;
                # with on-demand lm_head rows a tree projects about one prefetch's worth (a chain all of its few)
                keep = {"logits_to_keep": torch.arange(min(n, PREFETCH_ROWS), device=dev)} if lazy else {}
                pos = (torch.arange(n, device=dev) + prefix_len)[None]
                tok = torch.randint(3, vocab, (1, n), device=dev, generator=gen)
                sync(dev)
                t = time.perf_counter()
                with rt.kernels():  # the linear kernels, attention and hidden states of a verify forward
                    rt.forward(tok, cache, attention_mask=masks[n], position_ids=pos, **keep)
                sync(dev)
                times[n].append(time.perf_counter() - t)
                drop_last(cache, n)
    return {n: statistics.median(ts) for n, ts in times.items()}
