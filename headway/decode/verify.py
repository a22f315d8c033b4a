"""Verification: which drafted path the target accepts, and the bonus token.

Pure functions of the trees, the target's outputs at every tree node, and (for sampling) the
random draws, which are an argument so tests are deterministic. Terms, here and in ``sampling.py``:

    tree        a step's drafts of one row: node 0 is the root (the row's last emitted token, its
                KV entry not yet in the cache), every other node a draft token; ``parents`` (N,)
    p           the target's distribution at a node: over the token after it (its logits, processed by
                temperature / top-k / top-p when sampling; greedy reads the argmax)
    q           the draft distribution a drawn draft came from (sampled chains, ``fork-N`` above T=0);
                a top-k draft has none (deterministic)
    accepted    the drafts the target agrees with along one root path: greedy, each equals the argmax
                of p at its parent; sampling, each passes its rejection test (min(1, p/q) for a drawn
                draft, p(x) / sum(p) for a deterministic one)
    rejected    the first draft on the path that fails; siblings are tried in order before the walk
                stops at a node
    residual    what is left of p at a node after its rejected children: (p - q)+ for a drawn one,
                p without the token for a deterministic one, renormalised
    bonus       the target's own token after the last accepted node: the argmax of p (greedy), a
                draw from p (all accepted) or from the residual (after a rejection). vLLM calls the
                latter the recovered token. Always emitted, so a step emits accepted + 1 tokens
    emitted     the accepted drafts then the bonus token, which join the output
    Verdict     one row's answer: ``nodes`` the accepted path, root first (accepted + 1 nodes), and
                ``bonus``
    u           uniform draws in [0, 1): one per node for its test, one for the bonus

Greedy verification is exact (the emitted tokens are greedy decoding's), sampling exact in
distribution; Medusa's typical acceptance (``sampling.verify_typical``) is lossy and labelled so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .padding import pad_rows
from .tree import TreeBuffers


@dataclass
class Verdict:
    nodes: torch.Tensor  # (m + 1,) accepted node indices, root first
    bonus: torch.Tensor  # () the target's own next token after the last accepted node

    @property
    def accepted(self) -> int:
        """Number of accepted draft tokens (root excluded)."""
        return self.nodes.numel() - 1


def verify_greedy(tokens: torch.Tensor, parents: torch.Tensor, paths: torch.Tensor, logits: torch.Tensor
                  ) -> list[Verdict]:
    """Greedy acceptance of B trees in one tensor pass: per row, the longest root path whose every
    draft equals the target's argmax at its parent, and the bonus token (the argmax after it).

    tokens (B, N), parents (B, N) (the root's -1; a pad node's any node), paths (B, L, D + 1) each
    row's root-to-leaf paths padded with -1 (``TreeBuffers.retrieve``), logits (B, N, V) the target's
    at every node. Exact: the emitted tokens are what greedy decoding of the target alone emits. One
    host read for all rows: how many nodes each accepted."""
    B = tokens.shape[0]
    pred = logits.argmax(-1)  # (B, N) the target's next token after each node
    correct = tokens == pred.gather(1, parents.clamp(min=0))  # (B, N) node agrees with its parent's argmax
    correct[:, 0] = True
    ok = correct.gather(1, paths.clamp(min=0).flatten(1)).view(paths.shape) & (paths >= 0)  # (B, L, D + 1)
    length = ok.long().cumprod(dim=-1).sum(dim=-1)  # (B, L) accepted prefix of each path, root included
    rows = torch.arange(B, device=tokens.device)
    best = length.argmax(dim=-1)  # (B,)
    nodes, n = paths[rows, best], length[rows, best]  # (B, D + 1), (B,)
    bonus = pred.gather(1, nodes.gather(1, (n - 1)[:, None]))[:, 0]  # (B,) the argmax after the last accepted
    return [Verdict(nodes[b, :m], bonus[b]) for b, m in enumerate(n.tolist())]


def stack_trees(buffers: Sequence[TreeBuffers]) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_greedy``'s (parents (B, N), paths (B, L, D + 1)) of the rows' trees, padded to the
    largest (a pad node's parent: the root; a pad path: -1); rows of one shape share its buffers,
    uncopied."""
    first, B = buffers[0], len(buffers)
    if all(b is first for b in buffers):
        return first.parents.expand(B, -1), first.retrieve.expand(B, -1, -1)
    parents = pad_rows([b.parents for b in buffers])  # (B, N)
    paths = first.retrieve.new_full((B, max(b.retrieve.shape[0] for b in buffers),
                                     max(b.retrieve.shape[1] for b in buffers)), -1)
    for i, b in enumerate(buffers):
        paths[i, :b.retrieve.shape[0], :b.retrieve.shape[1]] = b.retrieve
    return parents, paths


def verify_greedy_walk(tokens: torch.Tensor, buffers: TreeBuffers, logits: Any) -> Verdict:
    """``verify_greedy`` of one tree reading the target's logits only along the accepted path: from
    the root, step to the child whose token is the target's argmax until none is. ``logits[node]``
    gives (V,) (a ``NodeLogits`` computes it then). Siblings carry distinct tokens, so the path is
    the same. A CPU path (on-demand lm_head rows): one host read per accepted node."""
    children: dict[tuple[int, int], int] = {}
    parents, toks = torch.stack([buffers.parents, tokens]).tolist()
    for i, (p, t) in enumerate(zip(parents[1:], toks[1:]), start=1):
        children.setdefault((p, t), i)
    path, node = [0], 0
    while True:
        best = logits[node].argmax(-1)
        child = children.get((node, int(best)))  # the one read per accepted node
        if child is None:
            return Verdict(torch.tensor(path, device=tokens.device), best)
        path.append(child)
        node = child
