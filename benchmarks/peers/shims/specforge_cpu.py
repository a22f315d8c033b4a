"""Run ``specforge train`` / ``specforge export`` on a CPU-only machine (specforge 0.2.0). One patch:

``specforge.core.loss`` imports Triton at module level (a GPU kernel for the KL over the draft vocabulary)
and wraps its reference in ``torch.compile``. It is replaced by that reference in plain PyTorch (the same
math: -sum(mask * p_target * log_softmax(logits)), averaged over positions), before SpecForge imports it.
Everything else (its CPU device detection, gloo process group, FSDP with NO_SHARD) is SpecForge's own.

    python shims/specforge_cpu.py train --config run.yaml [overrides ...]
"""
import sys
import types

import torch


def _compute_loss(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
    out_logp = torch.log_softmax(logits.float(), dim=2)  # (B, T, Vd)
    return -torch.sum(position_mask * target_p * out_logp, 2).mean()


class LogSoftmaxLoss:
    """The autograd Function's interface (``.apply``), autograd done by PyTorch."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        return _compute_loss(logits, target_p, position_mask)


loss = types.ModuleType("specforge.core.loss")
loss._compute_loss, loss.LogSoftmaxLoss = _compute_loss, LogSoftmaxLoss
sys.modules["specforge.core.loss"] = loss

from specforge.cli import main  # noqa: E402  (after the patch)

sys.exit(main())
