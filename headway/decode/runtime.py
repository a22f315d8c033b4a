"""Where and how fast the decoder runs: one ``Runtime`` object owns placement (device, dtypes), the
target's cache kind, torch.compile of the two hot calls, the CPU linear kernels, the tree attention
and the lm_head policy (all rows, or the rows verification reads). Exactness does not depend on any
of it: the verifier compares against the target's own logits, whatever kernels produced them."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn
from transformers import Cache

from ..compat import cache_kwarg, hidden_states_arg
from ..heads import HeadsBase
from ..target import resolve_dtype
from .args import HEADS_DTYPES, DecodeError
from .attention import tree_attention
from .kv import layer_masks, new_cache
from .node_logits import Projection, head_matches_logits


def heads_dtype_for(heads_dtype: str | torch.dtype | None, target_dtype: torch.dtype) -> torch.dtype | None:
    """``auto`` (or None) -> the target's dtype; a name or torch dtype -> that dtype."""
    if heads_dtype is None or heads_dtype == "auto":
        return target_dtype
    if isinstance(heads_dtype, str) and heads_dtype not in HEADS_DTYPES and heads_dtype not in ("fp32", "bf16", "fp16"):
        raise DecodeError(f"unknown heads dtype '{heads_dtype}'; use one of {', '.join(HEADS_DTYPES)}")
    return resolve_dtype(heads_dtype)


class Runtime:
    """The target and the heads as the decoder runs them.

    ``heads_dtype``: ``auto`` is the target's dtype (float32 keeps full-precision drafting); the heads
    move to the device of the target's lm_head (the last device under a ``device_map``).
    ``static_cache``: a preallocated transformers ``StaticCache`` per single-prompt generation.
    ``compile``: torch.compile the verify forward and the heads (implies ``static_cache``).
    ``linear_kernel`` (``headway.kernels``): how the few-row linears of decoding multiply on CPU
    (``auto`` measures the candidates on first use). ``verify_logits``: ``auto`` projects a large
    tree's lm_head rows only as verification reads them (CPU, not compiled, and only where the
    architecture's logits are its lm_head's output: checked once); ``all`` projects every node."""

    def __init__(self, target: nn.Module, heads: HeadsBase, heads_dtype: str | torch.dtype | None = "auto",
                 static_cache: bool = False, compile: bool = False, linear_kernel: str = "auto",
                 verify_logits: str = "auto") -> None:
        from ..kernels import LinearKernels

        if verify_logits not in ("auto", "all"):
            raise DecodeError(f"verify_logits must be auto or all, got {verify_logits!r}")
        self.target = target
        self.heads = heads.to(device=self.device, dtype=heads_dtype_for(heads_dtype, self.dtype)).eval()
        self.static_cache = bool(static_cache or compile)
        self.compiled = bool(compile)
        # the tree-verify call compiled (prefill stays eager: its length varies); with a static cache every
        # input has a fixed shape per tree size, so it compiles once per tree shape; the model is not changed
        self.verify_forward: Callable[..., Any] = torch.compile(target.forward, dynamic=False) if compile else target
        if compile and "forward" not in self.heads.__dict__:  # not yet (heads shared by several speculators)
            # the drafter step: Medusa one call per step, EAGLE one per tree level, whose length grows
            self.heads.forward = torch.compile(self.heads.forward, dynamic=True)  # type: ignore[method-assign]
        # a compiled forward chooses its own kernels, and swapping module forwards would break its guards
        self.kernels = LinearKernels("stock" if compile else linear_kernel, target, self.heads)
        # an sdpa target attends tree tokens through ``decode/attention.py`` (False: transformers' sdpa, A/B)
        self.grouped_attention = not compile
        self.layers: list[int] = []  # HF hidden-state indices the proposer reads (``Speculator`` sets them)
        self.lazy_logits: bool | None = None if verify_logits == "auto" and not compile else False
        self.keeps_logits = "logits_to_keep" in inspect.signature(target.forward).parameters
        self.projection = Projection(target.get_output_embeddings())  # lm_head calls of on-demand rows

    @property
    def device(self) -> torch.device:
        """The lm_head's device: heads, trees and verification live there; under a multi-device
        ``device_map`` accelerate's hooks move the target's inputs and outputs."""
        return self.target.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return int(self.target.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.target.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int:
        return int(getattr(self.target.config, "max_position_embeddings", 1 << 30))

    def eos_ids(self, tokenizer: Any) -> set[int]:
        eos = getattr(self.target.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(tokenizer, "eos_token_id", None)
        return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    def forward(self, ids: torch.Tensor, cache: Cache, verify: bool = False, layers: list[int] | None = None,
                **kw: Any) -> Any:
        """One target forward writing ``cache``, with the hidden states the proposer reads."""
        fn = self.verify_forward if verify else self.target  # compiled with ``compile``: the tree forward only
        if kw.get("attention_mask") is not None:  # sliding-window layers get their own cut of our mask
            kw["attention_mask"] = layer_masks(self.target.config, kw["attention_mask"])
        with tree_attention(self.target, self.grouped_attention):  # tree masks: grouped-query attention
            return fn(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True,
                      output_hidden_states=hidden_states_arg(layers or self.layers), **kw)

    def last_logits_only(self) -> dict[str, Any]:
        """Prefill reads one position's logits: skip the lm_head over the prompt, as HF generate does."""
        return {"logits_to_keep": 1} if self.keeps_logits else {}

    def uses_lazy_logits(self) -> bool:
        """Whether trees are verified with on-demand lm_head rows (decided once, on first use)."""
        if self.lazy_logits is None:
            probe = torch.tensor([[1, 2, 3, 4]], device=self.device)
            self.lazy_logits = self.device.type == "cpu" and head_matches_logits(self.target, self.num_layers, probe)
        return self.lazy_logits

    def new_cache(self, length: int | None = None) -> Cache:
        """A fresh target cache: a StaticCache of ``length`` positions when this runtime uses static
        caches (``length`` then needed), else a DynamicCache."""
        if not self.static_cache:
            return new_cache(self.target.config)
        if length is None:
            raise DecodeError("a static cache is sized from max_new_tokens; pass it to start()")
        return new_cache(self.target.config, length)
