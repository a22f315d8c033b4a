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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..heads import DFlashDrafter, HeadsBase
from .batch import TargetBatch
from .blocks import (accepted_at_every_anchor, anchor_candidates, block_predictions, correction_states, decoder_anchors,
                     draft_blocks, row_draws, select_anchors, slot_labels)
from .calibration import calibration_sums
from .config import TrainConfig
from .draft_vocab import answer_draft_vocab, draft_vocab_counts
from .eagle import _EagleTask, pass_deepest_feature_through, refuse_other_shapes, target_layer_modules
from .objectives import Terms, expected_accepted, in_topk, reached, topk_distill
from .ttt import acceptance_stats


def dflash_loss(drafter: DFlashDrafter, input_ids: Tensor, context: Tensor, target_logits: Tensor,
                target_top: Tensor, loss_mask: Tensor, anchors: Tensor, valid: Tensor, gamma: float = 4.0,
                hard_weight: float = 0.0, terms: Terms = Terms()) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ_k w_k · CE_k / labelled slots, w_k = exp(-(k-1)/gamma), CE_k the soft cross-entropy of slot
    k against the target's distribution over the draft vocabulary (renormalised there), plus
    ``hard_weight`` times a CE to the target's argmax. target_logits (B, T, R) over the draft
    vocabulary's rows in draft order (R = Vd), target_top (B, T) the target's argmax in target ids;
    slots whose argmax the draft vocabulary cannot express are left out (as EAGLE-3's loss).

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
    state = correction_states(drafter, input_ids, out, pos)  # teacher-forced along the data's tokens
    logits = drafter.logits(out[labelled], None if state is None else state[labelled])  # (N, Vd)
    logq = F.log_softmax(logits.float(), dim=-1)  # (N, Vd)
    p = F.softmax(target_logits[rows[labelled], prev[labelled]].float(), dim=-1)  # (N, Vd)
    k = torch.arange(1, bs, device=out.device).expand_as(prev)[labelled]  # (N,) slot of each row
    top_draft = drafter.to_draft_ids(top[labelled], missing=0)  # (N,)
    metrics: dict[str, Tensor] = {}
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
        logq, p, k, top_draft = (x[scored] for x in (logq, p, k, top_draft))
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
    return loss, metrics


@torch.no_grad()
def block_eval_sums(drafter: DFlashDrafter, tb: TargetBatch, context: Tensor, target_top: Tensor,
                    anchors: int) -> dict[str, Tensor]:
    """Fixed-shape sums over the first ``anchors`` whole-block anchors of each row: ``accept_hist``
    (greedy chain against the data's tokens), ``accept_hist_greedy`` (against the target's argmax),
    ``top1_hits`` per slot (against the data), ``starts``, and the ``calib_*`` sums by depth."""
    logits, rows, pos = block_predictions(drafter, tb.input_ids, tb.loss_mask, context, anchors)  # (N, bs-1, Vd)
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
    return {"accept_hist": hist(data), "accept_hist_greedy": hist(top),
            "accept_hist_decode": acceptance_stats(every, steps, depth)["accept_hist"],
            "top1_hits": (draft == data).sum(0).float(), "starts": ones.sum().float().reshape(1), **calib}


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
        mask_id, mask_from = o.mask_token_id, "config"
        if mask_id is None:
            counts = draft_vocab_counts(self.cfg.data, V) if self.cfg.data else torch.zeros(V)
            mask_id, mask_from = least_used_token(counts), "least used answer token"
        heads = DFlashDrafter.for_target(target, mask_token_id=mask_id, block_size=o.block_size,
                                         num_layers=o.num_layers, aux_layers=list(o.aux_layers) or None,
                                         draft_vocab=ids, qk_norm=o.qk_norm, correction_rank=o.correction_rank)
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
                           gamma=self.opts.gamma, hard_weight=self.opts.hard_weight, terms=Terms.of(self.opts))

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
        sums = block_eval_sums(heads, tb, self.hidden(heads, tb), top, self.opts.eval_anchors)
        return self.with_vocab_stats(sums, heads, tb)



__all__ = ["DFlashTask", "block_eval_sums", "dflash_loss", "init_from_target_layer"]
