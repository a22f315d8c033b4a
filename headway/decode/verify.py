"""Verification: which drafted path the target accepts, and the bonus token.

Pure functions of the tree, the target's outputs at every tree node, and (for sampling) the
random draws, which are an argument so tests are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .tree import TreeBuffers


@dataclass
class Verdict:
    nodes: torch.Tensor  # (m + 1,) accepted node indices, root first
    bonus: torch.Tensor  # () the target's own next token after the last accepted node

    @property
    def accepted(self) -> int:
        """Number of accepted draft tokens (root excluded)."""
        return self.nodes.numel() - 1


def verify_greedy(tokens: torch.Tensor, buffers: TreeBuffers, target_logits: torch.Tensor) -> Verdict:
    """Longest root-to-leaf prefix whose every token equals the target's argmax at its parent.

    tokens (N,), target_logits (N, V) at each node. Exact: the emitted tokens are what greedy
    decoding of the target alone would emit.
    """
    pred = target_logits.argmax(-1)  # (N,) target's next token after each node
    correct = tokens == pred[buffers.parents.clamp(min=0)]  # (N,) node agrees with its parent's argmax
    correct[0] = True
    paths = buffers.retrieve  # (L, D + 1)
    ok = correct[paths.clamp(min=0)] & (paths >= 0)
    length = ok.long().cumprod(dim=1).sum(dim=1)  # (L,) accepted prefix length, root included
    best = length.argmax()
    n = int(length[best])  # the one sync per step
    nodes = paths[best, :n]
    return Verdict(nodes, pred[nodes[-1]])


def verify_greedy_walk(tokens: torch.Tensor, buffers: TreeBuffers, logits: Any) -> Verdict:
    """``verify_greedy`` reading the target's logits only along the accepted path: from the root,
    step to the child whose token is the target's argmax until none is. ``logits[node]`` gives (V,)
    (a ``NodeLogits`` computes it then). Siblings carry distinct tokens, so the path is the same."""
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(buffers.parents.tolist()[1:], tokens.tolist()[1:]), start=1):
        children.setdefault((p, t), i)
    path, node = [0], 0
    while True:
        best = logits[node].argmax(-1)
        child = children.get((node, int(best)))  # the one sync per accepted node
        if child is None:
            return Verdict(torch.tensor(path, device=tokens.device), best)
        path.append(child)
        node = child
