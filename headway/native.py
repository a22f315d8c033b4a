"""headway's native few-row linear (``headway/csrc/fewrow.cpp``), built on first use.

A tree verify multiplies 2-8 rows by every weight of the target. On CPUs that product is bound by
reading the weights, yet PyTorch's kernels make each extra row cost more. The native kernel streams
each block of weight rows once for all rows, with a software prefetch ahead of the stream. On one
thread of a 2-core AMD EPYC with AVX-512 (the kernel built for AVX2), SmolLM2-135M's 211 linears
took, for 1 / 2 / 4 / 8 / 16 rows: ``F.linear`` 35.5 / 61.0 / 53.4 / 64.4 / 87.7 ms, native
18.9 / 21.2 / 21.8 / 30.0 / 58.7 ms. A verify of 8 tokens then costs less than the stock one-token
forward.

It is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~30 s of CPU once,
cached by torch under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). Where it cannot
be built (no compiler, MSVC), ``native_kernel()`` says why and ``--linear-kernel auto`` goes on
without it; ``HEADWAY_NATIVE_KERNEL=0`` skips it. Float32 only: other dtypes run stock.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from .errors import HeadwayError

SOURCE = Path(__file__).parent / "csrc" / "fewrow.cpp"
ENV = "HEADWAY_NATIVE_KERNEL"


class NativeKernelError(HeadwayError):
    """The native kernel was asked for by name and cannot be built here."""


def _flags() -> list[str]:
    """-O3, plus AVX2/FMA on an x86-64 CPU that has them (built where it runs, so no -march=native:
    a cached build then also runs on any other AVX2 machine sharing the cache)."""
    flags = ["-O3"]
    if platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in ("AVX2",
                                                                                                       "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


@functools.lru_cache(maxsize=None)
def _build() -> tuple[Any, str]:
    """(the extension module, "") or (None, why not). Once per process."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None, f"disabled by {ENV}=0"
    _ninja_on_path()
    flags = _flags()
    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:10]
    try:
        from torch.utils.cpp_extension import load

        if not _cached(f"headway_fewrow_{tag}"):
            print("headway: building the native few-row linear kernel (once per machine, ~30 s)...",
                  file=sys.stderr, flush=True)
        log = logging.getLogger("torch.utils.cpp_extension")  # its compiler-ABI warnings: the failure says enough
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            module = load(name=f"headway_fewrow_{tag}", sources=[str(SOURCE)], extra_cflags=flags, verbose=False)
        finally:
            log.setLevel(level)
    except Exception as exc:  # noqa: BLE001 - any build failure means "not available here"
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        return None, f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]
    return module, ""


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip package's copy sits in the venv's bin, which is
    not on PATH unless the venv is activated (``.venv/bin/headway`` run directly)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _cached(name: str) -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    try:
        return any(Path(_get_build_directory(name, verbose=False)).glob("*.so"))
    except Exception:  # noqa: BLE001 - only decides whether to print the build note
        return False


def native_kernel() -> tuple[bool, str]:
    """(True, "") where the kernel is built and loadable here, else (False, why)."""
    module, why = _build()
    return module is not None, why


def require_native() -> None:
    """Build the kernel or raise NativeKernelError saying why it cannot be."""
    ok, why = native_kernel()
    if not ok:
        raise NativeKernelError(f"the native linear kernel cannot be built here ({why}); it needs a C++ compiler "
                                "(g++ or clang++) and ninja; use --linear-kernel auto or weight-major")


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the native kernel (float32 CPU tensors, contiguous weight;
    no autograd). Equal to F.linear's result to float rounding."""
    module, why = _build()
    if module is None:
        raise NativeKernelError(f"the native linear kernel is not available: {why}")
    out = module.fewrow(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this product can run native: float32 CPU tensors, a contiguous weight, no gradient."""
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
