"""Proposers: the draft side of a decode step, one class per head kind, each over a batch of B rows
(a single prompt is a batch of one).

The decoder asks a drafter for nothing but the ``Proposer`` protocol below; a new head kind plugs in
as one more class here and one more line in ``make_proposer``.

* ``MedusaProposer``: K heads on each row's last final state; depth d reads head d - 1, whatever the
  parent token, so a tree costs one heads call per step.
* ``EagleProposer``: EAGLE-1 / EAGLE-3, one drafter forward per tree level over its own KV cache.
* ``PEagleProposer``: P-EAGLE, an EAGLE-3 drafter whose one forward per step drafts every depth (mask
  slots after the accepted entries).
* ``DFlashProposer``: a block drafter, one forward per step drafts every depth (plus, with a path
  correction, one small step per level).
* ``RowsProposer``: B batch-of-one proposers driven row by row (test oracles, and the A/B baseline
  of batched drafting).

The rows of a drafter's cache share one physical layout, as the target's do (``decode/padding.py``):
left-padded prefill, a ``valid`` (B, S) mask of real slots (pads, and the gaps a row that accepted
fewer drafts leaves), per-row position ids, additive masks with exact zeros, so row b drafts what it
would alone. A batch of one has no pads or gaps (``dense``): a chain's one-query steps skip the mask.
"""

from __future__ import annotations

import copy
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F

from ..heads import DFlashDrafter, Eagle1Drafter, Eagle3Drafter, HeadsBase, MedusaHeads, PEagleDrafter
from ..heads.base import DraftVocab
from ..heads.dflash import ContextKV, extend_context, survival
from ..heads.layers import DraftCache
from ..heads.metadata import calibration_temperatures
from .padding import (additive, after_prefix, catch_up_visible, first_slots, keep_rows, pad_rows, prefill_mask,
                      with_mask_queries)


@runtime_checkable
class Proposer(Protocol):
    """What the decoder asks of a drafter, for B rows at once. Per generation::

        prefill(tokens, valid, position_ids, features, first)   once: the prompts
        every step:
            root_logprobs()                 (B, Vd)     draft distribution after each row's root
            expand(parent_rows, tokens, d)  (B, n, Vd)  ... after n nodes per row at depth d
            to_target_ids(draft_ids)                    draft-vocabulary ids -> the target's
            end_tree()                                  the trees are built: forget their nodes
            accept(paths, features, starts)             what the target accepted, and its states there
        select(keep)                        rows that finished leave
        fork()                              an independent copy (a one-prompt tree search, in tests)

    The tree builders (``decode/trees.py``) call ``root_logprobs`` once and ``expand`` once per tree
    level for all rows; every row drafts the same number of nodes per level. How a kind answers is its
    own: a drafter that reads the parent (EAGLE) runs one forward per ``expand``; a block drafter, which
    drafts every depth in one forward (DFlash, or a parallel EAGLE-style drafter such as P-EAGLE), runs
    it in ``root_logprobs`` and answers ``expand`` from the block. How many drafted nodes are verified
    is the tree policy's choice (``decode/policy.py``: adaptive trees), not the proposer's."""

    max_depth: int | None  # deepest draft it can make (Medusa: its heads, DFlash: its block; None: no limit)
    draft_vocab_size: int | None  # columns of its log-probs (None: the target's vocabulary)
    feature_layers: list[int]  # target hidden states it reads (HF indices; -1: the final post-norm state)
    temperatures: Sequence[float] | None  # calibration per draft depth, depth 1 first (``trees.depth_temperature``)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        """tokens, valid, position_ids (B, n): the left-padded prompts; features [(B, n, H)] the
        target's states there, one per ``feature_layers``; first (B,) the target's token after each
        prompt (the first roots)."""
        ...

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        """Per row: paths[b] (m_b + 2,) the accepted path (root first) then the bonus token;
        features[b] [(m_b + 1, H)] the target's states at the path; starts[b] the root's position."""
        ...

    def root_logprobs(self) -> torch.Tensor:
        """(B, Vd) log-probs over each root's children (depth 1): a tree starts here."""
        ...

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """(B, n, Vd) log-probs over the children of n nodes per row at ``depth``, whose target ids
        are ``tokens`` (B, n); ``parent_rows`` (B, n) gives each node's parent as a row of the
        previous call (all 0 at depth 1: the root)."""
        ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def end_tree(self) -> None:
        """The trees are built: forget their nodes (the next ``accept`` brings the real ones)."""
        ...

    def select(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep``, in this order."""
        ...

    def fork(self) -> Proposer:
        """An independent copy of the draft state (the heads are shared)."""
        ...


def hidden_index(layer: int, num_layers: int) -> int:
    """HF hidden-state index; -1 means the final post-norm state (index L)."""
    return num_layers if layer == -1 else layer


class _Drafts:
    """What every kind below shares: the ``Proposer`` attributes read off its heads, the rows' cache
    layout (``valid`` (B, S) real slots, ``base`` (B,) each row's next root position), the draft ->
    target id map, and a block's answers: a kind that drafts every depth in one call keeps ``logp``
    (B, K, Vd), depth d's distribution whatever the parent token (Medusa, P-EAGLE, DFlash). Its
    tensors are replaced, never written in place (a fork copies only what a kind appends to)."""

    def __init__(self, heads: HeadsBase, max_depth: int | None, temperatures: Sequence[float] | None) -> None:
        self.heads = heads
        self.max_depth = max_depth
        self.temperatures = temperatures
        self.draft_vocab_size = heads.draft_vocab_size
        self.feature_layers = list(heads.feature_layers)
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.base = torch.zeros(0, dtype=torch.long)
        self.dense = True  # no pad or gap slot (a batch of one): a lone query or a block needs no mask
        self.logp: torch.Tensor | None = None  # (B, K, Vd) a block's depths 1..K after each row's root

    def root_logprobs(self) -> torch.Tensor:
        return self.logp[:, 0]

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        return self.logp[:, depth, None].expand(-1, tokens.shape[1], -1)  # a block ignores the parent token

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return DraftVocab.to_target_ids(self.heads, draft_ids)  # the draft vocabulary's map, in any mode

    def end_tree(self) -> None:
        pass

    def _select(self, keep: Sequence[int]) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """Keep rows ``keep`` of ``valid`` and ``base`` (``padding.keep_rows``: the target cache's rule).
        Returns the row index and what selects the same rows and slots of a cache tensor."""
        sel, self.valid, take = keep_rows(self.valid, keep)
        self.base = self.base[sel]
        return sel, take

    def _accepted(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
                  starts: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
        """What ``accept`` appends: row b's m_b + 1 entries (x_{t+1}, f_t), t = start_b .. start_b + m_b,
        padded to the longest row -> tokens (B, M) the path after the root (bonus included), features
        per layer (B, M, H) at the path (root first), their positions (B, M) (a pad slot's: harmless, never
        seen), counts (B,) the real entries, and their slots (B, M) (the pad slots are gaps, as in the
        target's cache). ``base`` moves past them."""
        dev = self.valid.device
        counts = [p.numel() - 1 for p in paths]
        start = torch.tensor(list(starts), dtype=torch.long, device=dev)
        c = torch.tensor(counts, dtype=torch.long, device=dev)
        self.base = start + c
        pos = start[:, None] + torch.arange(max(counts), device=dev)[None]
        return (pad_rows([p[1:] for p in paths]), [pad_rows(layer) for layer in zip(*features)], pos, c,
                first_slots(counts, dev))


def _next_tokens(tokens: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Prompts (B, n) and the target's first tokens (B,) -> x_{t+1} at slot t (left padding: pad slots
    hold junk, invalid)."""
    return torch.cat([tokens[:, 1:], first.view(-1, 1)], dim=1)


def _at(out: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """out (B, T, H), cols (B,) -> (B, H): row b's output at column cols[b]."""
    return out[torch.arange(out.shape[0], device=out.device), cols]


class MedusaProposer(_Drafts):
    """Head k's distribution is depth k + 1's for every parent: one heads call on the rows' last
    final states, when they arrive, drafts every tree."""

    def __init__(self, heads: MedusaHeads, temperatures: Sequence[float] | None = None) -> None:
        super().__init__(heads, heads.config.num_heads, temperatures)

    def _set(self, final_hidden: torch.Tensor) -> None:
        """final_hidden (B, H) -> per row, per head log-probs (B, K, Vd)."""
        w = next(self.heads.parameters())
        self.logp = F.log_softmax(self.heads(final_hidden.to(w.dtype)).float(), dim=-1).transpose(0, 1)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        self._set(features[0][:, -1])  # left padding: the last slot is every row's last prompt token

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        self._set(torch.stack([f[0][-1] for f in features]))

    def select(self, keep: Sequence[int]) -> None:
        self.logp = self.logp[torch.tensor(list(keep), dtype=torch.long, device=self.logp.device)]

    def fork(self) -> MedusaProposer:
        return copy.copy(self)  # logp is replaced, never written in place


class EagleProposer(_Drafts):
    """EAGLE-1 / EAGLE-3: the drafter runs autoregressively over the tree with its own KV cache.

    Entry t of a row holds (x_{t+1}, f_t), whatever its physical slot: the cache (B, kv_heads, S,
    head_dim) has ``valid`` (B, S) real slots and ``base`` (B,) each row's logical length (= its next
    root's position). Tree levels are appended after the S slots while drafting and cropped by
    ``end_tree``; ``accept`` then feeds the accepted positions with the target's real features.
    Log-probs are over the drafter's draft vocabulary (``draft_logits``)."""

    def __init__(self, drafter: Eagle1Drafter | Eagle3Drafter, max_depth: int | None = None,
                 temperatures: Sequence[float] | None = None) -> None:
        super().__init__(drafter, max_depth, temperatures)
        self.cache = DraftCache()

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor | None
             ) -> torch.Tensor:
        """One drafter forward of (B, T) tokens appended to the cache; visible (B, T, S + T), or None:
        every query sees every slot (one query per row, no pad or gap)."""
        d = self.heads
        mask = None if visible is None else additive(visible, d.fc.weight.dtype)
        return d(tokens, hidden, pos, mask, self.cache)  # (B, T, H)

    def _roots(self, out: torch.Tensor, last: torch.Tensor) -> None:
        """The output at each row's last real new slot feeds that row's depth-1 drafts."""
        self.root_out = _at(out, last)[:, None]  # (B, 1, H)
        self.root_lp = F.log_softmax(self.heads.draft_logits(self.root_out)[:, 0].float(), dim=-1)  # (B, Vd)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        self.cache, self.dense = DraftCache(), tokens.shape[0] == 1
        out = self._run(_next_tokens(tokens, first), self.heads.fuse(features), position_ids, prefill_mask(valid))
        self.valid, self.base = valid.clone(), valid.sum(1)  # its own: the target's mask changes apart
        self._roots(out, torch.full_like(self.base, tokens.shape[1] - 1))

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        tokens, feats, pos, c, new_valid = self._accepted(paths, features, starts)
        seen = None if self.dense and tokens.shape[1] == 1 else catch_up_visible(self.valid, new_valid)
        out = self._run(tokens, self.heads.fuse(feats), pos, seen)
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self._roots(out, c - 1)

    def root_logprobs(self) -> torch.Tensor:
        """Start the trees: depth-1 nodes read their row's root output and see no tree slots yet."""
        self.prev_out = self.root_out  # (B, rows of the last call, H)
        self.prev_vis = torch.zeros(self.root_out.shape[0], 1, 0, dtype=torch.bool, device=self.root_out.device)
        self.prev_chain = True  # every node so far is its level's only one: the tree is a chain
        return self.root_lp

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Feed n nodes per row at ``depth`` (drafter position base + depth - 1): each reads its
        parent's output and sees its row's valid slots, its tree ancestors and itself."""
        B, n = tokens.shape
        dev = tokens.device
        rows = torch.arange(B, device=dev)[:, None]
        tree_vis = torch.cat([self.prev_vis[rows, parent_rows],  # (B, n, slots) the ancestors' slots
                              torch.eye(n, dtype=torch.bool, device=dev).expand(B, n, n)], dim=2)
        # a lone node below a chain sees the whole cache (chains, static trees' narrow levels): decided
        # from shapes alone, so no device sync
        self.prev_chain = self.prev_chain and n == 1
        seen = None if self.dense and self.prev_chain else after_prefix(self.valid, tree_vis)
        pos = (self.base + depth - 1)[:, None].expand(B, n)
        out = self._run(tokens, self.prev_out[rows, parent_rows], pos, seen)
        self.prev_vis, self.prev_out = tree_vis, out  # the next level's ancestors include these slots
        return F.log_softmax(self.heads.draft_logits(out).float(), dim=-1)  # (B, n, Vd)

    def end_tree(self) -> None:
        self.cache.crop(self.valid.shape[1])

    def select(self, keep: Sequence[int]) -> None:
        sel, take = self._select(keep)
        self.cache.keys, self.cache.values = take(self.cache.keys), take(self.cache.values)
        self.root_out, self.root_lp = self.root_out[sel], self.root_lp[sel]

    def fork(self) -> EagleProposer:
        twin = copy.copy(self)
        twin.cache = copy.copy(self.cache)  # append / crop rebuild tensors, never write into them
        return twin


class PEagleProposer(_Drafts):
    """P-EAGLE: an EAGLE-3 drafter that drafts all K depths of a chain in one call (docs/peagle.md).

    Its cache holds EAGLE's entries (x_{t+1}, f_t at position t) with ``valid`` and ``base`` as the EAGLE
    proposer's. ``prefill`` and ``accept`` make the call: the new real entries, then K - 1 mask slots at
    the positions after each row's last real one (``drafter.with_mask_slots``), attention causal over the
    row's valid slots (``padding.with_mask_queries``). The outputs at the last real slot and the mask slots
    are depths 1..K; the mask slots' keys are cropped at once (the next call writes accepted entries at
    their positions). As with DFlash, depth d's distribution ignores the drafts above it: every tree
    shape reads the one (B, K, Vd) block, and a sampled chain draws each depth from its own row."""

    def __init__(self, drafter: PEagleDrafter, max_depth: int | None = None,
                 temperatures: Sequence[float] | None = None) -> None:
        K = drafter.num_depths
        super().__init__(drafter, K if max_depth is None else min(K, max_depth), temperatures)
        self.cache = drafter.new_cache()

    def _draft(self, tokens: torch.Tensor, features: list[torch.Tensor], pos: torch.Tensor,
               visible: torch.Tensor, new_valid: torch.Tensor, last: torch.Tensor) -> None:
        """One call: M new real entries per row (tokens, pos (B, M); the column ``last`` (B,) holds each
        row's last real one, at position base - 1; ``visible`` (B, M, S + M) among the real queries), then
        the K - 1 mask slots."""
        d = self.heads
        S, M = len(self.cache), tokens.shape[1]
        ids, hid, pos = d.with_mask_slots(tokens, d.fuse(features), pos)  # the last column is base - 1 in every row
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        seen = with_mask_queries(visible, self.valid, d.num_depths - 1)
        out = d(ids, hid, pos, additive(seen, d.fc.weight.dtype), self.cache)  # (B, M + K - 1, H)
        self.cache.crop(S + M)  # the mask slots' keys: placeholders, never context
        h = torch.cat([_at(out, last)[:, None], out[:, M:]], dim=1)  # (B, K, H): depth 1 first
        self.logp = F.log_softmax(d.logits(h).float(), dim=-1)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        self.cache, self.valid = self.heads.new_cache(), valid[:, :0]
        self._draft(_next_tokens(tokens, first), features, position_ids, prefill_mask(valid), valid.clone(),
                    torch.full((tokens.shape[0],), tokens.shape[1] - 1, dtype=torch.long, device=tokens.device))
        self.base = valid.sum(1)

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        """As EAGLE's, the pad slots at the row's last position so the mask slots follow it in every row."""
        tokens, feats, pos, c, new_valid = self._accepted(paths, features, starts)
        pos = torch.minimum(pos, pos[:, :1] + c[:, None] - 1)
        self._draft(tokens, feats, pos, catch_up_visible(self.valid, new_valid), new_valid, c - 1)

    def select(self, keep: Sequence[int]) -> None:
        sel, take = self._select(keep)
        for c in self.cache.layers:
            c.keys, c.values = take(c.keys), take(c.values)
        self.logp = self.logp[sel]

    def fork(self) -> PEagleProposer:
        twin = copy.copy(self)  # logp is replaced each call, never written in place
        twin.cache = copy.copy(self.cache)
        twin.cache.layers = [copy.copy(c) for c in self.cache.layers]  # append / crop rebuild tensors
        return twin


class DFlashProposer(_Drafts):
    """A DFlash block drafter: one drafter call per step drafts every depth at once.

    The drafter keeps the keys and values of the fused target features at every position the target
    has given (``context``: per layer (B, kv_heads, S, head_dim), ``valid`` (B, S) real slots); a
    step's block is [root, mask, ...] at the root's position and after. Like Medusa's, depth d's
    distribution ignores the parent token, so chains, static and dynamic trees all read the same
    (B, block_size - 1, Vd) block. A drafter with a path correction adds, per tree level, one
    correction step on each parent's state and token: depth d then depends on the path above it.
    DSpark's Markov head adds a bias from each node's parent token (the root's for depth 1), and its
    confidence head estimates each chain draft's chance of acceptance (``chain_survival``), from which
    the step chooses how many drafts to verify (``step.draft``)."""

    def __init__(self, drafter: DFlashDrafter, temperatures: Sequence[float] | None = None) -> None:
        super().__init__(drafter, drafter.block_size - 1, temperatures)
        self.context: ContextKV | None = None
        self.roots = torch.zeros(0, dtype=torch.long)  # (B,) each row's next block anchor
        self.out: torch.Tensor | None = None  # (B, bs - 1, H) slot outputs (correction, DSpark)
        self.slot_logits: torch.Tensor | None = None  # (B, bs - 1, Vd) slot logits before the correction
        self.state: torch.Tensor | None = None  # (B, rows of the last call, r) correction states

    def _write(self, features: list[torch.Tensor], pos: torch.Tensor, new_valid: torch.Tensor) -> None:
        d = self.heads
        self.context = extend_context(self.context, d.context_kv(d.fuse(features), pos))
        self.valid = torch.cat([self.valid, new_valid], dim=1)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        self.context, self.valid, self.dense = None, valid[:, :0], tokens.shape[0] == 1
        self._write(features, position_ids, valid.clone())
        self.base, self.roots = valid.sum(1), first.reshape(-1).clone()

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        """Row b's path features (m_b + 1 positions from its root) join its context, padded to the longest."""
        _, feats, pos, _, new_valid = self._accepted(paths, features, starts)
        self._write(feats, pos, new_valid)
        self.roots = torch.stack([p[-1] for p in paths])

    def root_logprobs(self) -> torch.Tensor:
        d = self.heads
        B, bs = self.roots.shape[0], d.block_size
        x = d.block_embeddings(self.roots[:, None])  # (B, bs, H)
        pos = self.base[:, None] + torch.arange(bs, device=x.device)  # (B, bs)
        mask = None if self.dense else additive(
            after_prefix(self.valid, torch.ones(B, bs, bs, dtype=torch.bool, device=x.device)), d.fc.weight.dtype)
        self.out, self.state = d(x, pos, self.context, mask)[:, 1:], None  # (B, bs - 1, H); no correction state yet
        if d.has_correction and not d.has_markov:
            self.slot_logits = d.logits(self.out)  # (B, bs - 1, Vd)
        elif not d.has_markov:
            self.logp = F.log_softmax(d.logits(self.out).float(), dim=-1)
        return self.expand(torch.zeros_like(self.roots[:, None]), self.roots[:, None], 0)[:, 0]  # the root: depth 0

    def _markov(self, parents: torch.Tensor, slot: int) -> torch.Tensor:
        """DSpark: slot ``slot`` (0-based) after parents (B, n) target ids, its logits plus the Markov
        bias of each parent -> (B, n, Vd)."""
        B, n = parents.shape
        h = self.out[:, slot, None].expand(B, n, -1)  # (B, n, H)
        return F.log_softmax(self.heads.logits(h, parents=parents).float(), dim=-1)

    def chain_survival(self, tokens: torch.Tensor) -> torch.Tensor:
        """DSpark's confidence head along each row's chain: tokens (B, D + 1) target ids, the root then
        the drafts at depths 1..D -> (B, D), the chance that drafts 1..k are all accepted (``survival``)."""
        D = tokens.shape[1] - 1
        return survival(self.heads.confidence(self.out[:, :D], tokens[:, :D]))

    @property
    def confident(self) -> bool:
        """The drafter estimates each slot's acceptance (a DSpark confidence head)."""
        return self.heads.has_confidence

    def _corrected(self, state: torch.Tensor | None, parents: torch.Tensor, slot: int) -> torch.Tensor:
        """Slot ``slot`` (0-based: depth slot + 1) after parents (B, n) target ids with states (B, n, r)
        -> (B, n, Vd)."""
        d = self.heads
        B, n = parents.shape
        flat = d.correction_step(None if state is None else state.reshape(B * n, -1), parents.reshape(-1),
                                 self.out[:, slot, None].expand(B, n, -1).reshape(B * n, -1))
        self.state = flat.view(B, n, -1)
        return F.log_softmax((self.slot_logits[:, slot, None] + d.correction.out(self.state)).float(), dim=-1)

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        if self.heads.has_markov:
            return self._markov(tokens, depth)
        if self.heads.has_correction:
            rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
            return self._corrected(None if self.state is None else self.state[rows, parent_rows], tokens, depth)
        return super().expand(parent_rows, tokens, depth)

    def select(self, keep: Sequence[int]) -> None:
        sel, take = self._select(keep)
        self.roots = self.roots[sel]
        self.context = [(take(k), take(v)) for k, v in self.context]

    def fork(self) -> DFlashProposer:
        twin = copy.copy(self)  # logp / out / slot_logits / state are replaced each tree, never written in place
        twin.context = None if self.context is None else list(self.context)  # extended by new lists only
        return twin


class RowsProposer:
    """B proposers of one row each, driven one row at a time: a replaced ``Speculator.new_proposer``
    (a test oracle) gets one per row, and ``Speculator.batched_drafting = False`` measures batched
    drafting against it."""

    def __init__(self, rows: Sequence[Proposer]) -> None:
        self.rows = list(rows)
        first = self.rows[0]
        self.max_depth, self.draft_vocab_size = first.max_depth, first.draft_vocab_size
        self.feature_layers, self.temperatures = first.feature_layers, first.temperatures

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        n = tokens.shape[1]
        for b, p in enumerate(self.rows):
            s = n - int(valid[b].sum())  # left padding: the row's tokens are the last ones
            p.prefill(tokens[b:b + 1, s:], valid[b:b + 1, s:], position_ids[b:b + 1, s:],
                      [f[b:b + 1, s:] for f in features], first[b:b + 1])

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        for b, p in enumerate(self.rows):
            p.accept(paths[b:b + 1], features[b:b + 1], starts[b:b + 1])

    def root_logprobs(self) -> torch.Tensor:
        return torch.cat([p.root_logprobs() for p in self.rows])

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        return torch.cat([p.expand(parent_rows[b:b + 1], tokens[b:b + 1], depth) for b, p in enumerate(self.rows)])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.rows[0].to_target_ids(draft_ids)  # the heads' map: the same for every row

    def end_tree(self) -> None:
        for p in self.rows:
            p.end_tree()

    def select(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def fork(self) -> RowsProposer:
        return RowsProposer([p.fork() for p in self.rows])


def make_proposer(heads: HeadsBase, max_depth: int | None = None, calibrate: bool = True) -> Proposer:
    """The heads' proposer; with ``calibrate`` it carries the heads' calibration temperatures
    (``metadata["calibration"]``, none when absent), which rank dynamic-tree nodes."""
    temps = calibration_temperatures(heads.metadata) if calibrate else None
    if isinstance(heads, MedusaHeads):
        return MedusaProposer(heads, temps)
    if isinstance(heads, (Eagle1Drafter, Eagle3Drafter)):
        return EagleProposer(heads, max_depth, temps)
    if isinstance(heads, PEagleDrafter):
        return PEagleProposer(heads, max_depth, temps)
    if isinstance(heads, DFlashDrafter):
        return DFlashProposer(heads, temps)
    raise TypeError(f"no proposer for {type(heads).__name__}")
