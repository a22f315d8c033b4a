"""``headway demo``: the whole pipeline on the embedded default, in one run folder.

build (or reuse) the demo target -> distil answers to its training prompts -> train Medusa,
EAGLE-1, EAGLE-3 and DFlash heads with the demo recipes -> bench them against HF baselines on held-out
prompts. Every stage writes under ``run_dir`` and is skipped when its output already exists,
so a rerun (or a resumed interrupted run) only does what is missing.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, load_config, opt
from ..errors import HeadwayError
from ..publish import check_output_path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # the repository's recipes: headway/demo/ -> root


def recipe(name: str) -> Path:
    """A demo recipe from the repository's configs/; missing is an error, never a silent fallback to
    defaults (which trained weaker heads: 1 epoch, no draft vocabulary, no hard-label CE)."""
    path = CONFIGS / name
    if not path.is_file():
        raise HeadwayError(f"demo recipe {path} not found: `headway demo` runs from a clone of the repository, "
                           "whose configs/ holds its recipes")
    return path
KINDS = ("medusa", "eagle1", "eagle3", "dflash")  # trained by default
MORE_KINDS = ("peagle", "dspark")  # on request (--kinds): configs/demo/{peagle,dspark}.yaml


@dataclass
class DemoConfig:
    run_dir: str = opt("runs/demo", "every artifact of the demo goes here; a rerun reuses what is built")
    quick: bool = opt(False, "the ~5-minute version: tiny target, fewer prompts and steps, shorter bench")
    target_preset: str | None = opt(None, "demo target preset (default: demo, or tiny with --quick)")
    kinds: list[str] = opt(default_factory=lambda: list(KINDS), help="head kinds to train and bench")
    distill_prompts: int | None = opt(None, "training prompts the target answers (default 512; quick 96)")
    distill_tokens: int | None = opt(None, "tokens per distilled answer (default 128; quick 64)")
    train_steps: int | None = opt(None, "optimiser steps per head kind (default: the recipe's; quick 60)")
    bench_prompts: int | None = opt(None, "held-out prompts in the bench (default 8; quick 4)")
    bench_tokens: int | None = opt(None, "new tokens per bench generation (default 128; quick 48)")
    temperatures: list[float] = opt(default_factory=lambda: [0.0, 1.0], help="bench temperatures")
    threads: int | None = opt(None, "torch CPU threads (default: all cores)")

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS + MORE_KINDS]
        if bad:
            raise ValueError(f"unknown head kind(s) {bad}; choose from {', '.join(KINDS + MORE_KINDS)}")

    def pick(self, value: Any, default: Any, quick: Any) -> Any:
        return value if value is not None else (quick if self.quick else default)


def _stage(name: str) -> None:
    print(f"\n== {name} ==", flush=True)


def build_target(cfg: DemoConfig) -> Path:
    from .builder import TargetBuildConfig, build_demo_target, read_metadata

    preset = cfg.target_preset or ("tiny" if cfg.quick else "demo")
    path = build_demo_target(TargetBuildConfig(preset=preset))
    meta = read_metadata(path)
    ppl = meta.get("heldout_perplexity") or meta.get("perplexity")
    print(f"target: {path}" + (f" (held-out perplexity {ppl:.1f})" if isinstance(ppl, (int, float)) else ""))
    return path


def distill_data(cfg: DemoConfig, target: Path, run: Path) -> Path:
    from ..data.distill import DistillConfig, distill

    out = run / "distill"
    if (out / "headway_distill.json").is_file() and (out / "dataset_info.json").is_file():
        print(f"reusing {out}")
        return out
    base = load_config(DistillConfig, recipe("demo/distill.yaml"))
    base.target, base.output = str(target), str(out)
    base.limit = cfg.pick(cfg.distill_prompts, 512, 96)
    base.max_new_tokens = cfg.pick(cfg.distill_tokens, 128, 64)
    return distill(base)


def train_kind(cfg: DemoConfig, kind: str, target: Path, data: Path, run: Path) -> Path:
    """One recipe per kind, run as its own process (``python -m headway train``, what ``accelerate
    launch`` runs too): accelerate's process state is a singleton that one process cannot re-set."""
    import subprocess
    import sys

    import yaml

    from ..config import to_dict
    from ..heads.files import is_heads_checkpoint

    out = run / kind
    final = out / "final"
    if is_heads_checkpoint(final):
        print(f"reusing {final}")
        return final
    tc = train_config(cfg, kind, target, data, out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = run / f"train-{kind}.yaml"
    resolved.write_text(yaml.safe_dump(to_dict(tc), sort_keys=False))
    env = None
    if cfg.threads:
        import os

        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}
    rc = subprocess.run([sys.executable, "-m", "headway", "train", "--config", str(resolved)], env=env).returncode
    if rc != 0 or not is_heads_checkpoint(final):
        raise HeadwayError(f"training {kind} failed (exit {rc}); rerun `headway demo` to resume from its checkpoint")
    return final


def train_config(cfg: DemoConfig, kind: str, target: Path, data: Path, out: Path) -> Any:
    """The kind's demo recipe, pointed at this run's target, data and folder. The EAGLE-3, DFlash and
    P-EAGLE recipes name aux layers of the 8-layer demo target and a draft vocabulary of a quarter of its 8,192
    tokens; a shallower target (--quick's tiny one) gets the default layers, and a smaller vocabulary a
    quarter of its own."""
    from ..target import load_config_only
    from ..train.config import TrainConfig

    overrides: dict[str, Any] = {"target": str(target), "data": str(data), "output_dir": str(out),
                                 "resume_from": "latest"}
    steps = cfg.pick(cfg.train_steps, None, 60)
    if steps is not None:
        overrides["max_steps"] = steps
    tc = load_config(TrainConfig, recipe(f"demo/{kind}.yaml"), overrides)
    target_cfg = load_config_only(str(target), None, False)
    layers = getattr(target_cfg, "num_hidden_layers", None)
    vocab = getattr(target_cfg, "vocab_size", None)
    for opts in (tc.eagle, tc.dflash, tc.peagle):
        if opts.aux_layers and layers is not None and max(opts.aux_layers) >= layers:
            opts.aux_layers = []  # the default for this depth
        if opts.draft_vocab_size and vocab is not None and opts.draft_vocab_size > vocab:
            opts.draft_vocab_size = max(1, vocab // 4)  # the recipe's share of this vocabulary
    return tc


def run_bench(cfg: DemoConfig, target: Path, heads: dict[str, Path], run: Path) -> dict[str, Any]:
    from ..bench.run import BenchConfig, bench_cli

    bc = BenchConfig(target=str(target), heads=[str(heads[k]) for k in cfg.kinds if k in heads],
                     prompts="demo:heldout", num_prompts=cfg.pick(cfg.bench_prompts, 8, 4),
                     max_new_tokens=cfg.pick(cfg.bench_tokens, 128, 48), temperature=list(cfg.temperatures),
                     tree=[], repeats=1, json=str(run / "bench.json"),  # benchmarks/ repeats 3 times
                     plot=str(run / "bench.png"), threads=cfg.threads)
    if bench_cli(bc) != 0:  # prints the table; non-zero only if a headway method was not exact
        raise HeadwayError("a headway method's greedy output differed from the target's: see the table above")
    return json.loads((run / "bench.json").read_text())


EXPLANATION = """\
How to read this: every row generated the same held-out code prompts in one process, interleaved.
tau is tokens emitted per target forward (1.0 = no speedup possible); speedup is tokens/s against
plain HF greedy generate; exact = share of temperature-0 generations identical token for token to
HF greedy (headway's decoder must show 100%). The demo target is small and its greedy output
repeats itself, so compare tau with its repetition rate; teacher-forced accuracy in each heads'
model card ({run}/<kind>/final/README.md) is the more realistic acceptance figure.
Artifacts: {run}"""


def demo(cfg: DemoConfig) -> dict[str, Any]:
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    check_output_path(run, "--run-dir", error=ConfigError)
    run.mkdir(parents=True, exist_ok=True)
    (run / "demo_config.json").write_text(json.dumps(cfg.__dict__, indent=2))
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def timed(name: str, fn: Any, *a: Any) -> Any:
        _stage(name)
        t = time.perf_counter()
        out = fn(*a)
        timings[name] = time.perf_counter() - t
        return out

    target = timed("1/4 demo target", build_target, cfg)
    data = timed("2/4 self-distillation", distill_data, cfg, target, run)
    heads = {k: timed(f"3/4 train {k}", train_kind, cfg, k, target, data, run) for k in cfg.kinds}
    report = timed("4/4 bench", run_bench, cfg, target, heads, run)
    timings["total"] = time.perf_counter() - t0
    (run / "timings.json").write_text(json.dumps(timings, indent=2))
    print()
    print(EXPLANATION.format(run=run.resolve()))
    print("stage times: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    return report


def demo_cli(cfg: DemoConfig) -> int:
    try:
        demo(cfg)
    except FileNotFoundError as e:
        raise HeadwayError(str(e)) from None
    return 0
