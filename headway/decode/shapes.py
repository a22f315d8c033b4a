"""Tree shapes: chain, static (Medusa-style rank paths) and dynamic (EAGLE-2).

A shape decides which draft candidates become tree nodes. Drafting itself is delegated to a
``Proposer`` (Medusa heads or an EAGLE drafter) through two calls:

* ``root_logprobs()`` -> (V,) the draft distribution over the root's children (depth 1);
* ``expand(parent_rows, tokens, depth)`` -> (n, V) the distributions over the children of n
  nodes at ``depth`` with target-space ``tokens``; ``parent_rows`` gives each node's parent as a
  row of the previous ``expand`` call (all 0 at depth 1: the root), so a drafter can attend to
  each node's ancestors and feed on its parent's output.

Token ids in logprobs are *draft* ids; ``proposer.to_target_ids`` maps them (EAGLE-3's reduced vocab).

Calibration: a proposer may carry ``temperatures`` (per draft depth, depth 1 first; from the
heads' ``metadata["calibration"]``). Dynamic trees rank candidates by the cumulative
``log_softmax(logp / T_depth)``, so a drafter that is right more often than it is confident still
gets deep trees. Adaptive dynamic trees (``adaptive-K-D-N``) also read the calibrated scores as
acceptance probabilities and keep, per step, only the nodes worth their verify cost
(``decode/cost.py``). Static trees are unaffected (ranks do not change with a temperature), and sampled
chains draw from the raw distribution, the ``q`` their accept rule needs. Which nodes are drafted
never changes what verification emits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from ..errors import HeadwayError
from .tree import TreeBuffers


class TreeSpecError(HeadwayError, ValueError):
    """A tree given on the command line or in a config cannot be parsed, or is too large."""


# Upper bounds on any tree: every node is a token of one target forward (the verify cost grows
# with it, the (N, N) mask with its square), and no drafter is accurate 64 tokens deep. Checked
# before anything of the tree's size is built, so a huge spec is refused at once.
MAX_TREE_NODES = 1024  # nodes, the root included (= tokens per verify forward)
MAX_TREE_DEPTH = 64  # draft tokens on the longest path
MAX_DYNAMIC_TOP_K = 64  # EAGLE-2 expansion width: each depth scores top_k x top_k candidates


def check_tree_size(nodes: int | None = None, depth: int | None = None, top_k: int | None = None,
                    what: str = "the tree") -> None:
    """Raise ``TreeSpecError`` when a tree would exceed ``MAX_TREE_NODES`` / ``MAX_TREE_DEPTH`` /
    ``MAX_DYNAMIC_TOP_K``."""
    for value, limit, name in ((nodes, MAX_TREE_NODES, "nodes (root included)"), (depth, MAX_TREE_DEPTH, "depth"),
                               (top_k, MAX_DYNAMIC_TOP_K, "top_k")):
        if value is not None and value > limit:
            raise TreeSpecError(f"{what}: {name} {value} is over the limit of {limit}")

# Medusa's published 63-path tree for Vicuna-7B ("mc_sim_7b_63"): each path lists the top-k rank
# chosen at each depth. With the root it has 64 nodes.
MC_SIM_7B_63: list[tuple[int, ...]] = [
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1),
    (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0),
    (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
]


@runtime_checkable
class Proposer(Protocol):
    """The draft side of a decode step (``decode/proposers.py``: ``MedusaProposer``,
    ``EagleProposer``), as ``Speculator`` and the tree builders drive it.

    Per generation: ``prefill`` once, then each step the builders ask ``root_logprobs`` /
    ``expand`` / ``to_target_ids`` (module docstring), ``end_tree`` drops what drafting the tree
    left behind, and ``accept`` is told what the target accepted. ``fork`` is an independent twin
    (a copy of the generation's draft state; the heads are shared)."""

    max_depth: int | None  # deepest draft the proposer can make (Medusa: its heads; None: no limit)
    draft_vocab_size: int | None  # rows of the draft logprobs (None: the target's vocabulary)
    feature_layers: list[int]  # target hidden states it reads (-1: the final post-norm state)
    temperatures: Sequence[float] | None  # calibration per draft depth, depth 1 first (module docstring)

    def prefill(self, input_ids: torch.Tensor, features: list[torch.Tensor], first_token: torch.Tensor) -> None:
        """input_ids (1, n) the prompt; features [(1, n, H)] the target's states at it, one per
        ``feature_layers``; first_token (1,) the target's token after the prompt (the first root)."""
        ...

    def accept(self, tokens: torch.Tensor, features: list[torch.Tensor], start: int) -> None:
        """tokens (m+2,): the accepted path (root first) then the bonus token; features [(m+1, H)]
        the target's states at the path; start: the target position of the root."""
        ...

    def root_logprobs(self) -> torch.Tensor: ...

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def end_tree(self) -> None:
        """The tree is built: forget its nodes (the next step's ``accept`` brings the real ones)."""
        ...

    def fork(self) -> Proposer:
        """An independent copy of this generation's draft state (``Speculator.fork``)."""
        ...


@dataclass
class DraftTree:
    """One step's tree: target-space tokens (root first) plus its buffers."""

    tokens: torch.Tensor  # (N,) target token ids; tokens[0] is the root
    buffers: TreeBuffers
    draft_ids: torch.Tensor | None = None  # (N,) draft-vocab ids (root: -1), for sampling verification
    # above T=0, the nodes drawn from the drafter's distribution: node -> (V,) target-vocab proposal it
    # was drawn from (``build_static`` with ``sample``; ``sampling.verify_sample`` reads it)
    proposals: dict[int, torch.Tensor] | None = None


# ---------------------------------------------------------------------------------------------
# Static shapes
# ---------------------------------------------------------------------------------------------


@dataclass
class StaticShape:
    """A fixed tree given as rank paths; node i's token is the rank-r child of its parent."""

    paths: list[tuple[int, ...]]
    name: str = "static"
    parents: torch.Tensor = field(init=False)
    ranks: torch.Tensor = field(init=False)
    buffers: TreeBuffers = field(init=False)

    def __post_init__(self) -> None:
        paths: set[tuple[int, ...]] = set()
        for p in self.paths:  # close under prefixes so every node has its parent
            p = tuple(int(r) for r in p)
            if any(r < 0 for r in p):
                raise TreeSpecError(f"tree path {p} has a negative rank")
            check_tree_size(depth=len(p), what=f"tree '{self.name}'")
            for i in range(len(p), 0, -1):  # longest first: stop at the first prefix already there
                if p[:i] in paths:
                    break
                paths.add(p[:i])
            check_tree_size(nodes=len(paths) + 1, what=f"tree '{self.name}'")
        ordered = sorted(paths, key=lambda p: (len(p), p))
        index = {(): 0}
        parents, ranks = [-1], [0]
        for p in ordered:
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            ranks.append(p[-1])
        self.paths = ordered
        self.parents = torch.tensor(parents, dtype=torch.long)
        self.ranks = torch.tensor(ranks, dtype=torch.long)
        self.buffers = TreeBuffers.build(self.parents)

    @property
    def size(self) -> int:
        return self.parents.numel()

    @property
    def depth(self) -> int:
        return self.buffers.max_depth

    def truncated(self, max_depth: int) -> "StaticShape":
        return StaticShape([p for p in self.paths if len(p) <= max_depth], name=f"{self.name}[:{max_depth}]")

    def within_vocab(self, vocab: int) -> "StaticShape":
        """Drop paths asking for a rank the draft vocabulary does not have."""
        if max(max(p) for p in self.paths) < vocab:
            return self
        return StaticShape([p for p in self.paths if max(p) < vocab], name=f"{self.name}[rank<{vocab}]")


def is_chain(shape: "TreeShape") -> bool:
    """One node per depth (``chain-N``, or any static shape that is a single path)."""
    return isinstance(shape, StaticShape) and shape.size == shape.depth + 1


def is_top1_chain(shape: "TreeShape") -> bool:
    """``chain-N``: a single path of rank-0 drafts, however it was written (``static:[[0],[0,0]]``)."""
    return is_chain(shape) and all(r == 0 for p in shape.paths for r in p)  # type: ignore[union-attr]


def chain(depth: int) -> StaticShape:
    """A single path of top-1 drafts, ``1 <= depth <= MAX_TREE_DEPTH``."""
    if depth < 1:
        raise TreeSpecError(f"chain-{depth}: a chain needs at least one draft (chain-N with N >= 1)")
    check_tree_size(depth=depth, what=f"chain-{depth}")  # before building its N(N+1)/2 path entries
    return StaticShape([(0,) * depth], name=f"chain-{depth}")  # the prefixes follow from the one path


@functools.lru_cache(maxsize=64)
def chain_buffers(depth: int, device: torch.device) -> TreeBuffers:
    """``chain(depth).buffers`` on ``device``, built once: a sampled chain needs them every step
    (~0.5 ms to build on CPU, ~1% of a SmolLM2 step). Shared: read, never written."""
    return chain(depth).buffers.to(device)


def fork(depth: int) -> StaticShape:
    """``fork-N``: a chain with a second child beside every node, 2N + 1 nodes. At T=0 the two are
    the drafter's top-2; above, both are drawn (``build_static`` with ``sample``): the chain's node
    from the drafter's distribution q, as in a sampled chain, its sibling from q less that token,
    tried against the residual when the first is rejected. Each depth then accepts what a sampled
    chain's does and then some (SmolLM2, T=1: .38 -> ~.45 at depth 1), for N more verified tokens."""
    if depth < 1:
        raise TreeSpecError(f"fork-{depth}: a fork needs at least one draft (fork-N with N >= 1)")
    check_tree_size(depth=depth, nodes=2 * depth + 1, what=f"fork-{depth}")
    return StaticShape(_fork_paths(depth), name=f"fork-{depth}")


def _fork_paths(depth: int) -> list[tuple[int, ...]]:
    return [(0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in (0, 1)]


def is_fork(shape: "TreeShape") -> bool:
    """``fork-N`` however it was written or truncated (checked once per shape)."""
    if not isinstance(shape, StaticShape):
        return False
    if "_is_fork" not in shape.__dict__:
        shape.__dict__["_is_fork"] = shape.paths == _fork_paths(shape.depth)
    return shape.__dict__["_is_fork"]


def mc_sim_7b_63() -> StaticShape:
    return StaticShape(list(MC_SIM_7B_63), name="mc_sim_7b_63")


def from_accuracies(topk_acc: Sequence[Sequence[float]], num_nodes: int) -> StaticShape:
    """Medusa's construction from measured accuracy: ``topk_acc[d][r]`` is the probability that
    the rank-r draft at depth d+1 is right. Greedily add the path with the highest product of
    accuracies (the expected gain of adding it) until the tree has ``num_nodes`` non-root nodes."""
    acc = [list(map(float, a)) for a in topk_acc]
    chosen: dict[tuple[int, ...], float] = {}
    frontier = {(r,): acc[0][r] for r in range(len(acc[0]))}
    while len(chosen) < num_nodes and frontier:
        best = max(frontier, key=lambda p: (frontier[p], -len(p)))
        score = frontier.pop(best)
        chosen[best] = score
        d = len(best)
        if d < len(acc):
            for r in range(len(acc[d])):
                frontier[best + (r,)] = score * acc[d][r]
    return StaticShape(list(chosen), name=f"measured-{num_nodes}")


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


def _levels(shape: StaticShape, device: torch.device) -> list[_Level]:
    """Per-depth index tensors of a static shape, built once per device (no syncs while drafting)."""
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


# sample(logprobs, k) -> k draws [(q, draft_id)], each from the processed draft distribution less the
# earlier draws (q None: they held all of its mass, draft_id the best other token); ``child_sampler``
SampleChild = Callable[[torch.Tensor, int], "list[tuple[torch.Tensor | None, torch.Tensor]]"]


def build_static(shape: StaticShape, proposer: Proposer, root_token: torch.Tensor,
                 sample: SampleChild | None = None, target_vocab: int = 0) -> DraftTree:
    """Fill the fixed shape level by level; only nodes with children are expanded.

    ``sample`` (above T=0, ``fork-N``): every child is drawn instead of taking its rank, in rank
    order, each from the drafter's processed distribution less its earlier siblings' tokens
    (``SampleChild``); the tree's ``proposals`` keep each draw's q in target-vocab space
    (``target_vocab`` tokens) for ``verify_sample``."""
    levels, b = _levels(shape, root_token.device)
    draft = torch.full((shape.size,), -1, dtype=torch.long, device=root_token.device)
    logp = proposer.root_logprobs()[None]  # (1, V): the root's children distribution
    drawn: dict[int, torch.Tensor] = {}
    for d, lv in enumerate(levels, start=1):
        top = logp.topk(lv.k, dim=-1).indices  # (n_parents, k)
        draft[lv.nodes] = top[lv.parent_row, lv.ranks]
        if sample is not None:
            draw_children(lv, logp, draft, drawn, sample)
        if d == len(levels):
            break
        logp = proposer.expand(lv.expand_parent_row, proposer.to_target_ids(draft[lv.expand]), d)
    tokens = proposer.to_target_ids(draft.clamp(min=0))
    tokens[0] = root_token
    return DraftTree(tokens, b, draft, to_target_proposals(proposer, drawn, target_vocab) if sample else None)


def draw_children(lv: "_Level", logp: torch.Tensor, draft: torch.Tensor, drawn: dict[int, torch.Tensor],
                  sample: SampleChild) -> None:
    """Above T=0: draw this level's children in place of their ranks (``build_static``)."""
    for row, nodes in lv.families:
        for node, (q, x) in zip(nodes, sample(logp[row], len(nodes))):
            draft[node] = x
            if q is not None:
                drawn[node] = q


def to_target_proposals(proposer: Any, drawn: dict[int, torch.Tensor], target_vocab: int) -> dict[int, torch.Tensor]:
    """Draft-vocab proposals -> (target_vocab,) ones (zero outside the draft vocabulary)."""
    if not drawn:
        return {}
    q = torch.stack(list(drawn.values()))  # (n, Vd)
    out = q.new_zeros(q.shape[0], target_vocab)
    out[:, proposer.to_target_ids(torch.arange(q.shape[1], device=q.device))] = q
    return dict(zip(drawn, out))


# ---------------------------------------------------------------------------------------------
# Dynamic shape (EAGLE-2)
# ---------------------------------------------------------------------------------------------


@dataclass
class DynamicShape:
    """EAGLE-2: per depth expand the ``top_k`` nodes with the best cumulative draft log-probability,
    then keep the best ``total_tokens`` (root included) of all candidates as the tree.

    ``adaptive``: keep only as many of them as pay for their verify cost at this step (at most
    ``total_tokens``; ``decode/cost.py``): the decoder passes ``build_dynamic`` a ``size_for``."""

    top_k: int = 8
    depth: int = 6
    total_tokens: int = 48
    name: str = "dynamic"
    adaptive: bool = False

    def __post_init__(self) -> None:
        what = self.spec
        if self.top_k < 1 or self.depth < 1 or self.total_tokens < 2:
            raise TreeSpecError(f"{what}: need top_k >= 1, depth >= 1 and total_tokens >= 2 (the root and a draft)")
        check_tree_size(self.total_tokens, self.depth, self.top_k, what=what)

    @property
    def size(self) -> int:
        """The most tokens a verify forward gets (an adaptive tree's steps may use fewer)."""
        return self.total_tokens

    @property
    def spec(self) -> str:
        """The string ``parse_shape`` reads back: ``dynamic-8-6-48`` / ``adaptive-8-6-48``."""
        return f"{'adaptive' if self.adaptive else 'dynamic'}-{self.top_k}-{self.depth}-{self.total_tokens}"

    def with_(self, top_k: int | None = None, depth: int | None = None) -> "DynamicShape":
        """This shape with another top_k or depth (the rest, ``adaptive`` included, kept)."""
        return DynamicShape(top_k or self.top_k, depth or self.depth, self.total_tokens, self.name, self.adaptive)


def depth_temperature(proposer: Proposer, depth: int) -> float:
    """The proposer's calibration temperature for drafts at ``depth`` (1-based): 1.0 without one;
    past the last fitted depth the last one holds (calibration drifts slowly with depth)."""
    temps = getattr(proposer, "temperatures", None)
    return float(temps[min(depth, len(temps)) - 1]) if temps else 1.0


def calibrated(logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) from log-probs (a log-softmax is logits up to a constant per row)."""
    return logp if temperature == 1.0 else torch.log_softmax(logp / temperature, dim=-1)


# (m,) acceptance probabilities of the best candidates, best first (root excluded) -> tokens to keep
SizeFor = Callable[[torch.Tensor], int]


def build_dynamic(shape: DynamicShape, proposer: Proposer, root_token: torch.Tensor,
                  size_for: SizeFor | None = None) -> DraftTree:
    """EAGLE-2's tree, ranked by calibrated cumulative log-probabilities (``depth_temperature``);
    ``size_for`` (adaptive trees) picks how many of the best ``total_tokens`` to keep."""
    dev = root_token.device
    k = shape.top_k
    max_depth = min(shape.depth, proposer.max_depth or shape.depth)
    # candidate pool; index 0 is the root
    lp, ids = calibrated(proposer.root_logprobs(), depth_temperature(proposer, 1)).topk(k)  # (k,)
    pool_draft = [torch.full((1,), -1, dtype=torch.long, device=dev), ids]
    pool_parent = [torch.full((1,), -1, dtype=torch.long, device=dev), torch.zeros(k, dtype=torch.long, device=dev)]
    pool_score = [torch.zeros(1, device=dev, dtype=lp.dtype), lp]
    frontier, frontier_score, n = torch.arange(1, k + 1, device=dev), lp, 1 + k
    frontier_row = torch.zeros(k, dtype=torch.long, device=dev)  # depth-1 nodes hang off the root
    for d in range(1, max_depth):
        draft_all = torch.cat(pool_draft)
        logp = proposer.expand(frontier_row, proposer.to_target_ids(draft_all[frontier]), d)
        c_lp, c_ids = calibrated(logp, depth_temperature(proposer, d + 1)).topk(k, dim=-1)  # (k_frontier, k)
        scores = (frontier_score[:, None] + c_lp).flatten()  # cumulative log-prob of each child
        pool_draft.append(c_ids.flatten())
        pool_parent.append(frontier.repeat_interleave(k))
        pool_score.append(scores)
        best = scores.topk(min(k, scores.numel())).indices
        frontier, frontier_score, frontier_row = n + best, scores[best], best // k
        n += scores.numel()
    draft, parent, score = torch.cat(pool_draft), torch.cat(pool_parent), torch.cat(pool_score)
    return select_tree(draft, parent, score, shape.total_tokens, proposer, root_token, size_for)


def select_tree(draft: torch.Tensor, parent: torch.Tensor, score: torch.Tensor, total: int, proposer: Proposer,
                root_token: torch.Tensor, size_for: SizeFor | None = None) -> DraftTree:
    """Keep the root and the best ``total - 1`` candidates (with ``size_for``: the root and the best
    ``size_for(probabilities) - 1`` of those). A child's cumulative score never exceeds its parent's,
    so the best set is closed under parents; ties are broken towards earlier (shallower) candidates,
    and any parent still missing is added to keep the tree valid."""
    n = draft.numel()
    order = torch.arange(n, device=draft.device, dtype=score.dtype)
    key = score.clone() - order * 1e-9  # stable tie-break: earlier candidates first
    key[0] = float("inf")
    keep = key.topk(min(total, n)).indices  # best first, the root at 0
    if size_for is not None:
        keep = keep[: max(1, min(int(size_for(score[keep[1:]].exp())), keep.numel()))]
    keep = keep.sort().values
    kept = torch.zeros(n, dtype=torch.bool, device=draft.device)
    kept[keep] = True
    missing = kept & ~kept[parent.clamp(min=0)]
    missing[0] = False
    while missing.any():  # rare: only on exact float ties
        kept[parent[missing]] = True
        missing = kept & ~kept[parent.clamp(min=0)]
        missing[0] = False
    keep = kept.nonzero().squeeze(1)
    remap = torch.full((n,), -1, dtype=torch.long, device=draft.device)
    remap[keep] = torch.arange(keep.numel(), device=draft.device)
    parents = torch.where(parent[keep] >= 0, remap[parent[keep].clamp(min=0)], parent[keep])
    tokens = proposer.to_target_ids(draft[keep].clamp(min=0))
    tokens[0] = root_token
    return DraftTree(tokens, TreeBuffers.build(parents), draft[keep])


TreeShape = StaticShape | DynamicShape


def build_sampled_chain(depth: int, proposer: Proposer, root_token: torch.Tensor, sample: Any,
                        target_vocab: int) -> tuple[DraftTree, torch.Tensor]:
    """A chain whose drafts are drawn from the drafter's processed distribution.

    ``sample(logprobs) -> (probs, draft_id)`` applies the sampling parameters to the drafter's
    log-probs over its own vocabulary and draws one id. Returns the tree and the draft
    distributions (depth, target_vocab) mapped into target-vocab space (zero outside the draft
    vocabulary), which ``verify_sampled_chain`` needs."""
    dev = root_token.device
    vocab_ids = None
    logp = proposer.root_logprobs()  # (Vd,)
    draft = torch.full((depth + 1,), -1, dtype=torch.long, device=dev)
    q_all = torch.zeros(depth, target_vocab, device=dev)
    for d in range(1, depth + 1):
        q, x = sample(logp)
        if vocab_ids is None:
            vocab_ids = proposer.to_target_ids(torch.arange(q.numel(), device=dev))
        q_all[d - 1, vocab_ids] = q
        draft[d] = x
        if d < depth:
            logp = proposer.expand(torch.zeros(1, dtype=torch.long, device=dev),
                                   proposer.to_target_ids(x.view(1)), d)[0]
    tokens = proposer.to_target_ids(draft.clamp(min=0))
    tokens[0] = root_token
    return DraftTree(tokens, chain_buffers(depth, dev), draft), q_all


def build_tree(shape: TreeShape, proposer: Proposer, root_token: torch.Tensor,
               size_for: SizeFor | None = None, sample: SampleChild | None = None, target_vocab: int = 0) -> DraftTree:
    """The shape's draft tree; ``size_for`` sizes an adaptive dynamic tree, ``sample`` draws a fork's
    children (``build_static``); each is ignored by the other family."""
    if isinstance(shape, StaticShape):
        return build_static(shape, proposer, root_token, sample, target_vocab)
    return build_dynamic(shape, proposer, root_token, size_for if shape.adaptive else None)


def check_rank_paths(paths: list[list[Any]], shown: str) -> None:
    """A static tree as given: every node's parent listed too (``[0, 0]`` needs ``[0]``), ranks whole
    numbers >= 0, no node twice. ``StaticShape`` would add a missing parent itself, and then
    decode a tree other than the one asked for; so a spec is refused naming the node."""
    seen: set[tuple[int, ...]] = set()
    for p in paths:
        for r in p:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise TreeSpecError(f"tree '{shown}': node {json_path(p)} has rank {json_path([r])[1:-1]}; a "
                                    "rank is a whole number >= 0 (0 = the draft's top choice)")
        key = tuple(p)
        if key in seen:
            raise TreeSpecError(f"tree '{shown}': node {json_path(p)} is listed twice")
        seen.add(key)
    check_tree_size(nodes=len(seen) + 1, depth=max(len(p) for p in seen), what=f"tree '{shown}'")
    for p in paths:
        if len(p) > 1 and tuple(p[:-1]) not in seen:
            raise TreeSpecError(f"tree '{shown}': node {json_path(p)} has no parent: list {json_path(p[:-1])} "
                                "too (every node's parent must be in the tree)")


def json_path(path: Sequence[Any]) -> str:
    import json

    return json.dumps(list(path), separators=(",", ":"))


def parse_shape(spec: str) -> TreeShape:
    """``chain-4`` | ``chain`` (= chain-4) | ``fork-3`` | ``mc_sim_7b_63`` | ``static:[[0],[0,0],[1]]`` | ``dynamic``
    | ``dynamic-8-6-48`` (top_k, depth, total_tokens; leading ones may be given alone: ``dynamic-8``)
    | ``adaptive-8-6-48`` (the same drafting; each step verifies the best 1..48 tokens that pay off).
    Numbers are checked against the size limits (``check_tree_size``) before anything is built."""
    import json
    import re

    spec = spec.strip()
    shown = spec if len(spec) <= 80 else spec[:77] + "..."  # messages stay one readable line
    try:
        if spec.startswith("chain"):
            m = re.fullmatch(r"chain(?:-(-?\d+))?", spec)
            if m is None:
                raise ValueError("expected chain-N with a whole number N >= 1")
            return chain(int(m.group(1) or 4))
        if spec.startswith("fork"):
            m = re.fullmatch(r"fork-(-?\d+)", spec)
            if m is None:
                raise ValueError("expected fork-N with a whole number N >= 1")
            return fork(int(m.group(1)))
        if spec == "mc_sim_7b_63":
            return mc_sim_7b_63()
        if spec.startswith("static:"):
            paths = json.loads(spec[7:])
            if not isinstance(paths, list) or not paths or not all(isinstance(p, list) and p for p in paths):
                raise ValueError("expected a non-empty JSON list of rank paths, e.g. static:[[0],[0,0],[1]]")
            # named by its compact spec, so reports tell two static trees apart and it reads back
            name = "static:" + json.dumps(paths, separators=(",", ":"))
            check_rank_paths(paths, name if len(name) <= 80 else name[:77] + "...")
            return StaticShape([tuple(p) for p in paths], name=name)
        for family in ("dynamic", "adaptive"):
            if spec.startswith(family):
                if not re.fullmatch(family + r"(-\d+){0,3}", spec):
                    raise ValueError(f"expected {family}-TOPK-DEPTH-TOTAL with whole numbers, e.g. {family}-8-6-48")
                parts = [int(x) for x in spec.split("-")[1:]]
                return DynamicShape(*parts, adaptive=family == "adaptive")
    except TreeSpecError:
        raise  # already names the tree and the rule
    except (ValueError, TypeError) as e:
        raise TreeSpecError(f"cannot parse tree '{shown}': {e}") from None
    raise TreeSpecError(f"unknown tree '{shown}'; use chain-N, fork-N, mc_sim_7b_63, static:[[0],[0,0],...], "
                        "dynamic[-TOPK-DEPTH-TOTAL] or adaptive[-TOPK-DEPTH-TOTAL]")
