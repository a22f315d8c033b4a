"""The ``headway`` command: argument parsing and dispatch, nothing else.

Each subcommand is a config dataclass plus a function taking it, named below as
"module:attribute" so that ``headway --help`` imports neither torch nor transformers. The config
dataclasses live in light modules (``demo.configs``, ``data.configs``, ``heads.configs``, ``bench.configs``, ...)
so that ``headway <command> --help`` does not either.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import __version__
from .config import help_text, parse_cli
from .errors import HeadwayError


@dataclass(frozen=True)
class Command:
    summary: str
    config: str  # "module:DataclassName"
    run: str  # "module:function" taking the config, returning an exit code or None


COMMANDS: dict[str, Command] = {
    "demo": Command("The whole pipeline on the demo target: build, distil, train Medusa/EAGLE-1/EAGLE-3, bench.",
                    "headway.demo.pipeline:DemoConfig", "headway.demo.pipeline:demo_cli"),
    "target build": Command("Build (or reuse from cache) a target: the demo (a small Llama trained on the stdlib source) "
                            "or a named real one (smollm2: SmolLM2-135M-Instruct from a PyPI wheel's GGUF).",
                            "headway.demo.configs:TargetBuildConfig", "headway.demo.builder:build_cli"),
    "prompts": Command("Let the target write prompts itself: sample its user turn from an empty chat (Magpie-style).",
                       "headway.data.configs:PromptsConfig", "headway.data.self_prompts:prompts_cli"),
    "distill": Command("Let the frozen target write the answers to prompts (self-distillation), in resumable shards.",
                       "headway.data.configs:DistillConfig", "headway.data.distill:distill_cli"),
    "tokenize": Command("Tokenise a dataset that already has answers: input_ids + assistant-only loss masks.",
                        "headway.data.encode:TokenizeConfig", "headway.data.encode:tokenize_cli"),
    "features": Command("Store the target's hidden states over a distilled dataset (EAGLE offline mode).",
                        "headway.data.configs:FeaturesConfig", "headway.data.features:features_cli"),
    "merge": Command("Merge distilled datasets, or features folders, into one (more data without redoing any).",
                     "headway.data.merge:MergeConfig", "headway.data.merge:merge_cli"),
    "import": Command("Import a reference checkpoint or any headway export (Medusa, EAGLE-1/EAGLE-3) as native heads.",
                      "headway.heads.configs:ImportConfig", "headway.heads.importers:import_cli"),
    "export": Command("Export heads for an engine: vLLM (Medusa, EAGLE-1/3), SGLang (EAGLE-1/3), TensorRT-LLM "
                      "(Medusa, EAGLE-3), speculators (EAGLE-3).",
                      "headway.heads.configs:ExportConfig", "headway.heads.export:export_cli"),
    "push": Command("Push a heads checkpoint (weights + model card) to the Hugging Face Hub: push HEADS ORG/NAME.",
                    "headway.heads.hub:PushConfig", "headway.heads.hub:push_cli"),
    "train": Command("Train Medusa / EAGLE heads on the frozen target (= accelerate launch -m headway train).",
                     "headway.train.config:TrainConfig", "headway.train.recipe:train"),
    "adapt": Command("Adapt served heads to a (fine-tuned) target and its traffic: distil new prompts, continue "
                     "training, publish only when held-out tau improves; --watch LOGS repeats it, --rollback K undoes.",
                     "headway.adapt.configs:AdaptConfig", "headway.adapt.run:adapt_cli"),
    "generate": Command("Generate with the tree speculative decoder: the target's exact output, faster.",
                        "headway.decode.cli:GenerateConfig", "headway.decode.cli:generate_cli"),
    "tune": Command("Measure acceptance and this machine's forward costs; store the fastest tree with the heads.",
                    "headway.bench.configs:TuneConfig", "headway.bench.tune:tune_cli"),
    "chat": Command("Interactive chat (or completion) with the speculative decoder.",
                    "headway.decode.cli:ChatConfig", "headway.decode.cli:chat_cli"),
    "bench": Command("Benchmark heads against HF generate / assisted / prompt lookup: tokens/s, tau, exact match.",
                     "headway.bench.configs:BenchConfig", "headway.bench.run:bench_cli"),
    "eval": Command("Standard suites (mt-bench, humaneval, gsm8k, spec-bench) per category: tau, acceptance by "
                    "position, speed against HF; --engine vllm compares with vLLM's own counters.",
                    "headway.bench.eval_configs:EvalConfig", "headway.bench.evaluate:eval_cli"),
}


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _listing() -> str:
    width = max(len(n) for n in COMMANDS) + 2
    lines = ["usage: headway <command> [--config FILE.yaml] [--key value | key=value ...]", "",
             "Train Medusa / EAGLE draft heads on a frozen LM and decode faster with exact output.", "",
             "commands:"]
    lines += [f"  {name:<{width}}{cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "Run 'headway <command> --help' for a command's options; 'headway --version' for the version."]
    return "\n".join(lines)


def _groups() -> dict[str, list[str]]:
    """Command groups ('target' for 'target build') -> their subcommands."""
    out: dict[str, list[str]] = {}
    for name in COMMANDS:
        group, _, sub = name.partition(" ")
        if sub:
            out.setdefault(group, []).append(sub)
    return out


def _group_listing(group: str) -> str:
    names = [f"{group} {sub}" for sub in _groups()[group]]
    width = max(len(n) for n in names) + 2
    lines = [f"usage: headway {group} <command> [--key value | key=value ...]", "", f"'{group}' commands:"]
    lines += [f"  {name:<{width}}{COMMANDS[name].summary}" for name in names]
    lines += ["", f"Run 'headway {group} <command> --help' for a command's options."]
    return "\n".join(lines)


def _find(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    for n in (2, 1):
        name = " ".join(argv[:n])
        if len(argv) >= n and name in COMMANDS:
            return name, list(argv[n:])
    return None, list(argv)


HELP = ("-h", "--help")


def _run(argv: list[str]) -> int:
    if not argv or argv[0] in (*HELP, "help"):
        print(_listing())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"headway {__version__}")
        return 0
    name, rest = _find(argv)
    groups = _groups()
    if name is None and argv[0] in groups and (len(argv) == 1 or argv[1] in HELP):
        print(_group_listing(argv[0]))  # `headway target`, `headway target --help`: what the group holds
        return 0
    if name is None:
        if argv[0] in groups:
            print(f"headway: error: unknown command '{argv[0]} {argv[1]}'; '{argv[0]}' commands: "
                  f"{', '.join(groups[argv[0]])}", file=sys.stderr)
        else:
            print(f"headway: error: unknown command '{argv[0]}'; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    cmd = COMMANDS[name]
    cfg_cls = _load(cmd.config)
    if any(a in HELP for a in rest):
        print(help_text(cfg_cls, f"headway {name}", cmd.summary))
        return 0
    try:
        cfg = parse_cli(cfg_cls, rest)
        quiet_library_bars()
        fn: Callable[[Any], Any] = _load(cmd.run)
        code = fn(cfg)  # an exit status, or what the command made (train: the heads folder) for 0
        return code if isinstance(code, int) else 0
    except HeadwayError as e:
        print(f"headway {name}: error: {e}", file=sys.stderr)
        if os.environ.get("HEADWAY_TRACEBACK"):
            raise
        return 2
    except KeyboardInterrupt:
        print(f"headway {name}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        if "torch.distributed" in sys.modules and not _EXITING_HARD:  # multi-process runs: exit cleanly
            from .data.runtime import release_process_group

            release_process_group()


_EXITING_HARD = False  # set by ``entry`` in a rank of a multi-process run


def entry() -> None:
    """The ``headway`` console script and ``python -m headway``: ``main``, then leave the process.

    A rank of a multi-process run (``accelerate launch``) leaves with ``os._exit`` once its files
    are written: its torch.distributed (Gloo) group and threads are never torn down. Tearing them
    down, at interpreter exit or explicitly, now and then hung a 2-process CPU run after it had
    saved its heads and printed "done"; a rank that has finished has nothing left to clean up."""
    global _EXITING_HARD
    _EXITING_HARD = int(os.environ.get("WORLD_SIZE", "1")) > 1
    code = main()
    if _EXITING_HARD:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


LIBRARY_BARS = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")  # transformers follows the hub's


def quiet_library_bars() -> None:
    """Silence the libraries' own bars (transformers' "Loading weights", Hub downloads, datasets'
    map): they would tear through generated text, tables and headway's progress. An explicit
    ``HF_HUB_DISABLE_PROGRESS_BARS=0`` brings them back."""
    for name in LIBRARY_BARS:
        os.environ.setdefault(name, "1")  # read when the libraries are imported: after this, in a command
    if os.environ[LIBRARY_BARS[0]] != "1":
        return
    if "huggingface_hub" in sys.modules:  # imported already (headway used as a library, tests)
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules and os.environ[LIBRARY_BARS[1]] == "1":
        from datasets.utils import logging as ds_logging

        ds_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, not at interpreter exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        # `headway ... | head -1`: the reader has gone. Stop quietly, like other command-line tools:
        # no traceback, and stdout pointed at /dev/null so the exit-time flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + 13  # 141: what a shell reports for a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
