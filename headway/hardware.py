"""Is bf16 worth it here? Measured once per process, not guessed from the CPU's name. And ``sync``:
wait for a device that works asynchronously (a GPU) around a timed section.

On a CPU with native bf16 matmul (AMX / AVX512-BF16) bf16 autocast trains the demo target and
runs batched forwards ~1.4-1.8x faster than fp32. Without it PyTorch emulates bf16, and the same
work runs ~20-50x *slower* (measured: 0.76 bf16 GFLOP/s against 41 fp32 GFLOP/s on a 2-core AMD
EPYC with AVX2 only), so "bf16 because it is faster" must be checked on the machine at hand.

bf16 is chosen only where it is clearly faster (``FAST``): where the two are about even the choice
would follow the probe's noise, and an interrupted ``dtype: auto`` job resumed in another process
could then meet its own shards written in the other dtype. On a 2-core Xeon with AVX-512 VNNI but no
BF16 the old probe (one 256 x 256 product, best of 3, not interleaved) read 0.84, 0.99 and 1.52 on
three runs, and a SmolLM2 distill run it sent to bf16 made 55 tok/s on its first 64 prompts, against
111 in float32; this one reads 0.24-0.26 there.

``HEADWAY_CPU_BF16=1`` / ``=0`` skips the measurement (forces the answer).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

ENV = "HEADWAY_CPU_BF16"
FAST = 1.2  # bf16 where its matmul is at least this much faster than fp32 (native bf16: 1.4-2.5x)


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup() -> float:
    """fp32 time / bf16 time of the same matmul on this CPU (> 1: bf16 is faster): best of 5 each,
    interleaved so that a busy moment hits both. About 20 ms on a CPU with native bf16, up to
    ~1 s without (the emulated bf16 runs are slow)."""
    import torch

    n = 384
    gen = torch.Generator().manual_seed(0)  # the probe leaves torch's global RNG as it found it
    pairs = {"fp32": (torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen))}
    pairs["bf16"] = (pairs["fp32"][0].bfloat16(), pairs["fp32"][1].bfloat16())
    best = {}
    for name, (a, b) in pairs.items():
        a @ b  # warm-up: kernel selection, allocation
        best[name] = float("inf")
    for _ in range(5):
        for name, (a, b) in pairs.items():
            t0 = time.perf_counter()
            a @ b
            best[name] = min(best[name], time.perf_counter() - t0)
    return best["fp32"] / max(best["bf16"], 1e-9)


def cpu_bf16_is_fast() -> bool:
    """True when bf16 matmul is clearly faster than fp32 on this CPU (``FAST``; ``HEADWAY_CPU_BF16``
    overrides)."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    return cpu_bf16_speedup() >= FAST


def bf16_is_fast(device_type: str = "cpu") -> bool:
    """bf16 for speed on this device: CUDA when it supports bf16, a CPU when measured faster than fp32."""
    import torch

    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_bf16_is_fast()


def sync(device: Any) -> None:
    """Wait for the work queued on ``device`` (a ``torch.device``): around a timed section on a GPU,
    whose calls return before the work is done. A no-op on CPUs, whose calls return when done."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
