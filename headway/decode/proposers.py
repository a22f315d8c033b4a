"""Proposers: the draft side of a decode step, one class per head kind, each over a batch of B rows
(a single prompt is a batch of one).

The decoder asks a drafter for nothing but the ``Proposer`` protocol below; a new head kind plugs in
as one more class here and one more line in ``make_proposer``.

* ``MedusaProposer``: K heads on each row's last final state; depth d reads head d - 1, whatever the
  parent token, so a tree costs one heads call per step.
* ``EagleProposer``: EAGLE-1 / EAGLE-3, one drafter forward per tree level over its own KV cache.
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
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F

from ..heads import DFlashDrafter, Eagle1Drafter, Eagle3Drafter, HeadsBase, MedusaHeads
from ..heads.dflash import ContextKV, extend_context
from ..heads.layers import DraftCache
from ..heads.metadata import calibration_temperatures
from .padding import additive, after_prefix, catch_up_visible, first_slots, pad_rows, prefill_mask, used_columns


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


def _index(keep: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(keep), dtype=torch.long, device=like.device)


class MedusaProposer:
    """Head k's distribution is depth k + 1's for every parent: one heads call on the rows' last
    final states, when they arrive, drafts every tree."""

    def __init__(self, heads: MedusaHeads, temperatures: Sequence[float] | None = None) -> None:
        self.heads = heads
        self.temperatures = temperatures
        self.max_depth = heads.config.num_heads
        self.draft_vocab_size = heads.draft_vocab_size
        self.feature_layers = [-1]
        self.logp: torch.Tensor | None = None  # (B, K, Vd)

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

    def root_logprobs(self) -> torch.Tensor:
        return self.logp[:, 0]

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        return self.logp[:, depth, None].expand(-1, tokens.shape[1], -1)  # head k ignores the parent token

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.heads.to_target_ids(draft_ids)

    def end_tree(self) -> None:
        pass

    def select(self, keep: Sequence[int]) -> None:
        self.logp = self.logp[_index(keep, self.logp)]

    def fork(self) -> MedusaProposer:
        return copy.copy(self)  # logp is replaced, never written in place


class EagleProposer:
    """EAGLE-1 / EAGLE-3: the drafter runs autoregressively over the tree with its own KV cache.

    Entry t of a row holds (x_{t+1}, f_t), whatever its physical slot: the cache (B, kv_heads, S,
    head_dim) has ``valid`` (B, S) real slots and ``base`` (B,) each row's logical length (= its next
    root's position). Tree levels are appended after the S slots while drafting and cropped by
    ``end_tree``; ``accept`` then feeds the accepted positions with the target's real features.
    Log-probs are over the drafter's draft vocabulary (``draft_logits``)."""

    def __init__(self, drafter: Eagle1Drafter | Eagle3Drafter, max_depth: int | None = None,
                 temperatures: Sequence[float] | None = None) -> None:
        self.drafter = drafter
        self.max_depth = max_depth
        self.temperatures = temperatures
        self.draft_vocab_size = drafter.draft_vocab_size
        self.feature_layers = list(drafter.feature_layers)
        self.cache = DraftCache()
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.base = torch.zeros(0, dtype=torch.long)
        self.dense = True  # no pad or gap slot (a batch of one): a lone query below a chain needs no mask

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor | None
             ) -> torch.Tensor:
        """One drafter forward of (B, T) tokens appended to the cache; visible (B, T, S + T), or None:
        every query sees every slot (one query per row, no pad or gap)."""
        d = self.drafter
        mask = None if visible is None else additive(visible, d.fc.weight.dtype)
        return d(tokens, hidden, pos, mask, self.cache)  # (B, T, H)

    def _roots(self, out: torch.Tensor, last: torch.Tensor) -> None:
        """The output at each row's last real new slot feeds that row's depth-1 drafts."""
        self.root_out = out[torch.arange(out.shape[0], device=out.device), last][:, None]  # (B, 1, H)
        self.root_lp = F.log_softmax(self.drafter.draft_logits(self.root_out)[:, 0].float(), dim=-1)  # (B, Vd)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        self.cache, self.dense = DraftCache(), tokens.shape[0] == 1
        x = torch.cat([tokens[:, 1:], first.view(-1, 1)], dim=1)  # x_{t+1} at slot t; pad slots: junk, invalid
        out = self._run(x, self.drafter.fuse(features), position_ids, prefill_mask(valid))
        self.valid, self.base = valid.clone(), valid.sum(1)  # its own: the target's mask changes apart
        self._roots(out, torch.full_like(self.base, tokens.shape[1] - 1))

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        """Row b appends m_b + 1 entries (x_{t+1}, f_t), t = start_b .. start_b + m_b, padded to the
        longest row; the pad slots are invalid (gaps), as in the target's cache."""
        dev = self.valid.device
        counts = [p.numel() - 1 for p in paths]  # the path without the root, bonus included
        tokens = pad_rows([p[1:] for p in paths])  # (B, M)
        feats = [pad_rows(layer) for layer in zip(*features)]  # per layer (B, M, H)
        M = tokens.shape[1]
        start = torch.tensor(list(starts), dtype=torch.long, device=dev)
        pos = start[:, None] + torch.arange(M, device=dev)[None]  # pad slots: harmless positions, never seen
        new_valid = first_slots(counts, dev)
        seen = None if self.dense and M == 1 else catch_up_visible(self.valid, new_valid)
        out = self._run(tokens, self.drafter.fuse(feats), pos, seen)
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        c = torch.tensor(counts, dtype=torch.long, device=dev)
        self.base = start + c
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
        return F.log_softmax(self.drafter.draft_logits(out).float(), dim=-1)  # (B, n, Vd)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target_ids(draft_ids)

    def end_tree(self) -> None:
        self.cache.crop(self.valid.shape[1])

    def select(self, keep: Sequence[int]) -> None:
        sel, c = _index(keep, self.valid), self.cache
        c.keys, c.values = c.keys.index_select(0, sel), c.values.index_select(0, sel)
        self.valid, self.base = self.valid[sel], self.base[sel]
        self.root_out, self.root_lp = self.root_out[sel], self.root_lp[sel]
        cols = used_columns(self.valid)  # slots only dropped rows used: the same rule as the target's cache
        if cols is not None:
            c.keys, c.values = c.keys.index_select(2, cols), c.values.index_select(2, cols)
            self.valid = self.valid[:, cols]

    def fork(self) -> EagleProposer:
        twin = copy.copy(self)
        twin.cache = copy.copy(self.cache)  # append / crop rebuild tensors, never write into them
        return twin


class DFlashProposer:
    """A DFlash block drafter: one drafter call per step drafts every depth at once.

    The drafter keeps the keys and values of the fused target features at every position the target
    has given (``context``: per layer (B, kv_heads, S, head_dim), ``valid`` (B, S) real slots); a
    step's block is [root, mask, ...] at the root's position and after. Like Medusa's, depth d's
    distribution ignores the parent token, so chains, static and dynamic trees all read the same
    (B, block_size - 1, Vd) block. A drafter with a path correction adds, per tree level, one
    correction step on each parent's state and token: depth d then depends on the path above it."""

    def __init__(self, drafter: DFlashDrafter, temperatures: Sequence[float] | None = None) -> None:
        self.drafter = drafter
        self.temperatures = temperatures
        self.max_depth = drafter.block_size - 1
        self.draft_vocab_size = drafter.draft_vocab_size
        self.feature_layers = list(drafter.feature_layers)
        self.context: ContextKV | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.base = torch.zeros(0, dtype=torch.long)  # (B,) each row's next root position
        self.roots = torch.zeros(0, dtype=torch.long)  # (B,) each row's next block anchor
        self.dense = True  # no pad or gap slot (a batch of one): the block needs no mask
        self.logp: torch.Tensor | None = None  # (B, bs - 1, Vd) (no correction)
        self.out: torch.Tensor | None = None  # (B, bs - 1, H) slot outputs (correction)
        self.slot_logits: torch.Tensor | None = None  # (B, bs - 1, Vd) slot logits before the correction
        self.state: torch.Tensor | None = None  # (B, rows of the last call, r) correction states

    def _write(self, features: list[torch.Tensor], pos: torch.Tensor, new_valid: torch.Tensor) -> None:
        d = self.drafter
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
        dev = self.valid.device
        counts = [p.numel() - 1 for p in paths]  # positions whose features arrive: the path, root first
        feats = [pad_rows(layer) for layer in zip(*features)]  # per layer (B, M, H)
        start = torch.tensor(list(starts), dtype=torch.long, device=dev)
        pos = start[:, None] + torch.arange(feats[0].shape[1], device=dev)[None]
        self._write(feats, pos, first_slots(counts, dev))
        self.base = start + torch.tensor(counts, dtype=torch.long, device=dev)
        self.roots = torch.stack([p[-1] for p in paths])

    def root_logprobs(self) -> torch.Tensor:
        d = self.drafter
        B, bs = self.roots.shape[0], d.block_size
        x = d.block_embeddings(self.roots[:, None])  # (B, bs, H)
        pos = self.base[:, None] + torch.arange(bs, device=x.device)  # (B, bs)
        mask = None if self.dense else additive(
            after_prefix(self.valid, torch.ones(B, bs, bs, dtype=torch.bool, device=x.device)), d.fc.weight.dtype)
        out = d(x, pos, self.context, mask)[:, 1:]  # (B, bs - 1, H)
        if not d.has_correction:
            self.logp = F.log_softmax(d.logits(out).float(), dim=-1)
            return self.logp[:, 0]
        self.out, self.slot_logits = out, d.logits(out)  # (B, bs - 1, H), (B, bs - 1, Vd)
        return self._corrected(None, self.roots[:, None], 0)[:, 0]

    def _corrected(self, state: torch.Tensor | None, parents: torch.Tensor, slot: int) -> torch.Tensor:
        """Slot ``slot`` (0-based: depth slot + 1) after parents (B, n) target ids with states (B, n, r)
        -> (B, n, Vd)."""
        d = self.drafter
        B, n = parents.shape
        flat = d.correction_step(None if state is None else state.reshape(B * n, -1), parents.reshape(-1),
                                 self.out[:, slot, None].expand(B, n, -1).reshape(B * n, -1))
        self.state = flat.view(B, n, -1)
        return F.log_softmax((self.slot_logits[:, slot, None] + d.correction.out(self.state)).float(), dim=-1)

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        if self.drafter.has_correction:
            rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
            return self._corrected(self.state[rows, parent_rows], tokens, depth)
        return self.logp[:, depth, None].expand(-1, tokens.shape[1], -1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target_ids(draft_ids)

    def end_tree(self) -> None:
        pass

    def select(self, keep: Sequence[int]) -> None:
        sel = _index(keep, self.valid)
        self.valid, self.base, self.roots = self.valid[sel], self.base[sel], self.roots[sel]
        self.context = [(k[sel], v[sel]) for k, v in self.context]
        cols = used_columns(self.valid)  # slots only dropped rows used
        if cols is not None:
            self.valid = self.valid[:, cols]
            self.context = [(k[:, :, cols], v[:, :, cols]) for k, v in self.context]

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
    if isinstance(heads, DFlashDrafter):
        return DFlashProposer(heads, temps)
    raise TypeError(f"no proposer for {type(heads).__name__}")
