"""DFlash training blocks as pure functions: where blocks start, which draws pick them, what each
block's queries may see, and every block of a batch drafted in one call (``train/dflash.py`` builds
the loss and evaluation on them; calibration reads ``block_predictions``).

Block j of a row starts at anchor a_j: slots 0 .. bs-1 sit at positions a_j .. a_j+bs-1, slot 0
holds the anchor's own token and slots 1.. the mask token; slot k predicts the token at a_j + k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..heads import DFlashDrafter
from .ttt import decoder_step_starts, noise_seed, shift_left


def anchor_candidates(loss_mask: Tensor, block_size: int, whole: bool = False) -> Tensor:
    """(B, T) bool: where a block may start. An answer token followed by an answer token; with
    ``whole``, by block_size - 1 of them (evaluation: every draft of the block has a label)."""
    m = loss_mask.bool()
    ok = m & shift_left(m, 1, False)
    if whole:
        for k in range(2, block_size):
            ok &= shift_left(m, k, False)
    return ok


def select_anchors(candidates: Tensor, n: int, scores: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The ``n`` best-scoring ``candidates`` (B, T) of each row -> (anchors (B, n') long, valid (B, n')
    bool), n' = min(n, T), sorted by position; rows with fewer candidates are padded with invalid
    anchors at position 0. ``scores`` (B, T): uniform draws give a uniform sample; None takes the
    earliest candidates."""
    B, T = candidates.shape
    n = min(n, T)
    if scores is None:  # earliest first: a score falling with the position
        scores = -torch.arange(T, dtype=torch.float32, device=candidates.device).expand(B, T)
    top = scores.masked_fill(~candidates, -math.inf).topk(n, dim=1)
    valid = torch.isfinite(top.values)  # (B, n)
    anchors = torch.where(valid, top.indices, torch.zeros_like(top.indices))
    order = anchors.masked_fill(~valid, T).argsort(dim=1)  # valid anchors first, by position
    return anchors.gather(1, order), valid.gather(1, order)


def row_draws(input_ids: Tensor, attention_mask: Tensor, seed: int, step: int) -> Tensor:
    """(B, T) uniform draws, row b's a pure function of (seed, step, its own tokens): a row gets the
    same anchors in any batch, on any number of processes, and after a resume."""
    out = torch.empty(input_ids.shape, dtype=torch.float32)
    for b in range(input_ids.shape[0]):
        row = input_ids[b][attention_mask[b].bool()]
        g = torch.Generator().manual_seed(noise_seed(seed, step, row))
        out[b] = torch.rand(input_ids.shape[1], generator=g)
    return out.to(input_ids.device)


def block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """anchors (B, n) -> (B, n * bs): the positions of every block's slots."""
    B, n = anchors.shape
    return (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).reshape(B, n * block_size)


def block_mask(anchors: Tensor, T: int, block_size: int, dtype: torch.dtype) -> Tensor:
    """Float additive (B, 1, n*bs, T + n*bs): block j's queries see context positions < anchor j
    and every slot of block j (bidirectional), nothing else."""
    B, n = anchors.shape
    Q = n * block_size
    dev = anchors.device
    owner = torch.arange(Q, device=dev) // block_size  # (Q,) the block each query belongs to
    ctx = torch.arange(T, device=dev)[None, None] < anchors.repeat_interleave(block_size, dim=1)[:, :, None]  # (B, Q, T)
    own = (owner[:, None] == owner[None, :]).expand(B, Q, Q)  # (B, Q, Q)
    visible = torch.cat([ctx, own], dim=2)
    return torch.zeros(B, 1, Q, T + Q, dtype=dtype, device=dev).masked_fill(~visible[:, None], torch.finfo(dtype).min)


def draft_blocks(drafter: DFlashDrafter, input_ids: Tensor, context: Tensor, anchors: Tensor) -> Tensor:
    """Every block of every row in one call: input_ids (B, T), context (B, T, H) = drafter.fuse(...),
    anchors (B, n) -> drafter outputs (B, n, bs, H) (slot 0 is the anchor's own, never scored)."""
    B, T = input_ids.shape
    bs = drafter.block_size
    ctx = drafter.context_kv(context, torch.arange(T, device=input_ids.device)[None])
    x = drafter.block_embeddings(input_ids.gather(1, anchors))  # (B, n * bs, H)
    mask = block_mask(anchors, T, bs, x.dtype)
    out = drafter(x, block_positions(anchors, bs), ctx, mask)  # (B, n * bs, H)
    return out.view(B, anchors.shape[1], bs, -1)


def slot_labels(anchors: Tensor, valid: Tensor, loss_mask: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """(positions (B, n, bs-1) of the tokens slots 1.. predict, clamped into the row; labelled
    (B, n, bs-1) bool: the anchor is valid and that token is an answer token of the row)."""
    T = loss_mask.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)  # (B, n, bs-1)
    inside = pos < T
    pos = pos.clamp(max=T - 1)
    labelled = valid[:, :, None] & inside & loss_mask.bool().gather(1, pos.flatten(1)).view_as(pos)
    return pos, labelled


def block_predictions(drafter: DFlashDrafter, input_ids: Tensor, loss_mask: Tensor, context: Tensor,
                      anchors: int) -> tuple[Tensor, Tensor, Tensor]:
    """Blocks at the first ``anchors`` positions of each row whose every slot is an answer token ->
    (logits (N, bs-1, Vd) of the N valid blocks, their rows (N,), the positions (N, bs-1) of the
    tokens they predict); with a path correction, along the data's tokens."""
    a, valid = select_anchors(anchor_candidates(loss_mask, drafter.block_size, whole=True), anchors)
    return blocks_at(drafter, input_ids, loss_mask, context, a, valid)


@dataclass
class BlockSlots:
    """The drafted slots of the valid blocks at some anchors, teacher-forced along the data."""

    out: Tensor  # (N, bs-1, H) pre-norm outputs of slots 1..
    parents: Tensor  # (N, bs-1) the data's token before each slot (the anchor for slot 1)
    logits: Tensor  # (N, bs-1, Vd) float, with the path correction or Markov bias of those parents
    rows: Tensor  # (N,) the row of each block
    pos: Tensor  # (N, bs-1) the positions of the tokens the slots predict


def block_slots(drafter: DFlashDrafter, input_ids: Tensor, loss_mask: Tensor, context: Tensor, a: Tensor,
                valid: Tensor) -> BlockSlots:
    """The blocks at anchors (B, n) whose ``valid`` (B, n) flag is set, every slot's parent from the data."""
    bs = drafter.block_size
    out = draft_blocks(drafter, input_ids, context, a)[:, :, 1:]  # (B, n, bs-1, H)
    pos, _ = slot_labels(a, valid, loss_mask, bs)
    rows = torch.arange(input_ids.shape[0], device=a.device)[:, None].expand_as(a)  # (B, n)
    parents = slot_parents(input_ids, pos)  # (B, n, bs-1)
    state = correction_states(drafter, out, parents)
    logits = drafter.logits(out[valid], None if state is None else state[valid], parents[valid]).float()
    return BlockSlots(out[valid], parents[valid], logits, rows[valid], pos[valid])


def blocks_at(drafter: DFlashDrafter, input_ids: Tensor, loss_mask: Tensor, context: Tensor, a: Tensor,
              valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``block_predictions`` at given anchors (B, n) and their ``valid`` (B, n) flags."""
    s = block_slots(drafter, input_ids, loss_mask, context, a, valid)
    return s.logits, s.rows, s.pos


def slot_parents(input_ids: Tensor, pos: Tensor) -> Tensor:
    """input_ids (B, T), pos (B, n, S) the positions slots predict -> (B, n, S) the data's token before each."""
    return input_ids.gather(1, (pos - 1).flatten(1)).view_as(pos)


def correction_states(drafter: DFlashDrafter, out: Tensor, parents: Tensor) -> Tensor | None:
    """The path correction's states (B, n, bs-1, r), teacher-forced along ``parents`` (``slot_parents``);
    None for a drafter without one. Acceptance counted against the data is exact so (a greedy chain is
    accepted only while it equals the data)."""
    if not drafter.has_correction:
        return None
    return drafter.path_states(out, parents)


def accepted_at_every_anchor(drafter: DFlashDrafter, input_ids: Tensor, loss_mask: Tensor, context: Tensor,
                             label: Tensor, chunk: int = 32) -> tuple[Tensor, Tensor]:
    """A greedy block drafted at every whole-block anchor of each row, ``chunk`` anchors per call
    (bounded memory) -> (accepted (B, T) long: the block's drafts equal to ``label`` (B, T), the
    token each position should predict, in a row from slot 1; anchors (B, T) bool)."""
    B, T = input_ids.shape
    a, valid = select_anchors(anchor_candidates(loss_mask, drafter.block_size, whole=True), T)
    n = int(valid.sum(1).max()) if valid.numel() else 0
    accepted = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)
    at = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    for c in range(0, n, chunk):
        logits, rows, pos = blocks_at(drafter, input_ids, loss_mask, context, a[:, c:c + chunk], valid[:, c:c + chunk])
        draft = drafter.to_target_ids(logits.argmax(-1))  # (N, bs-1)
        hits = (draft == label[rows[:, None], pos - 1]).long().cumprod(dim=1).sum(dim=1)  # (N,)
        accepted[rows, pos[:, 0] - 1] = hits
        at[rows, pos[:, 0] - 1] = True
    return accepted, at


def decoder_anchors(accepted: Tensor, at: Tensor, loss_mask: Tensor) -> Tensor:
    """(B, T) bool: the anchors where a greedy block decoder drafts, from each anchor's ``accepted``
    drafts and the whole-block anchors ``at`` (``accepted_at_every_anchor``): the first block of an
    answer is anchored at its first token (the prefill emitted it), the next one accepted + 1 tokens
    on. ``decoder_step_starts`` walks from the index before an answer, hence the shifts."""
    steps = decoder_step_starts(shift_left(accepted, 1), shift_left(at, 1, False), loss_mask)
    return torch.cat([torch.zeros_like(steps[:, :1]), steps[:, :-1]], dim=1)
