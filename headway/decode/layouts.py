"""The target cache of a decoding batch and what each step keeps of it (``decode/step.py``).

Two layouts, one interface (``prefill``, ``tree_inputs``, ``keep``, ``select``; a plain step:
``plain_inputs``, ``keep_plain``):

* ``OneRow``: one prompt. The cache is a plain ``DynamicCache`` or a preallocated ``StaticCache``;
  the tree's mask is ``kv.tree_mask`` and the accepted nodes move into place with
  ``kv.keep_accepted``. No padding, so prefill runs without a mask, exactly as HF ``generate``.
* ``PaddedRows``: B prompts in one ``DynamicCache`` of B rows and one physical length S; which
  slots belong to a row is a bool ``valid`` (B, S), and every slot carries the KV the row's own
  unbatched decode would hold at that logical position (RoPE is applied with the row's own
  position ids when the slot is written, so a slot's physical place does not matter):
  - prefill: prompts left-padded; pad slots invalid; position ids count a row's valid tokens;
  - each step: row b's tree (N_b nodes) padded to N = max N_b; pad nodes see only themselves and
    are never read. One forward with a float (B, 1, N, S + N) mask: node i of row b sees the row's
    valid slots and its own ancestors;
  - keep: row b's accepted nodes (m_b, root first) move to the first m_b tree slots; the cache
    keeps max m_b tree slots; slots past m_b in row b become gaps (invalid);
  - select: rows that stopped leave (their cache row is dropped, and slot columns no remaining
    row uses are dropped with them).
  Masked slots get weight exactly 0 (additive ``finfo.min``), so each row's logits equal its
  unbatched ones up to float rounding.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import Cache

from .kv import drop_last, keep_accepted, new_cache, static_length, tree_mask
from .padding import additive, after_prefix, first_slots, left_pad, pad_rows, prefill_mask, used_columns
from .trees import DraftTree


class OneRow:
    """One prompt's cache (dynamic or static)."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def prefill(self, runtime: Any, ids: Sequence[list[int]], pad: int
                ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (the forward's output, tokens, valid, position ids (1, n))."""
        tokens = torch.tensor([list(ids[0])], dtype=torch.long, device=runtime.device)
        out = runtime.forward(tokens, self.cache, **runtime.last_logits_only())
        n = tokens.shape[1]
        return out, tokens, torch.ones_like(tokens, dtype=torch.bool), torch.arange(n, device=tokens.device)[None]

    def tree_inputs(self, trees: Sequence[DraftTree], lengths: Sequence[int], pad: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (tokens (1, N), position ids (1, N), additive mask (1, 1, N, kv))."""
        b, P = trees[0].buffers, lengths[0]
        return (trees[0].tokens[None], (b.depth + P)[None],
                tree_mask(b.visible, P, dtype, static_length(self.cache)))

    def plain_inputs(self, roots: torch.Tensor, lengths: Sequence[int], dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A plain step's (tokens (1, 1), position ids (1, 1), mask): no mask over a dynamic cache (the
        token sees all of it, as in HF generate); a static one hides the slots past it."""
        static = static_length(self.cache)
        mask = None if static is None else \
            tree_mask(torch.ones(1, 1, dtype=torch.bool, device=roots.device), lengths[0], dtype, static)
        return roots.view(1, 1), torch.tensor([[lengths[0]]], device=roots.device), mask

    def keep(self, nodes: Sequence[torch.Tensor], moved: Sequence[bool], lengths: Sequence[int], width: int) -> None:
        """Row 0's accepted ``nodes`` (root first) into place (``moved``: they leave the first tree slots)."""
        keep_accepted(self.cache, lengths[0], width, nodes[0], moved[0])

    def keep_plain(self) -> None:
        pass  # the one new entry is already in place

    def select(self, keep: Sequence[int]) -> None:
        pass  # the only row stops: the generation ends with it

    def fork(self) -> "OneRow":
        import copy

        return OneRow(copy.deepcopy(self.cache))


class PaddedRows:
    """B prompts' cache with a ``valid`` (B, S) mask of real slots (module docstring)."""

    def __init__(self, config: Any) -> None:
        self.cache = new_cache(config)  # full layers: sliding-window ones would drop the entries keep() moves
        self.valid: torch.Tensor | None = None

    def prefill(self, runtime: Any, ids: Sequence[list[int]], pad: int
                ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, valid, pos = left_pad(ids, pad, runtime.device)  # (B, n) each
        self.valid = valid
        # left-padded: the last column is every row's last token
        out = runtime.forward(tokens, self.cache, position_ids=pos,
                              attention_mask=additive(prefill_mask(valid), runtime.dtype), **runtime.last_logits_only())
        return out, tokens, valid, pos

    def tree_inputs(self, trees: Sequence[DraftTree], lengths: Sequence[int], pad: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, pos, vis = pad_trees(trees, lengths, pad)  # (B, N), (B, N), (B, N, N)
        return tokens, pos, additive(after_prefix(self.valid, vis), dtype)

    def plain_inputs(self, roots: torch.Tensor, lengths: Sequence[int], dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A plain step's (tokens (B, 1), position ids (B, 1), mask (B, 1, 1, S + 1)): each row's
        token sees the row's valid slots and itself."""
        seen = torch.cat([self.valid, torch.ones_like(self.valid[:, :1])], dim=1)  # (B, S + 1)
        pos = torch.tensor(list(lengths), device=roots.device)[:, None]
        return roots[:, None], pos, additive(seen[:, None], dtype)

    def keep_plain(self) -> None:
        """The new slot is each row's one entry of the step: valid for every row."""
        self.valid = torch.cat([self.valid, torch.ones_like(self.valid[:, :1])], dim=1)

    def keep(self, nodes: Sequence[torch.Tensor], moved: Sequence[bool], lengths: Sequence[int], width: int) -> None:
        """The cache holds S slots + ``width`` tree slots per row: move row b's accepted ``nodes`` (root
        first) to its first m_b tree slots (``moved``: row b's leave them), keep max m_b tree slots,
        and mark row b's slots past m_b as gaps."""
        S = self.valid.shape[1]
        counts = [n.numel() for n in nodes]
        M = max(counts)
        if any(moved):  # chains never move
            idx = pad_rows(nodes)  # (B, M) tree slot to keep (a pad: slot 0, a gap after the move)
            for layer in self.cache.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name)  # (B, H, S + N, D)
                    src = idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]) + S
                    t[:, :, S:S + M] = t.gather(2, src)  # gather copies first: overlapping slots are safe
        if width > M:
            drop_last(self.cache, width - M)
        self.valid = torch.cat([self.valid, first_slots(counts, self.valid.device)], dim=1)

    def select(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep``, then drop slot columns no remaining row uses."""
        if len(keep) == self.valid.shape[0]:
            return
        sel = torch.tensor(list(keep), dtype=torch.long, device=self.valid.device)
        self.cache.batch_select_indices(sel)
        self.valid = self.valid[sel]
        cols = used_columns(self.valid)
        if cols is not None:
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(2, cols)
                layer.values = layer.values.index_select(2, cols)
            self.valid = self.valid[:, cols]


def pad_trees(trees: Sequence[DraftTree], lengths: Sequence[int], pad: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row trees -> (tokens (B, N), position_ids (B, N), visible (B, N, N)) padded to the largest;
    a pad node sits at its row's root position and sees only itself."""
    N = max(t.tokens.numel() for t in trees)
    dev = trees[0].tokens.device
    B = len(trees)
    tokens = torch.full((B, N), pad, dtype=torch.long, device=dev)
    pos = torch.tensor(list(lengths), dtype=torch.long, device=dev)[:, None].repeat(1, N)
    vis = torch.eye(N, dtype=torch.bool, device=dev).repeat(B, 1, 1)
    for b, t in enumerate(trees):
        n = t.tokens.numel()
        tokens[b, :n] = t.tokens
        pos[b, :n] += t.buffers.depth
        vis[b, :n, :n] = t.buffers.visible
    return tokens, pos, vis
