"""headway's native few-row linear (``headway/csrc/fewrow.cpp``), built on first use.

A tree verify multiplies 2-64 rows by every weight of the target. On CPUs that product is bound by
reading the weights up to ~8 rows, yet PyTorch's kernels make each extra row cost more. The native
kernel streams each block of weight rows once for all rows, with a software prefetch ahead of the
stream, and splits the blocks over torch's threads. On a 2-core AMD EPYC with AVX-512 (the kernel
built for AVX2), SmolLM2-135M's 211 linears took, for 1 / 4 / 8 / 16 / 64 rows, with 1 thread:
``F.linear`` 33.6 / 52.3 / 61.5 / 87.3 / 254 ms, native 18.0 / 18.0 / 28.6 / 56.4 / 227 ms; with 2:
``F.linear`` 36.2 / 53.5 / 57.6 / 67.8 / 133 ms, native 15.6 / 16.1 / 19.2 / 33.5 / 128 ms
(``experiments/native_threads.py``). A verify of 8 tokens then costs less than the stock one-token
forward. Past 8 rows the product is bound by its multiply-adds, and the kernel runs register tiles
(4 weight rows x 6 rows, in AVX-512 vectors where built with -mavx512f): on a 2-core Xeon with
AVX-512, 2 threads, 16 / 24 / 48 rows took 0.71 / 0.64 / 0.57x the time of 8-row chunks
(``experiments/native_tiles.py``). Built with AVX-512, the tiles run 1-8 rows too (one pass of up to
8 rows, fewer weight rows per tile past 6): 0.87-0.97x the streamed blocks' time there, with 1
and 2 threads; AVX2 builds keep the streamed blocks up to 8 rows.

It is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~30 s of CPU once,
cached by torch under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). Where it cannot
be built (no compiler, MSVC), ``native_kernel()`` says why and ``--linear-kernel auto`` goes on
without it; ``HEADWAY_NATIVE_KERNEL=0`` skips it. Float32, and bfloat16 weights (widened to float32 as
they are read, the product in float32, the result rounded to bfloat16): a bfloat16 drafter reads half
the bytes of a float32 one beside a float32 target. Other dtypes run stock.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import HeadwayError

SOURCE = Path(__file__).parent / "csrc" / "fewrow.cpp"
ENV = "HEADWAY_NATIVE_KERNEL"


class NativeKernelError(HeadwayError):
    """The native kernel was asked for by name and cannot be built here."""


def _flags() -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags): -O3, AVX2/FMA on an x86-64 CPU that has them, + AVX-512F where
    it has that (the many-row tiles; no -march=native, so a cached build also runs on any machine of
    the same capability sharing the cache, and the flags are in the build's name: another capability
    builds its own), and -fopenmp where ATen's parallel backend is OpenMP (Linux wheels): ``at::parallel_for``
    is a header template, so without it the kernel ran on one thread whatever torch's thread count
    (2 threads, 16 rows of SmolLM2-135M's linears: 61 ms without, 34 ms with). The loader reuses the
    libgomp torch already holds (same soname), so there is one OpenMP pool."""
    flags = ["-O3"]
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in ("x86_64", "amd64") and capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
        if capability == "AVX512":
            flags.append("-mavx512f")  # the many-row tiles: 16-float vectors, 32 registers
    link = []
    if platform.system() == "Linux" and "parallel backend: OpenMP" in torch.__config__.parallel_info():
        flags.append("-fopenmp")
        link.append("-fopenmp")
    return flags, link


@functools.lru_cache(maxsize=None)
def _build() -> tuple[Any, str]:
    """(the extension module, "") or (None, why not). Once per process. Where the compiler cannot
    build with OpenMP (e.g. clang without libomp), the kernel is built without it: on one thread it
    still beats ``F.linear`` on few rows."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None, f"disabled by {ENV}=0"
    _ninja_on_path()
    flags, link = _flags()
    module, why = _load(flags, link)
    if module is None and "-fopenmp" in flags:
        module, _ = _load([f for f in flags if f != "-fopenmp"], [f for f in link if f != "-fopenmp"])
        if module is not None:
            print(f"headway: the native kernel built without OpenMP ({why}); it runs on one thread",
                  file=sys.stderr, flush=True)
            why = ""
    if module is None:  # once per process: the stock kernels run instead, and the user learns why
        print(f"headway: the native few-row linear kernel cannot be built here ({why}); going on with PyTorch's "
              f"kernels (install a C++ compiler, g++ or clang++, for it; {ENV}=0 skips it)", file=sys.stderr, flush=True)
    return module, why


def _load(flags: list[str], link: list[str]) -> tuple[Any, str]:
    """Build (or load from torch's cache) the kernel with these flags: (module, "") or (None, why)."""
    tag = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags + link).encode()).hexdigest()[:10]
    try:
        from torch.utils.cpp_extension import load

        if not _cached(f"headway_fewrow_{tag}"):
            print("headway: building the native few-row linear kernel (once per machine, ~30 s)...",
                  file=sys.stderr, flush=True)
        log = logging.getLogger("torch.utils.cpp_extension")  # its compiler-ABI warnings: the failure says enough
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            with build_lock(f"headway_fewrow_{tag}"):
                module = load(name=f"headway_fewrow_{tag}", sources=[str(SOURCE)], extra_cflags=flags,
                              extra_ldflags=link, verbose=False)
        finally:
            log.setLevel(level)
    except Exception as exc:  # noqa: BLE001 - any build failure means "not available here"
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        return None, f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]
    return module, ""


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold headway's own lock on the build of ``name`` and clear a baton a killed build left behind.

    torch's builder marks a build in progress with a ``lock`` file in the build folder and waits, forever,
    while it exists; a build killed mid-way (kill -9, a session ended) leaves it there and every later
    process hangs. headway's builders hold an ``flock`` on a file beside the folder, which the kernel
    releases when its holder dies: whoever holds it and still finds the baton knows the builder is gone."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    baton = folder / "lock"
    try:
        import fcntl
    except ImportError:  # no flock (Windows): a baton older than any build is taken as stale
        if baton.exists() and time.time() - baton.stat().st_mtime > STALE_BATON_S:
            _clear(baton)
        yield
        return
    with open(folder.parent / f"{folder.name}.headway-lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another live builder: wait for it (~30 s)
        try:
            if baton.exists():
                _clear(baton)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


STALE_BATON_S = 1800.0


def _clear(baton: Path) -> None:
    print(f"headway: removing {baton}, left by a native-kernel build that was killed", file=sys.stderr, flush=True)
    baton.unlink(missing_ok=True)


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
    """``F.linear(x, weight, bias)`` through the native kernel (float32 or bfloat16 CPU tensors, contiguous
    weight; no autograd). Equal to F.linear's result to float rounding."""
    module, why = _build()
    if module is None:
        raise NativeKernelError(f"the native linear kernel is not available: {why}")
    out = module.fewrow(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def parallel_width(tasks: int = 64) -> int:
    """How many threads the kernel's parallel loop over ``tasks`` blocks runs on (at most
    ``torch.get_num_threads()``); 0 where the kernel is not built."""
    module, _ = _build()
    return int(module.parallel_width(tasks)) if module is not None else 0


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this product can run native: float32 or bfloat16 CPU tensors of one dtype, a contiguous
    weight, no gradient."""
    return (x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
            and weight.is_contiguous() and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
