"""Faster CPU matmuls for the few-row linears of decoding, chosen per row count by measurement.

Decoding multiplies a handful of rows (1 token, a draft tree of 2-32 nodes, a drafter level) by
every weight matrix. With PyTorch's CPU wheel (MKL) ``F.linear`` on such inputs can be far from
the memory bound: on a 2-core AMD EPYC (AVX2), SmolLM2-135M's 211 linears take 85 ms for 1 row
and 135 ms for 2 rows, while the same products computed weight-major (the weight as the left
operand, the rows as a few columns) take 63 ms and 61 ms. A tree verify of 2-5 tokens then costs
what a 1-token forward did, which is what speculative decoding needs. On other CPUs and thread
counts the winner differs (with 1 thread here ``F.linear`` wins at 1 row), so ``auto`` measures
both on the model's own weights, per row count, and keeps the faster (``probe_plan``). MKL's
product is also uneven in the column count: with 1 thread here 3 columns cost ~1.2x what 4 do (a
top-2 tree verifies 3 tokens), so the probe also times 3-8 rows at their own count, and keeps
padding with zero rows up to the next power of two where that is faster. A third kernel,
headway's own (``headway.native``, C++ built on first use), streams each weight once for up to 8
rows and keeps 1-8 rows at about one row's cost; ``auto`` probes it too where it builds.

It changes no weights and no modeling code: ``weight_major(modules, plan)`` swaps the ``forward``
of plain ``nn.Linear`` modules for the duration of a ``with`` block, then restores them. Results
equal ``F.linear``'s to float rounding (tested); greedy decoding stays exact because verification
compares against the target's logits, whatever kernel produced them.
"""

from __future__ import annotations

import contextlib
import time
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import native

# The kernel names; target.LINEAR_KERNELS repeats them as the config choices (target.py stays light for
# --help, and the kernels sit below every room): tests/test_kernels.py keeps the two equal.
KERNELS = ("auto", "stock", "weight-major", "native")

# row buckets: a linear over n rows uses the choice of the first bucket bound >= n; past the last
# bound (prefill) it stays stock. Wide trees verify 17-64 tokens: there the native kernel, on both
# threads of a 2-core EPYC, still beat MKL over SmolLM2's linears (24 rows: 51 vs 76 ms; 64: 128 vs 133).
# Bounds between the powers of two: on a 2-core Xeon at 1 thread native beat MKL at 9-12 rows (101-113
# vs 123-161 ms) and lost at 16 (162-170 vs 131-139), so a 9-16 bucket timed at 16 ran 9 rows stock
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
MAX_PAD = 8  # row counts up to this may run padded to the next power of two


def weight_major_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        width: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ x.T`` (x: (..., in) -> (..., out)).
    The rows are padded with zero rows to ``width`` columns where that is more (at least 2: MKL's
    one-column path is the slow matrix-vector kernel); the padding's outputs are dropped."""
    rows = x.reshape(-1, x.shape[-1])  # (n, in)
    n = rows.shape[0]
    pad = max(width or 2, 2) - n
    cols = (torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad > 0 else rows).t()  # (in, n')
    out = torch.mm(weight, cols) if bias is None else torch.addmm(bias[:, None], weight, cols)  # (out, n')
    return out[:, :n].t().contiguous().reshape(*x.shape[:-1], weight.shape[0])


STOCK, WEIGHT_MAJOR, NATIVE = "stock", "weight-major", "native"


@dataclass(frozen=True)
class LinearPlan:
    """Which kernel each row bucket runs (``BUCKETS[i]`` -> ``kernels[i]``: stock, weight-major or
    native), and at how many columns weight-major runs: n rows at ``widths[n - 1]`` (padded with
    zero rows; past the tuple, ``max(n, 2)``)."""

    kernels: tuple[str, ...] = (STOCK,) * len(BUCKETS)
    widths: tuple[int, ...] = ()

    def width(self, rows: int) -> int:
        return self.widths[rows - 1] if rows <= len(self.widths) else max(rows, 2)

    @classmethod
    def everywhere(cls, kernel: str = WEIGHT_MAJOR) -> "LinearPlan":
        return cls((kernel,) * len(BUCKETS))

    def kernel(self, rows: int) -> str:
        for bound, name in zip(BUCKETS, self.kernels):
            if rows <= bound:
                return name
        return STOCK

    def use(self, rows: int) -> bool:
        """Whether ``rows`` rows run weight-major."""
        return self.kernel(rows) == WEIGHT_MAJOR

    @property
    def active(self) -> bool:
        return any(k != STOCK for k in self.kernels)

    def describe(self) -> str:
        """e.g. ``weight-major at 2, 3-4 rows (3 as 4); native at 5-8 rows`` / ``stock``."""
        lows = {b: (BUCKETS[i - 1] + 1 if i else 1) for i, b in enumerate(BUCKETS)}
        parts = []
        for name in dict.fromkeys(k for k in self.kernels if k != STOCK):
            on = [b for b, k in zip(BUCKETS, self.kernels) if k == name]
            text = f"{name} at " + ", ".join(f"{lows[b]}-{b}" if lows[b] != b else str(b) for b in on) + " rows"
            if name == WEIGHT_MAJOR:
                padded = [f"{n} as {w}" for n, w in enumerate(self.widths, 1) if w > max(n, 2) and self.use(n)]
                text += f" ({', '.join(padded)})" if padded else ""
            parts.append(text)
        return "; ".join(parts) or STOCK


def plain_linears(*modules: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear`` modules under ``modules`` (subclasses, e.g. LoRA or quantised
    layers, keep their own forward)."""
    seen: dict[int, nn.Linear] = {}
    for root in modules:
        for m in root.modules():
            if type(m) is nn.Linear:
                seen.setdefault(id(m), m)
    return list(seen.values())


def _forward(plan: LinearPlan):  # noqa: ANN202 - a bound forward for nn.Linear
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if x.device.type == "cpu":
            kernel = plan.kernel(rows)
            if kernel == WEIGHT_MAJOR:
                return weight_major_linear(x, self.weight, self.bias, plan.width(rows))
            if kernel == NATIVE and native.fits(x, self.weight):  # else (fp16, mixed dtypes, autograd): stock
                return native.native_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
    return forward


def bound_forwards(linears: Sequence[nn.Linear], plan: LinearPlan) -> list[tuple[nn.Linear, Callable[..., Any]]]:
    """Each linear with the forward that follows ``plan`` (none when the plan is all stock)."""
    if not plan.active:
        return []
    fn = _forward(plan)
    return [(m, types.MethodType(fn, m)) for m in linears]


@contextlib.contextmanager
def swapped(forwards: Sequence[tuple[nn.Linear, Callable[..., Any]]]) -> Iterator[None]:
    """Within the block each module runs its given forward; restored after, after an error too."""
    for m, fn in forwards:  # straight into __dict__: nn.Module.__setattr__ costs ~4 us a module, per step
        m.__dict__["forward"] = fn
    try:
        yield
    finally:
        for m, _ in forwards:
            m.__dict__.pop("forward", None)


def weight_major(linears: Sequence[nn.Linear], plan: LinearPlan) -> contextlib.AbstractContextManager[None]:
    """Within the block, these linears run the plan's kernel at each row count; restored after."""
    return swapped(bound_forwards(linears, plan))


_PROBE_RNG = torch.Generator().manual_seed(0)


def _time(linears: Sequence[nn.Linear], rows: int, kernel: str) -> float:
    """One pass of every linear over ``rows`` random rows (each weight read once), in seconds
    (weight-major: ``rows`` columns)."""
    product = {STOCK: F.linear, WEIGHT_MAJOR: weight_major_linear, NATIVE: native.native_linear}[kernel]
    xs: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    t0 = time.perf_counter()
    for m in linears:
        w = m.weight
        x = xs.get((w.shape[1], w.dtype))
        if x is None:
            # a private generator: probing must not move torch's global RNG (users seed it)
            x = xs[w.shape[1], w.dtype] = torch.randn(rows, w.shape[1], dtype=w.dtype, generator=_PROBE_RNG)
        product(x, w, m.bias)
    return time.perf_counter() - t0


@torch.inference_mode()
def probe_plan(linears: Sequence[nn.Linear], reps: int = 2, margin: float = 0.05,
               with_native: bool | None = None) -> LinearPlan:
    """Time the kernels on these (CPU) linears with the current thread count, interleaved so that
    a noisy moment hits each: stock and native at each bucket's row count, weight-major at
    2..``MAX_PAD`` columns and at the buckets' counts past it. n rows run weight-major padded to the next
    power of two where that is ``margin`` faster than n columns (only that width: a noisy probe of
    many widths would pick far ones). A bucket runs the faster of weight-major and native where
    that is ``margin`` faster than stock at its bound. Native is timed where it builds here and the
    weights are float32 or bfloat16 (``with_native`` forces either way). 23 x reps passes over the weights
    of 1-64 rows (~7 s for a 135M model on 2 cores), 10 x reps more with native."""
    cpu = [m for m in linears if m.weight.device.type == "cpu"]
    if not cpu:
        return LinearPlan()
    if with_native is None:
        with_native = (all(m.weight.dtype in (torch.float32, torch.bfloat16) and m.weight.is_contiguous() for m in cpu)
                       and native.native_kernel()[0])
    _time(cpu, 2, STOCK)  # warm-up: pages, kernel selection
    _time(cpu, 2, WEIGHT_MAJOR)
    times = {STOCK: dict.fromkeys(BUCKETS, float("inf")),
             WEIGHT_MAJOR: dict.fromkeys((*range(2, MAX_PAD + 1), *(b for b in BUCKETS if b > MAX_PAD)),
                                         float("inf"))}
    if with_native:
        _time(cpu, 2, NATIVE)
        times[NATIVE] = dict.fromkeys(BUCKETS, float("inf"))
    for _ in range(reps):
        for rows in sorted({r for t in times.values() for r in t}):
            for kernel, t in times.items():
                if rows in t:
                    t[rows] = min(t[rows], _time(cpu, rows, kernel))
    wm = times[WEIGHT_MAJOR]
    widths = []
    for n in range(1, MAX_PAD + 1):
        own, wide = max(n, 2), max(2, 1 << (n - 1).bit_length())
        widths.append(wide if wm[wide] * (1 + margin) < wm[own] else own)
    plan = LinearPlan(widths=tuple(widths))
    picks = []
    for b in BUCKETS:
        others = {WEIGHT_MAJOR: wm[plan.width(b)], **({NATIVE: times[NATIVE][b]} if with_native else {})}
        best = min(others, key=others.__getitem__)
        picks.append(best if others[best] * (1 + margin) < times[STOCK][b] else STOCK)
    return LinearPlan(tuple(picks), plan.widths)


# plans probed per target module and thread count, shared by every decoder on that target (so the
# rows of one benchmark run compare like with like)
_PLANS: "weakref.WeakKeyDictionary[nn.Module, dict[int, LinearPlan]]" = weakref.WeakKeyDictionary()


class LinearKernels:
    """A decoder's choice of linear kernel (``stock``, ``weight-major``, ``native`` or ``auto``) for
    the target's and the drafter's linears; ``auto`` probes on the target's weights (they dominate
    the cost), once per target and thread count, on first use. ``native`` is refused at once where
    the native kernel cannot be built, saying why."""

    def __init__(self, kernel: str, target: nn.Module, *drafters: nn.Module) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown linear kernel '{kernel}'; use one of {', '.join(KERNELS)}")
        if kernel == NATIVE:
            native.require_native()
        self.kernel = kernel
        self.target = target
        self.linears = plain_linears(target, *drafters) if kernel != "stock" else []
        self._forwards: dict[LinearPlan, list[tuple[nn.Linear, Callable[..., Any]]]] = {}  # built once a plan

    def plan(self) -> LinearPlan:
        if self.kernel == "stock" or not self.linears:
            return LinearPlan()
        if self.kernel in (WEIGHT_MAJOR, NATIVE):
            return LinearPlan.everywhere(self.kernel)
        plans = _PLANS.setdefault(self.target, {})
        threads = torch.get_num_threads()
        if threads not in plans:
            plans[threads] = probe_plan(plain_linears(self.target))
        return plans[threads]

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        """``with kernels():`` runs the block with this plan (entered once per decoder step)."""
        plan = self.plan()
        if plan not in self._forwards:
            self._forwards[plan] = bound_forwards(self.linears, plan)
        return swapped(self._forwards[plan])
