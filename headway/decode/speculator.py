"""The public decoder: a stock transformers target + trained heads -> the target's own output, faster.

``Speculator`` is a thin front over three parts: the ``Runtime`` (``decode/runtime.py``: placement,
dtypes, compile, kernels, attention, the lm_head policy), the ``TreePolicy`` (``decode/policy.py``:
tree shapes, calibration, adaptive sizes, speculate-or-not by batch size) and the one decode step
(``decode/step.py``: draft -> verify -> accept -> commit), which ``generate`` runs on a batch of one
and ``generate_batch`` on several prompts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..hardware import sync
from ..heads import HeadsBase, load_heads
from ..heads.metadata import adapter_dir
from ..tokenizer import encode_prompt
from .args import DecodeError, check_decode_args, check_prompt_list, row_named
from .kv import OneRow
from .policy import TreePolicy, batch_table, drafts_per_token, fit_tree, fitted_table
from .proposers import DFlashProposer, Proposer, RowsProposer, hidden_index, make_proposer
from .runtime import Runtime
from .sampling import SamplingParams
from .shapes import TreeShape, chain
from .stats import BatchOutput, GenerationOutput, GenerationStats
from .step import (Batch, RecordStats, Row, RowScored, StepHooks, choose, commit, draft, leave, prefill, score, step,
                   stopped)
from .verify import Verdict

__all__ = ["Speculator", "GenerationOutput", "GenerationStats", "BatchOutput"]


class Speculator:
    """Target + heads + tree shape. ``generate`` returns exactly what the target would: greedy
    output equals ``model.generate(do_sample=False)``; sampling follows the target's distribution."""

    def __init__(self, target: nn.Module, tokenizer: Any, heads: HeadsBase, tree: TreeShape | str | None = None,
                 max_depth: int | None = None, typical: tuple[float, float] | None = None,
                 sampled_drafts: bool = True, sampling_tree: TreeShape | str | None = None,
                 calibrate: bool = True, heads_dtype: str | torch.dtype | None = "auto",
                 static_cache: bool = False, compile: bool = False, linear_kernel: str = "auto",
                 verify_logits: str = "auto", by_batch: dict[int, Any] | None = None,
                 batch_policy: str = "auto", by_batch_sampling: dict[int, Any] | None = None,
                 confidence_sizing: bool = True) -> None:
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
        output (checked once) and nothing is compiled; ``all`` projects every node. ``by_batch``:
        per batch size, decode plainly (False), speculate with ``tree`` (True) or with the tree
        given there (a shape or its spec, e.g. ``"chain-2"``), as ``headway tune`` measured
        (``by_batch_sampling``: above T=0, where it differs); without it one prompt speculates and a
        batch decodes plainly (``policy.untuned_speculates``); ``batch_policy="always"`` drafts at every step of every
        batch (A/B, and tests that compare batched steps with unbatched ones). ``confidence_sizing``:
        heads with a confidence head (DSpark) choose each step's chain length from it (the chance that
        drafts 1..k are all accepted against the verify-cost curve, as adaptive trees do); one prompt,
        deterministic drafts (a sampled chain verifies every draft: a cut chosen from drawn tokens would
        bias which are tested), not compiled. The output is the target's either way."""
        heads.check_tokenizer(tokenizer)  # ids must mean the tokens the heads were trained on
        self.tokenizer = tokenizer
        self.max_depth = max_depth
        self.calibrate = calibrate
        self.batched_drafting = True  # generate_batch: one drafter call per level for all rows (False: row by row, A/B)
        if batch_policy not in ("auto", "always"):
            raise DecodeError(f"batch_policy must be auto or always, got {batch_policy!r}")
        self.runtime = Runtime(target, heads, heads_dtype, static_cache, compile, linear_kernel, verify_logits)
        proposer = self.new_proposer()  # a template: its limits decide the tree
        self.runtime.layers = [hidden_index(i, self.runtime.num_layers) for i in proposer.feature_layers]
        if sampling_tree is None and tree is None and drafts_per_token(proposer):
            sampling_tree = chain(4)
        fitted = fit_tree(tree, proposer)
        confident = isinstance(proposer, DFlashProposer) and proposer.confident  # DSpark's confidence head
        self.policy = TreePolicy(fitted, fit_tree(sampling_tree, proposer) if sampling_tree is not None else fitted,
                                 self.runtime.max_positions, sampled_drafts, typical,
                                 fitted_table(by_batch, proposer), fitted_table(by_batch_sampling, proposer),
                                 batch_aware=batch_policy == "auto",
                                 confidence_sizing=confidence_sizing and not compile and confident)
        self.hooks: list[StepHooks] = []  # called after every step (``step.StepHooks``), after the stats
        self.adapter: str | None = None  # the PEFT adapter merged into the target by from_pretrained
        self.adapter_from_heads = False  # ... because the heads named it (the CLI says so)
        if compile and self.policy.adaptive():
            raise DecodeError("an adaptive tree changes the verify's token count every step, which a compiled "
                              "forward recompiles for; with --compile use a dynamic-K-D-N tree")

    @classmethod
    def from_pretrained(cls, target: str | nn.Module, heads: str | Path | HeadsBase, tokenizer: Any = None,
                        tree: TreeShape | str | None = None, dtype: str | torch.dtype | None = "float32",
                        device: str | torch.device | None = None, adapter: str | None = None,
                        device_map: str | dict[str, Any] | None = None, attn_implementation: str | None = None,
                        **options: Any) -> "Speculator":
        """``adapter``: a PEFT adapter merged into a target given by name; by default the one the heads
        checkpoint names (Medusa-2 heads are trained on an adapted target, which is the one whose
        output they reproduce). A target given as a model object is used as it is. ``device_map``,
        ``attn_implementation`` and ``dtype`` (``auto`` too) go to ``load_target``; ``options`` are the
        constructor's (``max_depth``, ``typical``, ``sampling_tree``, ``calibrate``, ``heads_dtype``,
        ``static_cache``, ``compile``, ``linear_kernel``, ``verify_logits``, ``confidence_sizing``); the
        tuned trees and batch tables stored with the heads fill in ``tree``, ``sampling_tree``,
        ``by_batch`` and ``by_batch_sampling``."""
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
        stored = heads.metadata.get("decode") or {}
        if tree is None:  # the tuned trees: one for both, or T=0's and the one above
            tree = stored.get("tree")
            options["sampling_tree"] = options.get("sampling_tree") or stored.get("sampling_tree")
        spec = cls(target, tokenizer, heads, tree, by_batch=batch_table(stored.get("by_batch")),
                   by_batch_sampling=batch_table(stored.get("by_batch_sampling")), **options)
        spec.adapter, spec.adapter_from_heads = (str(adapter) if adapter else None), from_heads
        return spec


    # -- the parts, by name ----------------------------------------------------------------------
    @property
    def target(self) -> nn.Module:
        return self.runtime.target

    @property
    def heads(self) -> HeadsBase:
        return self.runtime.heads

    @property
    def kernels(self) -> Any:
        return self.runtime.kernels

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runtime.dtype

    @property
    def max_positions(self) -> int:
        return self.runtime.max_positions

    @property
    def typical(self) -> tuple[float, float] | None:
        return self.policy.typical

    @property
    def tree(self) -> TreeShape:
        return self.policy.tree

    @tree.setter
    def tree(self, shape: TreeShape) -> None:
        self.policy.tree = shape

    @property
    def sampling_tree(self) -> TreeShape:
        return self.policy.sampling_tree

    @sampling_tree.setter
    def sampling_tree(self, shape: TreeShape) -> None:
        self.policy.sampling_tree = shape

    def tree_for(self, temperature: float) -> TreeShape:
        """The shape drafted at this temperature (``tree`` at 0, ``sampling_tree`` above)."""
        return self.policy.tree_for(temperature)

    def fit_tree(self, tree: TreeShape | str | None) -> TreeShape:
        """``tree`` as these heads can draft it (clipped to their depth and draft vocabulary)."""
        return fit_tree(tree, self.new_proposer())

    def new_proposer(self) -> Proposer:
        """Per-generation draft state, for any number of rows (the heads are shared)."""
        return make_proposer(self.heads, self.max_depth, calibrate=self.calibrate)

    def new_batch_proposer(self, rows: int) -> Proposer:
        """Draft state of a batch of ``rows`` (``decode/proposers.py``): one drafter call per draft
        level for all rows; row by row (``RowsProposer``, one ``new_proposer`` each) when
        ``batched_drafting`` is off or ``new_proposer`` was replaced (a test oracle drafts one row), so
        a custom proposer is never bypassed."""
        custom = "new_proposer" in vars(self) or type(self).new_proposer is not Speculator.new_proposer
        if rows > 1 and (custom or not self.batched_drafting):
            return RowsProposer([self.new_proposer() for _ in range(rows)])
        return self.new_proposer()

    def encode(self, prompt: Any, chat: bool | None = None) -> torch.Tensor:
        """(1, n) token ids of a prompt (``tokenizer.encode_prompt``)."""
        try:
            ids = encode_prompt(self.tokenizer, prompt, chat)
        except ValueError as e:
            raise DecodeError(str(e)) from None
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    def _prepare(self) -> None:
        """One-off measurements, outside any generation's time: the kernels (auto), the lm_head
        check, an adaptive tree's cost curve."""
        self.runtime.kernels.plan()
        self.runtime.uses_lazy_logits()
        if self.policy.sized_per_step():
            self.policy.verify_costs(self.runtime)

    # -- one prompt, step by step (tests and tune drive these) --------------------------------
    def start(self, input_ids: torch.Tensor, params: SamplingParams, gen: torch.Generator,
              max_new_tokens: int | None = None) -> Batch:
        """Prefill the target and the proposer for one prompt; the first token comes from the target."""
        ids = input_ids.reshape(-1).tolist()
        row = Row(0, [], len(ids), params, gen, max_new_tokens or (1 << 30))
        return self._prefill([ids], [row], max_new_tokens, self.new_proposer())

    def _prefill(self, ids: list[list[int]], rows: list[Row], max_new_tokens: int | None, proposer: Proposer
                 ) -> Batch:
        """The prompts' prefill; one prompt's static cache holds it, ``max_new_tokens`` and the largest tree."""
        length = None if max_new_tokens is None or len(ids) > 1 else \
            len(ids[0]) + max_new_tokens + self.policy.largest_size()
        return prefill(self.runtime, ids, rows, proposer, length, self._choose)

    def _choose(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        """A row's first token (tests replace it to start from a chosen one)."""
        return choose(logits, params, gen)

    def draft_and_score(self, state: Batch, params: SamplingParams | None = None,
                        gen: torch.Generator | None = None) -> RowScored:
        """Draft one prompt's tree and run the target's forward over it; ``params`` (default greedy)
        choose the tree and, with ``sampled_drafts``, sample a chain's drafts with ``gen``."""
        row = state.rows[0]
        row.params = params if params is not None else SamplingParams()
        row.gen = gen if gen is not None else row.gen
        drafts = draft(self.runtime, self.policy, state)
        return score(self.runtime, self.policy, state, drafts).row(0)

    def commit(self, state: Batch, scored: RowScored, verdict: Verdict) -> list[int]:
        """Keep the accepted entries, tell the proposer, append and return the emitted tokens."""
        return commit(state, scored.batch, [verdict], set())[0][0]

    def fork(self, state: Batch) -> Batch:
        """An independent copy of a one-prompt decode state (for tree search over outcomes in tests)."""
        import copy

        if not isinstance(state.kv, OneRow):
            raise DecodeError("only a one-prompt decode state can be forked")
        skipped = copy.deepcopy(state.skipped)  # plain steps the proposer has not seen: the copy's too
        return Batch(state.kv.fork(), state.proposer.fork(), [copy.deepcopy(r) for r in state.rows], state.step_cost,
                     skipped)

    # -- generation ---------------------------------------------------------------------------
    def stream(self, prompt: Any, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None, chat: bool | None = None,
               stats: GenerationStats | None = None) -> Iterator[list[int]]:
        """An iterator over the newly emitted token ids after every step (the first list comes from
        prefill). The arguments and the prompt's length are checked here, before it is returned
        (``check_decode_args``): a prompt that leaves no room for ``max_new_tokens`` is an error."""
        ids = self.encode(prompt, chat)[0].tolist()
        return self._stream(ids, self._row(0, ids, max_new_tokens, temperature, top_p, top_k, seed, stats), stop)

    def _stream(self, ids: list[int], row: Row, stop: Sequence[str]) -> Iterator[list[int]]:
        self._prepare()
        run = self._run([ids], [row], self.new_proposer())
        for i, new in enumerate(run):
            yield new[0]
            # stop strings are looked for after each step (not after prefill) while the row runs
            if i and stop and not row.stats.stopped_by and cut_at_stop(self.tokenizer.decode(row.emitted), stop)[1]:
                row.stats.stopped_by = "stop"
                run.close()  # times the row

    @torch.inference_mode()
    def _run(self, ids: list[list[int]], rows: list[Row], proposer: Proposer) -> Iterator[list[list[int]]]:
        """Prefill the prompts (one prompt's own ``generate``: ``new_proposer``; ``generate_batch``:
        ``new_batch_proposer``), then decode steps until every row has stopped; yields the new tokens of
        every row that entered (prefill's first tokens first). A row's times are set when it stops, or
        when the caller closes the run. The kernels are swapped in around each forward's work only."""
        eos = self.runtime.eos_ids(self.tokenizer)
        t_start = time.perf_counter()
        with self.kernels():
            batch = self._prefill(ids, rows, rows[0].max_new, proposer)
        sync(self.device)
        t_prefill = time.perf_counter() - t_start
        for r in rows:
            r.stats.time_prefill = t_prefill

        def finish(finished: Sequence[Row]) -> None:
            for r in finished:
                r.stats.time_total = time.perf_counter() - t_start

        try:
            finish(leave(batch, [stopped(r, eos) for r in batch.rows]))  # a first token may end a row
            yield [r.emitted[:] for r in rows]
            hooks: list[StepHooks] = [RecordStats(), *self.hooks]
            while batch.rows:
                with self.kernels():  # the drafter's and the target's forwards (commit may run the drafter)
                    _, new, finished = step(self.runtime, self.policy, batch, eos, hooks)
                finish(finished)
                yield new
        finally:
            finish(batch.rows)  # closed early (a stop string): the rows still running

    def generate(self, prompt: Any, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, stop: Sequence[str] = (), seed: int | None = None, stream: bool = False,
                 chat: bool | None = None) -> GenerationOutput | Iterator[str]:
        """Generate up to ``max_new_tokens``; ``stream=True`` returns an iterator of text pieces."""
        stats = GenerationStats()
        steps = self.stream(prompt, max_new_tokens, temperature, top_p, top_k, stop, seed, chat, stats)
        if stream:
            return self.text_stream(steps, stop)
        ids = [t for new in steps for t in new][: stats.new_tokens]
        return GenerationOutput(ids, cut_at_stop(self.tokenizer.decode(ids), stop)[0], stats)

    def generate_batch(self, prompts: Sequence[Any], max_new_tokens: int | Sequence[int] = 128,
                       temperature: float | Sequence[float] = 0.0, top_p: float | Sequence[float] = 1.0,
                       top_k: int | Sequence[int] = 0, seed: int | Sequence[int] | None = None,
                       chat: bool | None = None) -> BatchOutput:
        """Several prompts at once: one target forward per step for the whole batch, per-row trees,
        acceptance and stopping. ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` and ``seed``
        are one value for every row or one per row (row i's generator: ``seed[i]``, or ``seed + i``). A greedy row i
        equals ``generate(prompts[i])`` token for token; a sampled row follows the target's
        distribution, as ``generate`` does."""
        check_prompt_list(prompts)
        B = len(prompts)

        def per_row(name: str, value: Any) -> list[Any]:
            if isinstance(value, (list, tuple)):
                if len(value) != B:
                    raise DecodeError(f"{name} has {len(value)} values for {B} prompts; give one, or one per prompt")
                return list(value)
            return [value] * B

        temps, tops_p, tops_k = per_row("temperature", temperature), per_row("top_p", top_p), per_row("top_k", top_k)
        max_new = per_row("max_new_tokens", max_new_tokens)
        seeds = per_row("seed", seed) if isinstance(seed, (list, tuple)) else \
            [None if seed is None else int(seed) + i for i in range(B)]
        ids, rows = [], []
        for i, prompt in enumerate(prompts):
            with row_named(i):
                ids.append(self.encode(prompt, chat)[0].tolist())
                rows.append(self._row(i, ids[i], max_new[i], temps[i], tops_p[i], tops_k[i], seeds[i]))
        self._prepare()
        t_start = time.perf_counter()
        steps = self._run(ids, rows, self.new_batch_proposer(B))
        forwards = sum(1 for _ in steps) - 1  # a yield per step, after prefill's
        out = [GenerationOutput(r.emitted, self.tokenizer.decode(r.emitted), r.stats) for r in rows]
        return BatchOutput(out, forwards, time.perf_counter() - t_start)

    def _row(self, index: int, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
             seed: int | None, stats: GenerationStats | None = None) -> Row:
        """A prompt's decode state before prefill, its arguments and length checked first
        (``check_decode_args``), with its own generator (seeded when ``seed`` is given)."""
        check_decode_args(max_new_tokens, temperature, top_p, top_k, self.typical, len(ids), self.max_positions)
        gen = torch.Generator(device="cpu")
        if seed is not None:
            gen.manual_seed(int(seed))
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(ids)
        return Row(index, [], len(ids), SamplingParams(float(temperature), int(top_k), float(top_p)), gen,
                   int(max_new_tokens), stats)

    def text_stream(self, steps: Iterator[list[int]], stop: Sequence[str]) -> Iterator[str]:
        ids: list[int] = []
        shown = 0
        for new in steps:
            ids += new
            text, cut = cut_at_stop(self.tokenizer.decode(ids), stop)
            if len(text) > shown and not text.endswith("\ufffd"):
                yield text[shown:]
                shown = len(text)
            if cut:
                return


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first of the ``stop`` strings in it, and whether one was."""
    hits = [text.find(s) for s in stop if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def _adapter_of(heads: Path | HeadsBase) -> str | None:
    """The adapter a heads checkpoint names (Medusa-2: trained on an adapted target), or None."""
    if isinstance(heads, HeadsBase):
        if heads.metadata.get("adapter"):  # a module does not know the folder its adapter is in
            raise DecodeError(f"these heads were trained on an adapted target (metadata.adapter: "
                              f"{heads.metadata['adapter']}); pass adapter=PATH, or the heads' folder")
        return None
    found = adapter_dir(heads)
    return str(found) if found is not None else None
