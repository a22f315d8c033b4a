"""The target's logits at the nodes of one verified tree, projected through the lm_head on demand.

Verification reads the target's distribution only at the nodes of the accepted path (greedy: the
argmax there; exact sampling: the residual there), about tau of the tree's N nodes. On a CPU the
lm_head over N rows is compute-bound (SmolLM2: 57 MFLOP a row, a fifth of the whole model's),
while a few rows cost about one read of its weights. So the verify forward stops before the
lm_head, and ``NodeLogits`` projects a node's row when verification first reads it, together with
the chain of first children below it (where the walk most likely goes next) in the same call.
A step then costs one or two small projections instead of N rows, with the same logits.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from ..compat import hidden_states_arg
from ..hardware import sync
from .tree import TreeBuffers

PREFETCH_ROWS = 8  # rows per on-demand projection: a few rows cost about one (the weights are read once)


class NodeLogits:
    """(N, V) logits of a tree's nodes, each row computed once, when first read.

    ``hidden`` (N, H) the target's final (normed) hidden states at the nodes; ``head`` maps them to
    logits (the target's output embeddings). ``buffers`` the tree's. ``full`` given instead of
    ``hidden``: every row is already there (the eager path, and batch or tuning code that reads all).
    """

    def __init__(self, buffers: TreeBuffers, hidden: torch.Tensor | None = None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None, full: torch.Tensor | None = None) -> None:
        if (full is None) == (hidden is None):
            raise ValueError("give either the hidden states (and the head) or the full logits")
        self.buffers, self.size = buffers, buffers.size
        self.hidden, self.head, self.full = hidden, head, full
        self.rows: dict[int, torch.Tensor] = {}
        self.projections = 0  # lm_head calls made on demand (a full tensor counts none)
        self.seconds = 0.0  # time in them: the target's time, though spent after its forward

    @property
    def lazy(self) -> bool:
        return self.full is None

    def __getitem__(self, node: int) -> torch.Tensor:
        """(V,) logits at ``node``."""
        if self.full is not None:
            return self.full[node]
        node = int(node)
        if node not in self.rows:
            self._project(self.prefetch(node))
        return self.rows[node]

    def prefetch(self, node: int) -> list[int]:
        """The rows projected when ``node`` is read: it and its first-child chain, at most
        ``PREFETCH_ROWS``."""
        rows, first = [node], self.buffers.first_child
        while len(rows) < PREFETCH_ROWS and rows[-1] in first:
            rows.append(first[rows[-1]])
        return rows

    def all(self) -> torch.Tensor:
        """(N, V) every row (one projection of the rows not read yet)."""
        if self.full is None:
            missing = [i for i in range(self.size) if i not in self.rows]
            if missing:
                self._project(missing)
            self.full = torch.stack([self.rows[i] for i in range(self.size)])
        return self.full

    def _project(self, rows: list[int]) -> None:
        assert self.hidden is not None and self.head is not None
        t = time.perf_counter()
        out = self.head(self.hidden[rows])
        sync(out.device)
        self.seconds += time.perf_counter() - t
        self.projections += 1
        self.rows.update(zip(rows, out))


class Projection(nn.Module):
    """The target's output embeddings as called by verification: a module of its own, so that
    timing hooks (``headway bench``) count these calls as the target's time, apart from a drafter
    that borrows the same lm_head."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not a submodule: its parameters are the target's

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


class NodeProbs:
    """A processed distribution per node (``fn`` of that node's logits), computed when first read."""

    def __init__(self, logits: NodeLogits, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.logits, self.fn = logits, fn
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, node: int) -> torch.Tensor:
        node = int(node)
        if node not in self._rows:
            self._rows[node] = self.fn(self.logits[node][None])[0]
        return self._rows[node]


def head_matches_logits(model: nn.Module, layer: int, probe: torch.Tensor) -> bool:
    """Whether ``output_embeddings(hidden_states[layer])`` reproduces the model's logits on ``probe``
    and the model skips its lm_head with ``logits_to_keep`` (an empty index). Architectures that
    transform the projected logits (soft-capping, scaling) or lack ``logits_to_keep`` answer False,
    and keep the full verify forward."""
    head = model.get_output_embeddings()
    if head is None:
        return False
    try:
        with torch.inference_mode():
            full = model(input_ids=probe).logits[0]
            out: Any = model(input_ids=probe, output_hidden_states=hidden_states_arg([layer]),
                             logits_to_keep=torch.empty(0, dtype=torch.long, device=probe.device))
            if out.logits.shape[1] != 0:
                return False
            mine = head(out.hidden_states[layer][0])
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
        return False
    return mine.shape == full.shape and torch.equal(mine, full)
