"""Row padding for batched decoding: pure functions of bool ``valid`` masks and per-row lengths.

A batch's KV cache (the target's, and an EAGLE drafter's) has one physical length S for all rows;
``valid`` (B, S) says which slots hold a row's real entries (left padding, and the gaps rejected
drafts leave). A query of row b sees exactly the slots its unbatched run would have, so every
visibility here is "the row's valid slots" plus the new tokens' own structure (causal, or tree
ancestors), turned into a float additive mask with exact zeros (``additive``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (B, q, kv) -> float additive (B, 1, q, kv): 0 visible, dtype min hidden (a hidden key gets
    weight exactly 0 after the softmax, so padding changes nothing a row computes)."""
    out = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return out.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def left_pad(ids: Sequence[list[int]], pad: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens (B, n), valid (B, n) bool, position_ids (B, n)) of left-padded prompts."""
    n = max(map(len, ids))
    tokens = torch.full((len(ids), n), pad, dtype=torch.long, device=device)
    valid = torch.zeros(len(ids), n, dtype=torch.bool, device=device)
    for b, row in enumerate(ids):
        tokens[b, n - len(row):] = torch.tensor(row, dtype=torch.long, device=device)
        valid[b, n - len(row):] = True
    return tokens, valid, (valid.long().cumsum(1) - 1).clamp(min=0)


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """(B, n) valid -> bool (B, n, n): causal over valid slots; a pad query sees only itself."""
    n = valid.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
    return (causal[None] & valid[:, None, :]) | torch.eye(n, dtype=torch.bool, device=valid.device)[None]


def after_prefix(valid: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """valid (B, S) cached slots, new (B, q, q') visibility among the tokens being written ->
    bool (B, q, S + q'): each query sees its row's valid cached slots, then ``new``."""
    return torch.cat([valid[:, None, :].expand(-1, new.shape[1], -1), new], dim=2)


def catch_up_visible(valid: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
    """A padded causal write: row b appends ``new_valid[b].sum()`` real tokens (the first ones) and
    pads up to M. -> bool (B, M, S + M): the row's valid slots, causal over its real new tokens;
    a pad query also sees itself, so no softmax row is empty."""
    return after_prefix(valid, prefill_mask(new_valid))  # prefill_mask: causal over valid, pads see themselves


def with_mask_queries(visible: torch.Tensor, seen: torch.Tensor, n: int) -> torch.Tensor:
    """visible (B, M, S + M) of M real queries, seen (B, S + M) the row's valid slots once they are
    written -> bool (B, M + n, S + M + n): ``n`` mask queries (a parallel draft's placeholders) after
    them, each seeing its row's valid slots and the mask queries up to itself; no real query sees one."""
    B, M, _ = visible.shape
    causal = torch.ones(n, n, dtype=torch.bool, device=visible.device).tril().expand(B, n, n)
    top = torch.cat([visible, visible.new_zeros(B, M, n)], dim=2)
    bottom = torch.cat([seen[:, None, :].expand(-1, n, -1), causal], dim=2)
    return torch.cat([top, bottom], dim=1)


def first_slots(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """(B, max count) bool: row b's first ``counts[b]`` slots (the real ones of a padded write)."""
    c = torch.tensor(list(counts), dtype=torch.long, device=device)
    return torch.arange(max(counts), device=device)[None] < c[:, None]


def pad_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-row (m_b, ...) tensors -> (B, max m_b, ...), zeros after each row's own (the pad slots of
    a padded write, ``first_slots``). A batch of one is its row."""
    if len(rows) == 1:
        return rows[0][None]
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)


def used_columns(valid: torch.Tensor) -> torch.Tensor | None:
    """The slot columns some row still uses (sorted), or None when every column is used."""
    used = valid.any(0)
    return None if bool(used.all()) else used.nonzero().squeeze(1)


def keep_rows(valid: torch.Tensor, keep: Sequence[int]
              ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Rows ``keep`` of a padded cache, in this order, then only the slot columns some of them use
    (``used_columns``) -> (the row index (B',), their ``valid``, and what does the same to a cache
    tensor (B, heads, S, head_dim))."""
    sel = torch.tensor(list(keep), dtype=torch.long, device=valid.device)
    valid = valid[sel]
    cols = used_columns(valid)

    def take(t: torch.Tensor) -> torch.Tensor:
        t = t.index_select(0, sel)
        return t if cols is None else t.index_select(2, cols)
    return sel, (valid if cols is None else valid[:, cols]), take
