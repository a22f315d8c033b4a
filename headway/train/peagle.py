"""P-EAGLE training (the ``Task`` interface of tasks.py): the loss and evaluation sums (the pure layout
pieces are in ``parallel.py``; the drafter in ``heads/peagle.py``; docs/peagle.md).

One step runs the drafter twice: a causal pass over every real slot of the batch (EAGLE-3's step 0:
x_{t+1} and f_t at index t), whose keys stay in a cache, then one pass over the mask slots the step
trains (``parallel.cod_slots``), each attending to the real slots up to its anchor and to its own
chain (``parallel.slot_mask``). Depth d at anchor a is scored against the target's distribution at
a + d + 1 (the token x_{a+d+2}) over the draft vocabulary, where that token is an answer token and
the target's argmax is in the draft vocabulary; the loss is the mean soft cross-entropy over every
scored slot (speculators' count-normalised loss), plus ``hard_weight`` times a CE to the argmax.

Evaluation drafts a whole chain of K at every answer index, as one parallel call of the decoder
would (the mask slots never see a drafted token), and counts the drafts accepted in a row against
the data and against the target's argmax: the sums EAGLE's chain evaluation writes (``tau``,
``tau_decode``, acceptance and top-1 by depth, calibration), so ``eagle.summarize`` reads them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..heads import HeadsBase, PEagleDrafter
from .batch import StoredLogits, TargetBatch
from .blocks import row_draws
from .calibration import depth_sums, stack_depths
from .config import TrainConfig
from .dflash import mask_token
from .draft_vocab import answer_draft_vocab
from .eagle import _EagleTask, init_lm_head, lm_head_note
from .parallel import cod_slots, every_slot, slot_mask
from .ttt import acceptance_stats, decoder_step_starts, label_mask, shift_left, ttt_mask

EVAL_CHUNK = 64  # chains per row drafted in one evaluation call (bounds the (B, 1, n, T + n) mask)


def real_pass(drafter: PEagleDrafter, input_ids: Tensor, fused: Tensor) -> tuple[Tensor, Any]:
    """Every real slot of the batch in one causal pass: input_ids (B, T), fused (B, T, H) -> outputs
    (B, T, H) and the cache holding their keys (the prefix every mask slot reads)."""
    B, T = input_ids.shape
    cache = drafter.new_cache()
    pos = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    out = drafter(shift_left(input_ids, 1), fused, pos, ttt_mask(T, 0, drafter.fc.weight.dtype, input_ids.device),
                  cache)
    return out, cache


def slot_pass(drafter: PEagleDrafter, anchor: Tensor, depth: Tensor, ok: Tensor, T: int, cache: Any) -> Tensor:
    """Mask slots (anchor, depth, ok) (B, N) after T cached real slots -> their outputs (B, N, H)."""
    B, N = anchor.shape
    ids = anchor.new_full((B, N), drafter.config.mask_token_id)
    hidden = drafter.mask_feature().expand(B, N, -1)
    return drafter(ids, hidden, anchor + depth, slot_mask(anchor, depth, ok, T, drafter.fc.weight.dtype), cache)


def peagle_loss(drafter: PEagleDrafter, input_ids: Tensor, fused: Tensor, target_logits: Tensor, target_top: Tensor,
                loss_mask: Tensor, slots: tuple[Tensor, Tensor, Tensor], hard_weight: float = 0.0
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean soft CE over every scored real slot and mask slot. target_logits (B, T, Vd) over the draft
    vocabulary's rows in draft order, target_top (B, T) the target's argmax in target ids, slots the
    (anchor, depth, ok) of ``cod_slots``. Metrics ``ce{d}`` / ``acc{d}`` per depth d = 0 .. K-1."""
    anchor, depth, ok = slots
    B, T = input_ids.shape
    out0, cache = real_pass(drafter, input_ids, fused)
    outs = slot_pass(drafter, anchor, depth, ok, T, cache)  # (B, N, H)
    in_vocab = drafter.t2d[target_top]  # (B, T)
    at = torch.arange(B, device=input_ids.device)[:, None] * T  # (B, 1) each row's first flat index
    real = label_mask(loss_mask, 2) & shift_left(in_vocab, 1, False)  # (B, T) index t scored on x_{t+2}
    src = (anchor + depth + 1).clamp(max=T - 1)  # (B, N) where the target's distribution for the slot is
    label_in = (anchor + depth + 2 < T) & loss_mask.bool().gather(1, (anchor + depth + 2).clamp(max=T - 1))
    scored = ok & label_in & in_vocab.gather(1, src)  # (B, N)
    h = torch.cat([out0[real], outs[scored]])  # (M, H)
    flat = torch.cat([(at + torch.arange(T, device=at.device) + 1)[real], (at + src)[scored]])  # (M,)
    d = torch.cat([depth.new_zeros(int(real.sum())), depth[scored]])  # (M,)
    logq = F.log_softmax(drafter.logits(h).float(), dim=-1)  # (M, Vd)
    p = F.softmax(target_logits.reshape(B * T, -1)[flat].float(), dim=-1)  # (M, Vd)
    ce = -(p * logq).sum(-1)  # (M,)
    top = drafter.to_draft_ids(target_top.reshape(-1)[flat], missing=0)  # (M,)
    per_slot = ce + hard_weight * F.nll_loss(logq, top, reduction="none") if hard_weight else ce
    n = ce.new_tensor(ce.numel()).clamp(min=1)
    hit = (logq.argmax(-1) == top).float()
    metrics: dict[str, Tensor] = {"ce": ce.detach().sum() / n, "acc": hit.sum() / n}
    for j in range(drafter.num_depths):
        m = (d == j).float()
        metrics[f"ce{j}"] = (ce.detach() * m).sum() / m.sum().clamp(min=1)
        metrics[f"acc{j}"] = (hit * m).sum() / m.sum().clamp(min=1)
    return per_slot.sum() / n, metrics


def chain_starts(loss_mask: Tensor, num_depths: int) -> Tensor:
    """(B, T) bool: the indices whose whole chain x_{t+2} .. x_{t+K+1} is answer tokens (``chain_accepted``'s)."""
    start = torch.ones_like(loss_mask, dtype=torch.bool)
    for j in range(num_depths):
        start &= label_mask(loss_mask, j + 2)
    return start


@torch.no_grad()
def parallel_drafts(drafter: PEagleDrafter, input_ids: Tensor, fused: Tensor, start: Tensor,
                    chunk: int = EVAL_CHUNK) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """A chain of K drafted in parallel at every index, as one decoder call would: (drafts (B, T, K) target
    ids, per depth the calibration ``depth_sums`` at ``start`` against the data's tokens). Chunks of
    indices without a chain start are skipped (their drafts stay -1)."""
    B, T = input_ids.shape
    K = drafter.num_depths
    out0, cache = real_pass(drafter, input_ids, fused)
    drafts = torch.full((B, T, K), -1, dtype=torch.long, device=input_ids.device)
    sums: list[list[dict[str, Tensor]]] = [[] for _ in range(K)]

    def score(logits: Tensor, d: int, t0: int, t1: int) -> None:  # logits (B, t1 - t0, Vd) of depth d
        drafts[:, t0:t1, d] = drafter.to_target_ids(logits.argmax(-1))
        s = start[:, t0:t1]
        sums[d].append(depth_sums(logits[s], drafter.logit_ids(shift_left(input_ids, d + 2)[:, t0:t1][s])))

    score(drafter.logits(out0), 0, 0, T)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        if not bool(start[:, t0:t1].any()):
            continue
        anchor, depth, ok = every_slot(B, t0, t1, K, input_ids.device)
        logits = drafter.logits(slot_pass(drafter, anchor, depth, ok, T, cache)).view(B, t1 - t0, K - 1, -1)
        cache.crop(T)
        for d in range(1, K):
            score(logits[:, :, d - 1], d, t0, t1)
    empty = depth_sums(out0.new_zeros(0, drafter.draft_vocab_size), input_ids.new_zeros(0))  # a depth never drafted
    return drafts, [{k: sum(p[k] for p in per) for k in empty} if per else empty for per in sums]


def peagle_eval_sums(drafter: PEagleDrafter, tb: TargetBatch, fused: Tensor) -> dict[str, Tensor]:
    """EAGLE's chain sums (``eagle.eval_sums``) for parallel chains of K: ``accept_hist`` against the data,
    ``accept_hist_greedy`` against the target's argmax, ``accept_hist_decode`` where a greedy decoder's
    steps start, ``top1_hits`` per depth, ``starts`` and the ``calib_*`` sums."""
    K = drafter.num_depths
    start = chain_starts(tb.loss_mask, K)
    drafts, per_depth = parallel_drafts(drafter, tb.input_ids, fused, start)
    top = tb.top if tb.top is not None else tb.logits.argmax(-1)  # (B, T) the target's argmax

    def accepted(next_tokens: Tensor) -> Tensor:  # next_tokens (B, T): the token after each position
        hits = torch.stack([drafts[:, :, d] == shift_left(next_tokens, d + 1) for d in range(K)], -1)
        return hits.long().cumprod(-1).sum(-1)  # (B, T)

    data_next = shift_left(tb.input_ids, 1)
    greedy = accepted(top)
    steps = decoder_step_starts(greedy, start, tb.loss_mask)
    hits = torch.stack([((drafts[:, :, d] == shift_left(data_next, d + 1)) & start).sum() for d in range(K)])
    return {"accept_hist": acceptance_stats(accepted(data_next), start, K)["accept_hist"],
            "accept_hist_greedy": acceptance_stats(greedy, start, K)["accept_hist"],
            "accept_hist_decode": acceptance_stats(greedy, steps, K)["accept_hist"],
            "top1_hits": hits.float(), "starts": start.sum().float().reshape(1), **stack_depths(per_depth)}


class PEagleTask(_EagleTask):
    """P-EAGLE: EAGLE-3's fused features and draft vocabulary, K tokens drafted in one pass. Shares the
    EAGLE tasks' plumbing (frozen target, soft labels over the draft vocabulary, offline logits of only
    the rows the loss reads, ``argmax_from``)."""

    kind = "peagle"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.opts = cfg.peagle

    def build(self, target: nn.Module) -> HeadsBase:
        o = self.opts
        V = int(target.get_output_embeddings().weight.shape[0])
        ids, info = answer_draft_vocab(self.cfg, V, o.draft_vocab_size)
        mask_id, mask_from = mask_token(self.cfg, o.mask_token_id, V)
        heads = PEagleDrafter.for_target(target, draft_vocab_size=o.draft_vocab_size,
                                         aux_layers=list(o.aux_layers) or None, num_depths=o.num_depths,
                                         num_layers=o.num_layers, mask_token_id=mask_id,
                                         norm_before_fc=o.norm_before_fc, norm_before_residual=o.norm_before_residual,
                                         own_embeddings=o.own_embeddings)
        if ids is not None:
            heads.set_draft_vocab(ids.to(heads.d2t.device))
        init_lm_head(heads, target, train=o.train_lm_head)
        heads.metadata["draft_vocab"] = info | {"lm_head_init": lm_head_note(o.train_lm_head)}
        heads.metadata["mask_token"] = {"id": mask_id, "chosen_by": mask_from}
        self.check_data()
        return heads

    def stored_logits(self, heads: HeadsBase, lm_head: nn.Module) -> StoredLogits:
        """Offline: the target's lm_head on the stored final states (P-EAGLE has no stored top-k option)."""
        return StoredLogits(lm_head, rows=self.logit_rows(heads), top=self.opts.argmax_from)

    def slots(self, tb: TargetBatch, step: int) -> tuple[Tensor, Tensor, Tensor]:
        """This step's mask slots: each row's a pure function of (seed, step, row), so resumed and
        multi-process runs train the same."""
        o = self.opts
        draws = row_draws(tb.input_ids, tb.attention_mask, self.cfg.seed, step)
        return cod_slots(tb.loss_mask, draws, o.num_depths, o.down_sample_ratio, o.down_sample_ratio_min,
                         o.max_anchors)

    def loss(self, heads: HeadsBase, tb: TargetBatch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        logits, top = self.targets(heads, tb)
        return peagle_loss(heads, tb.input_ids, self.hidden(heads, tb), logits, top, tb.loss_mask,
                           self.slots(tb, step), hard_weight=self.opts.hard_weight)

    def eval_stats(self, heads: HeadsBase, tb: TargetBatch) -> dict[str, Tensor]:
        return self.with_vocab_stats(peagle_eval_sums(heads, tb, self.hidden(heads, tb)), heads, tb)

    @staticmethod
    def calibration_sums(heads: HeadsBase, tb: TargetBatch, depth: int) -> dict[str, Tensor]:
        """The ``calib_*`` sums alone (``calibrate.fit_calibration``): depth d + 1 is the d-th slot of a
        chain, at every chain start (``depth`` is the drafter's K, not asked)."""
        fused = heads.fuse([tb.hidden[i] for i in heads.feature_layers])
        _, per_depth = parallel_drafts(heads, tb.input_ids, fused, chain_starts(tb.loss_mask, heads.num_depths))
        return stack_depths(per_depth)


__all__ = ["PEagleTask", "chain_starts", "parallel_drafts", "peagle_eval_sums", "peagle_loss"]
