"""``headway generate`` and ``headway chat``."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ..config import SamplingOptions, opt
from .args import CALIBRATE_HELP, DecodeError, DecodeTargetArgs, check_decode_args


@dataclass(kw_only=True)
class DecodeSampling(SamplingOptions):
    """The sampling options of generate and chat; their seed is unset unless given."""

    seed: int | None = opt(None, "seed of the sampling draws (unset: torch's default generator "  # type: ignore[assignment]
                                 "seed)")


@dataclass
class GenerateConfig(DecodeSampling, DecodeTargetArgs):
    target: str | None = opt(None, "target model (required): a folder, a Hub id, or 'demo' for the demo target",
                             kw_only=True)
    heads: str = opt(help="heads checkpoint: a folder or a Hub id")
    prompt: str = opt("", "the prompt (plain text; chat targets get their chat template with --chat)")
    max_new_tokens: int = opt(128, "tokens to generate at most")
    tree: str | None = opt(None, "tree shape: chain-N, fork-N, mc_sim_7b_63, static:[[0],[0,0]], "
                                 "dynamic[-K-DEPTH-TOTAL], adaptive[-K-DEPTH-TOTAL] (per step, only the best nodes "
                                 "worth their verify cost; at most 64 deep, 1024 nodes, K <= 64); default: the tuned "
                                 "tree stored with the heads for this temperature, else a kind default")
    calibrate: bool = opt(True, CALIBRATE_HELP)
    stop: list[str] = opt(default_factory=list, help="stop strings")
    stream: bool = opt(False, "print tokens as they are accepted")
    chat: bool = opt(False, "apply the tokenizer's chat template to the prompt")
    typical: bool = opt(False, "LOSSY: Medusa's typical acceptance when sampling (faster; output no longer "
                               "follows the target's distribution)")
    posterior_threshold: float = opt(0.09, "typical acceptance: probability threshold (epsilon)")
    posterior_alpha: float = opt(0.3, "typical acceptance: entropy factor (delta)")

    def __post_init__(self) -> None:  # a bad value fails here, before a model is loaded
        super().__post_init__()
        check_decode_args(self.max_new_tokens, **self.sampling_kwargs(),
                          typical=(self.posterior_threshold, self.posterior_alpha) if self.typical else None)
        _check_tree(self.tree)


@dataclass
class ChatConfig(DecodeSampling, DecodeTargetArgs):
    target: str | None = opt(None, "target model (required): a folder, a Hub id, or 'demo'", kw_only=True)
    heads: str = opt(help="heads checkpoint: a folder or a Hub id")
    max_new_tokens: int = opt(256, "tokens per reply at most")
    tree: str | None = opt(None, "tree shape (see headway generate --help)")
    calibrate: bool = opt(True, CALIBRATE_HELP)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_decode_args(self.max_new_tokens, **self.sampling_kwargs())
        _check_tree(self.tree)


def _check_tree(tree: str | None) -> None:
    if tree is not None:
        from .shapes import parse_shape

        parse_shape(tree)


def adapter_note(adapter: Any) -> str:
    """The line the CLI prints when the heads' checkpoint named an adapter that was merged into the
    target: the output is then the adapted target's, not the base model's, and the user must know."""
    return (f"note: merged the LoRA adapter the heads name ({adapter}) into the target: the output is the "
            "adapted target's (Medusa-2), not the base model's")


def _speculator(cfg: DecodeTargetArgs, heads: str, tree: str | None, typical: tuple[float, float] | None = None):
    from ..target import resolve_target_path
    from .speculator import Speculator

    spec = Speculator.from_pretrained(resolve_target_path(cfg.target), heads, tree=tree, adapter=cfg.adapter,
                                      typical=typical, calibrate=cfg.calibrate,
                                      **cfg.load_kwargs(), **cfg.runtime_kwargs())
    if spec.adapter_from_heads:
        print(adapter_note(spec.adapter), file=sys.stderr)
    return spec


def prompt_token_ids(tokenizer: Any, prompt: str, chat: bool, target: str) -> list[int]:
    """The ids ``headway distill`` would condition the target on for this plain prompt: raw, or
    (``--chat``) the user message in the tokenizer's chat template (``data.plans.prompt_ids``)."""
    from ..data.chat import load_chat_template
    from ..data.plans import prompt_ids
    from ..data.samples import Sample

    template = load_chat_template(tokenizer, None)
    if chat and not template:
        raise DecodeError(f"--chat needs a chat template, and the tokenizer of '{target}' has none")
    return prompt_ids(Sample("prompt", prompt=prompt), tokenizer, template, "chat" if chat else "raw", target)[0]


def generate_cli(cfg: GenerateConfig) -> int:
    if not cfg.prompt:
        raise DecodeError("give a prompt with --prompt '...'")
    typical = (cfg.posterior_threshold, cfg.posterior_alpha) if cfg.typical else None
    if typical and cfg.temperature <= 0:
        raise DecodeError("--typical applies to sampling; set --temperature > 0 (greedy is always exact)")
    if typical:
        print("warning: typical acceptance is LOSSY: the output does not follow the target's distribution",
              file=sys.stderr)
    spec = _speculator(cfg, cfg.heads, cfg.tree, typical)
    kw = dict(max_new_tokens=cfg.max_new_tokens, **cfg.sampling_kwargs(), stop=cfg.stop, seed=cfg.seed)
    ids = prompt_token_ids(spec.tokenizer, cfg.prompt, cfg.chat, cfg.target)
    if cfg.stream:
        from .speculator import GenerationStats

        stats = GenerationStats()
        steps = spec.stream(ids, stats=stats, **kw)
        for piece in spec.text_stream(steps, cfg.stop):
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
    else:
        out = spec.generate(ids, **kw)
        stats = out.stats
        print(out.text)
    tree = spec.tree_for(cfg.temperature)
    print(f"[{type(spec.heads).__name__} tree={getattr(tree, 'name', tree)}] {stats.summary()}; "
          f"linear kernel: {spec.kernels.plan().describe()}", file=sys.stderr)
    return 0


def chat_cli(cfg: ChatConfig) -> int:
    spec = _speculator(cfg, cfg.heads, cfg.tree)
    has_template = bool(getattr(spec.tokenizer, "chat_template", None))
    history: list[dict] = []
    print("headway chat: empty line or Ctrl-D to quit" + ("" if has_template else
          " (no chat template: each line is a plain completion prompt)"), file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        prompt = history + [{"role": "user", "content": line}] if has_template else line
        pieces = []
        for piece in spec.generate(prompt, max_new_tokens=cfg.max_new_tokens, **cfg.sampling_kwargs(), seed=cfg.seed,
                                   stream=True):
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
        if has_template:
            history += [{"role": "user", "content": line}, {"role": "assistant", "content": "".join(pieces)}]
    return 0
