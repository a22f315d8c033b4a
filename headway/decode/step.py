"""One decode step for every batch size: draft -> verify -> accept -> commit.

    draft    every row's tree, rooted at its last emitted token: one drafter call per draft level
             for all rows (``decode/trees.py``: static trees, dynamic trees, sampled chains)
    verify   one target forward over every row's tree (B, N): tree masks, explicit position ids,
             the target's own cache object
    accept   per row, the longest path the target agrees with plus one bonus token: greedy (all
             rows in one tensor pass), exact sampling (deterministic trees, or sampled chains), or
             typical acceptance; a sampled row with its own parameters and its own generator
    commit   the cache keeps the accepted entries, the proposer sees the accepted path and the
             target's hidden states there, the rows' emitted tokens grow; stopped rows leave

When the policy says speculation does not pay at this batch size, ``plain`` runs instead: one
forward over each row's last token, as plain decoding does (no tree, no mask beyond the padding);
the proposer catches up on those tokens when drafting resumes.

``generate`` is a batch of one (``kv.OneRow``); ``generate_batch`` pads (``kv.PaddedRows``).
Randomness is an argument (each row's ``torch.Generator``), so tests can replay and bias it; timing
and statistics go to hooks (``StepHooks``), not into the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Protocol, Sequence

import torch

from ..hardware import sync
from .kv import OneRow, PaddedRows, in_place
from .node_logits import PREFETCH_ROWS, NodeLogits, NodeProbs
from .policy import TreePolicy
from .proposers import DFlashProposer, Proposer
from .runtime import Runtime
from .sampling import (SamplingParams, draw_children, draw_draft, processed_probs, sample_from, verify_sample,
                       verify_sampled_chain, verify_typical)
from .shapes import DynamicShape, TreeShape, is_chain
from .stats import GenerationStats
from .trees import DraftTree, build_trees, sampled_chains, sized_chain
from .verify import Verdict, stack_trees, verify_greedy, verify_greedy_walk


@dataclass
class Row:
    """One prompt's decode state."""

    index: int  # position in the caller's prompt list
    emitted: list[int]  # tokens generated so far; the last one is the next tree's root
    length: int  # tokens in the target cache (prompt + accepted): the root's position
    params: SamplingParams
    gen: torch.Generator
    max_new: int
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class Batch:
    """Everything a generation carries from step to step: the rows, the target cache (its
    layout), the proposer (its rows follow ``rows``)."""

    kv: OneRow | PaddedRows
    proposer: Proposer
    rows: list[Row]
    step_cost: float | None = None  # seconds of a step outside its verify (running mean): adaptive trees
    skipped: "Skipped | None" = None  # plain steps the proposer has not seen yet


@dataclass
class Skipped:
    """The plain steps since the proposer last saw the rows; it catches up on them, as one accepted
    path per row, when drafting resumes or ``FLUSH_EVERY`` steps have gathered (``_flush``). Per
    step: the rows' input tokens (B,) and the target's states there, (B, H) per feature layer;
    ``last``: the latest step's next tokens (B,)."""

    starts: list[int]  # each row's position of its first skipped token
    tokens: list[torch.Tensor] = field(default_factory=list)
    feats: list[list[torch.Tensor]] = field(default_factory=list)
    last: torch.Tensor | None = None

    def select(self, keep: Sequence[int]) -> None:
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.tokens[0].device)
        self.starts = [self.starts[i] for i in keep]
        self.tokens = [t[idx] for t in self.tokens]
        self.feats = [[f[idx] for f in layers] for layers in self.feats]
        self.last = self.last[idx] if self.last is not None else None


@dataclass
class Drafts:
    trees: list[DraftTree]
    shape: TreeShape
    draft_probs: list[torch.Tensor | None]  # per row (depth, V) when the chain's drafts were sampled


@dataclass
class Scored:
    """The drafts after the target's verify forward."""

    drafts: Drafts
    node_logits: list[NodeLogits]  # per row: the target's logits at its nodes (projected as read, when lazy)
    features: list[list[torch.Tensor]]  # per row, per feature layer: (N_b, H) target states at its nodes
    verify_time: float
    tokens: torch.Tensor  # (B, N) the forward's tokens: every row's tree, padded
    logits: torch.Tensor | None  # (B, N, V) the target's logits there (None when projected as read)

    def row(self, b: int) -> "RowScored":
        return RowScored(self.drafts.trees[b], self.node_logits[b], self.features[b], self.verify_time,
                         self.drafts.draft_probs[b], self)


@dataclass
class RowScored:
    """One row's view of ``Scored`` (the single-prompt API: ``Speculator.draft_and_score``)."""

    tree: DraftTree
    node_logits: NodeLogits
    features: list[torch.Tensor]
    verify_time: float
    draft_probs: torch.Tensor | None
    batch: Scored

    @property
    def logits(self) -> torch.Tensor:
        """(N, V) target logits at every node (all rows projected)."""
        return self.node_logits.all()


class StepHooks(Protocol):
    """Called after every step with the batch as it entered the step. A plain step (no drafts)
    passes ``scored`` and ``verdicts`` as None: each row took one target forward over one token."""

    def on_step(self, batch: Batch, scored: Scored | None, verdicts: Sequence[Verdict] | None,
                new: Sequence[list[int]], times: dict[str, float]) -> None: ...


def choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """The target's own next token: argmax, or a draw from its processed distribution."""
    if params.greedy:
        return logits.argmax(-1)
    return sample_from(processed_probs(logits, params), torch.rand((), generator=gen).to(logits.device))


# -- prefill ------------------------------------------------------------------------------------
def prefill(rt: Runtime, ids: Sequence[list[int]], rows: Sequence[Row], proposer: Proposer,
            cache_length: int | None = None, pick: Callable[..., torch.Tensor] = choose) -> Batch:
    """One target forward over the prompts; the first token of each row comes from the target
    alone; the proposer reads the prompts' hidden states. One prompt: ``OneRow`` (its cache static
    when the runtime's is, of ``cache_length`` positions); more: ``PaddedRows``."""
    kv: OneRow | PaddedRows = OneRow(rt.new_cache(cache_length)) if len(ids) == 1 else PaddedRows(rt.target.config)
    out, tokens, valid, pos = kv.prefill(rt, ids)
    first = torch.stack([pick(out.logits[b, -1], r.params, r.gen) for b, r in enumerate(rows)])  # (B,)
    proposer.prefill(tokens, valid, pos, [out.hidden_states[i] for i in rt.layers], first)
    for r, f in zip(rows, first.tolist()):
        r.emitted.append(int(f))
        r.stats.new_tokens = 1
    return Batch(kv, proposer, list(rows))


# -- draft --------------------------------------------------------------------------------------
def _flush(batch: Batch) -> None:
    """Tell the proposer the paths of the plain steps it skipped: per row, one accepted path of the
    skipped tokens then the latest next token, with the target's states at the skipped tokens."""
    s, batch.skipped = batch.skipped, None
    if s is None:
        return
    tokens = torch.stack([*s.tokens, s.last], dim=1)  # (B, k + 1)
    feats = [torch.stack(layer, dim=1) for layer in zip(*s.feats)]  # per layer (B, k, H)
    batch.proposer.accept(list(tokens), [[f[b] for f in feats] for b in range(tokens.shape[0])], s.starts)


def draft(rt: Runtime, policy: TreePolicy, batch: Batch) -> Drafts:
    """Every row's tree, rooted at its last emitted token: one drafter call per draft level for all
    rows; near the context's end a row's tree shrinks (``TreePolicy.shape_for``). The path
    (``decode/trees.py``): sampled chains when a row samples a chain's drafts, else the shape's, a
    static tree by rank (a fork's children drawn above T=0) or an EAGLE-2 dynamic tree."""
    rows, proposer = batch.rows, batch.proposer
    roots = torch.tensor([r.emitted[-1] for r in rows], device=rt.device)  # (B,)
    _flush(batch)
    t_draft = time.perf_counter()
    sampling = any(not r.params.greedy for r in rows)
    shapes = [policy.shape_for(rt.max_positions - 1 - r.length, sampling, len(rows)) for r in rows]
    if any(policy.samples_chain(r.params, s) for r, s in zip(rows, shapes)):
        drafts = draft_sampled_chains(rt, policy, batch, roots, shapes)
    else:
        children = [partial(draw_children, params=r.params, gen=r.gen) if policy.samples_children(r.params, s)
                    else None for r, s in zip(rows, shapes)]
        adaptive = isinstance(shapes[0], DynamicShape) and shapes[0].adaptive and len(rows) == 1  # batches: TOTAL
        confident = policy.sizes_chain(shapes[0], len(rows)) and isinstance(proposer, DFlashProposer) \
            and proposer.confident
        size_for = policy.size_for(rt, batch.step_cost, t_draft) if adaptive or confident else None
        trees = build_trees(shapes, proposer, roots, children if any(children) else (), rt.vocab_size, size_for)
        if confident:  # DSpark: the confidence head's survival along the chain sizes the verify
            trees = [sized_chain(trees[0], proposer.chain_survival(trees[0].tokens[None])[0], size_for)]
        drafts = Drafts(trees, shapes[0], [None] * len(rows))
    proposer.end_tree()
    return drafts


def draft_sampled_chains(rt: Runtime, policy: TreePolicy, batch: Batch, roots: torch.Tensor,
                         shapes: Sequence[TreeShape]) -> Drafts:
    """Speculative sampling's drafts: every row drafts a chain as deep as the shallowest row's, each
    draft drawn from the row's processed draft distribution q (a greedy row's: the argmax); a
    sampling row's verification reads the q its drafts were drawn from."""
    rows = batch.rows
    draws = [partial(draw_draft, params=r.params, gen=r.gen) for r in rows]
    trees, q = sampled_chains(min(s.depth for s in shapes), batch.proposer, roots, draws, rt.vocab_size)
    return Drafts(trees, shapes[0], [q[b] if policy.samples_chain(r.params, s) else None
                                     for b, (r, s) in enumerate(zip(rows, shapes))])


# -- verify -------------------------------------------------------------------------------------
def score(rt: Runtime, policy: TreePolicy, batch: Batch, drafts: Drafts) -> Scored:
    """One target forward over every row's tree. A single large tree (CPU) stops before the
    lm_head: its rows are projected as verification reads them (``NodeLogits``)."""
    trees = drafts.trees
    lengths = [r.length for r in batch.rows]
    # up to PREFETCH_ROWS nodes cost one projection either way (and a walk off the first-child chain
    # would cost a second); a chain's rows go together; typical acceptance reads every node
    lazy = len(trees) == 1 and trees[0].buffers.size > PREFETCH_ROWS \
        and not is_chain(drafts.shape) and policy.typical is None and rt.uses_lazy_logits()
    last = rt.num_layers  # its hidden states are the lm_head's input
    extra: dict[str, Any] = dict(logits_to_keep=torch.empty(0, dtype=torch.long, device=rt.device),
                                 layers=sorted(set(rt.layers) | {last})) if lazy else {}
    tokens, pos, mask = batch.kv.tree_inputs(trees, lengths, rt.dtype)
    out, seconds = timed_forward(rt, batch, tokens, pos, mask, **extra)
    node_logits, features = [], []
    for b, tree in enumerate(trees):
        n = tree.tokens.numel()
        node_logits.append(NodeLogits(tree.buffers, hidden=out.hidden_states[last][b], head=rt.projection) if lazy
                           else NodeLogits(tree.buffers, full=out.logits[b, :n]))
        features.append([out.hidden_states[i][b, :n] for i in rt.layers])
    return Scored(drafts, node_logits, features, seconds, tokens, None if lazy else out.logits)


def timed_forward(rt: Runtime, batch: Batch, tokens: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
                  **extra: Any) -> tuple[Any, float]:
    """The step's target forward over ``tokens`` (B, n) at ``pos`` (B, n) into the batch's cache, and its
    seconds (synced on both sides: a GPU's queued work is not counted)."""
    sync(rt.device)
    t = time.perf_counter()
    out = rt.forward(tokens, batch.kv.cache, verify=True, position_ids=pos, attention_mask=mask, **extra)
    sync(rt.device)
    return out, time.perf_counter() - t


# -- accept -------------------------------------------------------------------------------------
def verify_row(tree: DraftTree, logits: NodeLogits, params: SamplingParams, gen: torch.Generator,
               draft_probs: torch.Tensor | None = None, typical: tuple[float, float] | None = None) -> Verdict:
    """One row's accepted path and bonus token. ``logits``: the target's at the tree's nodes, rows
    projected as they are read when lazy (only the accepted path's)."""
    tokens, b = tree.tokens, tree.buffers
    if params.greedy:
        if logits.lazy:
            return verify_greedy_walk(tokens, b, logits)
        return verify_greedy(tokens[None], b.parents[None], b.retrieve[None], logits.all()[None])[0]
    u = torch.rand(b.size + 1, generator=gen).to(tokens.device)
    if draft_probs is not None:  # a sampled chain: one vectorised test
        return verify_sampled_chain(tokens, processed_probs(logits.all(), params), draft_probs, u[:-1], u[-1])
    if typical is not None:
        return verify_typical(tokens, b, processed_probs(logits.all(), params), *typical, u[-1])
    probs: Any = NodeProbs(logits, lambda x: processed_probs(x, params)) if logits.lazy else \
        processed_probs(logits.all(), params)
    return verify_sample(tokens, b, probs, u[:-1], u[-1], proposals=tree.proposals)


def accept(policy: TreePolicy, batch: Batch, scored: Scored) -> list[Verdict]:
    """Every row's verdict: greedy rows all in one tensor pass (``verify_greedy``), else row by row,
    each with its own sampling parameters and generator (``verify_row``)."""
    trees = scored.drafts.trees
    if scored.logits is not None and all(r.params.greedy for r in batch.rows):
        return verify_greedy(scored.tokens, *stack_trees([t.buffers for t in trees]), scored.logits)
    return [verify_row(trees[b], scored.node_logits[b], r.params, r.gen, scored.drafts.draft_probs[b], policy.typical)
            for b, r in enumerate(batch.rows)]


# -- commit -------------------------------------------------------------------------------------
def stopped(row: Row, eos: set[int], n_new: int = 1) -> bool:
    """Cut after the first EOS among the newly emitted tokens; stop at the length limit."""
    emitted = row.emitted
    for i in range(len(emitted) - n_new, len(emitted)):
        if emitted[i] in eos:
            del emitted[i + 1:]
            row.stats.new_tokens = len(emitted)
            row.stats.stopped_by = "eos"
            return True
    if len(emitted) >= row.max_new:
        row.stats.stopped_by = "length"
        return True
    return False


def commit(batch: Batch, scored: Scored, verdicts: Sequence[Verdict], eos: set[int]
           ) -> tuple[list[list[int]], list[Row]]:
    """Keep the accepted KV entries, tell the proposer (now, or at the next drafted step after a
    plain one), append the emitted tokens (accepted path + bonus). Returns each row's new tokens
    (cut at EOS and ``max_new``) and the rows that stopped, which leave the batch."""
    trees = scored.drafts.trees
    width = max(t.tokens.numel() for t in trees)
    starts = [r.length for r in batch.rows]
    nodes = [v.nodes for v in verdicts]  # (m_b + 1,) each
    paths = [torch.cat([t.tokens[n], v.bonus.view(1)]) for t, n, v in zip(trees, nodes, verdicts)]  # (m_b + 2,)
    host = torch.cat([x for n, p in zip(nodes, paths) for x in (n, p[1:])]).tolist()  # the step's one read: all rows
    kept, emitted = [], []
    for n in nodes:
        k = n.numel()
        kept.append(host[:k])
        emitted.append(host[k:2 * k])  # the accepted drafts and the bonus
        del host[:2 * k]
    batch.kv.keep(nodes, [not in_place(h) for h in kept], starts, width)
    feats = [[f[n] for f in fs] for fs, n in zip(scored.features, nodes)]
    batch.proposer.accept(paths, feats, starts)
    return _advance(batch, emitted, eos)


def _advance(batch: Batch, emitted: Sequence[list[int]], eos: set[int]) -> tuple[list[list[int]], list[Row]]:
    """Each row emits its tokens (each one's KV entry now in the cache: the row's length grows by as
    many), cut at EOS and ``max_new``; the rows that stopped leave the cache, the proposer and the
    batch. Returns (each row's new tokens, the rows that stopped)."""
    news, done = [], []
    for r, new in zip(batch.rows, emitted):
        r.length += len(new)
        before = len(r.emitted)
        r.emitted += new
        del r.emitted[r.max_new:]
        r.stats.new_tokens = len(r.emitted)
        done.append(stopped(r, eos, len(r.emitted) - before))
        news.append(r.emitted[before:])
    return news, leave(batch, done)


def leave(batch: Batch, done: Sequence[bool]) -> list[Row]:
    """The rows marked ``done`` leave the cache, the proposer and the batch; returns them."""
    keep = [i for i, d in enumerate(done) if not d]
    if 0 < len(keep) < len(done):  # the last row leaving ends the generation: nothing to keep
        batch.kv.select(keep)
        batch.proposer.select(keep)
        if batch.skipped is not None:
            batch.skipped.select(keep)
    finished = [r for r, d in zip(batch.rows, done) if d]
    batch.rows = [batch.rows[i] for i in keep]
    return finished


# -- a plain step -------------------------------------------------------------------------------
FLUSH_EVERY = 64  # plain steps the proposer may lag behind: it is told (one call) after this many
def plain(rt: Runtime, batch: Batch, eos: set[int]) -> tuple[list[list[int]], list[Row], float]:
    """A step without drafts (the policy's choice at this batch size): one target forward over each
    row's last token, which emits the target's own next token, as plain decoding does: no tree, no
    verification, the cache entry already in place. The proposer sees these tokens when drafting
    resumes, or every ``FLUSH_EVERY`` plain steps (``Skipped``). Returns (each row's new tokens,
    the rows that stopped, forward seconds)."""
    rows = batch.rows
    roots = torch.tensor([r.emitted[-1] for r in rows], device=rt.device)  # (B,)
    lengths = [r.length for r in rows]
    out, seconds = timed_forward(rt, batch, *batch.kv.plain_inputs(roots, lengths, rt.dtype))  # (B, 1) tokens
    logits = out.logits[:, -1]  # (B, V)
    greedy = all(r.params.greedy for r in rows)  # one argmax for the batch, not B small ones (a GPU pays per call)
    nxt = logits.argmax(-1) if greedy else torch.stack([choose(logits[b], r.params, r.gen)
                                                         for b, r in enumerate(rows)])  # (B,)
    batch.kv.keep_plain()
    s = batch.skipped = batch.skipped or Skipped(lengths)
    s.tokens.append(roots)
    s.feats.append([out.hidden_states[i][:, -1] for i in rt.layers])
    s.last = nxt
    if len(s.tokens) >= FLUSH_EVERY:  # bounded memory on long plain runs; the drafter catches up in chunks
        _flush(batch)
    news, finished = _advance(batch, [[t] for t in nxt.tolist()], eos)
    return news, finished, seconds


# -- the step -----------------------------------------------------------------------------------
def step(rt: Runtime, policy: TreePolicy, batch: Batch, eos: set[int], hooks: Sequence[StepHooks] = ()
         ) -> tuple[list[Row], list[list[int]], list[Row]]:
    """draft -> verify -> accept -> commit, or a plain step where the policy says speculation does not
    pay at this batch size. Returns (the rows as they entered, each one's new tokens, the rows that
    stopped)."""
    entered = replace(batch, rows=list(batch.rows))  # as it entered the step: before stopped rows leave
    B, t0 = len(batch.rows), time.perf_counter()
    sampling = any(not r.params.greedy for r in batch.rows)
    scored, verdicts = None, None
    if policy.speculate(B, sampling):
        drafts = draft(rt, policy, batch)
        t_draft = time.perf_counter() - t0
        scored = score(rt, policy, batch, drafts)
        verdicts = accept(policy, batch, scored)
        new, finished = commit(batch, scored, verdicts, eos)
        sync(rt.device)
        verify = scored.verify_time + sum(n.seconds for n in scored.node_logits)  # lm_head rows read: the target's
    else:
        new, finished, verify = plain(rt, batch, eos)
        t_draft = 0.0
    total = time.perf_counter() - t0
    if scored is not None:  # the rest of a step, for adaptive trees' sizes: a running mean
        batch.step_cost = total - verify if batch.step_cost is None else 0.8 * batch.step_cost + 0.2 * (total - verify)
    times = {"draft": t_draft, "verify": verify, "bookkeeping": total - t_draft - verify, "total": total}
    for h in hooks:
        h.on_step(entered, scored, verdicts, new, times)
    return entered.rows, new, finished


class RecordStats:
    """The hook that keeps every row's ``GenerationStats``: forwards, tree nodes, lm_head rows,
    accepted depths, and the step's times as each row lived through them."""

    def on_step(self, batch: Batch, scored: Scored | None, verdicts: Sequence[Verdict] | None,
                new: Sequence[list[int]], times: dict[str, float]) -> None:
        for b, r in enumerate(batch.rows):
            s = r.stats
            s.target_forwards += 1
            if scored is None or verdicts is None:  # a plain step: one token, one lm_head row
                s.tree_nodes += 1
                s.projected_rows += 1
            else:
                nodes = scored.drafts.trees[b].buffers.size
                s.tree_nodes += nodes
                s.projected_rows += len(scored.node_logits[b].rows) if scored.node_logits[b].lazy else nodes
                s.record_accepted(verdicts[b].accepted)
            s.time_draft += times["draft"]
            s.time_verify += times["verify"]
            s.time_bookkeeping += times["bookkeeping"]
