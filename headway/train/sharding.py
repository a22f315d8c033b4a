"""Sharding the frozen target across processes, when accelerate shards the training (design.md §8).

accelerate shards only what goes through ``accelerator.prepare``: the heads. The frozen target
is held outside that module (it is never trained nor saved), so without this module every rank
would hold all of it. Here it is sharded too:

- FSDP (``distributed_type: FSDP``, or ``ACCELERATE_USE_FSDP=true`` on CPU, where accelerate has
  no FSDP and runs the heads under DDP): torch's FSDP2 ``fully_shard`` on each decoder layer (the
  classes the target names in ``_no_split_modules``). Each layer gathers its weights for its own
  forward and frees them after. The embeddings, the final norm and the lm_head are left whole:
  the heads read the embeddings and the lm_head directly (outside the target's forward, where a
  sharded weight is a DTensor shard), so they would need whole copies anyway. The base model is
  not wrapped either: transformers finds which outputs to record by the model's class, which
  ``fully_shard`` replaces (``output_hidden_states`` would silently return None).
- DeepSpeed ZeRO-3: ``deepspeed.initialize`` on the target with the run's DeepSpeed config
  (no optimiser), which partitions every parameter; the heads first get their own whole copies
  of the modules they borrow. Checked by reading only (no DeepSpeed on these machines).

The trainable heads are sharded by accelerate; ``full_state`` gathers them whole for saving.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from torch import Tensor, nn


def env_true(name: str) -> bool:
    """An accelerate-style boolean environment variable (1/true/yes)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def sharding_backend(accelerator: Any) -> str | None:
    """How this run shards the frozen target: "fsdp", "deepspeed" (ZeRO-3) or None (one process,
    DDP, ZeRO-1/2: every rank holds the whole target, as before)."""
    from accelerate.utils import DistributedType

    if accelerator.num_processes < 2:
        return None
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return "fsdp"
    if kind == DistributedType.DEEPSPEED and int(accelerator.state.deepspeed_plugin.zero_stage) == 3:
        return "deepspeed"
    # accelerate turns FSDP on for GPUs only (state.py); launched with an FSDP config on CPU it
    # runs DDP, and the target is still sharded as the config asks
    if kind == DistributedType.MULTI_CPU and env_true("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return None


def shard_plan(target: nn.Module) -> list[str]:
    """Names of the modules ``fully_shard`` wraps: every module whose class the target lists in
    ``_no_split_modules`` (its decoder layers), outermost only. A pure function of the module tree."""
    classes = set(getattr(target, "_no_split_modules", None) or [])
    if not classes:
        raise ValueError(f"{type(target).__name__} names no decoder layer class (_no_split_modules), so its layers "
                         "cannot be sharded one by one")
    plan: list[str] = []
    for name, module in target.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(p + ".") for p in plan):
            plan.append(name)
    if not plan:
        raise ValueError(f"{type(target).__name__} has no module of the classes {sorted(classes)} to shard")
    return plan


def freeze(target: nn.Module) -> None:
    """No gradients, eval mode: what a frozen target is, whoever wraps it."""
    target.requires_grad_(False)
    target.eval()


def shard_fsdp(target: nn.Module, accelerator: Any) -> list[str]:
    """FSDP2 ``fully_shard`` on each decoder layer of the frozen target, over all processes
    (the plugin's CPU offload applies to it too). Returns the wrapped module names."""
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    freeze(target)
    plan = shard_plan(target)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    offload = getattr(plugin, "cpu_offload", None)
    kwargs: dict[str, Any] = {"reshard_after_forward": True}  # frozen: gather for the forward, free after
    if isinstance(offload, OffloadPolicy):
        kwargs["offload_policy"] = offload
    for name in plan:
        fully_shard(target.get_submodule(name), **kwargs)
    return plan


def own_borrowed(heads: nn.Module) -> None:
    """Give the heads whole, frozen copies of the target modules they borrow (embeddings, lm_head),
    before the target's own weights are partitioned."""
    keys = ("_target_embed", "_target_lm_head")
    borrowed = tuple(heads.__dict__.get(k) for k in keys)
    copies = copy.deepcopy(borrowed)  # one memo: a tied embedding / lm_head weight stays one tensor
    for key, module in zip(keys, copies):
        if module is not None:
            object.__setattr__(heads, key, module.requires_grad_(False))


def shard_sizes(target: nn.Module) -> tuple[int, int]:
    """(parameters this rank holds, parameters of the whole target)."""
    held = whole = 0
    for p in target.parameters():
        if hasattr(p, "ds_numel"):  # a ZeRO-3 partitioned parameter: p itself is empty
            held, whole = held + p.ds_tensor.numel(), whole + p.ds_numel
        else:
            held, whole = held + local_part(p).numel(), whole + p.numel()
    return held, whole


def shard_deepspeed(target: nn.Module, heads: nn.Module, accelerator: Any) -> nn.Module:
    """ZeRO-3 partitioning of the frozen target (the DeepSpeed engine is returned and run in its
    place); the run's DeepSpeed config, without optimiser or scheduler. By reading, not run here."""
    import deepspeed

    freeze(target)
    own_borrowed(heads)
    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    engine, *_ = deepspeed.initialize(model=target, config=config)
    engine.eval()
    return engine


def shard_target(target: nn.Module, heads: nn.Module, accelerator: Any) -> tuple[nn.Module, str | None]:
    """The target as this run runs it, and how it is sharded (None: whole on every rank)."""
    backend = sharding_backend(accelerator)
    if backend == "fsdp":
        shard_fsdp(target, accelerator)
    elif backend == "deepspeed":
        target = shard_deepspeed(target, heads, accelerator)
    return target, backend


# -- sharded trainable parameters ---------------------------------------------------------------
def is_sharded(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_part(t: Tensor) -> Tensor:
    """This rank's values of a parameter: its shard under FSDP2, the tensor itself otherwise."""
    return t.to_local() if is_sharded(t) else t


def full_state(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s state dict with whole CPU tensors, sharded parameters gathered (a collective:
    every process calls it; under FSDP2 only the main process receives the tensors)."""
    state = module.state_dict()
    if not any(is_sharded(v) for v in state.values()):
        return {k: v.detach().cpu() for k, v in state.items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
