"""The decoder's arguments, checked once, up front: each rule is in the message that breaks it.

``check_decode_args`` is pure (numbers in, ``DecodeError`` or None out); ``Speculator.stream``
calls it once the prompt is tokenised, and the CLI configs call it while parsing, so a bad value
fails in one line before any model is loaded. ``DecodeTargetArgs`` are the runtime options every
decoding command shares (generate, chat, bench, tune). Light at import (no torch): ``--help``
reads these configs.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..config import opt
from ..errors import HeadwayError
from ..target import LINEAR_KERNELS, TARGET_DTYPES, TargetArgs

HEADS_DTYPES = ("auto", *TARGET_DTYPES)  # auto: the target's dtype
VERIFY_LOGITS = ("auto", "all")  # Speculator(verify_logits=): on-demand lm_head rows on CPU, or every node's


class DecodeError(HeadwayError, ValueError):
    """A decoding argument or prompt the decoder cannot honour; the message names the rule."""


CALIBRATE_HELP = ("rank dynamic-tree nodes with the heads' fitted draft calibration (temperature by depth); "
                  "--no-calibrate ranks by the raw draft probabilities (the output is the target's either way)")

def _whole(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise DecodeError(f"{name} must be a whole number, got {value!r}") from None


def _real(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise DecodeError(f"{name} must be a number, got {value!r}") from None


def check_decode_args(max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                      typical: tuple[float, float] | None = None, prompt_tokens: int | None = None,
                      max_positions: int | None = None) -> None:
    """Raise ``DecodeError`` unless: max_new_tokens >= 1; temperature finite and >= 0 (0 = greedy);
    0 < top_p <= 1; top_k >= 0 (0 = off); typical acceptance ``(threshold, alpha)`` with
    0 < threshold <= 1 and alpha > 0, both finite; and, given the prompt's length and the
    target's context (``max_position_embeddings``), prompt_tokens + max_new_tokens <= max_positions.

    The tree needs no room of its own: the decoder shrinks it near the end of the context."""
    n_new = _whole("max_new_tokens", max_new_tokens)
    if n_new < 1:  # 0 or less would still emit the prefill's token
        raise DecodeError(f"max_new_tokens must be at least 1, got {n_new}")
    t = _real("temperature", temperature)
    if not (math.isfinite(t) and t >= 0):  # a negative one would silently mean greedy
        raise DecodeError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    p = _real("top_p", top_p)
    if not 0 < p <= 1:
        raise DecodeError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if _whole("top_k", top_k) < 0:
        raise DecodeError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if typical is not None:
        threshold, alpha = (_real("typical threshold (posterior_threshold)", typical[0]),
                            _real("typical alpha (posterior_alpha)", typical[1]))
        if not 0 < threshold <= 1:
            raise DecodeError(f"typical acceptance threshold (posterior_threshold) must be in (0, 1], got {threshold}")
        if not (math.isfinite(alpha) and alpha > 0):
            raise DecodeError(f"typical acceptance alpha (posterior_alpha) must be a finite number > 0, got {alpha}")
    if prompt_tokens is not None and max_positions is not None and prompt_tokens + n_new > max_positions:
        room = max_positions - prompt_tokens
        fix = f"lower max_new_tokens to {room} or shorten the prompt" if room >= 1 else "shorten the prompt"
        raise DecodeError(f"the prompt has {prompt_tokens} tokens and max_new_tokens is {n_new}: "
                          f"{prompt_tokens + n_new} positions, more than the target's context of {max_positions} "
                          f"(max_position_embeddings); {fix}")


PROMPT_FORMS = "a string, token ids (a list or a 1-D tensor) or a list of chat messages"


def check_prompt_list(prompts: Any) -> None:
    """``generate_batch``'s prompts: a non-empty list whose every row has a prompt's form (its
    content is checked when the row is encoded, under ``row_named``); the first other row is named."""
    import torch  # here, not above: the CLI configs import this module for --help

    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise DecodeError(f"generate_batch takes a non-empty list of prompts, each {PROMPT_FORMS}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list, tuple, torch.Tensor)):
            raise DecodeError(f"prompts[{i}] is {type(prompt).__name__}, not a prompt ({PROMPT_FORMS})")


@contextlib.contextmanager
def row_named(i: int) -> Iterator[None]:
    """Name the row in a ``DecodeError`` raised inside: ``prompts[3]: the prompt is empty``."""
    try:
        yield
    except DecodeError as e:
        raise DecodeError(f"prompts[{i}]: {e}") from None


@dataclass(kw_only=True)
class DecodeTargetArgs(TargetArgs):
    """``TargetArgs`` plus the runtime options of the commands that decode (generate, chat, bench,
    tune): the heads' dtype and the fast path (static KV cache, torch.compile). Exactness holds for
    every combination; float32 heads and target are what the exactness tests run."""

    heads_dtype: str = opt("auto", "dtype of the heads: auto = the target's (bf16 target -> bf16 heads); float32 "
                                   "keeps full-precision drafting", choices=HEADS_DTYPES)
    static_cache: bool = opt(False, "preallocate the target's KV cache (transformers StaticCache, sized prompt + "
                                    "max_new_tokens + tree); same output, fixed shapes for --compile")
    compile: bool = opt(False, "torch.compile the target's verify forward and the drafter step (minutes of "
                               "compilation on first use; pays off on GPUs; implies --static-cache)")
    linear_kernel: str = opt("auto", "CPU kernel of the decoder's few-row linears: auto = measure F.linear, the "
                                     "weight-major product (W @ x.T) and headway's native kernel (built on first use "
                                     "where a C++ compiler is) on the models' weights and keep the fastest per row "
                                     "count; stock = F.linear; weight-major / native = always (output unchanged)",
                             choices=LINEAR_KERNELS)
    verify_logits: str = opt("auto", "auto = on CPU a tree's verify forward stops before the lm_head and "
                                     "projects only the rows verification reads (the accepted path; same "
                                     "logits); all = project every tree node", choices=VERIFY_LOGITS)
    confidence_sizing: bool = opt(True, "heads with a confidence head (DSpark): each step's chain length is chosen "
                                        "from it (one prompt, greedy drafts); --no-confidence-sizing verifies the "
                                        "whole chain every step (output unchanged)")

    def runtime_kwargs(self) -> dict[str, Any]:
        """The ``Speculator`` keyword arguments these options ask for."""
        return {"heads_dtype": self.heads_dtype, "static_cache": self.static_cache, "compile": self.compile,
                "linear_kernel": self.linear_kernel, "verify_logits": self.verify_logits,
                "confidence_sizing": self.confidence_sizing}
