"""Drafting a step's trees for B rows at once: the shapes of ``decode/shapes.py`` filled from a
``Proposer``'s answers, one drafter call per tree level for all rows.

The paths, as the papers draw them:

* ``static_trees``: a fixed shape of rank paths (``chain-N``, Medusa's tree, ``fork-N``), filled level
  by level with each parent's top-k; only nodes with children are expanded. Above T=0 a fork's
  children are drawn instead, each from the drafter's distribution less its earlier siblings
  (``SampleChild``), and the tree keeps what each was drawn from (``DraftTree.proposals``).
* ``dynamic_trees``: EAGLE-2, expand the ``top_k`` nodes with the best cumulative draft
  log-probability per depth, keep the best ``total_tokens`` (``select_tree``; an adaptive tree keeps
  as many as pay for their verify cost, ``SizeFor``).
* ``sampled_chains``: a chain whose drafts are drawn from the drafter (speculative sampling).
* ``sized_chain``: a chain cut, per step, to the length a confidence head (DSpark) says pays off.

Each row gets the tree its own run would build from the same distributions. Rows need different
shapes only near the context window (``TreePolicy.shape_for`` shrinks the depth): a truncated static
shape is a prefix of the full one in node order (nodes sort by depth, then rank path) and a node's
draft depends only on its ancestors, so the largest shape is drafted once and each row keeps its
prefix; a dynamic tree's loop runs to the deepest row's depth and each row keeps the candidates of
its own depths, the pool its own shape would have built.

Token ids in log-probs are *draft* ids; ``proposer.to_target_ids`` maps them (a reduced vocabulary).
Calibration: dynamic trees rank candidates by the cumulative ``log_softmax(logp / T_depth)``
(``depth_temperature``), so a drafter that is right more often than it is confident still gets deep
trees; static trees (ranks) and sampled chains (the raw ``q`` their accept rule needs) ignore it.
Which nodes are drafted never changes what verification emits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .proposers import Proposer
from .shapes import DynamicShape, StaticShape, TreeShape, chain_buffers
from .tree import TreeBuffers


@dataclass
class DraftTree:
    """One row's tree of one step: target-space tokens (root first) plus its buffers."""

    tokens: torch.Tensor  # (N,) target token ids; tokens[0] is the root
    buffers: TreeBuffers
    draft_ids: torch.Tensor | None = None  # (N,) draft-vocab ids (root: -1)
    # above T=0, the nodes drawn from the drafter: node -> the (V,) target-vocab proposal it was drawn
    # from (``sampling.verify_sample`` reads it)
    proposals: dict[int, torch.Tensor] | None = None


# draw(logprobs (Vd,)) -> (q (Vd,), draft id): one draft from the processed distribution (``sampling.draw_draft``)
SampleDraft = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]
# draw(logprobs (Vd,), k) -> k draws [(q, draft id)], each from the processed distribution less the earlier
# draws (q None: they held all of its mass, the id the best other token; ``sampling.draw_children``)
SampleChild = Callable[[torch.Tensor, int], "list[tuple[torch.Tensor | None, torch.Tensor]]"]
# (m,) acceptance probabilities of the best candidates, best first (root excluded) -> tokens to keep
SizeFor = Callable[[torch.Tensor], int]


def build_trees(shapes: Sequence[TreeShape], proposer: Proposer, roots: torch.Tensor,
                samples: Sequence[SampleChild | None] = (), target_vocab: int = 0,
                size_for: SizeFor | None = None) -> list[DraftTree]:
    """Row b's tree of ``shapes[b]`` (all truncations of one shape) rooted at ``roots[b]``."""
    if isinstance(shapes[0], StaticShape):
        return static_trees(shapes, proposer, roots, samples, target_vocab)
    return dynamic_trees(shapes, proposer, roots, size_for if shapes[0].adaptive else None)


# -- static shapes: a chain, Medusa's tree, fork-N ------------------------------------------------
@dataclass
class _Level:
    nodes: torch.Tensor  # (n_d,) node ids at this depth
    k: int  # top-k needed from each parent's distribution
    parent_row: torch.Tensor  # (n_d,) row of each node's parent in the previous level's logprobs
    ranks: torch.Tensor  # (n_d,)
    expand: torch.Tensor  # node ids at this depth that have children (they get expanded next)
    expand_parent_row: torch.Tensor  # row of each expanded node's parent in the previous expand call
    # (parent row, its children's node ids in rank order) for drawing them above T=0 (plain ints: no syncs)
    families: tuple[tuple[int, tuple[int, ...]], ...] = ()


def levels(shape: StaticShape, device: torch.device) -> tuple[list[_Level], TreeBuffers]:
    """Per-depth index tensors and the buffers of a static shape, built once per device (no syncs
    while drafting)."""
    cached = shape.__dict__.setdefault("_levels_cache", {})
    if device not in cached:
        b, out = shape.buffers, []
        has_child = torch.zeros(shape.size, dtype=torch.bool)
        has_child[b.parents[1:]] = True
        frontier = torch.zeros(1, dtype=torch.long)
        for d in range(1, shape.depth + 1):
            nodes = (b.depth == d).nonzero().squeeze(1)
            row = torch.searchsorted(frontier, b.parents[nodes])
            expand = nodes[has_child[nodes]]
            kids: dict[int, list[tuple[int, int]]] = {}  # parent row -> [(rank, node)]
            for n, r in zip(nodes.tolist(), row.tolist()):
                kids.setdefault(r, []).append((int(shape.ranks[n]), n))
            families = tuple((r, tuple(n for _, n in sorted(ks))) for r, ks in kids.items())
            out.append(_Level(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in
                                (nodes, int(shape.ranks[nodes].max()) + 1, row, shape.ranks[nodes], expand,
                                 row[has_child[nodes]])), families=families))
            frontier = expand
        cached[device] = (out, b.to(device))
    return cached[device]


def static_trees(shapes: Sequence[StaticShape], proposer: Proposer, roots: torch.Tensor,
                 samples: Sequence[SampleChild | None] = (), target_vocab: int = 0) -> list[DraftTree]:
    """The largest shape filled for every row, one ``expand`` per level; row b keeps the prefix that
    is ``shapes[b]``. ``samples[b]`` draws row b's children above T=0 (module docstring); their
    proposals are kept in target-vocab space (``target_vocab`` tokens)."""
    full = max(shapes, key=lambda s: s.size)
    lvls, _ = levels(full, roots.device)
    B = roots.numel()
    draft = torch.full((B, full.size), -1, dtype=torch.long, device=roots.device)
    drawn: list[dict[int, torch.Tensor]] = [{} for _ in range(B)]
    logp = proposer.root_logprobs()[:, None]  # (B, 1, Vd): the roots' children
    for d, lv in enumerate(lvls, start=1):
        top = logp.topk(lv.k, dim=-1).indices  # (B, n_parents, k)
        draft[:, lv.nodes] = top[:, lv.parent_row, lv.ranks]
        for b, sample in enumerate(samples):
            if sample is not None:
                _draw_level(lv, logp[b], draft[b], drawn[b], sample)
        if d == len(lvls):
            break
        logp = proposer.expand(lv.expand_parent_row.expand(B, -1), proposer.to_target_ids(draft[:, lv.expand]), d)
    tokens = proposer.to_target_ids(draft.clamp(min=0))
    tokens[:, 0] = roots
    out = []
    for b, s in enumerate(shapes):
        mine = {n: q for n, q in drawn[b].items() if n < s.size}  # a truncation keeps a prefix of the nodes
        proposals = to_target_proposals(proposer, mine, target_vocab) if samples and samples[b] else None
        out.append(DraftTree(tokens[b, :s.size], levels(s, roots.device)[1], draft[b, :s.size], proposals))
    return out


def _draw_level(lv: _Level, logp: torch.Tensor, draft: torch.Tensor, drawn: dict[int, torch.Tensor],
                sample: SampleChild) -> None:
    """Above T=0: one row's children of this level drawn in place of their ranks."""
    for row, nodes in lv.families:
        for node, (q, x) in zip(nodes, sample(logp[row], len(nodes))):
            draft[node] = x
            if q is not None:
                drawn[node] = q


def to_target_proposals(proposer: Proposer, drawn: dict[int, torch.Tensor], target_vocab: int
                        ) -> dict[int, torch.Tensor]:
    """Draft-vocab proposals -> (target_vocab,) ones (zero outside the draft vocabulary)."""
    if not drawn:
        return {}
    return dict(zip(drawn, to_target_space(proposer, torch.stack(list(drawn.values())), target_vocab)))


def to_target_space(proposer: Proposer, q: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Draft-vocab distributions (..., Vd) -> (..., target_vocab), zero outside the draft vocabulary."""
    out = q.new_zeros(*q.shape[:-1], target_vocab)
    out[..., proposer.to_target_ids(torch.arange(q.shape[-1], device=q.device))] = q
    return out


# -- dynamic shapes: EAGLE-2 ----------------------------------------------------------------------
def depth_temperature(proposer: Proposer, depth: int) -> float:
    """The proposer's calibration temperature for drafts at ``depth`` (1-based): 1.0 without one;
    past the last fitted depth the last one holds (calibration drifts slowly with depth)."""
    temps = proposer.temperatures
    return float(temps[min(depth, len(temps)) - 1]) if temps else 1.0


def calibrated(logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) from log-probs (a log-softmax is logits up to a constant per row)."""
    return logp if temperature == 1.0 else torch.log_softmax(logp / temperature, dim=-1)


def dynamic_trees(shapes: Sequence[DynamicShape], proposer: Proposer, roots: torch.Tensor,
                  size_for: SizeFor | None = None) -> list[DraftTree]:
    """EAGLE-2's trees, ranked by calibrated cumulative log-probabilities; row b expands its own
    shape's depth (capped by the proposer's), ``size_for`` (adaptive) picks how many to keep."""
    dev, shape = roots.device, shapes[0]
    B, k = roots.numel(), shape.top_k
    depths = [min(s.depth, proposer.max_depth or s.depth) for s in shapes]
    lp, ids = calibrated(proposer.root_logprobs(), depth_temperature(proposer, 1)).topk(k, dim=-1)  # (B, k)
    pool_draft = [torch.full((B, 1), -1, dtype=torch.long, device=dev), ids]  # the candidate pool; 0 is the root
    pool_parent = [torch.full((B, 1), -1, dtype=torch.long, device=dev),
                   torch.zeros(B, k, dtype=torch.long, device=dev)]
    pool_score = [torch.zeros(B, 1, device=dev, dtype=lp.dtype), lp]
    frontier = torch.arange(1, k + 1, device=dev).expand(B, k)
    frontier_score, frontier_row = lp, torch.zeros(B, k, dtype=torch.long, device=dev)  # depth 1 hangs off the root
    sizes = [1 + k]  # pool size after depth 1, 2, ...
    for d in range(1, max(depths)):
        draft_all = torch.cat(pool_draft, dim=1)
        logp = proposer.expand(frontier_row, proposer.to_target_ids(draft_all.gather(1, frontier)), d)  # (B, kf, Vd)
        c_lp, c_ids = calibrated(logp, depth_temperature(proposer, d + 1)).topk(k, dim=-1)  # (B, kf, k)
        scores = (frontier_score[:, :, None] + c_lp).flatten(1)  # (B, kf * k) cumulative log-probs
        pool_draft.append(c_ids.flatten(1))
        pool_parent.append(frontier.repeat_interleave(k, dim=1))
        pool_score.append(scores)
        best = scores.topk(min(k, scores.shape[1]), dim=-1).indices  # (B, k)
        frontier, frontier_score, frontier_row = sizes[-1] + best, scores.gather(1, best), best // k
        sizes.append(sizes[-1] + scores.shape[1])
    draft, parent, score = (torch.cat(p, dim=1) for p in (pool_draft, pool_parent, pool_score))
    return [select_tree(draft[b, :sizes[d - 1]], parent[b, :sizes[d - 1]], score[b, :sizes[d - 1]], shape.total_tokens,
                        proposer, roots[b], size_for, d) for b, d in enumerate(depths)]


def select_tree(draft: torch.Tensor, parent: torch.Tensor, score: torch.Tensor, total: int, proposer: Proposer,
                root_token: torch.Tensor, size_for: SizeFor | None = None, depth: int | None = None) -> DraftTree:
    """Keep the root and the best ``total - 1`` candidates (with ``size_for``: the root and the best
    ``size_for(probabilities) - 1`` of those). A child's cumulative score never exceeds its parent's
    (a log-prob is <= 0, and float addition keeps that) and the child comes later in the pool, so a
    stable sort puts every parent before its children: the best set is closed under parents, ties
    going to the earlier (shallower) candidate. ``depth``: the pool's depth, so the tree's buffers
    are built without a host read."""
    key = score.clone()
    key[0] = float("inf")  # the root first
    keep = key.sort(descending=True, stable=True).indices[:total]  # best first
    if size_for is not None:
        keep = keep[: max(1, min(int(size_for(score[keep[1:]].exp())), keep.numel()))]
    keep = keep.sort().values  # pool order: parents before children
    remap = torch.full((draft.numel(),), -1, dtype=torch.long, device=draft.device)
    remap[keep] = torch.arange(keep.numel(), device=draft.device)
    parents = remap[parent[keep].clamp(min=0)]
    parents[0] = -1
    tokens = proposer.to_target_ids(draft[keep].clamp(min=0))
    tokens[0] = root_token
    return DraftTree(tokens, TreeBuffers.build(parents, depth), draft[keep])


# -- a chain sized by the drafter's confidence (DSpark) ---------------------------------------------
def sized_chain(tree: DraftTree, gains: torch.Tensor, size_for: SizeFor) -> DraftTree:
    """The root and the first ``size_for(gains) - 1`` drafts of a chain (its prefix, a chain too);
    ``gains`` (D,): the chance that drafts 1..k are all accepted. The drafts are a function of the
    prefix and so is the cut: verification of the shorter chain emits what the target would."""
    n = max(1, min(int(size_for(gains)), tree.tokens.numel()))
    if n == tree.tokens.numel():
        return tree
    dev = tree.tokens.device
    buffers = chain_buffers(n - 1, dev) if n > 1 else TreeBuffers.build(torch.full((1,), -1, device=dev), 0)
    return DraftTree(tree.tokens[:n], buffers, None if tree.draft_ids is None else tree.draft_ids[:n])


# -- sampled chains: speculative sampling ----------------------------------------------------------
def sampled_chains(depth: int, proposer: Proposer, roots: torch.Tensor, samples: Sequence[SampleDraft],
                   target_vocab: int) -> tuple[list[DraftTree], torch.Tensor]:
    """Chains whose drafts are drawn, row b's by ``samples[b]`` (its own parameters and generator),
    one drafter call per depth for all rows. Returns the trees and the draft distributions
    (B, depth, target_vocab) in target-vocab space (zero outside the draft vocabulary), which
    ``verify_sampled_chain`` needs."""
    dev = roots.device
    B = roots.numel()
    logp = proposer.root_logprobs()  # (B, Vd)
    draft = torch.full((B, depth + 1), -1, dtype=torch.long, device=dev)
    q = torch.zeros(B, depth, logp.shape[-1], device=dev)  # (B, depth, Vd) what each draft was drawn from
    for d in range(1, depth + 1):
        for b in range(B):
            q[b, d - 1], draft[b, d] = samples[b](logp[b])
        if d < depth:
            logp = proposer.expand(torch.zeros(B, 1, dtype=torch.long, device=dev),
                                   proposer.to_target_ids(draft[:, d:d + 1]), d)[:, 0]
    tokens = proposer.to_target_ids(draft.clamp(min=0))
    tokens[:, 0] = roots
    buffers = chain_buffers(depth, dev)
    return [DraftTree(tokens[b], buffers, draft[b]) for b in range(B)], to_target_space(proposer, q, target_vocab)
