"""What differs between head kinds in training: a small ``Task`` interface the one recipe drives.

The interface (the EAGLE tasks in ``headway/train/eagle.py`` implement the same one)
---------------------------------------------------------------------------------
The recipe (``headway/train/recipe.py``) owns data, the frozen target, accelerate, optimiser,
schedule, checkpoints, trackers and evaluation; the kind's ``Contract`` (``contracts.py``) says
which options, features and target limits it has. Each step it runs the target once
(``headway.train.batch.target_batch``) -- or, offline (``features=DIR``), reads the stored
states and applies only the target's lm_head (``stored_batch``) -- and hands the task a
``TargetBatch`` (defined in ``headway/train/batch.py``, re-exported here)::

    @dataclass
    class TargetBatch:              # what the target gives each step (all on the device)
        input_ids: Tensor           # (B, T) long, right-padded
        attention_mask: Tensor      # (B, T) long, 1 on real tokens
        loss_mask: Tensor           # (B, T) long, 1 on target-written tokens (0 on padding)
        hidden: dict[int, Tensor]   # HF hidden_states index -> (B, T, H); -1 = final post-norm
        logits: Tensor | None       # (B, T, V) target logits, when task.needs_logits()
        ref_logits: Tensor | None   # (B, T, V) logits of the *unadapted* target (adapter disabled),
                                    #   only when the task adapts the target (Medusa-2)
        logit_rows: Tensor | None   # offline with stored_logits: (R,) the target ids logits hold
        top: Tensor | None          #   (B, T, R) instead of V, and top (B, T) the target's argmax

    class Task(Protocol):
        kind: str                                   # TrainConfig.kind
        def __init__(self, cfg: TrainConfig)        # keep the options you need
        def build(self, target) -> HeadsBase        # fresh heads, attached to the (frozen) target
        def adapt_target(self, target) -> nn.Module # default: target unchanged. Medusa-2: a peft model
                                                    #   whose LoRA params require grad; the loop then
                                                    #   runs it with grad and trains it too
        def feature_layers(self, heads) -> list[int]
        def needs_logits(self) -> bool
        def stored_logits(self, heads, lm_head) -> StoredLogits  # optional: offline, project only the
                                                    #   rows (and argmax) the loss reads (EAGLE-3)
        def param_groups(self, heads, target) -> list[ParamGroup]  # (name, params, lr_mult, start_step)
        def loss(self, heads, tb, step) -> tuple[Tensor, dict[str, Tensor]]  # metrics: 0-d tensors,
                                                    #   no .item() (the loop syncs at log_every)
        def eval_stats(self, heads, tb) -> dict[str, Tensor]   # *sums* over the batch (fixed shapes);
                                                    #   the loop adds them over batches and processes
        def calibration_sums(heads, tb, depth)  # staticmethod: eval_stats' calib_* sums alone (tune)
        def summarize(self, stats) -> dict[str, Any]           # summed stats -> floats for card / log
                                                    #   (must include "tau": simulated chain acceptance)
        def save(self, heads, target, out_dir) -> None         # final artefacts: heads.save_pretrained(out_dir)
                                                    #   (+ out_dir/adapter for Medusa-2); the loop has put
                                                    #   metadata["training"] and metadata["eval"] on heads

``loss`` runs inside the module that accelerate prepares (DDP-wrapped), so every trainable
parameter must take part in each step's graph (a zero weight is fine). ``eval_stats`` runs
on the unwrapped module under no_grad, each process on its own share of the held-out rows.
``TASKS`` (``headway/train/registry.py``) is the one table of kind -> class: the Medusa tasks
here, the EAGLE tasks in ``eagle.py``; a new head kind adds its task there and its contract in
``contracts.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..heads import HeadsBase, MedusaHeads
from ..heads.metadata import ADAPTER_SUBFOLDER, adapter_dir
from .batch import TargetBatch
from .calibration import medusa_calibration_sums, summarize_calibration
from .config import TrainConfig
from .draft_vocab import answer_draft_vocab, in_draft_vocab
from .losses import IGNORE_INDEX, kl_to_target, medusa_labels, medusa_loss, next_token_loss
from .metrics import draft_vocab_stats, medusa_eval_stats, summarize_heads
from .optim import ParamGroup


class Task(Protocol):
    kind: str

    def build(self, target: nn.Module) -> HeadsBase: ...
    def adapt_target(self, target: nn.Module) -> nn.Module: ...
    def feature_layers(self, heads: HeadsBase) -> list[int]: ...
    def needs_logits(self) -> bool: ...
    def param_groups(self, heads: HeadsBase, target: nn.Module) -> list[ParamGroup]: ...
    def loss(self, heads: HeadsBase, tb: TargetBatch, step: int) -> tuple[Tensor, dict[str, Tensor]]: ...
    def eval_stats(self, heads: HeadsBase, tb: TargetBatch) -> dict[str, Tensor]: ...
    @staticmethod
    def calibration_sums(heads: HeadsBase, tb: TargetBatch, depth: int) -> dict[str, Tensor]: ...
    def summarize(self, stats: dict[str, Tensor]) -> dict[str, Any]: ...
    def save(self, heads: HeadsBase, target: nn.Module, out_dir: Path) -> None: ...


class MedusaTask:
    """Medusa-1: K heads on the frozen target's final hidden state (design.md §3).

    With ``draft_vocab_size`` N the heads predict over the N most frequent answer tokens: labels
    are draft ids, tokens outside the vocabulary are ignored by the losses (and count as misses
    at evaluation), and the KL term compares with the target's distribution renormalised on the
    draft vocabulary."""

    kind = "medusa"

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.opts = cfg.medusa

    def build(self, target: nn.Module) -> HeadsBase:
        o = self.opts
        V = int(target.get_output_embeddings().weight.shape[0])
        ids, info = answer_draft_vocab(self.cfg, V, o.draft_vocab_size)
        heads = MedusaHeads.for_target(target, draft_vocab=ids, num_heads=o.num_heads, num_layers=o.num_layers,
                                       own_lm_head=o.own_lm_head)
        if ids is not None:
            heads.metadata["draft_vocab"] = info | {"lm_head_init": "target lm_head rows"}
        return heads

    def adapt_target(self, target: nn.Module) -> nn.Module:
        return target

    def feature_layers(self, heads: HeadsBase) -> list[int]:
        return [-1]

    def needs_logits(self) -> bool:
        return self.opts.kl_weight > 0

    def param_groups(self, heads: HeadsBase, target: nn.Module) -> list[ParamGroup]:
        return [ParamGroup("heads", [p for p in heads.parameters() if p.requires_grad],
                           self.cfg.optim.head_lr_mult)]

    def head_loss(self, heads: HeadsBase, tb: TargetBatch) -> tuple[Tensor, dict[str, Tensor]]:
        K = heads.config.num_heads
        head_logits = heads(tb.hidden[-1])  # (K, B, T, Vd)
        labels = medusa_labels(tb.input_ids, tb.loss_mask, K)  # (K, B, T) target ids
        labels = in_draft_vocab(heads, labels, missing=IGNORE_INDEX)  # (K, B, T) draft ids
        weights = torch.tensor([self.opts.decay ** k for k in range(K)], device=head_logits.device)
        loss, per_head = medusa_loss(head_logits, labels, weights)
        metrics = {f"head{k}_ce": per_head[k].detach() for k in range(K)}
        if self.opts.kl_weight > 0:
            target_logits = tb.logits  # (B, T, V)
            if heads.has_draft_vocab:  # softmax over the draft columns = the target renormalised on them
                target_logits = target_logits[..., heads.draft_token_ids()]  # (B, T, Vd)
            kl, _ = kl_to_target(head_logits, target_logits, labels, weights)
            loss = loss + self.opts.kl_weight * kl
            metrics["kl"] = kl.detach()
        return loss, metrics

    def loss(self, heads: HeadsBase, tb: TargetBatch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        return self.head_loss(heads, tb)

    def eval_stats(self, heads: HeadsBase, tb: TargetBatch) -> dict[str, Tensor]:
        head_logits = heads(tb.hidden[-1])  # (K, B, T, Vd)
        labels = medusa_labels(tb.input_ids, tb.loss_mask, heads.config.num_heads)  # (K, B, T) target ids
        # a token outside the draft vocabulary is a miss the heads cannot avoid: it counts, and never matches
        labels = in_draft_vocab(heads, labels, missing=-1)
        stats = medusa_eval_stats(head_logits, labels, self.opts.topk)
        stats.update(medusa_calibration_sums(head_logits, labels, IGNORE_INDEX))  # head k = depth k+1
        if heads.has_draft_vocab:
            stats.update(draft_vocab_stats(heads.t2d, tb.input_ids, tb.loss_mask))
        return stats

    @staticmethod
    def calibration_sums(heads: HeadsBase, tb: TargetBatch, depth: int) -> dict[str, Tensor]:
        """The ``calib_*`` sums of ``eval_stats`` alone (``calibrate.fit_calibration``): head k is depth k+1."""
        labels = medusa_labels(tb.input_ids, tb.loss_mask, heads.config.num_heads)
        return medusa_calibration_sums(heads(tb.hidden[-1]), in_draft_vocab(heads, labels, missing=-1), IGNORE_INDEX)

    def summarize(self, stats: dict[str, Tensor]) -> dict[str, Any]:
        out = summarize_heads(stats, self.opts.topk)
        if "calib_count" in stats:
            out["calibration"] = summarize_calibration(stats)
        return out

    def save(self, heads: HeadsBase, target: nn.Module, out_dir: Path) -> None:
        heads.save_pretrained(out_dir)


def quality_weight(step: int, heads_only_steps: int, ramp_steps: int, weight: float) -> float:
    """Medusa-2's weight on the target-quality term at optimiser step ``step`` (0-based):
    0 during the heads-only warm-up, then a linear ramp to ``weight`` over ``ramp_steps``."""
    if step < heads_only_steps:
        return 0.0
    if ramp_steps <= 0:
        return weight
    return weight * min(1.0, (step - heads_only_steps + 1) / ramp_steps)


adapter_path = adapter_dir  # the PEFT adapter a heads checkpoint needs on its target (heads.metadata reads it)


class Medusa2Task(MedusaTask):
    """Medusa-2: heads plus a LoRA adapter on the target, trained jointly; a KL (or LM) term
    against the frozen target keeps the adapted target's own predictions."""

    kind = "medusa2"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.lora = cfg.lora

    def adapt_target(self, target: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        mods: Any = self.lora.target_modules
        if mods == ["all-linear"]:
            mods = "all-linear"
        config = LoraConfig(r=self.lora.r, lora_alpha=self.lora.alpha, lora_dropout=self.lora.dropout,
                            target_modules=mods, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(target, config)
        model.train()  # LoRA dropout on; the base model has no dropout in our targets
        return model

    def needs_logits(self) -> bool:
        return True

    def param_groups(self, heads: HeadsBase, target: nn.Module) -> list[ParamGroup]:
        lora = [p for p in target.parameters() if p.requires_grad]
        return [ParamGroup("heads", [p for p in heads.parameters() if p.requires_grad], self.cfg.optim.head_lr_mult),
                ParamGroup("target", lora, 1.0, start_step=self.lora.heads_only_steps)]

    def loss(self, heads: HeadsBase, tb: TargetBatch, step: int) -> tuple[Tensor, dict[str, Tensor]]:
        head_loss, metrics = self.head_loss(heads, tb)
        o = self.lora
        if o.quality_loss == "kl":
            ones = torch.ones(1, device=tb.logits.device)
            quality = kl_to_target(tb.logits[None], tb.ref_logits, _next_labels(tb), ones, offset=1)[0]
        else:
            quality = next_token_loss(tb.logits, tb.input_ids, tb.loss_mask)
        w = quality_weight(step, o.heads_only_steps, o.ramp_steps, o.quality_weight)
        hw = 1.0 if step < o.heads_only_steps else o.heads_weight
        metrics.update(heads_loss=head_loss.detach(), quality=quality.detach())
        return hw * head_loss + w * quality, metrics

    def save(self, heads: HeadsBase, target: nn.Module, out_dir: Path) -> None:
        """Heads in ``out_dir`` (their metadata names the adapter), the PEFT adapter in ``out_dir/adapter``:
        ``load_target(target, adapter=out_dir / "adapter")`` gives the target these heads were trained on."""
        heads.metadata["adapter"] = {"subfolder": ADAPTER_SUBFOLDER, "kind": "lora", "r": self.lora.r,
                                     "alpha": self.lora.alpha, "target_modules": list(self.lora.target_modules)}
        heads.save_pretrained(out_dir)  # replaces out_dir atomically, so the adapter goes in after
        target.save_pretrained(str(out_dir / ADAPTER_SUBFOLDER))


def _next_labels(tb: TargetBatch) -> Tensor:
    """(1, B, T) labels for the target's own next-token distribution at t (token t+1)."""
    return medusa_labels(tb.input_ids, tb.loss_mask, 1, offset=1)

