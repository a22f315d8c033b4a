"""Non-finite guards: a NaN or infinity stops training before it reaches the weights or a file.

One sync per step checks the summed loss and the gradient norm; after a bad step the inputs are
inspected in the order the data flows (hidden states or stored features, logits, loss, gradient)
so the one-line error names the first non-finite one. Heads holding a non-finite weight are never
written.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .batch import feature_key
from .config import TrainConfig
from .module import TrainModule
from .sharding import is_sharded, local_part


def step_is_finite(accelerator: Any, loss: Tensor, grad_norm: Tensor | None) -> bool:
    """One sync per step: the step's summed loss and its gradient norm are finite (on every process).
    Under fp16 the grad scaler skips overflowing steps itself, so only the loss is checked there."""
    ok = torch.isfinite(loss)
    if grad_norm is not None and accelerator.scaler is None:
        ok = ok & torch.isfinite(torch.as_tensor(grad_norm, device=ok.device))
    if accelerator.num_processes > 1:  # every process must stop, not only the one with the NaN row
        ok = accelerator.reduce(ok.float().reshape(1), reduction="sum") == accelerator.num_processes
    return bool(ok.all())


def non_finite_message(module: TrainModule, cfg: TrainConfig, step: int, batches: list[dict[str, Any]],
                       losses: list[Tensor], grad_norm: Tensor | None) -> str:
    """After a non-finite step: the first non-finite input, in the order the data flows (the
    target's hidden states or the stored features, the target's logits, the loss, the gradient
    norm), on the step's real tokens, as one line naming the step and what to do."""
    head = f"training stopped at step {step}"
    tail = "; nothing of this step was saved"
    for i, batch in enumerate(batches):
        where = f" (micro-batch {i + 1} of {len(batches)})" if len(batches) > 1 else ""
        tb = module.inspect(batch)
        real = tb.attention_mask.bool()  # (B, T): padding is never read
        for layer, hidden in sorted(tb.hidden.items()):
            if not bool(torch.isfinite(hidden[real]).all()):
                key = feature_key(layer)
                if "features" in batch:
                    return (f"{head}: the stored features '{key}' in {cfg.features} are NaN/inf{where}; make them "
                            f"again with headway features{tail}")
                return (f"{head}: the target's hidden states '{key}' are NaN/inf{where}; check the target's weights "
                        f"or its dtype (dtype={cfg.dtype}; float16 overflows){tail}")
        if tb.logits is not None and not bool(torch.isfinite(tb.logits[real]).all()):
            return (f"{head}: the target's logits are NaN/inf though its hidden states are finite{where}; check its "
                    f"lm_head weights or dtype={cfg.dtype}{tail}")
        if not bool(torch.isfinite(losses[i]).all()):
            return (f"{head}: the loss is {float(losses[i])} though the target's hidden states and logits are "
                    f"finite{where}: the heads diverged; lower optim.lr (now {cfg.optim.lr}) or set "
                    f"optim.max_grad_norm{tail}")
    norm = float(grad_norm) if grad_norm is not None else math.nan
    return (f"{head}: the gradient norm is {norm} though the loss is finite; lower optim.lr (now {cfg.optim.lr}) "
            f"or set optim.max_grad_norm{tail}")


def non_finite_weight(module: TrainModule, accelerator: Any = None) -> str | None:
    """The name of the first trainable weight that holds a NaN/inf (one sync), or None: heads with
    such weights are never written. Sharded weights (FSDP) are checked shard by shard on every
    process (a collective then: every process calls it)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(local_part(p.detach())).all() for _, p in named])  # (P,) bool
    if accelerator is not None and accelerator.num_processes > 1 and any(is_sharded(p) for _, p in named):
        finite = accelerator.reduce(finite.float(), reduction="sum") == accelerator.num_processes
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]

