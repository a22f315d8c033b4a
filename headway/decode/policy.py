"""Which tree a step drafts: the shape for the sampling mode, shrunk near the context's end, sized
per step for adaptive trees, and, by batch size, whether to speculate at all.

A tree costs a bigger verify forward; on a 2-core CPU at batch 8 that cost can exceed what the
accepted drafts save, and speculation then loses to plain decoding. ``TreePolicy.speculate`` decides
per step from the live batch size: a tuned table (``headway tune --batch-sizes``: the measured
fastest choice per batch size, stored with the heads) when there is one, else ``untuned_speculates``:
speculate only where the gain over plain decoding is known to be positive (one prompt), decode
plainly elsewhere, so an untuned decoder is never slower than plain decoding with the same kernel
at a batch size it knows nothing about. A plain step (``step.plain``) is one forward over each
row's last token and drafts nothing, so the output is the target's either way."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .cost import CURVE_SIZES, best_size, cost_by_size, forward_cost
from .sampling import SamplingParams
from .proposers import EagleProposer, Proposer
from .shapes import DynamicShape, StaticShape, TreeShape, chain, is_chain, is_fork, parse_shape
from .trees import SizeFor


def fit_tree(tree: TreeShape | str | None, proposer: Proposer) -> TreeShape:
    """A tree the proposer can draft: parsed, defaulted (a dynamic tree for EAGLE-style drafters, a
    chain over Medusa's heads), clipped to the draft vocabulary and to the proposer's depth."""
    if isinstance(tree, str):
        tree = parse_shape(tree)
    if tree is None:
        tree = DynamicShape(top_k=4, depth=5, total_tokens=16) if drafts_per_token(proposer) \
            else chain(proposer.max_depth)
    tree = tree.within_vocab(proposer.draft_vocab_size)
    cap = proposer.max_depth
    return tree.truncated(cap) if cap is not None and tree.depth > cap else tree


def drafts_per_token(proposer: Proposer) -> bool:
    """EAGLE drafters run once per tree level and condition on the parent: a dynamic tree pays off.
    Medusa and DFlash draft every depth in one call, independent of the parent: a chain."""
    return isinstance(proposer, EagleProposer)


@dataclass
class TreePolicy:
    """Tree shapes and the per-step choices. ``tree`` is drafted at T=0, ``sampling_tree`` above;
    ``by_batch`` maps a batch size to ``False`` (plain decoding), ``True`` (speculate with ``tree``)
    or the tree that was fastest at that size (a B-row verify costs more, so smaller trees win as B
    grows), tuned at T=0 (``by_batch_sampling``: above, where sampled drafts are accepted less
    often); a size between tuned ones takes the nearest by ratio (``nearest_size``). ``sampled_drafts``: at T > 0 a
    chain's drafts are sampled from the drafter and verified by speculative sampling; ``typical``:
    Medusa's lossy typical acceptance (threshold, alpha)."""

    tree: TreeShape
    sampling_tree: TreeShape
    max_positions: int
    sampled_drafts: bool = True
    typical: tuple[float, float] | None = None
    by_batch: dict[int, bool | TreeShape] | None = None
    by_batch_sampling: dict[int, bool | TreeShape] | None = None  # above T=0 (None: ``by_batch`` serves both)
    batch_aware: bool = True  # False: always speculate (A/B)
    confidence_sizing: bool = False  # a chain's verify length from the drafter's confidence head (DSpark)
    verify_costs_by_threads: dict[int, torch.Tensor] = field(default_factory=dict)
    _shapes: dict[tuple[int, int], TreeShape] = field(default_factory=dict)

    def tree_for(self, temperature: float) -> TreeShape:
        """The shape drafted at this temperature (``tree`` at 0, ``sampling_tree`` above)."""
        return self.tree if temperature <= 0 else self.sampling_tree

    def shape_for(self, room: int, sampling: bool = False, batch_size: int = 1) -> TreeShape:
        """The tree for the mode and batch size, shrunk so that its deepest node stays inside the
        context window (``room``: positions left after the root)."""
        tree = self.tuned(batch_size, sampling)
        if not isinstance(tree, (StaticShape, DynamicShape)):
            tree = self.sampling_tree if sampling else self.tree
        if room >= tree.depth:
            return tree
        key = (room, id(tree))
        if key not in self._shapes:
            self._shapes[key] = tree.truncated(room)  # a dynamic tree keeps depth 1
        return self._shapes[key]

    def samples_chain(self, params: SamplingParams, shape: TreeShape) -> bool:
        """Whether this step's chain drafts are sampled (verified by speculative sampling)."""
        return self._draws(params) and is_chain(shape)

    def samples_children(self, params: SamplingParams, shape: TreeShape) -> bool:
        """Whether a ``fork-N`` draws its children above T=0 (verified by recursive rejection
        sampling). Other trees keep their top-k drafts: their ranks are what ``tune`` measured."""
        return self._draws(params) and is_fork(shape)

    def _draws(self, params: SamplingParams) -> bool:
        """Drafts may be drawn from the drafter: a sampled row, drawing on, exact (not typical) acceptance."""
        return not params.greedy and self.sampled_drafts and self.typical is None

    # -- speculate or not, by batch size ------------------------------------------------------
    def speculate(self, batch_size: int, sampling: bool = False) -> bool:
        """Whether this step drafts: as the tuned table says for this batch size (greedy and sampling
        batches apart: a sampled chain is accepted less often than a greedy one), else as
        ``untuned_speculates`` rules."""
        tuned = self.tuned(batch_size, sampling)  # None when not batch-aware: then always speculate
        if tuned is not None or not self.batch_aware:
            return tuned is not False
        return untuned_speculates(batch_size)

    def tuned(self, batch_size: int, sampling: bool) -> bool | TreeShape | None:
        """The tuned table's entry for this batch size, or None: the nearest tuned size by ratio
        (``nearest_size``), since rows leave a batch as they finish."""
        table = self.by_batch_sampling if sampling and self.by_batch_sampling else self.by_batch
        if not table or not self.batch_aware:
            return None
        return table[nearest_size(table, batch_size)]

    def largest_size(self) -> int:
        """Nodes of the largest tree this policy may draft (a static cache leaves room for it)."""
        tables = [t for t in (self.by_batch, self.by_batch_sampling) if t]
        return max([self.tree.size, self.sampling_tree.size] +
                   [v.size for t in tables for v in t.values() if not isinstance(v, bool)])

    # -- adaptive trees: nodes weighed against the verify-cost curve --------------------------
    def adaptive(self) -> bool:
        return any(isinstance(t, DynamicShape) and t.adaptive for t in (self.tree, self.sampling_tree))

    def sized_per_step(self) -> bool:
        """Some step may verify fewer nodes than its tree: an adaptive tree, or a chain the drafter's
        confidence head sizes (both read the verify-cost curve)."""
        return self.adaptive() or (self.confidence_sizing and any(map(is_chain, (self.tree, self.sampling_tree))))

    def sizes_chain(self, shape: TreeShape, batch_size: int) -> bool:
        """This step's chain is cut to the length its confidence says pays (one prompt: a batch verifies
        the whole chain, as it does an adaptive tree's TOTAL)."""
        return self.confidence_sizing and batch_size == 1 and is_chain(shape)

    def verify_costs(self, runtime: Any) -> torch.Tensor:
        """(N,) seconds of a verify forward over 1..N tokens, N the largest adaptive tree's budget:
        timed once per thread count on first use (a few forwards per size, ``decode/cost.py``) with
        the decoder's own kernels, then interpolated."""
        threads = torch.get_num_threads()
        most = max(t.size for t in (self.tree, self.sampling_tree) if isinstance(t, DynamicShape) or is_chain(t))
        known = self.verify_costs_by_threads.get(threads)
        if known is None or known.numel() < most:
            sizes = [n for n in CURVE_SIZES if n < most] + [most]
            self.verify_costs_by_threads[threads] = cost_by_size(forward_cost(runtime, sizes, repeats=3), most)
        return self.verify_costs_by_threads[threads]

    def size_for(self, runtime: Any, step_cost: float | None, t_draft: float) -> SizeFor:
        """An adaptive tree's budget at this step: the size with the most expected tokens per second,
        a step costing its verify plus the rest of a step (drafting, bookkeeping: ``step_cost``, the
        running mean of the steps before; at the first step, this one's drafting so far)."""
        costs = self.verify_costs(runtime)

        def size_for(gains: torch.Tensor) -> int:
            rest = step_cost if step_cost is not None else time.perf_counter() - t_draft
            return best_size(gains, costs + rest)
        return size_for


def untuned_speculates(batch_size: int) -> bool:
    """Without a tuned table, speculate only where the expected gain over plain decoding is positive.

    One prompt: the tree was chosen for it (``headway tune`` against every chain, or a kind default
    whose drafts one row verifies for about the cost of a forward: a memory-bound pass over the
    weights). A batch: a B-row verify of an N-node tree multiplies B x N rows by every weight matrix,
    which on a CPU costs more the larger B is, while each row still gains only its accepted drafts;
    the gain may be negative (SmolLM2 EAGLE-3, 2 threads, T=0: 0.90x plain decoding at batch 16), and
    nothing the decoder holds says which. So an untuned batch decodes plainly: by construction never
    slower than plain decoding, and ``headway tune --batch-sizes`` measures where drafting pays."""
    return batch_size == 1


def nearest_size(sizes: Any, batch_size: int) -> int:
    """The tuned size nearest ``batch_size`` by ratio, the larger on a tie: a batch of 16 whose
    first row has finished (15) is decoded as 16 was tuned, not as 8, and 6 as 8, 5 as 4."""
    return min(sizes, key=lambda b: (abs(math.log(batch_size / b)), -b))


def batch_table(stored: Any) -> dict[int, bool | TreeShape] | None:
    """``metadata["decode"]["by_batch"]`` (or ``by_batch_sampling``) ({"1": "measured-16", "4": "chain-2",
    "8": false}) -> {1: <tree>, 4: <chain-2>, 8: False}: a tree spec becomes the tree, true means
    the default tree, false plain decoding."""
    if not stored:
        return None
    return {int(k): parse_shape(v) if isinstance(v, str) else bool(v) for k, v in dict(stored).items()}


def fitted_table(table: dict[int, Any] | None, proposer: Proposer) -> dict[int, bool | TreeShape] | None:
    """A batch table whose trees (shapes or spec strings) the proposer can draft (``fit_tree``)."""
    if not table:
        return None
    return {int(b): v if isinstance(v, bool) else fit_tree(v, proposer) for b, v in table.items()}
