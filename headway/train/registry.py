"""``TASKS``: the one table of which ``Task`` trains which head kind (``TrainConfig.kind``).

A new head kind adds its task here; ``tests/test_architecture.py`` checks that every kind the
config accepts, and every heads kind ``heads.load`` knows, has one."""

from __future__ import annotations

from .dflash import DFlashTask
from .eagle import Eagle1Task, Eagle3Task
from .peagle import PEagleTask
from .tasks import Medusa2Task, MedusaTask, Task

TASKS: dict[str, type[Task]] = {
    "medusa": MedusaTask,
    "medusa2": Medusa2Task,
    "eagle1": Eagle1Task,
    "eagle3": Eagle3Task,
    "dflash": DFlashTask,
    "peagle": PEagleTask,
}

__all__ = ["TASKS"]
