"""The trained module: what accelerate prepares, and how it is evaluated.

``TrainModule`` holds the heads (and, for Medusa-2, the adapted target); its forward runs the
target -- or reads stored features -- and the task's loss, so DDP sees one forward per backward.
``evaluate`` adds the task's held-out sums over batches and processes and summarises them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from .batch import StoredLogits, TargetBatch, lm_head_logits, logit_transform, stored_batch, target_batch
from .losses import IGNORE_INDEX, medusa_labels
from .tasks import Task


class TrainModule(nn.Module):
    """What accelerate prepares: the heads (and the adapted target, when it trains). Its forward
    runs the target and the task's loss, so DDP sees one forward per backward. A frozen target
    is held outside the module tree: never DDP-wrapped, never saved."""

    def __init__(self, task: Task, heads: nn.Module, target: nn.Module, adapted: bool, offline: bool = False) -> None:
        super().__init__()
        self.task, self.heads = task, heads
        if adapted:
            self.target = target
        else:
            object.__setattr__(self, "frozen_target", target)
        self.adapted = adapted
        self.layers = task.feature_layers(heads)
        self.stored_logits: StoredLogits | None = None
        if offline:  # stored states go where online ones live, in the target's dtype
            head = target.get_output_embeddings()
            self.stored_device, self.stored_dtype = head.weight.device, head.weight.dtype
            if task.needs_logits():  # the target's lm_head on the stored final state, in float32 (made once)
                reduced = getattr(task, "stored_logits", None)  # only the rows (and argmax) its loss reads
                self.stored_logits = reduced(heads, head) if reduced is not None else lm_head_logits(head)
                self.stored_logits.transform = logit_transform(target.config)  # Gemma 2's soft-cap, ...

    def run_target(self) -> nn.Module:
        return self.target if self.adapted else self.frozen_target

    def target_batch(self, batch: dict[str, Any], need_logits: bool, grad: bool = False,
                     evaluate: bool = False) -> TargetBatch:
        """Online: one target forward. Offline (a ``collate_features`` batch): the stored states,
        and the lm_head on ``final`` when logits are needed; the decoder never runs. Evaluation
        takes the target's argmax from its logits, whatever the training loss reads."""
        if "features" in batch:
            logits = self.stored_logits if need_logits else None
            if logits is not None and evaluate:
                logits = logits.exact()
            return stored_batch(batch, self.layers, logits, self.stored_device, self.stored_dtype)
        return target_batch(self.run_target(), batch, self.layers, need_logits, need_ref=self.adapted, grad=grad)

    def forward(self, batch: dict[str, Any], step: int, evaluate: bool = False) -> Any:
        """The step's (loss, metrics); with ``evaluate`` the held-out sums (``evaluate``). Evaluation
        goes through ``forward`` too: under FSDP the heads' weights are whole only inside it."""
        if evaluate:
            return self.evaluate(batch)
        tb = self.target_batch(batch, self.task.needs_logits(), grad=self.adapted)
        return self.task.loss(self.heads, tb, step)

    @torch.no_grad()
    def inspect(self, batch: dict[str, Any]) -> TargetBatch:
        """The target's side of a batch with logits, to find where a NaN came from (failure path only)."""
        if "features" not in batch:
            return target_batch(self.run_target(), batch, self.layers, need_logits=True)
        logits = self.stored_logits
        if logits is None and "final" in batch["features"]:
            logits = lm_head_logits(self.run_target().get_output_embeddings())
            logits.transform = logit_transform(self.run_target().config)
        return stored_batch(batch, self.layers, logits, self.stored_device, self.stored_dtype)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        tb = self.target_batch(batch, self.task.needs_logits() or self.adapted, evaluate=True)
        stats = self.task.eval_stats(self.heads, tb)
        if self.adapted:  # what adapting cost the target: its held-out LM loss with and without the adapter
            stats.update(target_lm_stats(tb.logits, tb.ref_logits, tb.input_ids, tb.loss_mask))
        return stats


def target_lm_stats(logits: Tensor, ref_logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """Summed next-token cross-entropy of the adapted and the base target on target-written tokens."""
    labels = medusa_labels(input_ids, loss_mask, 1, offset=1)[0]  # (B, T)
    flat = labels.flatten()
    ce = torch.nn.functional.cross_entropy
    return {"target_ce_sum": ce(logits.flatten(0, 1).float(), flat, ignore_index=IGNORE_INDEX, reduction="sum"),
            "base_ce_sum": ce(ref_logits.flatten(0, 1).float(), flat, ignore_index=IGNORE_INDEX, reduction="sum"),
            "target_ce_count": (flat != IGNORE_INDEX).sum()}


def evaluate(module: TrainModule, loader: DataLoader, accelerator: Any, max_batches: int | None = None
             ) -> dict[str, Any]:
    """The held-out summary: the task's sums over ``loader`` (at most ``max_batches``) and every process."""
    was_training = module.training
    module.eval()
    totals: dict[str, Tensor] = {}
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        with accelerator.autocast():
            stats = module(batch, 0, evaluate=True)
        for k, v in stats.items():
            totals[k] = totals[k] + v.detach() if k in totals else v.detach().clone()
    totals = {k: accelerator.reduce(v.to(accelerator.device), reduction="sum").cpu() for k, v in sorted(totals.items())}
    module.train(was_training)
    out = module.task.summarize({k: v for k, v in totals.items() if not k.startswith(("target_ce", "base_ce"))})
    if "target_ce_sum" in totals:
        n = max(1, int(totals["target_ce_count"]))
        out["target_loss"] = round(float(totals["target_ce_sum"]) / n, 5)
        out["base_target_loss"] = round(float(totals["base_ce_sum"]) / n, 5)
        out["target_loss_cost"] = round(out["target_loss"] - out["base_target_loss"], 5)
    return out

