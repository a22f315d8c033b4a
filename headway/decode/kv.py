"""The target's KV cache: which cache a generation uses, a step's inputs over it, and what a step
keeps of it (``decode/step.py``). Dynamic and static caches share one commit/rollback rule: the
verify forward writes every tree node's KV after the prefix, then ``keep_accepted`` moves the
accepted entries into place and rolls the length back (``crop``; a static cache only moves its
length, the stale rows are overwritten by the next write and hidden by the mask until then).

Two layouts, one interface (``prefill``, ``tree_inputs``, ``keep``, ``select``; a plain step:
``plain_inputs``, ``keep_plain``):

* ``OneRow``: one prompt. The cache is a plain ``DynamicCache`` or a preallocated ``StaticCache``;
  the tree's mask is ``tree.tree_mask`` and the accepted nodes move into place with
  ``keep_accepted``. No padding, so prefill runs without a mask, exactly as HF ``generate``.
* ``PaddedRows``: B prompts in one ``DynamicCache`` of B rows and one physical length S; which
  slots belong to a row is a bool ``valid`` (B, S), and every slot carries the KV the row's own
  unbatched decode would hold at that logical position (RoPE is applied with the row's own
  position ids when the slot is written, so a slot's physical place does not matter):
  - prefill: prompts left-padded; pad slots invalid; position ids count a row's valid tokens;
  - each step: row b's tree (N_b nodes) padded to N = max N_b; pad nodes see only themselves and
    are never read. One forward with a float (B, 1, N, S + N) mask: node i of row b sees the row's
    valid slots and its own ancestors (``decode/padding.py``: the masks of padded rows);
  - keep: row b's accepted nodes (m_b, root first) move to the first m_b tree slots; the cache
    keeps max m_b tree slots; slots past m_b in row b become gaps (invalid);
  - select: rows that stopped leave (their cache row is dropped, and slot columns no remaining
    row uses are dropped with them).
  Masked slots get weight exactly 0 (additive ``finfo.min``), so each row's logits equal its
  unbatched ones up to float rounding.

Sliding-window layers (Mistral, Mixtral, Gemma 2/3) keep every entry too: transformers' sliding
cache layers drop all but the last ``window`` entries, which the keep-accepted moves cannot follow,
and transformers takes a 4-D mask as it is, window or not. So the cache is a full one for every
layer, and ``layer_masks`` gives the sliding layers the decoder's mask cut to the window."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from transformers import Cache, DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from .args import DecodeError
from .padding import additive, after_prefix, first_slots, keep_rows, left_pad, pad_rows, prefill_mask
from .tree import tree_mask
from .trees import DraftTree

FULL, SLIDING = "full_attention", "sliding_attention"


def new_cache(config: Any, max_len: int | None = None) -> Cache:
    """A fresh target cache, every layer holding the whole sequence: dynamic (grows with the
    sequence), or with ``max_len`` a transformers ``StaticCache`` of that many positions (fixed
    shapes: what torch.compile and CUDA graphs want). A layer type other than full or
    sliding-window attention (chunked, linear or compressed attention) is refused."""
    types = getattr(config, "layer_types", None) or []
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        name = getattr(config, "model_type", "this target")
        raise DecodeError(f"{name} has {', '.join(other)} layers, whose cache the tree decoder cannot roll back; "
                          f"it verifies targets of full and sliding-window attention layers")
    if max_len is None:
        cache: Cache = DynamicCache(config=config)
        whole: Callable[[], Any] = DynamicLayer
    else:
        cache = StaticCache(config=config, max_cache_len=int(max_len))
        whole = functools.partial(StaticLayer, max_cache_len=int(max_len))
    # a sliding layer (still empty: layers allocate on first write) becomes a full one; the model keeps its window
    cache.layers = [whole() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Additive (B, 1, q, k) mask -> each query sees only the last ``window`` of its visible keys.
    A query's visible keys are its own history, one per logical position in order (prefix or row
    slots, then tree ancestors, then itself), so these are the positions p with q_pos - p < window:
    transformers' sliding window (``sliding_window_overlay``)."""
    visible = mask == 0
    from_end = visible.flip(-1).cumsum(-1).flip(-1)  # (B, 1, q, k): visible keys at or after each key
    return mask.masked_fill(visible & (from_end > window), torch.finfo(mask.dtype).min)


def layer_masks(config: Any, mask: torch.Tensor | None) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """The ``attention_mask`` a target forward takes for the decoder's 4-D ``mask``: as it is without
    sliding-window layers; cut to the window when every layer slides (one mask, as Mistral takes it);
    else transformers' per-layer-type mapping {full_attention: mask, sliding_attention: cut}."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or []
    if mask is None or window is None or (types and SLIDING not in types):
        return mask
    cut = window_mask(mask, int(window))
    return cut if not types or set(types) == {SLIDING} else {FULL: mask, SLIDING: cut}


def static_length(cache: Cache) -> int | None:
    """The preallocated length of a static cache; None for a dynamic one."""
    if isinstance(cache, StaticCache):
        return int(cache.layers[0].max_cache_len)
    return None


def in_place(nodes: Sequence[int] | torch.Tensor) -> bool:
    """Accepted ``nodes`` 0, 1, .., m: already the first tree slots (every chain's path, and a tree's
    when nothing past the root or only first children were accepted), so nothing needs to move.
    A tensor is read to the host; the decoder passes the nodes it has read already."""
    nodes = nodes.tolist() if isinstance(nodes, torch.Tensor) else list(nodes)
    return nodes == list(range(len(nodes)))


def keep_accepted(cache: Cache, prefix_len: int, tree_size: int, nodes: torch.Tensor,
                  moved: bool | None = None) -> None:
    """The cache holds prefix + all ``tree_size`` tree nodes; keep the accepted ``nodes`` (sorted,
    root first) at contiguous positions ``prefix_len ..`` and crop the rest. ``moved``: whether the
    nodes leave the first tree slots (``not in_place(nodes)``; None: read them to find out)."""
    n = nodes.numel()
    if moved if moved is not None else not in_place(nodes):  # chains never move
        for layer in cache.layers:
            src = nodes.to(layer.keys.device) + prefix_len  # under a device_map each layer has its own device
            # advanced indexing copies first, so overlapping source/destination is safe; in place, so a
            # static cache keeps its (compile-visible) storage
            layer.keys[..., prefix_len:prefix_len + n, :] = layer.keys[..., src, :]
            layer.values[..., prefix_len:prefix_len + n, :] = layer.values[..., src, :]
    if tree_size > n:
        drop_last(cache, tree_size - n)


def drop_last(cache: Cache, count: int) -> None:
    """Remove the last ``count`` entries of every layer: ``Cache.crop(-count)``. Static layers of
    releases before ~5.2x have no ``crop``; theirs is the same move, the length counter stepped back
    in place (a compiled graph holds its address), the stale rows overwritten by the next write."""
    if count <= 0:
        return
    for layer in cache.layers:  # what Cache.crop does, layer by layer
        if hasattr(layer, "crop"):
            layer.crop(-count)
        else:
            layer.cumulative_length.sub_(count)


class OneRow:
    """One prompt's cache (dynamic or static)."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def prefill(self, runtime: Any, ids: Sequence[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (the forward's output, tokens, valid, position ids (1, n))."""
        tokens = torch.tensor([list(ids[0])], dtype=torch.long, device=runtime.device)
        out = runtime.forward(tokens, self.cache, **runtime.last_logits_only())
        n = tokens.shape[1]
        return out, tokens, torch.ones_like(tokens, dtype=torch.bool), torch.arange(n, device=tokens.device)[None]

    def tree_inputs(self, trees: Sequence[DraftTree], lengths: Sequence[int], dtype: torch.dtype
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

    def prefill(self, runtime: Any, ids: Sequence[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, valid, pos = left_pad(ids, 0, runtime.device)  # (B, n) each; a pad slot is hidden: any id serves
        self.valid = valid
        # left-padded: the last column is every row's last token
        out = runtime.forward(tokens, self.cache, position_ids=pos,
                              attention_mask=additive(prefill_mask(valid), runtime.dtype), **runtime.last_logits_only())
        return out, tokens, valid, pos

    def tree_inputs(self, trees: Sequence[DraftTree], lengths: Sequence[int], dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, pos, vis = pad_trees(trees, lengths)  # (B, N), (B, N), (B, N, N)
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
        """Keep only rows ``keep``, then drop slot columns no remaining row uses (``keep_rows``)."""
        if len(keep) == self.valid.shape[0]:
            return
        _, self.valid, take = keep_rows(self.valid, keep)
        for layer in self.cache.layers:
            layer.keys, layer.values = take(layer.keys), take(layer.values)


def pad_trees(trees: Sequence[DraftTree], lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row trees -> (tokens (B, N), position_ids (B, N), visible (B, N, N)) padded to the largest;
    a pad node (token 0: no other query sees it) sits at its row's root position and sees only itself."""
    tokens = pad_rows([t.tokens for t in trees])  # (B, N)
    pos = torch.tensor(list(lengths), device=tokens.device)[:, None] + pad_rows([t.buffers.depth for t in trees])
    vis = torch.eye(tokens.shape[1], dtype=torch.bool, device=tokens.device).repeat(len(trees), 1, 1)
    for b, t in enumerate(trees):
        n = t.buffers.size
        vis[b, :n, :n] = t.buffers.visible
    return tokens, pos, vis
