"""The settings of ``headway distill`` and ``headway features``.

Apart from the code that runs them (``distill``, ``features``; both re-export them) so that
``headway distill --help`` and ``headway features --help`` read them without importing torch.
The target options come from ``TargetArgs``, the same for every command that runs a target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import check_numbers, opt
from ..target import LINEAR_KERNELS, TargetArgs
from .errors import DataError
from .plans import OVERLONG, PROMPT_FORMATS
from .source_spec import parse_sources

if TYPE_CHECKING:
    from .generation import SamplingSettings

STORE_DTYPE_NAMES = ("bfloat16", "float16", "float32")
# what writes the answers: transformers in this process, or vLLM in its own environment (engines/)
ENGINES = ("hf", "vllm")


@dataclass
class DistillConfig(TargetArgs):
    source: Any = opt(help="prompts: a .jsonl/.json/.parquet file (prompt | messages | conversations | instruction "
                           "rows), a datasets folder, a Hub dataset (org/name, org/name:config@split), preset:sharegpt "
                           "/ preset:ultrachat, demo:train / demo:heldout, the built-in chat instructions chat:train "
                           "/ chat:extra / chat:heldout / chat:dev / chat:test, or a source spec: a mapping ('{path: ..., split: "
                           "..., columns: {...}, shuffle: true, sample: N, streaming: true}') or a list of them, mixed "
                           "by weight (docs/data.md)", positional=True)
    output: str = opt("runs/distilled", "output folder (resumed if it holds shards of the same settings)")
    chat_template: str | None = opt(None, "Jinja chat template file, for targets whose tokenizer has none")
    prompt_format: str = opt("auto", "auto: chat template when the tokenizer has one (plain prompts become a "
                                     "user message); chat: always; raw: plain prompts as they are",
                             choices=PROMPT_FORMATS)
    stop_tokens: list[str] = opt(default_factory=list, help="extra tokens that end an answer (e.g. <|im_end|>)")
    split: str = opt("train", "split of a datasets folder / Hub dataset")
    limit: int | None = opt(None, "use only the first N prompts (demo sources: the number of prompts, default 256)")
    skip: int = opt(0, "leave out the first N prompts (those an earlier run distilled; limit counts after them)")
    prompt_tokens: int = opt(64, "demo sources: prompt length in tokens")
    max_prompt_tokens: int = opt(1024, "prompts longer than this (in tokens) are dropped or truncated")
    overlong: str = opt("drop", "what to do with a too-long prompt", choices=OVERLONG)
    max_new_tokens: int = opt(256, "longest answer (tokens) per assistant turn")
    temperature: float = opt(0.0, "sampling temperature; 0 = greedy")
    top_p: float = opt(1.0, "nucleus sampling threshold (1 = off)")
    top_k: int = opt(0, "top-k sampling (0 = off)")
    seed: int = opt(0, "seed for sampling and the demo prompts")
    samples_per_prompt: int = opt(1, "answers sampled per prompt (needs temperature > 0): answer s of prompt i is "
                                     "row i * N + s, with the prompt's id and its sample index s (column 'sample'), "
                                     "seeded like every sampled row by the seed and its place (per batch with hf, per "
                                     "row with vllm), so a resumed run redraws it. limit counts prompts (N answers "
                                     "to limit / N prompts cost what one answer to limit prompts does), "
                                     "shard_size rows")
    batch_size: int = opt(8, "prompts per generate() call")
    shard_size: int = opt(256, "prompts per shard (the unit of resumption)")
    skip_bad_rows: bool = opt(False, "skip malformed rows (and report how many) instead of stopping")
    overwrite: bool = opt(False, "delete the output folder first")
    engine: str = opt("hf", "what writes the answers: hf (transformers, here) or vllm (vLLM in its own virtual "
                            "environment, see --vllm-python; the same rows as hf at temperature 0, where fp32 "
                            "logits are not near-tied; sampled rows are seeded but differ from hf's)",
                      choices=ENGINES)
    vllm_python: str | None = opt(None, "--engine vllm: the Python of a vLLM environment (default: "
                                        "$HEADWAY_VLLM_PYTHON)")
    linear_kernel: str = opt("auto", "--engine hf on CPU: kernel of the batch's few-row linears (auto = the faster "
                                     "of F.linear and W @ x.T, measured on the target's weights; stock = F.linear); "
                                     "a speed knob, not a setting: the rows are the same up to float near-ties",
                             choices=LINEAR_KERNELS)
    features: str | None = opt(None, "also store the target's hidden states over every row in this features folder "
                                     "(what headway features would write, with shard_size rows per shard), taken "
                                     "from the forwards that write the answers instead of a second pass; hf "
                                     "engine only")
    feature_layers: list[str] = opt(default_factory=lambda: ["eagle3", "final"],
                                    help="--features: the hidden states to store, as headway features --layers "
                                         "('eagle3 final': what every head kind trains on)")
    feature_store_dtype: str = opt("bfloat16", "--features: dtype of the stored features", choices=STORE_DTYPE_NAMES)

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_sources(self.source)  # a bad spec fails here, before the target loads
        check_numbers(self, "", {"batch_size": ">= 1", "shard_size": ">= 1", "max_prompt_tokens": ">= 1",
                                 "prompt_tokens": ">= 1", "limit": ">= 1", "skip": ">= 0", "samples_per_prompt": ">= 1"})
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise DataError(f"samples_per_prompt {self.samples_per_prompt} at temperature 0 would write the same "
                            "greedy answer every time; set --temperature > 0 (e.g. 1.0)")
        if self.engine == "vllm" and self.adapter:
            raise DataError("--engine vllm cannot apply a PEFT adapter (--adapter); merge it into the target "
                            "first, or use --engine hf")
        if self.engine == "vllm" and self.features:
            raise DataError("--engine vllm returns no hidden states, so it cannot write --features; drop --features "
                            "(--features none) and run headway features on the dataset, or use --engine hf")
        self.sampling()  # validates the sampling settings

    def sampling(self) -> SamplingSettings:
        from .generation import SamplingSettings  # lazy: torch

        return SamplingSettings(self.temperature, self.top_p, self.top_k, self.max_new_tokens)


@dataclass
class FeaturesConfig(TargetArgs):
    dataset: str = opt(help="a distilled (or tokenized) dataset folder", positional=True)
    target: str | None = opt(None, "target model (default: the one that distilled the dataset); a folder, a Hub id "
                                   "or 'demo'", kw_only=True)
    output: str = opt("runs/features", "output folder (resumed if it holds shards of the same settings)")
    layers: list[str] = opt(default_factory=lambda: ["final"],
                            help="hidden states to store: 'final' (post-norm, Medusa/EAGLE-1), HF hidden_states "
                                 "indices (e.g. 2 4 5), 'eagle3' (2, L//2, L-3) or 'dflash' (5 spread over the "
                                 "depth); training reads 'final' for Medusa / EAGLE-1 and for every drafter's "
                                 "soft labels, so EAGLE-3 wants 'eagle3 final' and DFlash 'dflash final'")
    store_dtype: str = opt("bfloat16", "dtype of the stored features", choices=STORE_DTYPE_NAMES)
    topk_logits: int = opt(0, "also store the target's K largest logits (float32 values, sorted, and their int32 "
                              "token ids) at every position whose next token is an answer token, K = this (e.g. "
                              "64; 512 bytes a token): training reads them with eagle.soft_labels / "
                              "dflash.soft_labels=stored_topk instead of projecting 'final' through the lm_head "
                              "each step; 0 = none")
    batch_size: int = opt(8, "rows per forward pass")
    shard_size: int = opt(512, "rows per shard (the unit of resumption)")
    limit: int | None = opt(None, "use only the first N rows of the dataset")
    overwrite: bool = opt(False, "delete the output folder first")

    def __post_init__(self) -> None:  # no super(): the target may be left to the dataset's record
        check_numbers(self, "", {"batch_size": ">= 1", "shard_size": ">= 1", "limit": ">= 1", "topk_logits": ">= 0"})


@dataclass
class PromptsConfig(TargetArgs):
    num: int = opt(2000, "prompts to write, in whole batches (so a few more); a resumed run writes only the rest, "
                         "a larger num extends a finished folder")
    output: str = opt("runs/prompts", "output folder: prompts.jsonl (one {\"id\", \"prompt\"} row per line, what "
                                      "`headway distill` reads) and settings.json")
    system: str | None = opt(None, "system message before the user turn (default: none, or the chat template's own)")
    chat_template: str | None = opt(None, "Jinja chat template file, for targets whose tokenizer has none")
    stop_tokens: list[str] = opt(default_factory=list, help="extra tokens that end a user turn (the template's "
                                                            "end-of-turn token and the target's EOS always do)")
    temperature: float = opt(1.0, "sampling temperature of the user turns (> 0: greedy would write one prompt)")
    top_p: float = opt(1.0, "nucleus sampling threshold (1 = off)")
    top_k: int = opt(0, "top-k sampling (0 = off)")
    max_new_tokens: int = opt(128, "longest user turn (tokens); turns the target has not ended by then are dropped")
    min_chars: int = opt(15, "shorter prompts are dropped")
    max_chars: int = opt(800, "longer prompts are dropped")
    exclude: list[str] = opt(default_factory=list, help="prompt sources (files, datasets, chat:heldout, ...) whose "
                                                        "prompts are never written: keeps benchmark prompts out of "
                                                        "training data")
    batch_size: int = opt(64, "user turns sampled per batch (the unit of resumption)")
    seed: int = opt(0, "sampling seed; batch b draws from seed and b, so a resumed run writes the same prompts")
    linear_kernel: str = opt("auto", "CPU kernel of the batch's few-row linears (as distill's)",
                             choices=LINEAR_KERNELS)
    overwrite: bool = opt(False, "delete the output folder first")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_numbers(self, "", {"num": ">= 1", "batch_size": ">= 1", "max_new_tokens": ">= 1",
                                 "max_chars": ">= 1"})
        if self.temperature <= 0:
            raise DataError(f"temperature must be > 0 (greedy sampling writes the same prompt every time), got "
                            f"{self.temperature}")
        self.sampling()

    def sampling(self) -> SamplingSettings:
        from .generation import SamplingSettings  # lazy: torch

        return SamplingSettings(self.temperature, self.top_p, self.top_k, self.max_new_tokens)
