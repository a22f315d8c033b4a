"""What differs between transformers v5 releases that headway relies on, decided once per process.

- The KV cache goes in as ``cache=`` from about 5.2x on (``past_key_values=`` still accepted, with a
  warning); earlier v5 releases read only ``past_key_values=`` and swallow an unknown ``cache=`` into
  ``**kwargs``, so every step would silently run without its context.
- ``output_hidden_states=[i, ...]`` selects layers from about 5.2x on: a tuple of L + 1 entries with
  the HF indices asked for filled (the last one after the final norm) and None elsewhere. Earlier
  releases read such a list with another numbering and drop the final entry; there headway asks for
  every hidden state (``True``) and indexes the full tuple: the same tensors, more memory.
"""

from __future__ import annotations

from typing import Sequence

_CACHE_KWARG: str | None = None
_SELECTS: bool | None = None


def cache_kwarg() -> str:
    """The name under which this release's forwards take the KV cache (Llama's forward is asked:
    one answer for every architecture of a release)."""
    global _CACHE_KWARG
    if _CACHE_KWARG is None:
        import inspect

        from transformers import LlamaModel

        _CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
    return _CACHE_KWARG


def selects_hidden_states() -> bool:
    """Whether ``output_hidden_states=[i, ...]`` returns exactly ``hidden_states[i]`` of the full
    tuple, at the full tuple's length: probed once on a 2-layer Llama of 16 dimensions."""
    global _SELECTS
    if _SELECTS is None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=8)
        with torch.random.fork_rng(devices=[]), torch.inference_mode():  # the user's seeded RNG never moves
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg).eval()
            ids = torch.tensor([[1, 2, 3]])
            full = model(input_ids=ids, output_hidden_states=True).hidden_states
            try:
                some = model(input_ids=ids, output_hidden_states=[1, 2]).hidden_states
            except (TypeError, ValueError):
                some = None
        _SELECTS = (some is not None and len(some) == len(full)
                    and all(some[i] is not None and torch.equal(some[i], full[i]) for i in (1, 2)))
    return _SELECTS


def hidden_states_arg(layers: Sequence[int]) -> list[int] | bool:
    """``output_hidden_states`` for wanting HF hidden-state indices ``layers``: the list where this
    release selects them as headway indexes them, else every hidden state."""
    return sorted(set(layers)) if selects_hidden_states() else True
