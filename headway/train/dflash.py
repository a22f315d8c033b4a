"""DFlash block-drafter training (the ``Task`` interface of tasks.py): the loss and evaluation sums
(the pure block pieces are in ``blocks.py``).

Per row, anchors are sampled from the answer: positions a whose token is an answer token and whose
next token is one too. Block j is [x_a, mask, ..., mask] at positions a .. a+bs-1; it attends to
the fused target context of positions < a and bidirectionally inside itself (``block_mask``), all
blocks of a row in one drafter call. Slot k (1 .. bs-1) is scored against the target's distribution
over the token at a+k (its logits at a+k-1), where that token is an answer token, with weight
exp(-(k-1)/gamma): early slots decide acceptance, so they weigh most (the DFlash paper's schedule).

Evaluation drafts a block at every sampled anchor whose whole block is answer tokens and counts the
drafts accepted greedily in a row (against the target's argmax and against the data), as the
decoder's chain verification would: ``tau`` = 1 + mean accepted, comparable with EAGLE's simulated
chains (``tau_by_depth[d-1]`` cuts the same blocks at depth d); the sums have EAGLE's keys, so
``eagle.summarize`` reads them. ``tau_decode`` drafts a block at every whole-block anchor and walks
each answer as a greedy decoder would (its first block at the answer's first token, each next one
past the accepted drafts and the bonus token): acceptance where a decoder's steps start, EAGLE's
``tau_decode`` for blocks.

DSpark (``dflash.markov_rank``, ``dflash.confidence_head``) trains its two heads with the block: the
Markov bias of each slot is teacher-forced on the data's token before it, and the confidence head
learns the overlap of the target's and the drafter's distributions at each slot (``dflash_loss``);
evaluation reports its estimate against that overlap per slot (``confidence_head`` in the summary).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..heads import DFlashDrafter, HeadsBase
from .batch import TargetBatch
from .blocks import (BlockSlots, accepted_at_every_anchor, anchor_candidates, block_predictions, block_slots,
                     correction_states, decoder_anchors, draft_blocks, row_draws, select_anchors, slot_labels,
                     slot_parents)
from .calibration import calibration_sums
from .config import TrainConfig
from .draft_vocab import answer_draft_vocab, draft_vocab_counts
from .eagle import _EagleTask, pass_deepest_feature_through, refuse_other_shapes, target_layer_modules
from .objectives import Terms, expected_accepted, in_topk, reached, topk_distill
from .ttt import acceptance_stats


def dflash_loss(drafter: DFlashDrafter, input_ids: Tensor, context: Tensor, target_logits: Tensor,
                target_top: Tensor, loss_mask: Tensor, anchors: Tensor, valid: Tensor, gamma: float = 4.0,
                hard_weight: float = 0.0, confidence_weight: float = 1.0,
                terms: Terms = Terms()) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ_k w_k · CE_k / labelled slots, w_k = exp(-(k-1)/gamma), CE_k the soft cross-entropy of slot
    k against the target's distribution over the draft vocabulary (renormalised there), plus
    ``hard_weight`` times a CE to the target's argmax. target_logits (B, T, R) over the draft
    vocabulary's rows in draft order (R = Vd), target_top (B, T) the target's argmax in target ids;
    slots whose argmax the draft vocabulary cannot express are left out (as EAGLE-3's loss).

    A Markov head (DSpark) biases each slot by the data's token before it (teacher forcing); a
    confidence head adds ``confidence_weight`` · Σ_k w_k · BCE(its logit, sum_v min(p_v, q_v)), the
    overlap of the target's distribution p and the drafter's q at the slot (detached): the chance that
    a draft sampled from q is accepted, speculators' DSpark target.

    ``terms`` (``objectives.py``, off by default): + topk_weight · w_k · L_topK per slot (HASS);
    GRIFFIN's alignment (slot k is scored only where every slot before it had the data's token
    among its top align_topk drafts: decoding reaches slot k only through them); and
    -chain_weight · the mean over blocks of Σ_k Π_{i<=k} q_i(the target's argmax)."""
    bs = drafter.block_size
    out = draft_blocks(drafter, input_ids, context, anchors)[:, :, 1:]  # (B, n, bs-1, H)
    pos, labelled = slot_labels(anchors, valid, loss_mask, bs)
    prev = pos - 1  # the target's logits at the position before a slot's token
    top = target_top.gather(1, prev.flatten(1)).view_as(prev)  # (B, n, bs-1) target ids
    if drafter.has_draft_vocab:
        labelled = labelled & drafter.t2d[top]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None, None].expand_as(prev)
    parents = slot_parents(input_ids, pos)  # (B, n, bs-1) teacher-forced along the data's tokens
    state = correction_states(drafter, out, parents)
    logits = drafter.logits(out[labelled], None if state is None else state[labelled], parents[labelled])  # (N, Vd)
    logq = F.log_softmax(logits.float(), dim=-1)  # (N, Vd)
    p = F.softmax(target_logits[rows[labelled], prev[labelled]].float(), dim=-1)  # (N, Vd)
    k = torch.arange(1, bs, device=out.device).expand_as(prev)[labelled]  # (N,) slot of each row
    top_draft = drafter.to_draft_ids(top[labelled], missing=0)  # (N,)
    metrics: dict[str, Tensor] = {}
    slot_out, slot_parents_ = out[labelled], parents[labelled]  # the confidence head's inputs, per scored slot
    chain = None
    if terms.chain_weight:  # q_k(the target's argmax) per slot, 0 where a slot has no label
        q = logq.new_zeros(labelled.shape).masked_scatter(labelled, logq.gather(-1, top_draft[:, None])[:, 0].exp())
        firsts = labelled[..., 0]  # (B, n) blocks whose first slot has a label
        chain = expected_accepted(q)[firsts].sum() / firsts.sum().clamp(min=1)
        metrics["chain"] = chain.detach()
    if terms.align_topk:  # GRIFFIN: only the slots a decoder reaches through the slots before them
        data = drafter.to_draft_ids(input_ids.gather(1, pos.flatten(1)).view_as(pos)[labelled])  # (N,) -1 outside
        hits = torch.zeros_like(labelled).masked_scatter(labelled, in_topk(logits, data, terms.align_topk))
        scored = reached(hits)[labelled]  # (N,)
        metrics["reached"] = scored.sum().float() / labelled.sum().clamp(min=1)
        logq, p, k, top_draft, slot_out, slot_parents_ = (
            x[scored] for x in (logq, p, k, top_draft, slot_out, slot_parents_))
    n = k.new_tensor(k.numel()).clamp(min=1)  # the scored slots
    ce = -(p * logq).sum(-1)  # (N,)
    w = torch.exp(-(k - 1).float() / gamma)
    per_slot = ce
    if hard_weight:
        per_slot = ce + hard_weight * F.nll_loss(logq, top_draft, reduction="none")
    if terms.topk_weight:
        topk = topk_distill(p, logq, terms.topk_k)  # (N,)
        per_slot = per_slot + terms.topk_weight * topk
        metrics["topk"] = topk.sum().detach() / n
    loss = (w * per_slot).sum() / n
    if chain is not None:
        loss = loss - terms.chain_weight * chain
    hit = logq.argmax(-1) == top_draft  # (N,)
    metrics.update(ce=ce.sum().detach() / n, acc=hit.sum().float() / n)
    for j in (1, bs - 1):
        at = k == j
        metrics[f"acc_slot{j}"] = (hit & at).sum().float() / at.sum().clamp(min=1)
    if drafter.has_confidence:
        overlap = torch.minimum(p, logq.detach().exp()).sum(-1)  # (N,) sum_v min(p_v, q_v)
        z = drafter.confidence_logit(slot_out, slot_parents_).float()  # (N,)
        bce = F.binary_cross_entropy_with_logits(z, overlap, reduction="none")
        loss = loss + confidence_weight * (w * bce).sum() / n
        metrics["confidence_bce"] = bce.detach().sum() / n
        metrics["confidence_error"] = (torch.sigmoid(z.detach()) - overlap).abs().sum() / n
    return loss, metrics


def confidence_sums(drafter: DFlashDrafter, slots: BlockSlots, target_logits: Tensor) -> dict[str, Tensor]:
    """The confidence head at evaluated slots against the overlap it estimates, per slot depth (bs-1,):
    ``conf_pred`` Σ estimate, ``conf_overlap`` Σ sum_v min(p_v, q_v), ``conf_abs`` Σ |difference|,
    ``conf_n`` slots; target_logits (B, T, Vd) over the draft vocabulary's rows."""
    p = F.softmax(target_logits[slots.rows[:, None], slots.pos - 1].float(), dim=-1)  # (N, bs-1, Vd)
    overlap = torch.minimum(p, slots.logits.softmax(-1)).sum(-1)  # (N, bs-1)
    pred = drafter.confidence(slots.out, slots.parents)  # (N, bs-1)
    return {"conf_pred": pred.sum(0), "conf_overlap": overlap.sum(0), "conf_abs": (pred - overlap).abs().sum(0),
            "conf_n": torch.full_like(pred[0], pred.shape[0])}


def summarize_confidence(stats: dict[str, Tensor]) -> dict[str, list[float]]:
    """Summed ``conf_*`` stats -> per slot depth: mean estimate, mean overlap, mean absolute error."""
    n = stats["conf_n"].clamp(min=1)
    return {k: [round(float(x), 4) for x in stats[f"conf_{s}"] / n]
            for k, s in (("estimate", "pred"), ("overlap", "overlap"), ("abs_error", "abs"))}


@torch.no_grad()
def block_eval_sums(drafter: DFlashDrafter, tb: TargetBatch, context: Tensor, target_top: Tensor,
                    anchors: int, target_logits: Tensor | None = None) -> dict[str, Tensor]:
    """Fixed-shape sums over the first ``anchors`` whole-block anchors of each row: ``accept_hist``
    (greedy chain against the data's tokens), ``accept_hist_greedy`` (against the target's argmax),
    ``top1_hits`` per slot (against the data), ``starts``, and the ``calib_*`` sums by depth; with a
    confidence head and ``target_logits`` (B, T, Vd), its ``conf_*`` sums (``confidence_sums``)."""
    a, valid = select_anchors(anchor_candidates(tb.loss_mask, drafter.block_size, whole=True), anchors)
    slots = block_slots(drafter, tb.input_ids, tb.loss_mask, context, a, valid)
    logits, rows, pos = slots.logits, slots.rows, slots.pos  # (N, bs-1, Vd), (N,), (N, bs-1)
    draft = drafter.to_target_ids(logits.argmax(-1))  # (N, bs-1)
    data = tb.input_ids[rows[:, None], pos]  # (N, bs-1) the data's tokens
    top = target_top[rows[:, None], pos - 1]  # (N, bs-1) the target's argmax
    depth = drafter.block_size - 1
    ones = torch.ones(draft.shape[0], dtype=torch.bool, device=draft.device)

    def hist(label: Tensor) -> Tensor:
        accepted = (draft == label).long().cumprod(dim=1).sum(dim=1)  # (N,)
        return acceptance_stats(accepted, ones, depth)["accept_hist"]

    ids = drafter.to_draft_ids(data)  # (N, bs-1) -1 outside the draft vocabulary
    calib = calibration_sums([logits[:, j] for j in range(depth)], [ids[:, j] for j in range(depth)])
    every, at = accepted_at_every_anchor(drafter, tb.input_ids, tb.loss_mask, context, target_top)
    steps = decoder_anchors(every, at, tb.loss_mask)  # where a greedy decoder's blocks start
    conf = confidence_sums(drafter, slots, target_logits) if drafter.has_confidence and target_logits is not None \
        else {}
    return {"accept_hist": hist(data), "accept_hist_greedy": hist(top),
            "accept_hist_decode": acceptance_stats(every, steps, depth)["accept_hist"],
            "top1_hits": (draft == data).sum(0).float(), "starts": ones.sum().float().reshape(1), **calib, **conf}


BLOCK_ANCHORS = 64  # DFlash blocks per row a calibration measures (the default dflash.eval_anchors)
_COPIED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


def init_from_target_layer(heads: DFlashDrafter, target: nn.Module, layer: int) -> dict[str, object]:
    """Start every draft layer as a copy of the target's decoder layer ``layer`` (0-based), ``fc``
    as a pass-through of the deepest fused feature, ``hidden_norm`` as that layer's input norm (the
    context enters k_proj / v_proj as the layer's normed residual stream would) and ``norm`` as the
    target's final norm, as EAGLE-3's ``init_layer`` does.

    Needs Llama-style module names; q/k norms (absent in Llama) stay as built. Biases are copied
    where both layers have them. Every shape is checked before anything is copied."""
    found, index = target_layer_modules(target, layer, _COPIED, "dflash.init_layer")
    refuse_other_shapes(((found[n].weight.shape, dst.get_submodule(n).weight.shape, n)
                         for dst in heads.layers for n in _COPIED), "dflash.init_layer")
    with torch.no_grad():
        for dst in heads.layers:
            for n in _COPIED:
                mine, theirs = dst.get_submodule(n), found[n]
                mine.weight.copy_(theirs.weight)
                if getattr(mine, "bias", None) is not None and getattr(theirs, "bias", None) is not None:
                    mine.bias.copy_(theirs.bias)
        heads.hidden_norm.weight.copy_(found["input_layernorm"].weight)
        pass_deepest_feature_through(heads, target)
    return {"layer": index, "fc": f"identity on aux layer {heads.feature_layers[-1]}"}


def least_used_token(counts: Tensor) -> int:
    """The mask token when none is given: the target token the training answers use least (the
    highest such id), so that a real anchor token rarely shares its embedding."""
    low = counts.min()
    return int((counts == low).nonzero().max())


def mask_token(cfg: TrainConfig, given: int | None, vocab_size: int) -> tuple[int, str]:
    """(the mask token id, how it was chosen): ``given``, else the least used answer token of the data."""
    if given is not None:
        return given, "config"
    counts = draft_vocab_counts(cfg.data, vocab_size) if cfg.data else torch.zeros(vocab_size)
    return least_used_token(counts), "least used answer token"


class DFlashTask(_EagleTask):
    """DFlash: a block of ``block_size`` drafted in one bidirectional pass over fused target layers.
    Shares the EAGLE tasks' plumbing (frozen target, soft labels over the draft vocabulary, offline
    logits of only the rows the loss reads, ``argmax_from``)."""

    kind = "dflash"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.opts = cfg.dflash

    def build(self, target: nn.Module) -> HeadsBase:
        o = self.opts
        V = int(target.get_output_embeddings().weight.shape[0])
        ids, info = answer_draft_vocab(self.cfg, V, o.draft_vocab_size)
        mask_id, mask_from = mask_token(self.cfg, o.mask_token_id, V)
        heads = DFlashDrafter.for_target(target, mask_token_id=mask_id, block_size=o.block_size,
                                         num_layers=o.num_layers, aux_layers=list(o.aux_layers) or None,
                                         draft_vocab=ids, qk_norm=o.qk_norm, correction_rank=o.correction_rank,
                                         markov_rank=o.markov_rank, confidence_head=o.confidence_head,
                                         confidence_with_markov=o.confidence_with_markov)
        heads.metadata["draft_vocab"] = info | ({"lm_head_init": "target lm_head rows"} if ids is not None else
                                                {"lm_head": "the target's (shared, frozen)"})
        heads.metadata["mask_token"] = {"id": mask_id, "chosen_by": mask_from}
        if o.init_layer is not None:
            heads.metadata["init_from_target"] = init_from_target_layer(heads, target, o.init_layer)
        self.check_data()
        return heads

    def anchors(self, tb: TargetBatch, step: int) -> tuple[Tensor, Tensor]:
        """This step's anchors: each row's a pure function of (seed, step, row), so resumed and
        multi-process runs draw the same."""
        draws = row_draws(tb.input_ids, tb.attention_mask, self.cfg.seed, step)
        return select_anchors(anchor_candidates(tb.loss_mask, self.opts.block_size), self.opts.anchors, draws)

    def loss(self, heads: HeadsBase, tb: TargetBatch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        logits, top = self.targets(heads, tb)
        anchors, valid = self.anchors(tb, step)
        return dflash_loss(heads, tb.input_ids, self.hidden(heads, tb), logits, top, tb.loss_mask, anchors, valid,
                           gamma=self.opts.gamma, hard_weight=self.opts.hard_weight,
                           confidence_weight=self.opts.confidence_weight, terms=Terms.of(self.opts))

    @staticmethod
    def calibration_sums(heads: HeadsBase, tb: TargetBatch, depth: int) -> dict[str, Tensor]:
        """The ``calib_*`` sums alone (``calibrate.fit_calibration``): slot k is depth k, at the blocks
        evaluation drafts (``depth`` is the block's, not asked)."""
        context = heads.fuse([tb.hidden[i] for i in heads.feature_layers])
        logits, rows, pos = block_predictions(heads, tb.input_ids, tb.loss_mask, context, BLOCK_ANCHORS)
        ids = heads.to_draft_ids(tb.input_ids[rows[:, None], pos])  # (N, bs-1) -1 outside the draft vocabulary
        return calibration_sums([logits[:, j] for j in range(ids.shape[1])], [ids[:, j] for j in range(ids.shape[1])])

    def eval_stats(self, heads: HeadsBase, tb: TargetBatch) -> dict[str, Tensor]:
        top = tb.top if tb.top is not None else tb.logits.argmax(-1)  # (B, T) the target's argmax
        logits = self.targets(heads, tb)[0] if heads.has_confidence else None
        sums = block_eval_sums(heads, tb, self.hidden(heads, tb), top, self.opts.eval_anchors, logits)
        return self.with_vocab_stats(sums, heads, tb)

    def summarize(self, stats: dict[str, Tensor]) -> dict[str, Any]:
        """The chain summary, and the confidence head's calibration per slot when it has one."""
        out = super().summarize({k: v for k, v in stats.items() if not k.startswith("conf_")})
        if "conf_n" in stats:
            out["confidence_head"] = summarize_confidence(stats)
        return out


__all__ = ["DFlashTask", "block_eval_sums", "confidence_sums", "dflash_loss", "init_from_target_layer"]
