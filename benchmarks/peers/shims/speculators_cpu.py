"""Run ``speculators train`` on a CPU-only machine (speculators 0.9.0). Each patch says why; nothing else
changes: the model, data pipeline, loss (``--loss-implementation eager``) and optimiser are its own.

    python shims/speculators_cpu.py train --data-path ... (the same arguments as ``speculators train``)
"""
import sys

import torch

import speculators.train.trainer as trainer

# 1. The trainer moves the model and every batch to ``get_local_rank()`` (0 = cuda:0): use the CPU.
trainer.get_local_rank = lambda: "cpu"
# 2. Its autocast device is ``torch.accelerator.current_accelerator()`` or "cuda" when there is none:
#    report the CPU so ``torch.autocast("cpu", dtype=--hidden-states-dtype)`` is used.
torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
# 3. Timers call ``torch.accelerator.synchronize()``, which needs an accelerator: nothing to wait for.
torch.accelerator.synchronize = lambda *a, **k: None
# 4. With an accelerator reported, its step timer also reads accelerator memory: none (peak RSS is measured outside).
torch.accelerator.memory_allocated = lambda *a, **k: 0
# 5. At exit it empties the accelerator's cache (``torch.cpu`` has no empty_cache): nothing to empty.
torch.cpu.empty_cache = lambda: None

# 6. Its DataLoader pins memory (pin_memory=True), which needs an accelerator: no pinning.
import speculators.train.dataloader as dataloader  # noqa: E402

_DataLoader = dataloader.DataLoader


def _loader(*args, **kwargs):
    kwargs["pin_memory"] = False
    return _DataLoader(*args, **kwargs)


dataloader.DataLoader = _loader

from speculators.__main__ import app  # noqa: E402  (after the patches)

sys.exit(app())
