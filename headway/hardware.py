"""Is bf16 worth it here? Measured once per process, not guessed from the CPU's name.

On a CPU with native bf16 matmul (AMX / AVX512-BF16) bf16 autocast trains the demo target and
runs batched forwards ~1.4-1.8x faster than fp32. Without it PyTorch emulates bf16, and the same
work runs ~20-50x *slower* (measured: 0.76 bf16 GFLOP/s against 41 fp32 GFLOP/s on a 2-core AMD
EPYC with AVX2 only), so "bf16 because it is faster" must be checked on the machine at hand.

``HEADWAY_CPU_BF16=1`` / ``=0`` skips the measurement (forces the answer).
"""

from __future__ import annotations

import functools
import os
import time

ENV = "HEADWAY_CPU_BF16"


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup() -> float:
    """fp32 time / bf16 time of the same small matmul on this CPU (> 1: bf16 is faster).

    About 5 ms on a CPU with native bf16, up to ~0.2 s without (the emulated bf16 runs are slow)."""
    import torch

    n = 256
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    a16, b16 = a32.bfloat16(), b32.bfloat16()

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        a @ b  # warm-up: kernel selection, allocation
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(a32, b32) / max(best(a16, b16), 1e-9)


def cpu_bf16_is_fast() -> bool:
    """True when bf16 matmul is at least as fast as fp32 on this CPU (``HEADWAY_CPU_BF16`` overrides)."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    return cpu_bf16_speedup() >= 1.0


def bf16_is_fast(device_type: str = "cpu") -> bool:
    """bf16 for speed on this device: CUDA when it supports bf16, a CPU when measured faster than fp32."""
    import torch

    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_bf16_is_fast()
