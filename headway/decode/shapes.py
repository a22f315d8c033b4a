"""Tree shapes: which draft candidates become a step's tree nodes. A chain (``chain-N``), static
rank paths (Medusa's published tree, one measured from per-depth accuracy, ``fork-N``), EAGLE-2
dynamic trees (``dynamic-K-D-N``) and adaptive ones (``adaptive-K-D-N``), parsed from their specs and
bounded in size. Shapes are data: ``decode/trees.py`` fills them from a proposer's drafts."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

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

    @functools.cached_property
    def forks(self) -> bool:
        """Whether this is ``fork-N``, however it was written or truncated (checked once per shape)."""
        return self.paths == _fork_paths(self.depth)

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
    _check_family("chain", depth)  # before building its N(N+1)/2 path entries
    return StaticShape([(0,) * depth], name=f"chain-{depth}")  # the prefixes follow from the one path


@functools.lru_cache(maxsize=64)
def chain_buffers(depth: int, device: torch.device) -> TreeBuffers:
    """``chain(depth).buffers`` on ``device``, built once: a sampled chain needs them every step
    (~0.5 ms to build on CPU, ~1% of a SmolLM2 step). Shared: read, never written."""
    return chain(depth).buffers.to(device)


def fork(depth: int) -> StaticShape:
    """``fork-N``: a chain with a second child beside every node, 2N + 1 nodes. At T=0 the two are
    the drafter's top-2; above, both are drawn (``trees.static_trees``): the chain's node
    from the drafter's distribution q, as in a sampled chain, its sibling from q less that token,
    tried against the residual when the first is rejected. Each depth then accepts what a sampled
    chain's does and then some (SmolLM2, T=1: .38 -> ~.45 at depth 1), for N more verified tokens."""
    _check_family("fork", depth, nodes=2 * depth + 1)
    return StaticShape(_fork_paths(depth), name=f"fork-{depth}")


def _check_family(family: str, depth: int, nodes: int | None = None) -> None:
    if depth < 1:
        raise TreeSpecError(f"{family}-{depth}: a {family} needs at least one draft ({family}-N with N >= 1)")
    check_tree_size(depth=depth, nodes=nodes, what=f"{family}-{depth}")


def _fork_paths(depth: int) -> list[tuple[int, ...]]:
    return [(0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in (0, 1)]


def is_fork(shape: "TreeShape") -> bool:
    """``fork-N`` however it was written or truncated (``StaticShape.forks``)."""
    return isinstance(shape, StaticShape) and shape.forks


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


# ---------------------------------------------------------------------------------------------
# Dynamic shape (EAGLE-2)
# ---------------------------------------------------------------------------------------------


@dataclass
class DynamicShape:
    """EAGLE-2: per depth expand the ``top_k`` nodes with the best cumulative draft log-probability,
    then keep the best ``total_tokens`` (root included) of all candidates as the tree.

    ``adaptive``: keep only as many of them as pay for their verify cost at this step (at most
    ``total_tokens``; ``decode/cost.py``): the decoder passes ``trees.dynamic_trees`` a ``size_for``."""

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

    def truncated(self, max_depth: int) -> "DynamicShape":
        return self.with_(depth=max(max_depth, 1))

    def within_vocab(self, vocab: int) -> "DynamicShape":
        """Expand no more children per node than the draft vocabulary has."""
        return self if self.top_k <= vocab else self.with_(top_k=vocab)


TreeShape = StaticShape | DynamicShape


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
        for family, build in (("chain", chain), ("fork", fork)):
            if spec.startswith(family):
                m = re.fullmatch(family + r"(?:-(-?\d+))?", spec)
                if m is None or (family == "fork" and m.group(1) is None):  # a bare "chain" is chain-4
                    raise ValueError(f"expected {family}-N with a whole number N >= 1")
                return build(int(m.group(1) or 4))
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
