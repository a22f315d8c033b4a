"""Pure pieces of training: label shift, losses, simulated acceptance, schedules, collation."""

import math

import pytest
import torch
import torch.nn.functional as F

from headway.heads import MedusaHeads
from headway.train.batch import collate
from headway.train.config import OptimConfig, TrainConfig
from headway.train.losses import IGNORE_INDEX as X
from headway.train.losses import kl_to_target, medusa_labels, medusa_loss, next_token_loss
from headway.train.optim import lr_factor
from headway.train.metrics import chain_acceptance, medusa_eval_stats, summarize_heads, tau_from_hist
from headway.train.tasks import MedusaTask, quality_weight


def test_medusa_labels_hand_made_sequence():
    # tokens:      10 11 12 13 14 15 ; loss mask 0 on the "prompt" (first two), 1 on the answer
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    labels = medusa_labels(ids, mask, num_heads=3)  # head k at t predicts token t+k+2
    assert labels.shape == (3, 1, 6)
    assert labels[0, 0].tolist() == [12, 13, 14, 15, X, X]
    assert labels[1, 0].tolist() == [13, 14, 15, X, X, X]
    assert labels[2, 0].tolist() == [14, 15, X, X, X, X]
    # a prompt token is never a label: head 0 at t=-1 would be 11 (masked); shift 1 = the target's own head
    assert medusa_labels(ids, mask, 1, offset=1)[0, 0].tolist() == [X, 12, 13, 14, 15, X]


def test_medusa_labels_respect_padding_and_short_rows():
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    labels = medusa_labels(ids, mask, num_heads=4)
    assert labels[0, 0].tolist() == [7, X, X, X, X]
    assert labels[3, 1].tolist() == [X] * 5  # t+5 never exists in a 5-token row
    assert (labels[:, 0, 2:] == X).all()


def test_medusa_loss_matches_manual_cross_entropy():
    torch.manual_seed(0)
    K, B, T, V = 3, 2, 5, 7
    logits = torch.randn(K, B, T, V)
    labels = torch.randint(0, V, (K, B, T))
    labels[0, 0, :2] = X
    labels[2] = X  # a head with no labels contributes 0, not NaN
    w = torch.tensor([1.0, 0.8, 0.64])
    loss, per_head = medusa_loss(logits, labels, w)
    for k in range(2):
        ref = F.cross_entropy(logits[k].reshape(-1, V), labels[k].reshape(-1), ignore_index=X)
        assert per_head[k].item() == pytest.approx(ref.item(), rel=1e-6)
    assert per_head[2].item() == 0.0
    assert loss.item() == pytest.approx(per_head[0].item() + 0.8 * per_head[1].item(), rel=1e-6)


def test_kl_to_target_is_zero_on_the_shifted_target_distribution():
    torch.manual_seed(0)
    B, T, V = 2, 6, 5
    target = torch.randn(B, T, V)
    # head k's reference for token t+k+2 is the target's logits at t+k+1
    heads = torch.stack([torch.roll(target, shifts=-(k + 1), dims=1) for k in range(2)])
    labels = medusa_labels(torch.randint(0, V, (B, T)), torch.ones(B, T, dtype=torch.long), 2)
    kl, per_head = kl_to_target(heads, target, labels, torch.ones(2))
    assert kl.abs().item() < 1e-6
    kl2, _ = kl_to_target(torch.randn(2, B, T, V), target, labels, torch.ones(2))
    assert kl2.item() > 0.01


def test_next_token_loss_is_the_shift_one_cross_entropy():
    torch.manual_seed(0)
    logits, ids = torch.randn(1, 4, 6), torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[0, 1, 1, 1]])
    ref = F.cross_entropy(logits[0, :3], ids[0, 1:])
    assert next_token_loss(logits, ids, mask).item() == pytest.approx(ref.item(), rel=1e-6)


def test_chain_acceptance_hand_made():
    # 3 heads x 5 positions: leading run of correct heads, +1 bonus token
    correct = torch.tensor([[1, 1, 0, 1, 1],
                            [1, 0, 1, 1, 1],
                            [0, 1, 1, 1, 0]], dtype=torch.bool)
    assert chain_acceptance(correct).tolist() == [3, 2, 1, 4, 3]


def test_eval_stats_and_tau_on_hand_made_logits():
    V = 4
    # K=2 heads, one row, T=4. Head predictions (argmax) vs labels:
    preds = torch.tensor([[[1, 2, 3, 0]], [[2, 0, 1, 1]]])  # (K, B, T)
    labels = torch.tensor([[[1, 2, 0, X]], [[2, 3, X, X]]])
    logits = F.one_hot(preds, V).float()
    s = medusa_eval_stats(logits, labels, topk=2)
    assert s["count"].tolist() == [3, 2] and s["top1"].tolist() == [2, 1]
    # positions with both labels: t=0 (both right -> 2 accepted), t=1 (head0 right, head1 wrong -> 1)
    assert s["chain_hist"].tolist() == [0, 1, 1]
    assert tau_from_hist(s["chain_hist"]) == pytest.approx((3 + 2) / 2)
    summary = summarize_heads(s, topk=2)
    assert summary["top1"] == [pytest.approx(2 / 3, abs=1e-4), 0.5] and summary["tau"] == 2.5
    assert summary["positions"] == 2


def test_lr_schedule_warmup_and_decay():
    o = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine")
    assert [lr_factor(s, 12, o) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 12, o) == 1.0 and lr_factor(12, 12, o) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(8, 12, o) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    lin = OptimConfig(lr=1.0, schedule="linear", min_lr_ratio=0.1)
    assert lr_factor(5, 10, lin) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(7, 10, OptimConfig(schedule="constant")) == 1.0


def test_quality_weight_warmup_and_ramp():
    ws = [quality_weight(s, heads_only_steps=2, ramp_steps=4, weight=1.0) for s in range(8)]
    assert ws == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert quality_weight(0, 0, 0, 0.3) == 0.3


def test_collate_pads_right_and_truncates():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    b = collate(rows, pad_id=2)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert collate(rows, max_length=2)["input_ids"].shape == (2, 2)
    with pytest.raises(ValueError, match="loss_mask has 2"):
        collate([{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}])


def test_resblocks_are_distinct_instances(tiny_llama):
    target, _ = tiny_llama
    cfg = TrainConfig(target="tiny")
    cfg.medusa.num_heads, cfg.medusa.num_layers = 2, 3
    heads = MedusaTask(cfg).build(target)
    H, V = 64, target.get_output_embeddings().weight.shape[0]
    n_params = sum(p.numel() for p in heads.parameters())
    assert n_params == 2 * (3 * (H * H + H) + V * H)  # shared ResBlocks would count once
    ptrs = {p.data_ptr() for p in heads.parameters()}
    assert len(ptrs) == len(list(heads.parameters()))
    # zero-initialised ResBlocks; own lm_heads start as copies of the target's
    assert all((lin.weight == 0).all() for b in heads.blocks for lin in b.layers)
    assert torch.equal(heads.lm_heads[1].weight, target.get_output_embeddings().weight)


@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_schedule_against_transformers_cosine_with_min_lr(warmup):
    """Why headway keeps its own schedule (loop.lr_factor): after the warm-up its cosine is
    transformers' "cosine_with_min_lr" step for step; in the warm-up transformers starts at lr 0
    (its first optimiser step trains nothing), headway at 1/warmup."""
    from transformers import get_scheduler

    total, o = 12, OptimConfig(lr=1.0, warmup_steps=warmup, schedule="cosine", min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs={"min_lr_rate": 0.1})
    theirs = []
    for _ in range(total):
        theirs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    ours = [lr_factor(s, total, o) for s in range(total)]
    assert ours[warmup:] == pytest.approx(theirs[warmup:], abs=1e-12)
    assert ours[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert theirs[:warmup] == pytest.approx([s / warmup for s in range(warmup)])  # lr 0 at step 0
