"""Tree building over B rows at once: ``shapes.build_static`` / ``shapes.build_dynamic`` with a
leading row dimension, driven by a ``BatchProposer`` (one drafter call per draft level).

Each row gets the tree its unbatched run would build from the same draft distributions: the same
top-k, the same cumulative scores and the same ``select_tree``. Rows may need different shapes
only near the context window (``TreePolicy.shape_for`` shrinks the depth):

* static: a truncated shape is a prefix of the full one in node order (nodes are sorted by depth,
  then rank path), and a node's draft depends only on its ancestors, so the largest shape is drafted
  once and each row keeps its prefix;
* dynamic: the loop runs to the deepest row's depth and each row keeps the candidates of its own
  depths (the pool grows depth by depth), exactly the pool its own shape would have built.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .batch_proposers import BatchProposer
from .shapes import (DraftTree, DynamicShape, SampleChild, StaticShape, TreeShape, _levels, calibrated, chain_buffers,
                     depth_temperature, draw_children, select_tree, to_target_proposals)


def build_static_batch(shape: StaticShape, bp: BatchProposer, roots: torch.Tensor,
                       samples: Sequence[SampleChild | None] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor, list[dict[int, torch.Tensor]]]:
    """(tokens (B, N), draft ids (B, N), per row the drawn nodes' draft-vocab proposals) of the
    static shape for every row; only nodes with children are expanded, one ``expand`` call per
    level for all rows. ``samples[b]`` draws row b's children above T=0 (``build_static``)."""
    levels, _ = _levels(shape, roots.device)
    B = roots.numel()
    draft = torch.full((B, shape.size), -1, dtype=torch.long, device=roots.device)
    drawn: list[dict[int, torch.Tensor]] = [{} for _ in range(B)]
    logp = bp.root_logprobs()[:, None]  # (B, 1, V)
    for d, lv in enumerate(levels, start=1):
        top = logp.topk(lv.k, dim=-1).indices  # (B, n_parents, k)
        draft[:, lv.nodes] = top[:, lv.parent_row, lv.ranks]
        for b, sample in enumerate(samples):
            if sample is not None:
                draw_children(lv, logp[b], draft[b], drawn[b], sample)
        if d == len(levels):
            break
        logp = bp.expand(lv.expand_parent_row.expand(B, -1), bp.to_target_ids(draft[:, lv.expand]), d)
    tokens = bp.to_target_ids(draft.clamp(min=0))
    tokens[:, 0] = roots
    return tokens, draft, drawn


def build_dynamic_batch(shape: DynamicShape, bp: BatchProposer, roots: torch.Tensor, depths: Sequence[int]
                        ) -> list[DraftTree]:
    """EAGLE-2 trees for every row; row b expands ``depths[b]`` levels (its own shape's depth)."""
    dev = roots.device
    B, k = roots.numel(), shape.top_k
    lp, ids = calibrated(bp.root_logprobs(), depth_temperature(bp, 1)).topk(k, dim=-1)  # (B, k)
    pool_draft = [torch.full((B, 1), -1, dtype=torch.long, device=dev), ids]
    pool_parent = [torch.full((B, 1), -1, dtype=torch.long, device=dev),
                   torch.zeros(B, k, dtype=torch.long, device=dev)]
    pool_score = [torch.zeros(B, 1, device=dev, dtype=lp.dtype), lp]
    frontier = torch.arange(1, k + 1, device=dev).expand(B, k)
    frontier_score, frontier_row = lp, torch.zeros(B, k, dtype=torch.long, device=dev)
    n = 1 + k
    sizes = [n]  # pool size after depth 1, 2, ...
    for d in range(1, max(depths)):
        draft_all = torch.cat(pool_draft, dim=1)
        logp = bp.expand(frontier_row, bp.to_target_ids(draft_all.gather(1, frontier)), d)  # (B, kf, V)
        c_lp, c_ids = calibrated(logp, depth_temperature(bp, d + 1)).topk(k, dim=-1)  # (B, kf, k)
        scores = (frontier_score[:, :, None] + c_lp).flatten(1)  # (B, kf * k) cumulative log-probs
        pool_draft.append(c_ids.flatten(1))
        pool_parent.append(frontier.repeat_interleave(k, dim=1))
        pool_score.append(scores)
        best = scores.topk(min(k, scores.shape[1]), dim=-1).indices  # (B, k)
        frontier, frontier_score, frontier_row = n + best, scores.gather(1, best), best // k
        n += scores.shape[1]
        sizes.append(n)
    draft, parent, score = (torch.cat(p, dim=1) for p in (pool_draft, pool_parent, pool_score))
    return [select_tree(draft[b, :sizes[depths[b] - 1]], parent[b, :sizes[depths[b] - 1]],
                        score[b, :sizes[depths[b] - 1]], shape.total_tokens, bp, roots[b]) for b in range(B)]


def build_trees(shapes: Sequence[TreeShape], bp: BatchProposer, roots: torch.Tensor,
                samples: Sequence[SampleChild | None] = (), target_vocab: int = 0) -> list[DraftTree]:
    """One tree per row (row b of ``shape[b]``, all truncations of one shape; module docstring);
    ``samples`` draw a fork's children above T=0 (``shapes.build_static``)."""
    if isinstance(shapes[0], StaticShape):
        full = max(shapes, key=lambda s: s.size)
        tokens, draft, drawn = build_static_batch(full, bp, roots, samples)
        out = []
        for b, s in enumerate(shapes):
            buffers = _levels(s, roots.device)[1]
            mine = {n: q for n, q in drawn[b].items() if n < s.size}  # a truncation keeps a prefix of the nodes
            proposals = to_target_proposals(bp, mine, target_vocab) if samples and samples[b] else None
            out.append(DraftTree(tokens[b, :s.size], buffers, draft[b, :s.size], proposals))
        return out
    cap = bp.max_depth
    depths = [min(s.depth, cap or s.depth) for s in shapes]
    return build_dynamic_batch(shapes[0], bp, roots, depths)


def build_sampled_chains(depth: int, bp: BatchProposer, roots: torch.Tensor, samples: Sequence[Any],
                         target_vocab: int) -> tuple[list[DraftTree], list[torch.Tensor]]:
    """``shapes.build_sampled_chain`` for B rows: one drafter call per depth for all rows, row b's
    draft drawn by ``samples[b](logprobs) -> (probs, draft_id)`` (its own parameters and generator).
    Returns the trees and each row's (depth, target_vocab) draft distributions."""
    dev = roots.device
    B = roots.numel()
    logp = bp.root_logprobs()  # (B, Vd)
    vocab_ids = bp.to_target_ids(torch.arange(logp.shape[-1], device=dev))
    draft = torch.full((B, depth + 1), -1, dtype=torch.long, device=dev)
    q_all = torch.zeros(B, depth, target_vocab, device=dev)
    for d in range(1, depth + 1):
        for b in range(B):
            q, x = samples[b](logp[b])
            q_all[b, d - 1, vocab_ids] = q
            draft[b, d] = x
        if d < depth:
            logp = bp.expand(torch.zeros(B, 1, dtype=torch.long, device=dev),
                             bp.to_target_ids(draft[:, d:d + 1]), d)[:, 0]
    tokens = bp.to_target_ids(draft.clamp(min=0))
    tokens[:, 0] = roots
    buffers = chain_buffers(depth, dev)
    return [DraftTree(tokens[b], buffers, draft[b]) for b in range(B)], list(q_all)
