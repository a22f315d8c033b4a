"""Proposers: the draft side of a decode step, one per head kind.

Each proposer is told what the target accepted (tokens and the target's hidden states at those
positions) and then answers the tree builder's questions (``root_logprobs``, ``expand``): the
``Proposer`` protocol of ``shapes.py``, which every class here satisfies.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F

from ..heads import DFlashDrafter, Eagle1Drafter, Eagle3Drafter, HeadsBase, MedusaHeads
from ..heads.dflash import ContextKV, extend_context
from ..heads.layers import DraftCache, causal_mask
from ..heads.metadata import calibration_temperatures
from .shapes import Proposer


def hidden_index(layer: int, num_layers: int) -> int:
    """HF hidden-state index; -1 means the final post-norm state (index L)."""
    return num_layers if layer == -1 else layer


class MedusaProposer:
    """Head k's top-k at depth k+1, independent of the parent token: drafting costs one call.
    Log-probs are over the heads' draft vocabulary (Vd; the full V without one)."""

    def __init__(self, heads: MedusaHeads, temperatures: Sequence[float] | None = None) -> None:
        self.heads = heads
        self.temperatures = temperatures  # calibration by depth (head k = depth k+1): shapes.py applies it
        self.max_depth = heads.config.num_heads
        self.draft_vocab_size = heads.draft_vocab_size
        self.feature_layers = [-1]
        self.logp: torch.Tensor | None = None  # (K, Vd)

    def _set(self, final_hidden: torch.Tensor) -> None:
        w = next(self.heads.parameters())
        self.logp = F.log_softmax(self.heads(final_hidden.to(w.dtype)).float(), dim=-1)  # (K, V)

    def prefill(self, input_ids: torch.Tensor, features: list[torch.Tensor], first_token: torch.Tensor) -> None:
        self._set(features[0][0, -1])  # (H,) final state at the last prompt position

    def accept(self, tokens: torch.Tensor, features: list[torch.Tensor], start: int) -> None:
        """tokens (m+2,): accepted path (root first) then bonus; features (m+1, H) at the path."""
        self._set(features[0][-1])

    def root_logprobs(self) -> torch.Tensor:
        return self.logp[0]

    def end_tree(self) -> None:
        pass

    def fork(self) -> MedusaProposer:
        return copy.copy(self)  # state is replaced, never mutated in place

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        return self.logp[depth].expand(tokens.numel(), -1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.heads.to_target_ids(draft_ids)


class EagleProposer:
    """EAGLE-1 / EAGLE-3: the drafter runs autoregressively over the tree with its own KV cache.

    The cache holds one entry per target position whose true features are known: entry t is
    (x_{t+1}, f_t). Tree nodes are appended while drafting and cropped away afterwards; the next
    step's catch-up feeds the accepted positions with the target's real features. Log-probs are
    over the drafter's draft vocabulary (``draft_logits``, whatever the module's train/eval mode).
    """

    def __init__(self, drafter: Eagle1Drafter | Eagle3Drafter, max_depth: int | None = None,
                 temperatures: Sequence[float] | None = None) -> None:
        self.drafter = drafter
        self.max_depth = max_depth
        self.temperatures = temperatures  # calibration by depth: shapes.py ranks dynamic trees with it
        self.draft_vocab_size = drafter.draft_vocab_size
        self.feature_layers = list(drafter.feature_layers)
        self.cache = DraftCache()
        self.base = 0  # cache length before the tree = position of the tree root

    def _catch_up(self, tokens: torch.Tensor, features: list[torch.Tensor], start: int) -> None:
        """tokens (1, m) = x_{t+1}, features [(1, m, H)] = f_t for t = start .. start+m-1."""
        self.cache.crop(start)
        d = self.drafter
        m = tokens.shape[1]
        dtype = d.fc.weight.dtype
        pos = torch.arange(start, start + m, device=tokens.device)[None]
        mask = causal_mask(m, start, dtype, tokens.device) if m > 1 else None  # one query sees all
        out = d(tokens, d.fuse(features), pos, mask, self.cache)
        self.base = start + m
        self.root_out = out[0, -1:]  # (1, H): the root's output feeds the depth-1 nodes
        self.root_lp = F.log_softmax(d.draft_logits(out[:, -1:])[0, 0].float(), dim=-1)  # (Vd,)

    def prefill(self, input_ids: torch.Tensor, features: list[torch.Tensor], first_token: torch.Tensor) -> None:
        self.cache = DraftCache()
        tokens = torch.cat([input_ids[:, 1:], first_token.view(1, 1)], dim=1)  # x_{t+1} for t = 0..n-1
        self._catch_up(tokens, features, 0)

    def accept(self, tokens: torch.Tensor, features: list[torch.Tensor], start: int) -> None:
        """tokens (m+2,): accepted path (root first) then bonus; features [(m+1, H)] at the path's
        positions start .. start+m (``start`` = root position)."""
        self._catch_up(tokens[1:][None], [f[None] for f in features], start)

    def root_logprobs(self) -> torch.Tensor:
        """Start a tree: depth-1 nodes read the root's output and see no tree slots yet."""
        self.prev_out = self.root_out
        self.prev_vis = torch.zeros(1, 0, dtype=torch.bool, device=self.root_out.device)  # (rows, tree slots)
        self.prev_full = True  # every row of prev_vis is all True (a chain so far): no mask needed
        return self.root_lp

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        """Feed n nodes at ``depth`` (drafter position base + depth - 1): each reads its parent's
        output and attends to the cached prefix, its tree ancestors and itself."""
        d = self.drafter
        n = tokens.numel()
        dev = tokens.device
        slots = self.prev_vis.shape[1]
        vis_tree = self.prev_vis[parent_rows]  # (n, slots) ancestors among earlier tree nodes
        vis = torch.cat([vis_tree, torch.eye(n, dtype=torch.bool, device=dev)], dim=1)  # (n, slots + n)
        # A lone node below a chain sees the whole cache: skip building the mask (chains, static
        # trees' narrow levels). Decided from shapes alone, so no device sync.
        full = self.prev_full and n == 1
        mask = None
        if not full:
            dtype = d.fc.weight.dtype
            mask = torch.zeros(n, self.base + slots + n, dtype=dtype, device=dev)
            mask[:, self.base:].masked_fill_(~vis, torch.finfo(dtype).min)
            mask = mask[None, None]
        pos = torch.full((1, n), self.base + depth - 1, dtype=torch.long, device=dev)
        hidden = self.prev_out[parent_rows][None]  # (1, n, H)
        out = d(tokens[None], hidden, pos, mask, self.cache)[0]  # (n, H)
        self.prev_vis, self.prev_out, self.prev_full = vis, out, full  # rows of the next call: ancestors now include these slots
        return F.log_softmax(d.draft_logits(out[None])[0].float(), dim=-1)  # (n, Vd)

    def end_tree(self) -> None:
        self.cache.crop(self.base)

    def fork(self) -> EagleProposer:
        twin = copy.copy(self)
        twin.cache = copy.copy(self.cache)  # append/crop rebuild tensors, never write into them
        return twin

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target_ids(draft_ids)


class DFlashProposer:
    """A DFlash block drafter: one drafter call per step drafts every depth at once.

    The drafter keeps the keys and values of the fused target features at every position whose
    features the target has given (0 .. root - 1); a step's block is [root, mask, ...] at the root's
    position and after. Like Medusa, depth d's distribution does not depend on the parent token, so
    chains, static (top-k per depth) and dynamic trees all read the same (block_size - 1, Vd) block.
    A drafter with a path correction adds, per tree node, one correction step on its parent's state
    and the parent's token: depth d's distribution then depends on the path above it."""

    def __init__(self, drafter: DFlashDrafter, temperatures: Sequence[float] | None = None) -> None:
        self.drafter = drafter
        self.temperatures = temperatures  # calibration by depth: shapes.py ranks dynamic trees with it
        self.max_depth = drafter.block_size - 1
        self.draft_vocab_size = drafter.draft_vocab_size
        self.feature_layers = list(drafter.feature_layers)
        self.context: ContextKV | None = None
        self.length = 0  # positions in the context: the next root's position
        self.root: torch.Tensor | None = None  # (1,) the next block's anchor
        self.logp: torch.Tensor | None = None  # (block_size - 1, Vd) of the current tree (no correction)
        self.out: torch.Tensor | None = None  # (block_size - 1, H) slot outputs (correction)
        self.slot_logits: torch.Tensor | None = None  # (block_size - 1, Vd) slot logits before the correction
        self.state: torch.Tensor | None = None  # (rows of the last call, r) correction states

    def _extend(self, features: list[torch.Tensor], start: int) -> None:
        """features [(1, m, H)] at positions start .. start + m - 1 join the context."""
        d = self.drafter
        if start != self.length:
            raise RuntimeError(f"DFlash context holds {self.length} positions; features start at {start}")
        m = features[0].shape[1]
        pos = torch.arange(start, start + m, device=features[0].device)[None]  # (1, m)
        self.context = extend_context(self.context, d.context_kv(d.fuse(features), pos))
        self.length = start + m

    def prefill(self, input_ids: torch.Tensor, features: list[torch.Tensor], first_token: torch.Tensor) -> None:
        self.context, self.length = None, 0
        self._extend(features, 0)
        self.root = first_token.reshape(1)

    def accept(self, tokens: torch.Tensor, features: list[torch.Tensor], start: int) -> None:
        """tokens (m+2,): accepted path (root first) then bonus; features [(m+1, H)] at the path."""
        self._extend([f[None] for f in features], start)
        self.root = tokens[-1:]

    def root_logprobs(self) -> torch.Tensor:
        d = self.drafter
        pos = torch.tensor([self.length], device=self.root.device)
        out = d.block_outputs(self.root, pos, self.context)[0]  # (bs - 1, H)
        if not d.has_correction:
            self.logp = F.log_softmax(d.logits(out).float(), dim=-1)  # (bs - 1, Vd)
            return self.logp[0]
        self.out, self.slot_logits = out, d.logits(out)  # (bs - 1, H), (bs - 1, Vd)
        return self._corrected(None, self.root, 0)[0]

    def _corrected(self, state: torch.Tensor | None, parents: torch.Tensor, slot: int) -> torch.Tensor:
        """Slot ``slot`` (0-based: depth slot + 1) after n parents (target ids) with states (n, r) -> (n, Vd)."""
        d, n = self.drafter, parents.numel()
        self.state = d.correction_step(state, parents, self.out[slot].expand(n, -1))  # (n, r)
        return F.log_softmax((self.slot_logits[slot] + d.correction.out(self.state)).float(), dim=-1)

    def expand(self, parent_rows: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
        if self.drafter.has_correction:
            return self._corrected(self.state[parent_rows], tokens, depth)
        return self.logp[depth].expand(tokens.numel(), -1)

    def end_tree(self) -> None:
        pass

    def fork(self) -> DFlashProposer:
        twin = copy.copy(self)  # state / out / slot_logits are replaced each tree, never written in place
        twin.context = None if self.context is None else list(self.context)  # extended by new lists only
        return twin

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target_ids(draft_ids)


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
