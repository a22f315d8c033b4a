"""The methods ``headway bench`` times, behind one interface, observed by forward hooks.

A method turns (prompt ids, max new tokens, temperature, seed) into new token ids plus what it
knows about its drafts. ``timed_run`` wraps every call the same way: a ``Probe`` of forward
hooks counts target forwards, times the outermost forwards of the target and of the drafter
(heads, or the assistant model), and tracks the peak bytes of the KV caches those forwards
return; the wall clock brackets the whole call.

Methods:
- ``HFMethod``: plain ``generate`` (greedy or sampling), the same with headway's few-row linear
  kernel (``headway.kernels``: what the kernel alone gains, apart from drafting), assisted
  generation with a small draft model, prompt-lookup decoding;
- ``HeadwayMethod``: the tree speculative decoder (``Speculator``) with one heads checkpoint
  and one tree shape.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
from torch import nn
from transformers import Cache

from ..heads.layers import DraftCache
from ..hardware import sync
from ..kernels import LinearKernels
from ..heads.metadata import calibration_temperatures
from ..decode.shapes import DynamicShape, TreeShape, is_top1_chain
from ..decode.speculator import GenerationStats, Speculator


@dataclass
class Generated:
    """What one method call produced."""

    ids: list[int]  # new tokens only
    draft_steps: int = 0  # target forwards that verified a draft (0 for plain decoding)
    accepted_per_depth: list[int] = field(default_factory=list)  # steps in which depth d+1 was accepted
    tree_nodes: int = 0  # tokens the draft steps' verify forwards scored (roots included)


@dataclass
class Run:
    """One timed call: the output plus what the probe saw."""

    ids: list[int]
    seconds: float
    target_forwards: int  # every target forward, prefill included
    draft_steps: int
    accepted_per_depth: list[int]
    time_target: float  # inside outermost target forwards
    time_drafter: float  # inside outermost drafter forwards (heads / assistant model)
    peak_kv_bytes: int  # target cache + drafter cache, each at its own peak
    peak_cuda_bytes: int | None = None
    tree_nodes: int = 0  # as in Generated


class Method(Protocol):
    name: str
    kind: str  # hf_generate | hf_weight_major | hf_assisted | hf_prompt_lookup | medusa | eagle1 | eagle3 | dflash
    tree: str | None
    draft_depth: int  # deepest draft token a step can accept (0: no drafts)
    heads_path: str | None  # the heads checkpoint (None for the HF baselines)
    target: nn.Module
    drafter_modules: list[nn.Module]  # modules whose outermost forwards count as drafting
    kernels: LinearKernels | None  # the few-row linear kernel it decodes with (None: stock)

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Generated: ...

    def param_bytes(self) -> int: ...


def module_bytes(*modules: nn.Module) -> int:
    """Bytes of the distinct parameters and buffers of ``modules`` (shared tensors counted once)."""
    seen: dict[int, int] = {}
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def cache_bytes(cache: Cache | DraftCache) -> int:
    """Bytes held by an HF ``Cache`` (per layer ``.keys``/``.values``) or a drafter ``DraftCache``."""
    total = 0
    for layer in cache.layers if isinstance(cache, Cache) else [cache]:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total



class Probe:
    """Forward hooks on the target and the drafter modules, nesting-aware: only the outermost
    forward is timed, so the target's lm_head inside its own forward is target time, while the
    same module called by a drafter (EAGLE logits) is drafter time."""

    def __init__(self, target: nn.Module, drafter_modules: Sequence[nn.Module],
                 projections: Sequence[nn.Module] = ()) -> None:
        """``projections``: modules that run part of the target outside its forward (the decoder's
        on-demand lm_head rows): target time, not target forwards."""
        self.device = next(target.parameters()).device
        self.depth = 0
        self.started = 0.0
        self.kind = ""
        self.target_forwards = 0
        self.time = {"target": 0.0, "drafter": 0.0}
        self.peak_kv = {"target": 0, "drafter": 0}
        self.handles = []
        self._watch(target, "target")
        for m in drafter_modules:
            self._watch(m, "drafter")
        for m in projections:
            self._watch(m, "target", forward=False)

    def _watch(self, module: nn.Module, kind: str, forward: bool = True) -> None:
        self.handles.append(module.register_forward_pre_hook(lambda m, a: self._enter(kind, forward)))
        self.handles.append(module.register_forward_hook(
            lambda m, a, kw, out: self._leave(kind, a, kw, out), with_kwargs=True))

    def _enter(self, kind: str, forward: bool = True) -> None:
        if self.depth == 0:
            sync(self.device)
            self.kind, self.started = kind, time.perf_counter()
            self.target_forwards += kind == "target" and forward
        self.depth += 1

    def _leave(self, kind: str, args: tuple, kwargs: dict, out: Any) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        sync(self.device)
        self.time[self.kind] += time.perf_counter() - self.started
        seen = (getattr(out, "cache", None), *args, *kwargs.values())
        caches = [a for a in seen if isinstance(a, (Cache, DraftCache))]
        size = sum(cache_bytes(c) for c in {id(c): c for c in caches}.values())
        self.peak_kv[self.kind] = max(self.peak_kv[self.kind], size)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def timed_run(method: Method, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
    """Call ``method.generate`` once under a fresh probe and the wall clock."""
    probe = Probe(method.target, method.drafter_modules, getattr(method, "projections", ()))
    dev = probe.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        sync(dev)
        t0 = time.perf_counter()
        out = method.generate(ids, max_new_tokens, temperature, seed)
        sync(dev)
        seconds = time.perf_counter() - t0
    finally:
        probe.close()
    peak_cuda = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return Run(out.ids, seconds, probe.target_forwards, out.draft_steps, out.accepted_per_depth,
               probe.time["target"], probe.time["drafter"], probe.peak_kv["target"] + probe.peak_kv["drafter"],
               peak_cuda, out.tree_nodes)


# ---------------------------------------------------------------------------------------------
# Hugging Face baselines


class StepRecorder:
    """A ``generate`` streamer that records how many tokens each step emitted (the first ``put``
    is the prompt): in assisted / prompt-lookup decoding a step is one verification forward."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.steps.append(int(value.numel()))

    def end(self) -> None:
        pass


def depth_counts(accepted: Sequence[int]) -> list[int]:
    """Per-step accepted draft counts -> how many steps accepted depth d+1, for each d."""
    out = [0] * max(accepted, default=0)
    for a in accepted:
        for d in range(a):
            out[d] += 1
    return out


class HFMethod:
    """``model.generate`` with fixed extra arguments: plain, assisted (``assistant_model``) or
    prompt lookup (``prompt_lookup_num_tokens``). Every logits processor is set explicitly (a
    model's ``generation_config.json`` may ship a repetition penalty or top-p); sampling is pure
    temperature, the distribution the tree decoder samples from."""

    def __init__(self, name: str, kind: str, target: nn.Module, stop_ids: Sequence[int], pad_token_id: int,
                 draft_depth: int = 0, assistant: nn.Module | None = None, kernels: LinearKernels | None = None,
                 **config: Any) -> None:
        self.name, self.kind, self.tree, self.draft_depth = name, kind, None, draft_depth
        self.heads_path: str | None = None
        self.target = target
        self.stop_ids, self.pad_token_id = list(stop_ids), pad_token_id
        self.config = config  # extra GenerationConfig fields, e.g. prompt_lookup_num_tokens
        self.assistant = assistant
        self.drafter_modules = [assistant] if assistant is not None else []
        self.kernels = kernels  # hf_weight_major: plain generate with headway's few-row linear kernel

    @property
    def drafts(self) -> bool:
        return self.kind not in ("hf_generate", "hf_weight_major")

    def param_bytes(self) -> int:
        return module_bytes(self.target, *self.drafter_modules)

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Generated:
        from ..data.generation import SamplingSettings, generation_config

        dev = next(self.target.parameters()).device
        x = torch.tensor([ids], device=dev)  # (1, T)
        gc = generation_config(SamplingSettings(temperature, 1.0, 0, max_new_tokens), self.stop_ids,
                               self.pad_token_id)
        gc.update(**self.config)
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        torch.manual_seed(seed)
        rec = StepRecorder()
        with self.kernels() if self.kernels is not None else contextlib.nullcontext():
            out = self.target.generate(x, attention_mask=torch.ones_like(x), generation_config=gc, streamer=rec,
                                       **extra)  # (1, T + new)
        new = out[0, len(ids):].tolist()
        if not self.drafts:
            return Generated(new)
        accepted = [max(n - 1, 0) for n in rec.steps]
        return Generated(new, len(rec.steps), depth_counts(accepted))


def stop_ids_of(target: nn.Module, tokenizer: Any) -> list[int]:
    """The EOS ids the tree decoder stops at: the target's generation config, else the tokenizer's."""
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [int(eos)]


def configure_assistant(assistant: nn.Module, num_tokens: int) -> None:
    """HF reads these from the assistant's generation config (passing them to ``generate`` has no
    effect); a constant draft length, and no confidence threshold cutting drafts short."""
    gc = assistant.generation_config
    gc.num_assistant_tokens = num_tokens
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0


# ---------------------------------------------------------------------------------------------
# The tree speculative decoder


def tree_spec(shape: TreeShape) -> str:
    """A shape as the string ``parse_shape`` reads back (dynamic shapes spell out their numbers)."""
    if isinstance(shape, DynamicShape):
        return shape.spec
    return f"chain-{shape.depth}" if is_top1_chain(shape) else shape.name  # a chain stored as static:[[0]]


class HeadwayMethod:
    """One heads checkpoint with one tree shape, through ``Speculator.generate``."""

    def __init__(self, name: str, speculator: Speculator, heads_path: str,
                 tree_names: dict[str, str] | None = None) -> None:
        self.name = name
        self.speculator = speculator
        self.kind = speculator.heads.kind
        self.tree_names = dict(tree_names or {})  # a tree's spec -> the name tune gave it (measured-16)
        self.tree = self.label(speculator.tree)
        self.draft_depth = speculator.tree.depth
        self.heads_path = heads_path
        self.target = speculator.target
        proposer = speculator.new_proposer()
        self.has_calibration = (isinstance(speculator.tree, DynamicShape)
                                and bool(calibration_temperatures(speculator.heads.metadata)))
        self.calibrated = bool(proposer.temperatures)
        heads = speculator.heads
        borrowed = [m for m in (heads.__dict__.get("_target_embed"), heads.__dict__.get("_target_lm_head"))
                    if m is not None]
        # every submodule: a drafter may call a grandchild outside its forward (DFlash projects the new
        # context's keys and values with each layer's k_proj / v_proj); only the outermost call is timed
        self.drafter_modules = [*heads.modules(), *borrowed]
        self.projections = [speculator.runtime.projection]  # on-demand lm_head rows: the target's time
        speculator.runtime.uses_lazy_logits()  # its one-off probe forwards, before any timed run counts them
        self.kernels: LinearKernels | None = speculator.kernels

    def param_bytes(self) -> int:
        return module_bytes(self.target, self.speculator.heads)

    def label(self, shape: TreeShape) -> str:
        """The shape as reports name it: the name tune stored for it, else its spec."""
        spec = tree_spec(shape)
        return self.tree_names.get(spec, spec)

    def label_at(self, temperature: float) -> tuple[str, str, int]:
        """(name, tree, depth) at this temperature: the speculator may draft another shape when
        sampling (a chain of sampled drafts), and the table must say which one ran."""
        shape = self.speculator.tree_for(temperature)
        tree = self.label(shape)
        return self.name.replace(f"[{self.tree}]", f"[{tree}]"), tree, shape.depth

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Generated:
        out = self.speculator.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        stats: GenerationStats = out.stats
        return Generated(out.ids, stats.target_forwards, list(stats.accepted_per_depth), stats.tree_nodes)
