"""Where and how fast the decoder runs: the heads' dtype, and torch.compile of the two hot calls
(the target's tree-verify forward, the drafter step). Exactness does not depend on any of it:
the verifier compares against the target's own logits, whatever kernels produced them."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..target import HEADS_DTYPES, resolve_dtype
from .args import DecodeError


def heads_dtype_for(heads_dtype: str | torch.dtype | None, target_dtype: torch.dtype) -> torch.dtype | None:
    """``auto`` (or None) -> the target's dtype; a name or torch dtype -> that dtype."""
    if heads_dtype is None or heads_dtype == "auto":
        return target_dtype
    if isinstance(heads_dtype, str) and heads_dtype not in HEADS_DTYPES and heads_dtype not in ("fp32", "bf16", "fp16"):
        raise DecodeError(f"unknown heads dtype '{heads_dtype}'; use one of {', '.join(HEADS_DTYPES)}")
    return resolve_dtype(heads_dtype)


def compile_verify(target: nn.Module) -> Callable[..., Any]:
    """The target's forward compiled for the tree-verify call (prefill stays eager: its length
    varies). With a static cache every input has a fixed shape per tree size, so it compiles once
    per tree shape; the model object itself is not changed."""
    return torch.compile(target.forward, dynamic=False)


def compile_heads(heads: nn.Module) -> None:
    """Compile the drafter step in place (the module's ``forward``; Medusa: one call per step,
    EAGLE: one call per tree level, whose length grows, hence ``dynamic=True``)."""
    if "forward" in heads.__dict__:  # already compiled (heads shared by several speculators)
        return
    heads.forward = torch.compile(heads.forward, dynamic=True)  # type: ignore[method-assign]
