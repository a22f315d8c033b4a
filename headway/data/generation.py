"""Batched generation by the frozen target: left padding, greedy or sampled, cut at the stop token."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..kernels import LinearKernels
from ..compat import cache_kwarg, hidden_states_arg
from .errors import DataError


@dataclass(frozen=True)
class SamplingSettings:
    """How the target writes answers. ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise DataError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DataError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise DataError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Answer:
    tokens: list[int]  # what the target wrote, its stop token included when it stopped
    stopped: bool  # False: cut by max_new_tokens
    # with a FeatureSpec: {key: (prompt + answer tokens, H)}, the target's hidden states over the whole row
    features: dict[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class FeatureSpec:
    """Hidden states to keep while generating: {feature key: HF ``hidden_states`` index}, stored as
    ``store_dtype`` (``headway.data.feature_format.layer_key`` names the keys)."""

    layers: Mapping[str, int]
    store_dtype: torch.dtype = torch.bfloat16


class FeatureRecorder:
    """Collects, for every prompt of one ``decode_batch``, the target's hidden states over the
    prompt (from the prefill) and over each token written (from the forward that reads it, the
    last one included): the row's features, as a forward over the finished row gives them, from
    forwards that generation runs anyway. A decode step only appends its (b, H) states and row ids
    (no per-row work, no copy off the device); ``rows`` sorts them out once, at the end."""

    def __init__(self, spec: FeatureSpec, prompt_lengths: Sequence[int]) -> None:
        self.spec = spec
        self.indices = sorted(set(spec.layers.values()))
        self.lengths = list(prompt_lengths)
        self.prompt: dict[str, torch.Tensor] = {}  # key -> (B, T, H), left-padded
        self.steps: dict[str, list[torch.Tensor]] = {k: [] for k in spec.layers}  # key -> per step (b, H)
        self.step_rows: list[torch.Tensor] = []  # per step (b,): the prompt each state belongs to

    def add_prefill(self, hidden: Sequence[torch.Tensor | None]) -> None:
        self.prompt = {k: self._take(hidden, i) for k, i in self.spec.layers.items()}

    def add_step(self, hidden: Sequence[torch.Tensor | None], rows: torch.Tensor) -> None:
        """``rows``: (b,) the prompt of each batch row of a forward that read one token per row."""
        self.step_rows.append(rows)
        for k, i in self.spec.layers.items():
            self.steps[k].append(self._take(hidden, i)[:, -1])

    def _take(self, hidden: Sequence[torch.Tensor | None], i: int) -> torch.Tensor:
        h = hidden[i]
        assert h is not None
        return h.to(self.spec.store_dtype)

    def rows(self) -> list[dict[str, torch.Tensor]]:
        """Per prompt {key: (prompt + written tokens, H)} on the CPU."""
        n = len(self.lengths)
        ids = torch.cat(self.step_rows)  # decode_batch runs every row through at least one step
        order = torch.argsort(ids, stable=True)  # each prompt's steps together, in step order
        counts = torch.bincount(ids, minlength=n).tolist()
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        for k, prompt in self.prompt.items():
            prompt = prompt.cpu()
            written = torch.cat(self.steps[k]).cpu()[order].split(counts)
            width = prompt.shape[1]
            for r, length in enumerate(self.lengths):
                out[r][k] = torch.cat([prompt[r, width - length:], written[r]])
        return out


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T), with padding on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def generation_config(settings: SamplingSettings, stop_ids: Sequence[int], pad_id: int) -> Any:
    """A complete ``GenerationConfig``: values left unset would be filled from the model's own
    ``generation_config.json`` (a repetition penalty, say), so every processor is set explicitly."""
    from transformers import GenerationConfig

    sample = settings.temperature > 0
    neutral = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0, length_penalty=1.0)
    # Greedy ignores the sampling fields; setting them to transformers' own defaults only keeps
    # it from warning about the model's sampling defaults.
    sampling = dict(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k, min_p=0.0,
                    typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0) if sample else dict(
                    temperature=1.0, top_p=1.0, top_k=50)
    return GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=sample, num_beams=1,
                            eos_token_id=list(stop_ids), pad_token_id=pad_id, use_cache=True, **neutral, **sampling)


@torch.inference_mode()
def generate_batch(model: nn.Module, prompts: Sequence[Sequence[int]], settings: SamplingSettings,
                   stop_ids: Sequence[int], pad_id: int, seed: int | None = None) -> list[Answer]:
    """Generate an answer to each prompt (token ids) in one left-padded batch.

    ``seed`` seeds torch's RNG first, so a batch's samples are reproducible on resume.
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)  # (B, T)
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask,
                         generation_config=generation_config(settings, stop_ids, pad_id))  # (B, T + new)
    return [cut_at_stop(row, stop_ids) for row in out[:, ids.shape[1]:].tolist()]


@torch.inference_mode()
def greedy_batch(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop_ids: Sequence[int], pad_id: int, features: FeatureSpec | None = None) -> list[Answer]:
    """Greedy answers to one left-padded batch, each row leaving the batch when it stops.

    ``model.generate`` keeps decoding finished rows until the batch's longest answer ends; chat
    answers vary in length (SmolLM2: 116 tokens on average under a 160-token cap), so about a third of
    its row-steps were padding. Here the KV cache drops the finished rows
    (``Cache.batch_select_indices``) and later steps cost only the live ones. Same tokens as
    ``generate_batch`` at temperature 0 (tested). With ``features``, each answer carries the row's
    hidden states (``FeatureRecorder``).
    """
    return decode_batch(model, prompts, max_new_tokens, stop_ids, pad_id, lambda logits: logits.float().argmax(-1),
                        features)


@torch.inference_mode()
def sample_batch(model: nn.Module, prompts: Sequence[Sequence[int]], settings: SamplingSettings,
                 stop_ids: Sequence[int], pad_id: int, seed: int, features: FeatureSpec | None = None) -> list[Answer]:
    """Sampled answers (temperature, top-k, top-p as in ``generate``) to one left-padded batch,
    finished rows leaving the batch as in ``greedy_batch``. Draws come from a generator seeded
    with ``seed``, so the same batch and seed give the same answers (a resumed job redoes a batch
    exactly); they differ from ``generate_batch``'s, which draws from torch's global RNG."""
    from ..sampling import SamplingParams, processed_probs

    if settings.temperature <= 0:
        return greedy_batch(model, prompts, settings.max_new_tokens, stop_ids, pad_id, features)
    params = SamplingParams(settings.temperature, settings.top_k, settings.top_p)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    return decode_batch(model, prompts, settings.max_new_tokens, stop_ids, pad_id,
                        lambda logits: torch.multinomial(processed_probs(logits, params), 1, generator=gen)[:, 0],
                        features)


@torch.inference_mode()
def decode_batch(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int],
                 pad_id: int, choose: Callable[[torch.Tensor], torch.Tensor],
                 features: FeatureSpec | None = None) -> list[Answer]:
    """One left-padded batch decoded step by step; ``choose`` maps (b, V) logits of the live rows to
    their (b,) next tokens. A row that writes a stop token leaves the batch and the KV cache; with
    ``features`` one forward later, once its last token has been read (``FeatureRecorder``)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)  # (B, T)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each row counts from its first token
    cache = DynamicCache(config=model.config)
    record = FeatureRecorder(features, [len(p) for p in prompts]) if features is not None else None
    hidden: dict[str, Any] = {"output_hidden_states": hidden_states_arg(record.indices)} if record is not None else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{cache_kwarg(): cache},
                logits_to_keep=1, **hidden)
    logits = out.logits[:, -1]  # (B, V)
    rows = torch.arange(len(prompts))  # the prompt index of each live row
    if record is not None:
        record.add_prefill(out.hidden_states)
    next_pos = positions[:, -1] + 1  # (b,)
    stops = torch.tensor(sorted(set(stop_ids)), device=device)
    answers: list[list[int]] = [[] for _ in prompts]

    def keep_live(live: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
        keep = live.nonzero().squeeze(1)
        cache.batch_select_indices(keep)
        return [rows[keep.cpu()]] + [t[keep] for t in tensors]

    for step in range(max_new_tokens):
        tokens = choose(logits)  # (b,)
        for r, t in zip(rows.tolist(), tokens.tolist()):
            answers[r].append(t)
        last = step == max_new_tokens - 1
        live = torch.zeros_like(tokens, dtype=torch.bool) if last else ~torch.isin(tokens, stops)  # (b,)
        if record is None:  # finished rows leave before the next forward
            if not live.any():
                break
            if not live.all():
                rows, tokens, mask, next_pos = keep_live(live, tokens, mask, next_pos)
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    use_cache=True, **{cache_kwarg(): cache}, **hidden)
        logits, next_pos = out.logits[:, -1], next_pos + 1
        if record is not None:  # the finished rows' last tokens were read too: now they leave
            record.add_step(out.hidden_states, rows)
            if not live.any():
                break
            if not live.all():
                rows, logits, mask, next_pos = keep_live(live, logits, mask, next_pos)
    if record is None:
        return [cut_at_stop(a, stop_ids) for a in answers]
    return [replace(cut_at_stop(a, stop_ids), features=f) for a, f in zip(answers, record.rows())]


def cut_at_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> Answer:
    """An answer ends at its first stop token (kept); none: it was cut by max_new_tokens. Every
    engine's output goes through here, so the engines agree on where an answer ends."""
    stops = set(stop_ids)
    cut = next((i for i, t in enumerate(tokens) if t in stops), None)
    return Answer(list(tokens[: cut + 1]), True) if cut is not None else Answer(list(tokens), False)


# An engine's answers: (prompts as token ids, the batch's seed, one seed per prompt) -> one Answer per
# prompt. transformers draws a batch from one seeded RNG; vLLM seeds each request.
Generate = Callable[[list[list[int]], int, list[int]], list[Answer]]


def hf_generate(model: nn.Module, settings: SamplingSettings, stop_ids: Sequence[int], pad_id: int,
                kernels: LinearKernels | None = None, features: FeatureSpec | None = None) -> Generate:
    """Answers by this model with these settings, as a ``Generate``; with ``kernels``, the decode
    steps' few-row linears use that choice (``headway.kernels``). Greedy runs ``greedy_batch``,
    sampling ``sample_batch`` with the batch's seed: finished rows leave the batch either way, and
    a sampled batch draws from its own generator, so a resumed shard redraws the same answers.
    With ``features`` each answer carries its row's hidden states."""
    def generate(prompts: list[list[int]], seed: int, seeds: list[int]) -> list[Answer]:
        with kernels() if kernels is not None else contextlib.nullcontext():
            if settings.temperature == 0:
                return greedy_batch(model, prompts, settings.max_new_tokens, stop_ids, pad_id, features)
            return sample_batch(model, prompts, settings, stop_ids, pad_id, seed=seed, features=features)

    return generate


def stop_token_ids(model: nn.Module, tokenizer: Any, extra: Sequence[str] = ()) -> list[int]:
    """EOS ids of the model's generation config and tokenizer, plus ``extra`` tokens (e.g. ``<|im_end|>``)."""
    ids: list[int] = []
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids += [src] if isinstance(src, int) else list(src or [])
    for tok in extra:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or tid == tokenizer.unk_token_id:
            raise DataError(f"stop token '{tok}' is not a single token of the target's tokenizer")
        ids.append(int(tid))
    ids = list(dict.fromkeys(int(i) for i in ids))
    if not ids:
        raise DataError("the target has no EOS token; name one with --stop-tokens")
    return ids
