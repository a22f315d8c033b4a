"""Which process am I: rank, world size and device, through accelerate (one process works too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Processes:
    rank: int
    world_size: int
    device: torch.device
    state: Any  # accelerate.PartialState

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            self.state.wait_for_everyone()


def processes(device: str | None = None) -> Processes:
    """The current process group (``accelerate launch`` / ``torchrun``), or a group of one."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # Without cpu=True accelerate treats CPU processes as independent single-process runs.
    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available() or (device or "").startswith("cpu")
    state = PartialState(cpu=cpu)
    dev = torch.device(device) if device else state.device
    if state.num_processes > 1 and dev.type == "cpu":
        # Several processes share the cores: one thread each avoids oversubscription.
        torch.set_num_threads(max(1, torch.get_num_threads() // state.num_processes))
    return Processes(state.process_index, state.num_processes, dev, state)


def release_process_group() -> None:
    """Destroy the torch.distributed process group, if one exists, while the interpreter is whole.

    Left to interpreter teardown, the Gloo group's destructor joins its worker thread while holding
    the GIL, and that thread may be waiting for the GIL itself: a rank that finished its work then
    hangs at exit (seen in a 2-process CPU training run, about one run in a few)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
