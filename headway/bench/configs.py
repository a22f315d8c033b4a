"""The settings of ``headway tune`` and ``headway bench``.

They live here, apart from the code that runs them (``tune``, ``bench``; both re-export them),
so that ``headway tune --help`` and ``headway bench --help`` read them without importing torch or
transformers. Validation that needs the tree code (``parse_shape``) imports it when a config is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, opt
from ..data.plans import PROMPT_FORMATS
from ..decode.args import VERIFY_LOGITS, DecodeTargetArgs, check_decode_args



REPORTING_SPLIT = "chat:test"  # reported numbers come from it; no choice may read it (docs/benchmarks.md)


def refuse_reporting_split(source: Any, what: str) -> None:
    """Choices are made on ``chat:dev``: a command that chooses refuses the reporting split."""
    from ..data.source_spec import parse_sources

    if any(spec.path == REPORTING_SPLIT for spec in parse_sources(source)):
        raise ConfigError(f"{what} reads {REPORTING_SPLIT}, the split reported numbers are measured on, which no "
                          "choice may see (tune chooses the tree): tune on chat:dev, report on chat:test")


@dataclass
class TuneConfig(DecodeTargetArgs):
    target: str | None = opt(None, "target model (required): a folder, a Hub id, or 'demo'", kw_only=True)
    heads: str = opt(help="heads checkpoint folder (the tuned tree is written into its config.json)")
    prompts: Any = opt("demo:heldout", "calibration prompts (any source `headway distill` reads, specs included)")
    num_prompts: int = opt(8, "calibration prompts to use")
    prompt_tokens: int = opt(96, "prompt length for demo-corpus prompts")
    chat_template: str | None = opt(None, "Jinja chat template file, for targets whose tokenizer has none")
    prompt_format: str = opt("auto", "auto: chat template when the tokenizer has one (plain prompts become a "
                                     "user message); chat: always; raw: plain prompts as they are",
                             choices=PROMPT_FORMATS)
    max_new_tokens: int = opt(64, "tokens generated per prompt while measuring")
    probe_depth: int = opt(6, "deepest draft position measured")
    probe_rank: int = opt(8, "ranks measured per depth")
    sizes: list[int] = opt(default_factory=lambda: [2, 4, 8, 12, 16, 24, 32, 48, 64],
                           help="tree sizes (non-root nodes) considered for measured static trees")
    finalists: int = opt(3, "predicted-best static trees that are run for real")
    temperatures: list[float] = opt(default_factory=lambda: [0.0], help="temperatures the choice is made for: "
                                    "T=0's fastest tree is stored, and with temperatures above 0 too, their "
                                    "fastest (mean tokens/s) as the tree drafted when sampling")
    repeats: int = opt(2, "interleaved timing repeats")
    calibration_data: str | None = opt(None, "a distilled dataset or features folder of this target: fit the heads' "
                                             "draft calibration (temperature by depth) on it and store it with the "
                                             "tree; default: the calibration training stored, if any")
    batch_sizes: list[int] = opt(default_factory=list, help="also measure, per batch size, the chosen tree against "
                                 "plain decoding with the same kernel (Speculator.generate_batch, the calibration "
                                 "prompts in batches) and store which is faster: generate_batch then speculates only "
                                 "at batch sizes where it pays (without it the choice is measured while decoding)")
    write: bool = opt(True, "store the chosen tree in the heads' config.json")
    json_out: str | None = opt(None, "write the measurements here as JSON")

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_reporting_split(self.prompts, "'prompts'")
        if not self.temperatures:
            raise ConfigError("'temperatures' needs one or more values >= 0")
        for t in self.temperatures:
            check_decode_args(self.max_new_tokens, t)
        self.batch_sizes = sorted(set(self.batch_sizes))
        if any(b < 1 for b in self.batch_sizes):
            raise ConfigError(f"'batch_sizes' must be whole numbers >= 1, got {self.batch_sizes}")


OPTIONAL_BASELINES = ("hf-assisted", "hf-prompt-lookup", "hf-weight-major", "hf-prompt-lookup-weight-major")
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class BenchConfig(DecodeTargetArgs):
    heads: list[str] = opt(help="heads checkpoints to compare: --heads A B C (folders or Hub ids)",
                           default_factory=list)
    prompts: Any = opt("demo:heldout", "prompt source (any `headway distill` reads, specs included): demo:heldout, "
                                       "demo:train, chat:heldout, a .jsonl/.json/.parquet file, a datasets folder or "
                                       "a cached Hub dataset")
    num_prompts: int = opt(8, "prompts to use (the first N of the source)")
    prompt_tokens: int = opt(64, "demo sources: prompt length in tokens (code prefixes cut at line ends)")
    max_new_tokens: int = opt(128, "new tokens per generation at most (EOS stops earlier, for every method alike)")
    temperature: list[float] = opt(help="temperatures: --temperature 0 1 (exact-match is checked at 0)",
                                   default_factory=lambda: [0.0])
    tree: list[str] = opt(help="tree shapes to try with every heads checkpoint (chain-N, fork-N, mc_sim_7b_63, "
                               "dynamic-K-D-T, adaptive-K-D-T, ...; 'stored': the checkpoint's tuned trees, "
                               "one per temperature if tuned so); default: each checkpoint's stored tree, "
                               "else its kind's default",
                          default_factory=list)
    calibration: list[str] = opt(help="on: dynamic trees ranked with the heads' fitted draft calibration (the "
                                      "decoder's default); off: by the raw draft probabilities; 'on off' benches "
                                      "both side by side (chains and static trees are the same either way)",
                                 default_factory=lambda: ["on"], choices=("on", "off"))
    verify_logits: list[str] = opt(help="auto: on CPU a tree's lm_head rows are projected as verification reads "
                                        "them (the decoder's default); all: every node's; 'auto all' benches both "
                                        "side by side (chains project all rows either way)",
                                   default_factory=lambda: ["auto"], choices=VERIFY_LOGITS)  # type: ignore[assignment]
    batch_policy: list[str] = opt(help="with --batch-size: auto: speculate or decode plainly per batch size (the "
                                       "heads' tuned table, else measured while decoding: the decoder's default); "
                                       "always: draft at every step; 'auto always' benches both side by side",
                                  default_factory=lambda: ["auto"], choices=("auto", "always"))
    chat_template: str | None = opt(None, "Jinja chat template file, for targets whose tokenizer has none")
    prompt_format: str = opt("auto", "auto: chat template when the tokenizer has one (plain prompts become a "
                                     "user message); chat: always; raw: plain prompts as they are",
                             choices=PROMPT_FORMATS)
    baselines: list[str] = opt(help="HF baselines besides hf-generate (always run: the reference and speedup "
                                    "1.0): hf-assisted hf-prompt-lookup hf-weight-major "
                                    "hf-prompt-lookup-weight-major, or none; leave out hf-assisted to bench a "
                                    "non-demo target without an assistant model; "
                                    "hf-weight-major / hf-prompt-lookup-weight-major: HF generate / prompt lookup "
                                    "with the decoder's --linear-kernel choice (what the kernel gains apart from "
                                    "the drafts; named for the first such kernel, they run whichever the choice "
                                    "picks, native included)",
                               default_factory=lambda: ["hf-assisted", "hf-prompt-lookup"])
    assistant: str | None = opt(None, "draft model for HF assisted generation (same tokenizer as the target), or "
                                      "none to skip that baseline; default for the demo target: the same recipe "
                                      "with --assistant-layers layers", none_word=True)
    assistant_layers: int = opt(2, "layers of the default demo assistant")
    assistant_tokens: int = opt(5, "draft tokens per step in HF assisted generation (constant schedule)")
    prompt_lookup_tokens: int = opt(10, "draft tokens per step in HF prompt-lookup decoding")
    repeats: int = opt(3, "timed passes over all prompts; tokens/s and speedup are medians over them")
    warmup: int = opt(1, "untimed warm-up generations per method and temperature before timing")
    seed: int = opt(0, "prompt selection and sampling seed")
    threads: int | None = opt(None, "torch CPU threads (1 is often fastest for small models on a busy machine)")
    json: str | None = opt(None, "write the report here (schema headway.bench/1)")
    plot: str | None = opt(None, "write a PNG here: speedup by method, acceptance by depth")
    batch_size: list[int] = opt(help="batched throughput instead of the per-prompt protocol: --batch-size 1 4 8 "
                                     "runs HF generate (left-padded batches, the baseline; with hf-weight-major in "
                                     "--baselines also with the linear kernel) and each headway method "
                                     "(Speculator.generate_batch) on batches of each size, at each --temperature; "
                                     "assisted and prompt lookup do not batch",
                                default_factory=list, choices=BATCH_SIZES)
    progress: bool = opt(True, "progress on stderr: a bar on a terminal, else a plain line with rate and ETA")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_prompts", "prompt_tokens", "max_new_tokens", "repeats", "assistant_layers",
                     "assistant_tokens", "prompt_lookup_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"'{name}' must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"'warmup' must be >= 0, got {self.warmup}")
        if not self.temperature or any(t < 0 for t in self.temperature):
            raise ConfigError(f"'temperature' needs one or more values >= 0, got {self.temperature}")
        self.temperature = list(dict.fromkeys(float(t) for t in self.temperature))
        for t in self.temperature:  # finite too
            check_decode_args(self.max_new_tokens, t)
        self.calibration = list(dict.fromkeys(self.calibration))
        self.verify_logits = list(dict.fromkeys(self.verify_logits))  # type: ignore[assignment]
        self.batch_policy = list(dict.fromkeys(self.batch_policy))
        self.batch_size = sorted(set(self.batch_size))
        if self.tree:  # a bad tree fails before the target is loaded
            from ..decode.shapes import parse_shape  # lazy: it imports torch, which --help does not need

            for spec in self.tree:
                if spec != "stored":
                    parse_shape(spec)
        self.baselines = [] if self.baselines == ["none"] else list(dict.fromkeys(self.baselines))
        for name in self.baselines:
            if name not in OPTIONAL_BASELINES:
                raise ConfigError(f"'baselines' must be one of {', '.join(OPTIONAL_BASELINES)} (or none); got {name!r}")
        if self.assistant is not None and self.assistant.strip().lower() == "none":
            # no assistant model: the assisted baseline is skipped, for the demo target as for any other
            self.assistant = None
            self.baselines = [b for b in self.baselines if b != "hf-assisted"]
        if self.assistant and "hf-assisted" not in self.baselines:
            raise ConfigError("'assistant' is set but 'baselines' leaves out hf-assisted, the only method using it")

    def runtime_kwargs(self) -> dict[str, Any]:
        """The ``Speculator`` options shared by every method (``verify_logits`` is looped over)."""
        kw = super().runtime_kwargs()
        kw.pop("verify_logits")
        return kw

