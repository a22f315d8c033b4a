"""The generation loop: a stock transformers target + trained heads -> the target's own output, faster.

Each step: the proposer drafts a tree rooted at the last emitted token; one target forward
verifies every node (float 4-D tree mask, explicit position ids, the model's cache object);
the longest agreeing path plus one bonus token is emitted; the cache keeps the accepted entries.
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn
from transformers import Cache

from ..heads import HeadsBase, load_heads
from ..heads.metadata import adapter_dir
from ..compat import cache_kwarg, hidden_states_arg
from .args import DecodeError, check_decode_args
from .attention import tree_attention
from .cost import CURVE_SIZES, best_size, cost_by_size, forward_cost
from .kv import keep_accepted, layer_masks, new_cache, static_length, tree_mask
from .node_logits import PREFETCH_ROWS, NodeLogits, NodeProbs, Projection, head_matches_logits
from .proposers import EagleProposer, hidden_index, make_proposer
from .sampling import (SamplingParams, processed_probs, sample_from, verify_sample, verify_sampled_chain,
                       verify_typical)
from .shapes import (DraftTree, DynamicShape, Proposer, SizeFor, StaticShape, TreeShape, build_sampled_chain,
                     build_tree, chain, is_chain, parse_shape)
from .stats import GenerationOutput, GenerationStats, _record_depths, _sync  # noqa: F401  (re-exported)
from .verify import Verdict, verify_greedy, verify_greedy_walk

if TYPE_CHECKING:
    from .batch import BatchOutput
    from .batch_proposers import BatchProposer


@dataclass
class DecodeState:
    """Everything one generation carries from step to step."""

    cache: Cache  # the target's KV cache (dynamic or static, ``decode/kv.py``): ``length`` entries
    proposer: Proposer  # per-generation draft state (MedusaProposer / EagleProposer)
    emitted: list[int]  # tokens generated so far; the last one is the next tree's root
    length: int
    step_cost: float | None = None  # seconds of a step outside its verify forward (a running mean): adaptive trees


@dataclass
class Scored:
    """A drafted tree after the target's verify forward."""

    tree: DraftTree
    node_logits: NodeLogits  # target logits at the nodes, projected when verification reads them
    features: list[torch.Tensor]  # per feature layer (N, H) target hidden states at every node
    verify_time: float
    draft_probs: torch.Tensor | None = None  # (depth, V) when the chain's drafts were sampled

    @property
    def logits(self) -> torch.Tensor:
        """(N, V) target logits at every node (all rows projected)."""
        return self.node_logits.all()


class Speculator:
    """Target + heads + tree shape. ``generate`` returns exactly what the target would: greedy
    output equals ``model.generate(do_sample=False)``; sampling follows the target's distribution."""

    def __init__(self, target: nn.Module, tokenizer: Any, heads: HeadsBase, tree: TreeShape | str | None = None,
                 max_depth: int | None = None, typical: tuple[float, float] | None = None,
                 sampled_drafts: bool = True, sampling_tree: TreeShape | str | None = None,
                 calibrate: bool = True, heads_dtype: str | torch.dtype | None = "auto",
                 static_cache: bool = False, compile: bool = False, linear_kernel: str = "auto",
                 verify_logits: str = "auto") -> None:
        """``typical=(threshold, alpha)`` switches sampling to Medusa's typical acceptance, which is
        LOSSY (faster, but the output no longer follows the target's distribution); off by default.
        ``sampled_drafts``: at temperature > 0 a chain's drafts are drawn from the drafter's
        distribution (processed like the target's) and verified by speculative sampling, which
        accepts ~sum_x min(p, q) per depth instead of p(top-1); trees keep deterministic drafts.
        ``sampling_tree``: the shape used at temperature > 0; by default ``tree`` when one is given
        (or stored with the heads), else a 4-deep chain for EAGLE drafters, whose sampled drafts
        beat a deterministic tree there (demo target, T=1: tau 1.98 against 1.44 for EAGLE-1).
        ``calibrate``: rank dynamic-tree nodes with the heads' calibration temperatures
        (``metadata["calibration"]``); False ranks by the raw draft log-probs (for A/B measurement).
        Either way the output is the target's: calibration only changes which nodes are drafted.

        Placement and speed (``headway.decode.runtime``): the heads move to the device of the
        target's lm_head (the last device under a ``device_map``) in ``heads_dtype`` (``auto``: the
        target's dtype; float32 keeps full-precision drafting). ``static_cache``: a preallocated
        transformers ``StaticCache`` sized prompt + max_new_tokens + tree, with the same
        keep-accepted bookkeeping. ``compile``: torch.compile the target's verify forward and the
        heads' forward (in place); it implies ``static_cache`` (fixed shapes, few recompiles).
        ``linear_kernel`` (``headway.kernels``): how the few-row linears of decoding multiply on CPU;
        ``auto`` measures ``F.linear``, the weight-major product and the native kernel
        (``headway.native``, where it builds) on the models' own weights (once per thread count, on
        first use) and keeps the fastest per row count; ``stock`` is
        ``F.linear`` everywhere (and with ``compile``). Only the target's and the heads' forwards
        inside a generation see it. ``verify_logits``: ``auto`` verifies a tree of more than 8 nodes on
        CPU with the target's lm_head projected only at the nodes verification reads (``NodeLogits``;
        the same logits, ~tau rows instead of N), where the architecture's logits are its lm_head's
        output (checked once) and nothing is compiled; ``all`` projects every node."""
        from ..kernels import LinearKernels
        from .runtime import compile_heads, compile_verify, heads_dtype_for

        self.target = target
        self.tokenizer = tokenizer
        heads.check_tokenizer(tokenizer)  # ids must mean the tokens the heads were trained on
        self.heads = heads.to(device=self.device, dtype=heads_dtype_for(heads_dtype, self.dtype)).eval()
        self.static_cache = bool(static_cache or compile)
        self.compiled = bool(compile)
        self._verify_forward = compile_verify(target) if compile else target
        if compile:
            compile_heads(self.heads)
        # a compiled forward chooses its own kernels, and swapping module forwards would break its guards
        self.kernels = LinearKernels("stock" if compile else linear_kernel, target, self.heads)
        self.max_depth = max_depth
        self.typical = typical
        self.sampled_drafts = sampled_drafts
        self.calibrate = calibrate
        self.batched_drafting = True  # generate_batch: one drafter call per level for all rows (False: row by row, A/B)
        # an sdpa target attends tree tokens through ``decode/attention.py`` (False: transformers' sdpa, A/B);
        # a compiled forward keeps its own
        self.grouped_attention = not compile
        proposer = self.new_proposer()  # a template: its limits decide the tree
        self.tree = self._default_tree(tree, proposer)
        if sampling_tree is None and tree is None and isinstance(proposer, EagleProposer):
            sampling_tree = chain(4)
        self.sampling_tree = self._default_tree(sampling_tree, proposer) if sampling_tree is not None else self.tree
        L = int(target.config.num_hidden_layers)
        self._layers = [hidden_index(i, L) for i in proposer.feature_layers]
        self._shape_cache: dict[tuple[int, int], TreeShape] = {}
        self.adapter: str | None = None  # the PEFT adapter merged into the target by from_pretrained
        self.adapter_from_heads = False  # ... because the heads named it (the CLI says so)
        # a tree's verify forward stops before the lm_head, whose rows are projected as verification
        # reads them (``decode/node_logits.py``): None decides on first use (CPU, not compiled, and the
        # architecture's logits are its lm_head's output); False always projects every node
        if verify_logits not in ("auto", "all"):
            raise DecodeError(f"verify_logits must be auto or all, got {verify_logits!r}")
        self.lazy_logits: bool | None = None if verify_logits == "auto" and not compile else False
        self._keeps_logits = "logits_to_keep" in inspect.signature(target.forward).parameters
        self.projection = Projection(target.get_output_embeddings())  # lm_head calls of on-demand rows
        self._verify_costs: dict[int, torch.Tensor] = {}  # threads -> seconds of a verify of 1..N tokens
        if compile and self._adaptive():
            raise DecodeError("an adaptive tree changes the verify's token count every step, which a compiled "
                              "forward recompiles for; with --compile use a dynamic-K-D-N tree")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, target: str | nn.Module, heads: str | Path | HeadsBase, tokenizer: Any = None,
                        tree: TreeShape | str | None = None, dtype: str | torch.dtype | None = "float32",
                        device: str | torch.device | None = None, adapter: str | None = None,
                        max_depth: int | None = None, typical: tuple[float, float] | None = None,
                        calibrate: bool = True, device_map: str | dict[str, Any] | None = None,
                        attn_implementation: str | None = None, heads_dtype: str | torch.dtype | None = "auto",
                        static_cache: bool = False, compile: bool = False,
                        linear_kernel: str = "auto", sampling_tree: TreeShape | str | None = None,
                        verify_logits: str = "auto") -> "Speculator":
        """``adapter``: a PEFT adapter merged into a target given by name; by default the one the heads
        checkpoint names (Medusa-2 heads are trained on an adapted target, which is the one whose
        output they reproduce). A target given as a model object is used as it is. ``device_map``,
        ``attn_implementation`` and ``dtype`` (``auto`` too) go to ``load_target``; the rest to the
        constructor."""
        from ..heads.base import resolve_checkpoint
        from ..target import load_target

        if not isinstance(heads, HeadsBase):
            heads = resolve_checkpoint(heads)  # fail fast, before loading a large target
        from_heads = False
        if isinstance(target, (str, Path)):
            if adapter is None:
                adapter = _adapter_of(heads)
                from_heads = adapter is not None
            target, tok = load_target(str(target), dtype=dtype, device=device, adapter=adapter,
                                      device_map=device_map, attn_implementation=attn_implementation)
            tokenizer = tokenizer or tok
        if tokenizer is None:
            raise DecodeError("a tokenizer is needed when the target is given as a model object")
        if not isinstance(heads, HeadsBase):
            heads = load_heads(heads, target=target)
        else:
            heads.attach(target)
        if tree is None:  # the tuned trees: one for both, or T=0's and the one above
            stored = heads.metadata.get("decode") or {}
            tree, sampling_tree = stored.get("tree"), sampling_tree or stored.get("sampling_tree")
        spec = cls(target, tokenizer, heads, tree, max_depth, typical, sampling_tree=sampling_tree,
                   calibrate=calibrate, heads_dtype=heads_dtype, static_cache=static_cache, compile=compile,
                   linear_kernel=linear_kernel, verify_logits=verify_logits)
        spec.adapter, spec.adapter_from_heads = (str(adapter) if adapter else None), from_heads
        return spec

    @staticmethod
    def _default_tree(tree: TreeShape | str | None, proposer: Proposer) -> TreeShape:
        if isinstance(tree, str):
            tree = parse_shape(tree)
        if tree is None:
            tree = DynamicShape(top_k=4, depth=5, total_tokens=16) if isinstance(proposer, EagleProposer) \
                else chain(proposer.max_depth)
        vocab = proposer.draft_vocab_size
        if isinstance(tree, StaticShape):
            tree = tree.within_vocab(vocab)
        elif tree.top_k > vocab:
            tree = tree.with_(top_k=vocab)
        cap = proposer.max_depth
        if cap is not None:
            if isinstance(tree, StaticShape) and tree.depth > cap:
                tree = tree.truncated(cap)
            if isinstance(tree, DynamicShape) and tree.depth > cap:
                tree = tree.with_(depth=cap)
        return tree

    @property
    def device(self) -> torch.device:
        """Where the decoder works (heads, trees, verification): the target's lm_head device. Under a
        multi-device ``device_map`` accelerate's hooks move the target's inputs and outputs."""
        return self.target.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    @property
    def max_positions(self) -> int:
        return int(getattr(self.target.config, "max_position_embeddings", 1 << 30))

    # -- prompts and stops ---------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | torch.Tensor | list[dict], chat: bool | None = None) -> torch.Tensor:
        tok = self.tokenizer
        if isinstance(prompt, torch.Tensor):
            ids = prompt.reshape(-1).tolist()
        elif isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            has_template = bool(getattr(tok, "chat_template", None))
            if isinstance(prompt, list) or (chat if chat is not None else False) and has_template:
                if not has_template:
                    raise DecodeError("messages need a chat template, and this tokenizer has none")
                msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tok(prompt)["input_ids"]
        else:
            ids = list(prompt)
        if not ids:
            raise DecodeError("the prompt is empty")
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    def _eos_ids(self) -> set[int]:
        eos = getattr(self.target.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    def tree_for(self, temperature: float) -> TreeShape:
        """The shape drafted at this temperature (``tree`` at 0, ``sampling_tree`` above)."""
        return self.tree if temperature <= 0 else self.sampling_tree

    def _shape_for(self, room: int, params: SamplingParams | None = None) -> TreeShape:
        """The tree for these sampling parameters, shrunk so that its deepest node stays inside
        the context window."""
        tree = self.tree_for(params.temperature if params is not None else 0.0)
        depth = tree.depth
        if room >= depth:
            return tree
        key = (room, id(tree))
        if key not in self._shape_cache:
            self._shape_cache[key] = tree.truncated(room) if isinstance(tree, StaticShape) else \
                tree.with_(depth=max(room, 1))
        return self._shape_cache[key]

    def _adaptive(self) -> bool:
        return any(isinstance(t, DynamicShape) and t.adaptive for t in (self.tree, self.sampling_tree))

    def verify_costs(self) -> torch.Tensor:
        """(N,) seconds of a verify forward over 1..N tokens, N the largest adaptive tree's budget:
        timed once per thread count on first use (a few forwards per size, ``decode/cost.py``) with
        the decoder's own kernels, then interpolated. Adaptive trees weigh their nodes against it."""
        threads = torch.get_num_threads()
        most = max(t.size for t in (self.tree, self.sampling_tree) if isinstance(t, DynamicShape))
        if threads not in self._verify_costs or self._verify_costs[threads].numel() < most:
            sizes = [n for n in CURVE_SIZES if n < most] + [most]
            self._verify_costs[threads] = cost_by_size(forward_cost(self, sizes, repeats=3), most)
        return self._verify_costs[threads]

    def _size_for(self, state: DecodeState, t_draft: float) -> SizeFor:
        """An adaptive tree's budget at this step: the size with the most expected tokens per second,
        a step costing its verify (``verify_costs``) plus the rest of a step (drafting, bookkeeping:
        the running mean of the steps before; at the first step, this one's drafting so far)."""
        costs = self.verify_costs()

        def size_for(gains: torch.Tensor) -> int:
            rest = state.step_cost if state.step_cost is not None else time.perf_counter() - t_draft
            return best_size(gains, costs + rest)
        return size_for

    # -- the loop -----------------------------------------------------------------------------
    def new_proposer(self) -> Proposer:
        """Per-generation draft state (the heads are shared)."""
        return make_proposer(self.heads, self.max_depth, calibrate=self.calibrate)

    def new_batch_proposer(self, rows: int) -> "BatchProposer":
        """Draft state of a batch of ``rows`` (``decode/batch_proposers.py``): one drafter call per
        draft level for all rows; row by row (a ``Proposer`` each) when ``batched_drafting`` is off or
        ``new_proposer`` was replaced (test oracles), so a custom proposer is never bypassed, and for a
        single row, where the unbatched proposer's mask-free chain steps are faster."""
        from .batch_proposers import RowsProposer, make_batch_proposer

        custom = "new_proposer" in vars(self) or type(self).new_proposer is not Speculator.new_proposer
        if self.batched_drafting and not custom and rows > 1:
            return make_batch_proposer(self.heads, self.max_depth, calibrate=self.calibrate)
        return RowsProposer([self.new_proposer() for _ in range(rows)])

    def _forward(self, ids: torch.Tensor, cache: Cache, verify: bool = False, layers: list[int] | None = None,
                 **kw: Any) -> Any:
        fn = self._verify_forward if verify else self.target  # compiled with ``compile``: the tree forward only
        if kw.get("attention_mask") is not None:  # sliding-window layers get the mask cut to their window
            kw["attention_mask"] = layer_masks(self.target.config, kw["attention_mask"])
        with tree_attention(self.target, self.grouped_attention):  # tree masks: grouped-query attention
            return fn(input_ids=ids, **{cache_kwarg(): cache}, use_cache=True,
                      output_hidden_states=hidden_states_arg(layers or self._layers), **kw)

    def uses_lazy_logits(self) -> bool:
        """Whether trees are verified with on-demand lm_head rows (decided once, on first use)."""
        if self.lazy_logits is None:
            probe = torch.tensor([[1, 2, 3, 4]], device=self.device)
            self.lazy_logits = self.device.type == "cpu" and head_matches_logits(
                self.target, int(self.target.config.num_hidden_layers), probe)
        return self.lazy_logits

    def new_cache(self, prompt_len: int, max_new_tokens: int | None) -> Cache:
        """The target cache of one generation: a StaticCache of prompt + max_new_tokens + tree
        positions with ``static_cache`` (``max_new_tokens`` then needed), else a DynamicCache."""
        if not self.static_cache:
            return new_cache(self.target.config)
        if max_new_tokens is None:
            raise DecodeError("a static cache is sized from max_new_tokens; pass it to start()")
        tree = max(self.tree.size, self.sampling_tree.size)
        return new_cache(self.target.config, prompt_len + max_new_tokens + tree)

    def _features(self, out: Any, index: torch.Tensor | slice) -> list[torch.Tensor]:
        return [out.hidden_states[i][0, index] for i in self._layers]

    def start(self, input_ids: torch.Tensor, params: SamplingParams, gen: torch.Generator,
              max_new_tokens: int | None = None) -> DecodeState:
        """Prefill the target and the proposer; the first token comes from the target alone."""
        cache = self.new_cache(input_ids.shape[1], max_new_tokens)
        # only the last position's logits are read: skip the lm_head over the prompt, as HF generate does
        out = self._forward(input_ids, cache, **({"logits_to_keep": 1} if self._keeps_logits else {}))
        first = self._choose(out.logits[0, -1], params, gen)
        proposer = self.new_proposer()
        proposer.prefill(input_ids, [f[None] for f in self._features(out, slice(None))], first)
        return DecodeState(cache, proposer, [int(first)], input_ids.shape[1])

    def draft_and_score(self, state: DecodeState, params: SamplingParams | None = None,
                        gen: torch.Generator | None = None) -> Scored:
        """Draft a tree rooted at the last emitted token and run the one target forward over it.
        With sampling ``params`` (and ``sampled_drafts``), a chain's drafts are sampled with ``gen``."""
        t_draft = time.perf_counter()
        P = state.length
        root = torch.tensor(state.emitted[-1], device=self.device)
        shape = self._shape_for(self.max_positions - 1 - P, params)
        draft_probs = None
        if params is not None and not params.greedy and self.sampled_drafts and self.typical is None \
                and is_chain(shape):
            def sample(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                q = processed_probs(logp, params)
                return q, sample_from(q, torch.rand((), generator=gen).to(q.device))

            V = int(self.target.get_output_embeddings().weight.shape[0])
            tree, draft_probs = build_sampled_chain(shape.depth, state.proposer, root, sample, V)
        else:
            adaptive = isinstance(shape, DynamicShape) and shape.adaptive
            tree = build_tree(shape, state.proposer, root, self._size_for(state, t_draft) if adaptive else None)
        state.proposer.end_tree()
        # up to PREFETCH_ROWS nodes cost one projection either way (and a walk off the first-child chain
        # would cost a second); a chain's rows go together; typical acceptance reads every node
        lazy = tree.buffers.size > PREFETCH_ROWS and not is_chain(shape) and self.typical is None \
            and self.uses_lazy_logits()
        last = int(self.target.config.num_hidden_layers)  # its hidden states are the lm_head's input
        extra: dict[str, Any] = {}
        if lazy:
            extra = dict(logits_to_keep=torch.empty(0, dtype=torch.long, device=self.device),
                         layers=sorted(set(self._layers) | {last}))
        _sync(self.device)
        t = time.perf_counter()
        b = tree.buffers
        out = self._forward(tree.tokens[None], state.cache, verify=True, position_ids=(b.depth + P)[None],
                            attention_mask=tree_mask(b.visible, P, self.dtype, static_length(state.cache)), **extra)
        _sync(self.device)
        node_logits = NodeLogits(b, hidden=out.hidden_states[last][0], head=self.projection) if lazy else \
            NodeLogits(b, full=out.logits[0])
        return Scored(tree, node_logits, self._features(out, slice(None)), time.perf_counter() - t, draft_probs)

    def commit(self, state: DecodeState, scored: Scored, verdict: Verdict) -> list[int]:
        """Keep the accepted KV entries, tell the proposer, append the emitted tokens (accepted path +
        bonus) to ``state.emitted`` and return them."""
        tree = scored.tree
        keep_accepted(state.cache, state.length, tree.buffers.size, verdict.nodes)
        path_tokens = torch.cat([tree.tokens[verdict.nodes], verdict.bonus.view(1)])
        state.proposer.accept(path_tokens, [f[verdict.nodes] for f in scored.features], state.length)
        state.length += verdict.nodes.numel()
        new = path_tokens[1:].tolist()
        state.emitted += new
        return new

    def fork(self, state: DecodeState) -> DecodeState:
        """An independent copy of a decode state (for tree search over outcomes in tests)."""
        return DecodeState(copy.deepcopy(state.cache), state.proposer.fork(), list(state.emitted), state.length)

    def stream(self, prompt: Any, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None, chat: bool | None = None,
               stats: GenerationStats | None = None) -> Iterator[list[int]]:
        """An iterator over the newly emitted token ids after every step (the first list comes from
        prefill). The arguments and the prompt's length are checked here, before it is returned
        (``check_decode_args``): a prompt that leaves no room for ``max_new_tokens`` is an error."""
        input_ids = self.encode(prompt, chat)
        check_decode_args(max_new_tokens, temperature, top_p, top_k, self.typical, input_ids.shape[1],
                          self.max_positions)
        return self._steps(input_ids, int(max_new_tokens), SamplingParams(float(temperature), int(top_k),
                                                                          float(top_p)), stop, seed, stats)

    @torch.inference_mode()
    def _steps(self, input_ids: torch.Tensor, max_new_tokens: int, params: SamplingParams, stop: Sequence[str],
               seed: int | None, stats: GenerationStats | None) -> Iterator[list[int]]:
        stats = stats if stats is not None else GenerationStats()
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(seed)
        n = input_ids.shape[1]
        stats.prompt_tokens = n
        eos = self._eos_ids()
        self.kernels.plan()  # probed on first use (auto): not part of the generation's time
        self.uses_lazy_logits()  # likewise its one-off check
        if self._adaptive():
            self.verify_costs()  # and an adaptive tree's cost curve
        t_start = time.perf_counter()
        with self.kernels():
            state = self.start(input_ids, params, gen, max_new_tokens)
        _sync(self.device)
        stats.time_prefill = time.perf_counter() - t_start
        emitted = state.emitted
        stats.new_tokens = 1
        yield emitted[:]
        done = self._stopped(emitted, eos, max_new_tokens, stats)
        while not done:
            t0 = time.perf_counter()
            with self.kernels():  # the drafter's and the target's forwards (commit may run the drafter)
                scored = self.draft_and_score(state, params, gen)
                t2 = time.perf_counter()
                verdict = self._verify(scored.tree.tokens, scored.tree.buffers, scored.node_logits, params, gen,
                                       scored.draft_probs)
                before = len(emitted)
                self.commit(state, scored, verdict)
            del emitted[max_new_tokens:]
            stats.target_forwards += 1
            nodes = scored.tree.buffers.size
            stats.tree_nodes += nodes
            stats.projected_rows += len(scored.node_logits.rows) if scored.node_logits.lazy else nodes
            _record_depths(stats, verdict)
            stats.new_tokens = len(emitted)
            done = self._stopped(emitted, eos, max_new_tokens, stats, len(emitted) - before)
            if stop and not done:
                done = self._stop_strings(emitted, stop, stats)[1]
            _sync(self.device)
            projected = scored.node_logits.seconds  # lm_head rows read by verification: the target's time
            stats.time_verify += scored.verify_time + projected
            stats.time_draft += t2 - t0 - scored.verify_time
            stats.time_bookkeeping += time.perf_counter() - t2 - projected
            rest = time.perf_counter() - t0 - scored.verify_time - projected
            state.step_cost = rest if state.step_cost is None else 0.8 * state.step_cost + 0.2 * rest
            yield emitted[before:]
        stats.time_total = time.perf_counter() - t_start

    def _choose(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        if params.greedy:
            return logits.argmax(-1)
        return sample_from(processed_probs(logits, params), torch.rand((), generator=gen).to(logits.device))

    def _verify(self, tokens: torch.Tensor, b: Any, logits: NodeLogits | torch.Tensor, params: SamplingParams,
                gen: torch.Generator, draft_probs: torch.Tensor | None = None) -> Verdict:
        """The accepted path and bonus token. ``logits``: every node's (N, V), or a ``NodeLogits``
        whose rows are projected as they are read (only the accepted path's, when lazy)."""
        if isinstance(logits, torch.Tensor):
            logits = NodeLogits(b, full=logits)
        if params.greedy:
            return verify_greedy_walk(tokens, b, logits) if logits.lazy else verify_greedy(tokens, b, logits.all())
        u = torch.rand(b.size + 1, generator=gen).to(tokens.device)
        if draft_probs is not None:
            return verify_sampled_chain(tokens, processed_probs(logits.all(), params), draft_probs, u[:-1], u[-1])
        if self.typical is not None:
            return verify_typical(tokens, b, processed_probs(logits.all(), params), *self.typical, u[-1])
        probs: Any = NodeProbs(logits, lambda x: processed_probs(x, params)) if logits.lazy else \
            processed_probs(logits.all(), params)
        return verify_sample(tokens, b, probs, u[:-1], u[-1])

    @staticmethod
    def _stopped(emitted: list[int], eos: set[int], max_new: int, stats: GenerationStats, n_new: int = 1) -> bool:
        """Cut after the first EOS among the newly emitted tokens; stop at the length limit."""
        for i in range(len(emitted) - n_new, len(emitted)):
            if emitted[i] in eos:
                del emitted[i + 1:]
                stats.new_tokens = len(emitted)
                stats.stopped_by = "eos"
                return True
        if len(emitted) >= max_new:
            stats.stopped_by = "length"
            return True
        return False

    def _stop_strings(self, emitted: list[int], stop: Sequence[str], stats: GenerationStats) -> tuple[str, bool]:
        text = self.tokenizer.decode(emitted)
        hits = [text.find(s) for s in stop if s in text]
        if not hits:
            return text, False
        stats.stopped_by = "stop"
        return text[: min(hits)], True

    def generate(self, prompt: Any, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None, stream: bool = False,
                 chat: bool | None = None) -> GenerationOutput | Iterator[str]:
        """Generate up to ``max_new_tokens``; ``stream=True`` returns an iterator of text pieces."""
        stats = GenerationStats()
        steps = self.stream(prompt, max_new_tokens, temperature, top_p, top_k, stop, seed, chat, stats)
        if stream:
            return self.text_stream(steps, stop)
        ids: list[int] = []
        for new in steps:
            ids += new
        ids = ids[: stats.new_tokens]
        text = self.tokenizer.decode(ids)
        if stop:
            cut = [text.find(s) for s in stop if s in text]
            text = text[: min(cut)] if cut else text
        return GenerationOutput(ids, text, stats)

    def generate_batch(self, prompts: Sequence[Any], max_new_tokens: int = 128, temperature: float = 0.0,
                       chat: bool | None = None) -> "BatchOutput":
        """Greedy decoding of several prompts at once (``decode/batch.py``): one target forward per
        step for the whole batch, per-row trees, acceptance and stopping; row i equals
        ``generate(prompts[i])`` token for token. Temperature > 0 is refused for now."""
        from .batch import generate_batch

        return generate_batch(self, prompts, max_new_tokens, temperature, chat)

    def text_stream(self, steps: Iterator[list[int]], stop: Sequence[str]) -> Iterator[str]:
        ids: list[int] = []
        shown = 0
        for new in steps:
            ids += new
            text = self.tokenizer.decode(ids)
            cut = [text.find(s) for s in stop if s in text]
            if cut:
                text = text[: min(cut)]
            if len(text) > shown and not text.endswith("\ufffd"):
                yield text[shown:]
                shown = len(text)
            if cut:
                return


def _adapter_of(heads: Path | HeadsBase) -> str | None:
    """The adapter a heads checkpoint names (Medusa-2: trained on an adapted target), or None."""
    if isinstance(heads, HeadsBase):
        if heads.metadata.get("adapter"):  # a module does not know the folder its adapter is in
            raise DecodeError(f"these heads were trained on an adapted target (metadata.adapter: "
                              f"{heads.metadata['adapter']}); pass adapter=PATH, or the heads' folder")
        return None
    found = adapter_dir(heads)
    return str(found) if found is not None else None
