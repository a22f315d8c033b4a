"""Sampling on both sides of a step: drafts drawn from the drafter (``draw_draft``: a sampled chain's,
``draw_children``: a fork's), and exact verification of trees of deterministic (top-k) drafts,
drawn drafts, or both (recursive rejection sampling), with a vectorised path for sampled chains.
The processed distribution (temperature, top-k, top-p) is ``headway.sampling``'s, re-exported here;
terms as in ``decode/verify.py``'s glossary."""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, processed_probs  # noqa: F401  (re-exported)
from .tree import TreeBuffers
from .verify import Verdict


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from (V,) ``probs`` with a uniform ``u`` in [0, 1)."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).clamp(max=probs.numel() - 1)
    return idx[0]


def draw_draft(logp: torch.Tensor, params: SamplingParams, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft from the drafter's log-probs (Vd,), processed as the target's are -> (q, draft id);
    a greedy row takes the argmax (q one-hot). ``trees.SampleDraft``."""
    if params.greedy:
        x = logp.argmax(-1)
        return torch.nn.functional.one_hot(x, logp.shape[-1]).float(), x
    q = processed_probs(logp, params)
    return q, sample_from(q, torch.rand((), generator=gen).to(q.device))


def draw_children(logp: torch.Tensor, k: int, params: SamplingParams, gen: torch.Generator
                  ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """A fork's k children of one parent: each drawn from the drafter's processed distribution less
    the earlier draws, processed once for all k; when the earlier draws held all of its mass, the
    best other token (q None: a deterministic draft). ``trees.SampleChild``."""
    q = processed_probs(logp, params)
    draws: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    taken: list[torch.Tensor] = []
    for i in range(k):
        if i:
            q = q.index_fill(0, taken[-1].view(1), 0.0)
            z = q.sum()
            if not z > 0:
                taken.append(logp.index_fill(0, torch.stack(taken), float("-inf")).argmax())
                draws.append((None, taken[-1]))
                continue
            q = q / z
        taken.append(sample_from(q, torch.rand((), generator=gen).to(q.device)))
        draws.append((q, taken[-1]))
    return draws


def verify_sample(tokens: torch.Tensor, buffers: TreeBuffers, probs: torch.Tensor, u_accept: torch.Tensor,
                  u_bonus: torch.Tensor, renormalise: bool = True,
                  proposals: dict[int, torch.Tensor] | None = None) -> Verdict:
    """Exact tree verification (recursive rejection sampling).

    Walk from the root; at each node try its children in order against the residual target
    distribution r (the target's there, less what earlier siblings took):

    * a deterministic child c (a top-k draft) is accepted with probability r(c) / sum(r); on
      rejection r(c) = 0;
    * a child x drawn from a proposal q (``proposals[child]``, (V,) in target-vocab space) is
      accepted with probability min(1, r~(x) / q(x)), r~ = r / sum(r); on rejection r = max(r~ - q, 0)
      (speculative sampling, Leviathan et al. 2023, applied to the residual).

    When no child is accepted, the bonus token is drawn from the residual. Each stage emits its
    residual exactly, whatever the proposal (it may depend on the earlier siblings' tokens), so the
    emitted tokens follow the target's processed distribution. ``u_accept`` (N,) holds one uniform
    per node (used when that node is tried), ``u_bonus`` one for the final draw.
    ``renormalise=False`` exists only so tests can show that a biased verifier is caught.
    """
    parents, toks = torch.stack([buffers.parents, tokens]).tolist()  # the tree on the host: one read
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, []).append(i)
    proposals = proposals or {}
    path, node = [0], 0
    while True:
        r = probs[node].clone()  # residual distribution at this node
        nxt = None
        for c in children.get(node, []):
            q, x = proposals.get(c), toks[c]
            if q is None:
                if u_accept[c] * r.sum() < r[x]:  # accept with probability r(c) / sum(r)
                    nxt = c
                    break
                if renormalise:
                    r[x] = 0
                continue
            z = r.sum()
            if u_accept[c] * q[x] * z < r[x]:  # accept with probability min(1, r(x) / (z q(x))); q(x) > 0
                nxt = c
                break
            if renormalise:
                left = (r / z - q).clamp(min=0)
                r = torch.where(left.sum() > 0, left, r)  # r~ == q: a rejection had probability 0 (rounding), keep r
        if nxt is None:
            return Verdict(torch.tensor(path, device=tokens.device), sample_from(r, u_bonus))
        path.append(nxt)
        node = nxt


def verify_typical(tokens: torch.Tensor, buffers: TreeBuffers, probs: torch.Tensor, threshold: float, alpha: float,
                   u_bonus: torch.Tensor) -> Verdict:
    """Medusa's *typical acceptance* — LOSSY: output no longer follows the target's distribution.

    A node is accepted when the target gives its token probability above
    ``min(threshold, alpha * exp(-entropy))`` at its parent; the longest such path wins and the
    bonus token is sampled from the target at its last node.
    """
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)  # (N,)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))  # (N,)
    par = buffers.parents.clamp(min=0)
    ok_node = probs[par, tokens] > bar[par]
    ok_node[0] = True
    paths = buffers.retrieve
    ok = ok_node[paths.clamp(min=0)] & (paths >= 0)
    length = ok.long().cumprod(dim=1).sum(dim=1)
    best = length.argmax()
    nodes = paths[best, : int(length[best])]
    return Verdict(nodes, sample_from(probs[nodes[-1]], u_bonus))


def verify_sampled_chain(tokens: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor,
                         u_accept: torch.Tensor, u_bonus: torch.Tensor, residual: bool = True) -> Verdict:
    """Exact verification of a chain whose draft d was *sampled* from ``draft_probs[d-1]``.

    tokens (D+1,) root then drafts; probs (D+1, V) the target's processed distribution at each
    node; draft_probs (D, V) the distribution each draft was drawn from (in target-vocab space).
    Draft x at depth d is accepted with probability min(1, p(x) / q(x)), p the target at its
    parent; at the first rejection the bonus token is drawn from the residual max(p - q, 0),
    so every emitted token follows p exactly (Leviathan et al., Chen et al. 2023). When q is
    close to p this accepts far more often than a deterministic top-1 draft, whose acceptance is
    p(top-1). ``residual=False`` (draw the bonus from p) exists only so tests can show that a
    biased verifier is caught.
    """
    D = tokens.numel() - 1
    rows = torch.arange(D, device=tokens.device)
    x = tokens[1:]  # (D,) drafts
    ok = u_accept[1:D + 1] * draft_probs[rows, x] < probs[rows, x]  # accept w.p. min(1, p(x) / q(x)); q(x) > 0
    m = int(ok.long().cumprod(0).sum())  # accepted prefix length: the one sync of the step
    nodes = torch.arange(m + 1, device=tokens.device)
    if m == D:
        return Verdict(nodes, sample_from(probs[D], u_bonus))
    p, q = probs[m], draft_probs[m]  # first rejection: draft m+1 against the target at node m
    return Verdict(nodes, sample_from((p - q).clamp(min=0) if residual else p, u_bonus))
