"""accelerate plumbing: the Accelerator a run trains with, and the collectives the loop calls.

Everything here is the same for every head kind: mixed precision (``auto`` picks bf16 only where
it is measured fast), gradient accumulation counted by accelerate, trackers whose package may be
missing, what a checkpoint saves of a module that holds an adapted target, and the refusals of
settings an accelerator made elsewhere cannot honour.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..hardware import bf16_is_fast
from ..optional import MissingDependency, need, skip_line
from .config import TrainConfig
from .errors import TrainError
from .sharding import env_true, shard_sizes


def make_accelerator(cfg: TrainConfig) -> Any:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

    mp = cfg.mixed_precision
    on_cpu = cfg.device == "cpu" or not torch.cuda.is_available() or env_true("ACCELERATE_USE_CPU")
    if mp == "auto":  # bf16 where it is fast: a GPU that has it, a CPU measured faster in bf16 than fp32
        mp = "bf16" if bf16_is_fast("cpu" if on_cpu else "cuda") else "no"
    elif mp == "bf16" and on_cpu and not bf16_is_fast("cpu") and PartialState().is_main_process:
        print("warning: mixed_precision=bf16 on a CPU without fast bf16 matmul (emulated bf16 is many times "
              "slower than fp32 here); mixed_precision=auto picks what is fast", file=sys.stderr, flush=True)
    log_with = tracker(cfg.report_to)
    # AcceleratorState is a per-process singleton that refuses a second mixed_precision; reset it
    # (not the distributed PartialState) so several runs can share one process (tests, notebooks).
    AcceleratorState._reset_state()
    # sync_with_dataloader off: a step is always grad_accum micro-batches (the loader is longer
    # than the run, and a resumed run skips whole steps), counted by accelerate, never cut short
    accumulation = GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False)
    return Accelerator(mixed_precision=mp, log_with=log_with, step_scheduler_with_optimizer=False,
                       gradient_accumulation_plugin=accumulation,
                       project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                                           logging_dir=str(Path(cfg.output_dir) / "logs")),
                       dataloader_config=DataLoaderConfiguration(even_batches=True))


def check_accumulation(accelerator: Any, grad_accum: int) -> None:
    """An accelerator made elsewhere must accumulate as configured: ``accumulate`` decides when to
    sync and ``backward`` divides the loss by its count."""
    if accelerator.gradient_accumulation_steps != grad_accum:
        raise TrainError(f"the accelerator accumulates {accelerator.gradient_accumulation_steps} micro-batches but "
                         f"grad_accum={grad_accum}; make it with make_accelerator(cfg)")


def check_optimizer(accelerator: Any, optimizer: str) -> None:
    """Muon orthogonalises whole matrices: refuse runs where accelerate shards the heads' parameters."""
    from accelerate.utils import DistributedType

    if optimizer == "muon" and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise TrainError(f"optim.name=muon needs each head matrix whole in every process, but this run shards the "
                         f"heads or their optimiser state ({accelerator.distributed_type.value}); use "
                         "optim.name=adamw or plain DDP")


def tracker(report_to: str) -> list[str] | None:
    """accelerate's ``log_with`` for ``report_to``; a tracker whose package is not installed is left
    out with one line saying what to install (the run's own log.jsonl still has every record).
    ``PartialState`` is only asked then: made before the Accelerator on every run, it left both
    processes of a 2-process CPU run believing they were the main one."""
    if report_to == "none":
        return None
    try:
        need(report_to, f"report_to: {report_to}")
    except MissingDependency as e:
        from accelerate import PartialState

        if PartialState().is_main_process:
            print(f"headway train: {skip_line(e, f'report_to: {report_to}')}; the run's log.jsonl has every "
                  "record", file=sys.stderr, flush=True)
        return None
    return [report_to]


def trainable_only_hook(models: list[nn.Module], weights: list[dict[str, Tensor]], output_dir: str) -> None:
    """Save only what trains (+ head buffers): a Medusa-2 checkpoint must not copy the whole target."""
    for model, w in zip(models, weights):
        keep = {n for n, p in model.named_parameters() if p.requires_grad}
        keep |= {n for n, _ in model.named_buffers() if ".heads." in f".{n}" or n.startswith("heads.")}
        for k in [k for k in w if k not in keep]:
            del w[k]


def reduce_mean(accelerator: Any, values: dict[str, Tensor]) -> dict[str, float]:
    """One sync point: stack, average over processes, ``.tolist()``."""
    keys = sorted(values)
    stacked = torch.stack([values[k].float().reshape(()) for k in keys]).to(accelerator.device)
    stacked = accelerator.reduce(stacked, reduction="mean")
    return dict(zip(keys, stacked.tolist()))


def sharding_record(target: nn.Module, backend: str | None, accelerator: Any) -> dict[str, Any] | None:
    """How the frozen target is spread over the processes, for the log: the backend, its parameter
    count and how many each process holds (a collective). None when every process holds it whole."""
    if backend is None:
        return None
    held, whole = shard_sizes(target)
    per_rank = accelerator.gather(torch.tensor([held], device=accelerator.device)).tolist()
    return {"backend": backend, "params": whole, "params_per_rank": per_rank}


def main_console(accelerator: Any) -> Any:
    from rich.console import Console

    return Console() if accelerator.is_main_process else None

