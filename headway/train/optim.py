"""The optimisers ``optim.name`` picks for the heads.

- ``adamw`` (the default): AdamW with decoupled weight decay on matrices only.
- ``muon``: Muon (momentum, then the update orthogonalised by a Newton–Schulz iteration) on the
  hidden matrices — attention, MLP and ``fc`` weights — and AdamW on everything else: vectors
  (norms, biases) and the vocabulary-sized matrices (``lm_head``, embeddings), as Muon's authors
  and speculators' trainer do. One optimiser object for both, so accelerate's ``prepare``, the
  per-group lr schedule and checkpoint/resume treat it like plain AdamW.

Muon orthogonalises whole matrices, so it needs each matrix whole in one process: runs that shard
the heads (FSDP, ZeRO-3) are refused in ``check_optimizer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from .config import OptimConfig

ADAMW_NAME_HINTS = ("lm_head", "embed")  # vocabulary-sized matrices stay on AdamW
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic iteration, steep at zero (Keller Jordan's Muon)


@dataclass
class ParamGroup:
    """A task's parameters that share a learning rate (``Task.param_groups``)."""

    name: str
    params: list[nn.Parameter]
    lr_mult: float = 1.0  # this group's lr = optim.lr * lr_mult
    start_step: int = 0  # lr is 0 before this optimiser step (Medusa-2's heads-only warm-up)


def muon_eligible(name: str, p: Tensor) -> bool:
    """A hidden 2-D matrix (both sides > 1) that is not a vocabulary projection."""
    return p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAME_HINTS)


def orthogonalize(g: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """(A, B) -> (A, B) with singular values pushed towards 1 (roughly U V^T of g's SVD), in bf16.

    Works on the wide orientation (rows <= columns) so the Gram matrix is the small one."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T  # (A, A)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_lr_scale(shape: torch.Size) -> float:
    """Scale Muon's step so its RMS matches AdamW's (0.2 * sqrt(max side)); one lr serves both kinds."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


class MuonAdamW(torch.optim.Optimizer):
    """Param groups with ``muon: True`` take Muon steps, the others AdamW steps."""

    def __init__(self, groups: Iterable[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, momentum: float = 0.95, ns_steps: int = 5) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "momentum": momentum,
                    "ns_steps": ns_steps, "muon": False}
        super().__init__(list(groups), defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if group["muon"]:
                    if "momentum" not in state:
                        state["momentum"] = torch.zeros_like(p)
                    buf = state["momentum"]
                    buf.lerp_(g, 1 - group["momentum"])
                    update = orthogonalize(g.lerp(buf, group["momentum"]), group["ns_steps"])  # Nesterov
                    p.mul_(1 - lr * wd)
                    p.add_(update.to(p.dtype), alpha=-lr * muon_lr_scale(p.shape))
                    continue
                b1, b2 = group["betas"]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1  # a Python int: the bias corrections need no device sync
                t = state["step"]
                state["exp_avg"].lerp_(g, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
                p.mul_(1 - lr * wd)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))
        return loss


def lr_factor(step: int, total: int, o: OptimConfig) -> float:
    """Multiplier on the peak lr at optimiser step ``step`` (0-based): linear warm-up, then decay.

    Kept instead of ``transformers.get_scheduler``: its warm-up starts at lr 0 (step 0 trains
    nothing), "linear" has no floor (min_lr_ratio), "cosine_warmup_with_min_lr" decays one step
    ahead, and one schedule serves all param groups (Medusa-2's LoRA starts at ``start_step``).
    After the warm-up, cosine equals its "cosine_with_min_lr" (tests/test_train_losses.py)."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    if o.schedule == "linear":
        return 1.0 - (1.0 - o.min_lr_ratio) * progress
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(groups: list[ParamGroup], o: OptimConfig, names: dict[int, str] | None = None
                   ) -> torch.optim.Optimizer:
    """Per ParamGroup: decayed matrices and undecayed biases / norms on AdamW; with ``optim.name: muon``
    the hidden matrices (``muon_eligible`` by ``names``: id(param) -> name) go to a third group, on Muon."""
    names, on_muon = names or {}, o.name == "muon"
    pgs = []
    for g in groups:
        muon = [p for p in g.params if on_muon and muon_eligible(names.get(id(p), ""), p)]
        taken = {id(p) for p in muon}
        decay = [p for p in g.params if p.ndim >= 2 and id(p) not in taken]
        no_decay = [p for p in g.params if p.ndim < 2]
        parts = [(decay, o.weight_decay, False), (no_decay, 0.0, False)] + ([(muon, o.muon_weight_decay, True)]
                                                                            if muon else [])
        for ps, wd, is_muon in parts:  # extra keys ride along in the groups; AdamW ignores "muon"
            pgs.append({"params": ps, "lr": o.lr * g.lr_mult, "weight_decay": wd, "name": g.name,
                        "start_step": g.start_step, "muon": is_muon})
    if on_muon:
        return MuonAdamW(pgs, lr=o.lr, betas=tuple(o.betas), eps=o.eps, momentum=o.muon_momentum)
    return torch.optim.AdamW(pgs, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def make_scheduler(optimizer: torch.optim.Optimizer, total: int, o: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(start: int) -> Callable[[int], float]:
        return lambda step: 0.0 if step < start else lr_factor(step, total, o)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, [factor(g["start_step"]) for g in optimizer.param_groups])

