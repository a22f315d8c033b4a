"""Batched proposers: the draft side of a batched decode step, one drafter call per draft level
for all B rows (``decode/batch.py``).

The protocol mirrors ``shapes.Proposer`` with a leading row dimension: ``root_logprobs`` ->
(B, Vd), ``expand(parent_rows (B, n), tokens (B, n), depth)`` -> (B, n, Vd). Every row drafts the
same number of nodes per level (chains, static trees and dynamic trees of one shape all do), so
no tree padding is needed while drafting. ``accept`` takes per-row paths (their lengths differ),
``select`` drops the rows that left the batch.

* ``MedusaBatchProposer``: all heads on the B rows' last final states, one call per step.
* ``EagleBatchProposer``: the drafter's own KV cache holds B rows with the target's padding
  scheme (``decode/padding.py``): left-padded prefill, per-row position ids, a ``valid`` (B, S)
  mask of real slots, additive masks with exact zeros. Row b's drafter state is its unbatched
  state (``proposers.EagleProposer``) spread over valid slots: entry t of a row still holds
  (x_{t+1}, f_t) at position t, whatever its physical slot.
* ``DFlashBatchProposer``: one block per row from one drafter call per step; the rows' contexts
  (keys and values of the fused target features) share a padded (B, kv_heads, S, head_dim) layout
  with a ``valid`` (B, S) mask, written as the target's cache is.
* ``RowsProposer``: per-row ``Proposer``s behind the batched protocol (each row drafts alone): a
  replaced ``Speculator.new_proposer`` (test oracles), and the A/B baseline of
  ``Speculator.batched_drafting = False``.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F

from ..heads import DFlashDrafter, Eagle1Drafter, Eagle3Drafter, HeadsBase, MedusaHeads
from ..heads.dflash import ContextKV, extend_context
from ..heads.layers import DraftCache
from ..heads.metadata import calibration_temperatures
from .padding import additive, after_prefix, catch_up_visible, first_slots, prefill_mask, used_columns
from .shapes import Proposer


@runtime_checkable
class BatchProposer(Protocol):
    """``shapes.Proposer`` over B rows (module docstring)."""

    max_depth: int | None
    draft_vocab_size: int | None
    feature_layers: list[int]
    temperatures: Sequence[float] | None

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        """tokens, valid, position_ids (B, n): the left-padded prompts; features [(B, n, H)] the
        target's states there; first (B,) the target's token after each prompt (the first roots)."""
        ...

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        """Per row: path (m_b+2,) accepted path (root first) then bonus; features [(m_b+1, H)] the
        target's states at the path; start the root's position."""
        ...

    def root_logprobs(self) -> torch.Tensor: ...

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def end_tree(self) -> None: ...

    def select(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in this order)."""
        ...


class RowsProposer:
    """One ``Proposer`` per row, driven one row at a time (the unbatched drafting, for A/B and oracles)."""

    def __init__(self, rows: Sequence[Proposer]) -> None:
        self.rows = list(rows)
        first = self.rows[0]
        self.max_depth = first.max_depth
        self.draft_vocab_size = getattr(first, "draft_vocab_size", None)
        self.feature_layers = first.feature_layers
        self.temperatures = getattr(first, "temperatures", None)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        n = tokens.shape[1]
        for b, p in enumerate(self.rows):
            start = n - int(valid[b].sum())  # left padding: the row's tokens are the last ones
            p.prefill(tokens[b:b + 1, start:], [f[b:b + 1, start:] for f in features], first[b])

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        for p, path, feats, start in zip(self.rows, paths, features, starts):
            p.accept(path, feats, start)

    def root_logprobs(self) -> torch.Tensor:
        return torch.stack([p.root_logprobs() for p in self.rows])

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        return torch.stack([p.expand(parent_rows[b], tokens[b], depth) for b, p in enumerate(self.rows)])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.rows[0].to_target_ids(draft_ids)  # the heads' map: the same for every row

    def end_tree(self) -> None:
        for p in self.rows:
            p.end_tree()

    def select(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]


class MedusaBatchProposer:
    """Every head's distribution for every row from one heads call on the rows' last final states."""

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
        self.logp = self.logp[torch.tensor(list(keep), dtype=torch.long, device=self.logp.device)]


class EagleBatchProposer:
    """EAGLE-1 / EAGLE-3 over B rows: one drafter forward per catch-up and per tree level.

    State: the drafter cache (B, kv_heads, S, head_dim) with ``valid`` (B, S) real slots, and
    ``base`` (B,) each row's logical cache length (= its next root's position). Tree levels are
    appended after the S slots while drafting and cropped by ``end_tree``."""

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

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor
             ) -> torch.Tensor:
        """One drafter forward of (B, T) tokens appended to the cache; visible (B, T, S + T)."""
        d = self.drafter
        return d(tokens, hidden, pos, additive(visible, d.fc.weight.dtype), self.cache)  # (B, T, H)

    def _roots(self, out: torch.Tensor, last: torch.Tensor) -> None:
        """The output at each row's last real new slot feeds that row's depth-1 drafts."""
        rows = torch.arange(out.shape[0], device=out.device)
        self.root_out = out[rows, last][:, None]  # (B, 1, H)
        self.root_lp = F.log_softmax(self.drafter.draft_logits(self.root_out)[:, 0].float(), dim=-1)  # (B, Vd)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        d = self.drafter
        self.cache = DraftCache()
        x = torch.cat([tokens[:, 1:], first.view(-1, 1)], dim=1)  # x_{t+1} at slot t; pad slots: junk, invalid
        out = self._run(x, d.fuse(features), position_ids, prefill_mask(valid))
        self.valid, self.base = valid.clone(), valid.sum(1)  # its own: the target's mask changes apart
        self._roots(out, torch.full_like(self.base, tokens.shape[1] - 1))

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        """Row b appends m_b+1 entries (x_{t+1}, f_t), t = start_b .. start_b + m_b, padded to the
        longest row; the pad slots are invalid (gaps), as in the target's cache."""
        d = self.drafter
        dev = self.valid.device
        counts = [p.numel() - 1 for p in paths]  # path without the root, bonus included
        M = max(counts)
        tokens = torch.zeros(len(paths), M, dtype=torch.long, device=dev)
        feats = [torch.zeros(len(paths), M, f.shape[-1], dtype=f.dtype, device=dev) for f in features[0]]
        for b, (path, fs) in enumerate(zip(paths, features)):
            tokens[b, :counts[b]] = path[1:]
            for i, f in enumerate(fs):
                feats[i][b, :counts[b]] = f
        start = torch.tensor(list(starts), dtype=torch.long, device=dev)
        pos = start[:, None] + torch.arange(M, device=dev)[None]  # pad slots: harmless positions, never seen
        new_valid = first_slots(counts, dev)
        out = self._run(tokens, d.fuse(feats), pos, catch_up_visible(self.valid, new_valid))
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        c = torch.tensor(counts, dtype=torch.long, device=dev)
        self.base = start + c
        self._roots(out, c - 1)

    def root_logprobs(self) -> torch.Tensor:
        """Start a tree: depth-1 nodes read their row's root output and see no tree slots yet."""
        self.prev_out = self.root_out  # (B, rows of the last call, H)
        self.prev_vis = torch.zeros(self.root_out.shape[0], 1, 0, dtype=torch.bool, device=self.root_out.device)
        return self.root_lp

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Feed n nodes per row at ``depth`` (drafter position base + depth - 1): each reads its
        parent's output and sees its row's valid slots, its tree ancestors and itself."""
        B, n = tokens.shape
        dev = tokens.device
        rows = torch.arange(B, device=dev)[:, None]
        tree_vis = torch.cat([self.prev_vis[rows, parent_rows],  # (B, n, slots) the ancestors' slots
                              torch.eye(n, dtype=torch.bool, device=dev).expand(B, n, n)], dim=2)
        pos = (self.base + depth - 1)[:, None].expand(B, n)
        out = self._run(tokens, self.prev_out[rows, parent_rows], pos, after_prefix(self.valid, tree_vis))
        self.prev_vis, self.prev_out = tree_vis, out
        return F.log_softmax(self.drafter.draft_logits(out).float(), dim=-1)  # (B, n, Vd)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target_ids(draft_ids)

    def end_tree(self) -> None:
        self.cache.crop(self.valid.shape[1])

    def select(self, keep: Sequence[int]) -> None:
        sel = torch.tensor(list(keep), dtype=torch.long, device=self.valid.device)
        c = self.cache
        c.keys, c.values = c.keys.index_select(0, sel), c.values.index_select(0, sel)
        self.valid, self.base = self.valid[sel], self.base[sel]
        self.root_out, self.root_lp = self.root_out[sel], self.root_lp[sel]
        cols = used_columns(self.valid)  # slots only dropped rows used: the same rule as the target's cache
        if cols is not None:
            c.keys, c.values = c.keys.index_select(2, cols), c.values.index_select(2, cols)
            self.valid = self.valid[:, cols]


class DFlashBatchProposer:
    """DFlash over B rows: the context keys / values of every row in one padded layout, one block
    forward per step for all rows; depth d's distribution ignores the parent token (as Medusa's),
    unless the drafter has a path correction (one step per node, as ``DFlashProposer``)."""

    def __init__(self, drafter: DFlashDrafter, temperatures: Sequence[float] | None = None) -> None:
        self.drafter = drafter
        self.temperatures = temperatures
        self.max_depth = drafter.block_size - 1
        self.draft_vocab_size = drafter.draft_vocab_size
        self.feature_layers = list(drafter.feature_layers)
        self.context: ContextKV | None = None  # per layer (B, nkv, S, hd) keys, values
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # (B, S) real context slots
        self.base = torch.zeros(0, dtype=torch.long)  # (B,) each row's next root position
        self.roots = torch.zeros(0, dtype=torch.long)  # (B,) each row's next block anchor
        self.logp: torch.Tensor | None = None  # (B, bs - 1, Vd) (no correction)
        self.out: torch.Tensor | None = None  # (B, bs - 1, H) slot outputs (correction)
        self.slot_logits: torch.Tensor | None = None  # (B, bs - 1, Vd) slot logits before the correction
        self.state: torch.Tensor | None = None  # (B, rows of the last call, r) correction states

    def _write(self, features: list[torch.Tensor], pos: torch.Tensor, new_valid: torch.Tensor) -> None:
        d = self.drafter
        self.context = extend_context(self.context, d.context_kv(d.fuse(features), pos))
        self.valid = torch.cat([self.valid.to(new_valid.device), new_valid], dim=1)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, position_ids: torch.Tensor,
                features: list[torch.Tensor], first: torch.Tensor) -> None:
        self.context, self.valid = None, valid[:, :0]
        self._write(features, position_ids, valid.clone())
        self.base, self.roots = valid.sum(1), first.reshape(-1).clone()

    def accept(self, paths: Sequence[torch.Tensor], features: Sequence[list[torch.Tensor]],
               starts: Sequence[int]) -> None:
        """Row b's path features (m_b+1 positions from its root) join its context, padded to the longest."""
        dev = self.valid.device
        counts = [p.numel() - 1 for p in paths]  # positions whose features arrive: the path, root first
        M = max(counts)
        feats = [torch.zeros(len(paths), M, f.shape[-1], dtype=f.dtype, device=dev) for f in features[0]]
        for b, fs in enumerate(features):
            for i, f in enumerate(fs):
                feats[i][b, :counts[b]] = f
        start = torch.tensor(list(starts), dtype=torch.long, device=dev)
        self._write(feats, start[:, None] + torch.arange(M, device=dev)[None], first_slots(counts, dev))
        self.base = start + torch.tensor(counts, dtype=torch.long, device=dev)
        self.roots = torch.stack([p[-1] for p in paths])

    def root_logprobs(self) -> torch.Tensor:
        d = self.drafter
        B, bs = self.roots.shape[0], d.block_size
        x = d.block_embeddings(self.roots[:, None])  # (B, bs, H)
        pos = self.base[:, None] + torch.arange(bs, device=x.device)  # (B, bs)
        block = torch.ones(B, bs, bs, dtype=torch.bool, device=x.device)
        mask = additive(after_prefix(self.valid, block), d.fc.weight.dtype)  # (B, 1, bs, S + bs)
        out = d(x, pos, self.context, mask)[:, 1:]  # (B, bs - 1, H)
        if not d.has_correction:
            self.logp = F.log_softmax(d.logits(out).float(), dim=-1)
            return self.logp[:, 0]
        self.out, self.slot_logits = out, d.logits(out)  # (B, bs - 1, H), (B, bs - 1, Vd)
        return self._corrected(None, self.roots[:, None], 0)[:, 0]

    def _corrected(self, state: torch.Tensor | None, parents: torch.Tensor, slot: int) -> torch.Tensor:
        """Slot ``slot`` after parents (B, n) target ids with states (B, n, r) -> (B, n, Vd)."""
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
        sel = torch.tensor(list(keep), dtype=torch.long, device=self.valid.device)
        self.valid, self.base, self.roots = self.valid[sel], self.base[sel], self.roots[sel]
        self.context = [(k[sel], v[sel]) for k, v in self.context]
        cols = used_columns(self.valid)  # slots only dropped rows used
        if cols is not None:
            self.valid = self.valid[:, cols]
            self.context = [(k[:, :, cols], v[:, :, cols]) for k, v in self.context]


def make_batch_proposer(heads: HeadsBase, max_depth: int | None = None, calibrate: bool = True) -> BatchProposer:
    """The heads' batched proposer, with the calibration temperatures ``make_proposer`` would give."""
    temps = calibration_temperatures(heads.metadata) if calibrate else None
    if isinstance(heads, MedusaHeads):
        return MedusaBatchProposer(heads, temps)
    if isinstance(heads, (Eagle1Drafter, Eagle3Drafter)):
        return EagleBatchProposer(heads, max_depth, temps)
    if isinstance(heads, DFlashDrafter):
        return DFlashBatchProposer(heads, temps)
    raise TypeError(f"no batched proposer for {type(heads).__name__}")
