"""``headway bench``: every decoding method in one process, interleaved, on the same prompts.

The protocol of design.md §7: load the target once; build the methods (each heads checkpoint x
each tree shape, plus the HF baselines: ``generate`` (always), assisted generation with a small
draft model and prompt lookup (both by default, ``--baselines``)); prompts are tokenised exactly
as ``headway distill`` conditions the target (``data.plans.prompt_ids``: chat template or raw,
``--prompt-format``); let HF greedy write the reference
completions (exact-match and the target's repetition rate are measured against them); warm up
every method; then for each repeat, for each prompt, for each temperature run every method in
turn, rotating the order. Per method: median tokens/s over repeats, speedup as the median
per-repeat ratio to HF ``generate`` (ratios within a repeat cancel the load of a shared
machine), τ, exact-match, acceptance by depth, overhead share and peak memory
(``bench_report`` documents the JSON schema).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import datetime
import json
import os
import platform
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..config import ConfigError
from ..decode.shapes import parse_shape
from ..data.progress import quiet_transformers
from ..kernels import LinearKernels
from ..optional import MissingDependency, skip_line
from ..publish import check_output_path
from ..target import default_assistant, demo_metadata
from .methods import (HeadwayMethod, HFMethod, Method, Run, configure_assistant, module_bytes, stop_ids_of,
                            timed_run, tree_spec)
from .repetition import repetition_rate
from .report import SCHEMA, Record, render_table, summarize, write_plot
from .configs import OPTIONAL_BASELINES, BenchConfig  # noqa: F401  (re-exported; light, for --help)


# ---------------------------------------------------------------------------------------------
# Building the methods


def load_assistant(cfg: BenchConfig, target_path: str, tokenizer: Any
                   ) -> tuple[nn.Module | None, dict[str, Any] | None]:
    """The draft model of HF assisted generation and its report entry; (None, None) when
    ``--baselines`` leaves hf-assisted out."""
    from ..target import load_target

    if "hf-assisted" not in cfg.baselines:
        return None, None
    path, note = (cfg.assistant, "given with --assistant") if cfg.assistant else \
        default_assistant(target_path, cfg.assistant_layers, cfg.progress)
    assistant, atok = load_target(path, **cfg.load_kwargs())
    if atok.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"the assistant '{path}' has a different tokenizer than the target; HF assisted "
                          "generation here needs the same vocabulary")
    configure_assistant(assistant, cfg.assistant_tokens)
    local = Path(path).expanduser()
    info = {"path": str(local.resolve()) if local.exists() else path,
            "parameters": sum(p.numel() for p in assistant.parameters()),
            "num_hidden_layers": int(assistant.config.num_hidden_layers), "note": note}
    return assistant, info


def baselines(target: nn.Module, tokenizer: Any, assistant: nn.Module | None, cfg: BenchConfig) -> list[HFMethod]:
    """HF generate first (it writes the reference), then the ``--baselines`` asked for."""
    stops = stop_ids_of(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [0])[0]
    out = [HFMethod("hf-generate", "hf_generate", target, stops, pad)]
    if "hf-assisted" in cfg.baselines:
        out.append(HFMethod("hf-assisted", "hf_assisted", target, stops, pad, cfg.assistant_tokens,
                            assistant=assistant))
    if "hf-prompt-lookup" in cfg.baselines:
        out.append(HFMethod("hf-prompt-lookup", "hf_prompt_lookup", target, stops, pad, cfg.prompt_lookup_tokens,
                            prompt_lookup_num_tokens=cfg.prompt_lookup_tokens))
    kernel = cfg.linear_kernel if cfg.linear_kernel != "stock" else "auto"  # the decoder's choice
    if "hf-weight-major" in cfg.baselines:
        out.append(HFMethod("hf-weight-major", "hf_weight_major", target, stops, pad,
                            kernels=LinearKernels(kernel, target)))
    if "hf-prompt-lookup-weight-major" in cfg.baselines:
        out.append(HFMethod("hf-prompt-lookup-weight-major", "hf_prompt_lookup", target, stops, pad,
                            cfg.prompt_lookup_tokens, kernels=LinearKernels(kernel, target),
                            prompt_lookup_num_tokens=cfg.prompt_lookup_tokens))
    return out


def _missing_path(value: str | None) -> bool:
    return bool(value) and value.startswith((".", "/", "~")) and not Path(value).expanduser().exists()


def check_inputs(cfg: BenchConfig) -> None:
    """What can be checked without the target, checked before it is built or loaded (building the
    demo target takes minutes; a typo in --heads or --prompts must not cost them): every heads
    checkpoint is one, the prompt source and the chat template exist, local paths given for the
    target, the assistant and the adapter exist, the report's paths can be written. Tree specs were
    parsed with the config."""
    from ..data.errors import ChatTemplateError
    from ..data.sources import check_source
    from ..heads.base import read_config, resolve_checkpoint

    for path in cfg.heads:
        read_config(resolve_checkpoint(path))
    check_source(cfg.prompts)
    if cfg.chat_template and not Path(cfg.chat_template).expanduser().is_file():
        raise ChatTemplateError(f"chat template file not found: {Path(cfg.chat_template).expanduser()}")
    for what, value in (("target", cfg.target), ("assistant", cfg.assistant), ("adapter", cfg.adapter)):
        if _missing_path(value):
            raise ConfigError(f"{what} not found: {Path(value).expanduser()}")
    for what, value in (("--json", cfg.json), ("--plot", cfg.plot)):  # refused now, not after the timing
        if value:
            check_output_path(value, what, file=True, error=ConfigError)


def heads_adapter(heads: Sequence[str]) -> str | None:
    """The adapter the heads checkpoints name (Medusa-2), merged into the one target every method
    runs; None when none names one. Two different adapters cannot share a target: that is an error."""
    from ..heads.base import resolve_checkpoint
    from ..heads.metadata import adapter_dir

    named = {str(path): adapter_dir(resolve_checkpoint(path)) for path in heads}
    found = sorted({str(a) for a in named.values() if a is not None})
    if len(found) > 1:
        raise ConfigError("the heads name different adapters for the target ("
                          + ", ".join(f"{h}: {a}" for h, a in named.items() if a is not None)
                          + "); bench them separately, or pass --adapter PATH to run all on one adapted target")
    return found[0] if found else None


def headway_methods(target: nn.Module, tokenizer: Any, cfg: BenchConfig) -> list[HeadwayMethod]:
    from ..heads import load_heads
    from ..decode.policy import batch_table
    from ..decode.speculator import Speculator

    methods: list[HeadwayMethod] = []
    for path in cfg.heads:
        heads = load_heads(path, target=target)
        if heads.metadata.get("adapter") and not cfg.adapter:
            raise ConfigError(f"heads '{path}' were trained with a LoRA adapter on the target (Medusa-2: "
                              f"{heads.metadata['adapter']}); pass --adapter PATH so that every method, the "
                              "baselines included, runs the same adapted target")
        stored = heads.metadata.get("decode") or {}
        for tree in cfg.tree or ["stored"]:
            sampling = None  # a tree given by name is drafted at every temperature
            if tree == "stored":  # tuned: T=0's tree, and the one above 0 where it differs
                tree, sampling = stored.get("tree"), stored.get("sampling_tree")
            policies = cfg.batch_policy if cfg.batch_size else ["auto"]  # one prompt: no batch to decide for
            for mode, logits, policy in itertools.product(cfg.calibration, cfg.verify_logits, policies):
                method = HeadwayMethod("", Speculator(target, tokenizer, heads, tree=tree, sampling_tree=sampling,
                                                      calibrate=mode == "on", verify_logits=logits,
                                                      by_batch=batch_table(stored.get("by_batch")),
                                                      by_batch_sampling=batch_table(stored.get("by_batch_sampling")),
                                                      batch_policy=policy, **cfg.runtime_kwargs()), str(path),
                                    stored_names(stored))
                if mode == "off" and "on" in cfg.calibration and not method.has_calibration:
                    continue  # the same drafts as the calibrated run: one row is enough
                methods.append(method)
    # "uncalibrated" only where it can differ: a dynamic tree of heads that carry a calibration
    tags = ["" if m.calibrated or not m.has_calibration else "[uncalibrated]" for m in methods]
    if len(cfg.verify_logits) > 1:  # side by side: the rows that project every node say so
        tags = [t + ("[all-logits]" if m.speculator.runtime.lazy_logits is False else "") for t, m in zip(tags, methods)]
    if cfg.batch_size and len(cfg.batch_policy) > 1:  # and the rows that draft at every step
        tags = [t + ("" if m.speculator.policy.batch_aware else "[always]") for t, m in zip(tags, methods)]
    names = [f"{m.kind}[{m.tree}]{tag}" for m, tag in zip(methods, tags)]
    for i, m in enumerate(methods):
        m.name = (names[i] if names.count(names[i]) == 1
                  else f"{m.kind}#{cfg.heads.index(m.heads_path)}[{m.tree}]{tags[i]}")
    return methods


def stored_names(decode: dict[str, Any]) -> dict[str, str]:
    """The tuned trees' specs -> the names tune chose them by (``measured-16``), for the reports."""
    names = {}
    for tree, chosen in (("tree", "chosen"), ("sampling_tree", "sampling_chosen")):
        if decode.get(tree) and decode.get(chosen):
            names[tree_spec(parse_shape(decode[tree]))] = str(decode[chosen])
    return names


# ---------------------------------------------------------------------------------------------
# Prompts


@dataclass
class Prompts:
    ids: list[list[int]]  # what the target is conditioned on, per prompt
    names: list[str]  # the source rows' ids
    format: str  # data.plans.describe_format: "raw", "chat (template of the target)", ...


def load_prompts(cfg: BenchConfig, tokenizer: Any) -> Prompts:
    """The first ``num_prompts`` prompts, tokenised by ``data.plans.prompt_ids`` exactly as
    ``headway distill`` conditions the target's first answer (same ``prompt_format`` and
    ``chat_template``; the template file, if given, is installed on ``tokenizer``). Demo code
    prompts come without trailing whitespace (``demo_target.demo_prompts``: the demo BPE merges
    newline + indent, so a prompt ending in one would be out of distribution)."""
    from ..data.chat import load_chat_template
    from ..data.plans import describe_format, prompt_ids
    from ..data.sources import read_samples

    template = load_chat_template(tokenizer, cfg.chat_template)
    src = read_samples(cfg.prompts, tokenizer=tokenizer, prompt_tokens=cfg.prompt_tokens, limit=cfg.num_prompts,
                       seed=cfg.seed)
    ids, names, formats = [], [], []
    for s in src.samples:
        row, used = prompt_ids(s, tokenizer, template, cfg.prompt_format, cfg.target)
        if row:
            ids.append(row)
            names.append(s.id)
            formats.append(used)
    if not ids:
        raise ConfigError(f"no usable prompts in '{cfg.prompts}'")
    return Prompts(ids, names, describe_format(formats, cfg.chat_template))


# ---------------------------------------------------------------------------------------------
# The protocol


def schedule(n_methods: int, repeats: int, n_prompts: int,
             temps: Sequence[float]) -> Iterator[tuple[int, int, float, list[int]]]:
    """(repeat, prompt, temperature, method order): every method in turn, the order rotated each time."""
    k = 0
    for r in range(repeats):
        for p in range(n_prompts):
            for t in temps:
                yield r, p, t, [(i + k) % n_methods for i in range(n_methods)]
                k += 1


def run_seed(seed: int, repeat: int, prompt: int) -> int:
    return seed + 1000 * repeat + prompt


class _Progress:
    """The bench's progress over generations: a bar on a terminal, plain lines with rate and ETA in a log."""

    def __init__(self, enabled: bool, total: int) -> None:
        from ..progress import Progress

        self.bar = Progress("bench", total, unit="runs", enabled=enabled).__enter__()

    def step(self, description: str) -> None:
        self.bar.advance(1, info=description)

    def close(self) -> None:
        self.bar.__exit__(None, None, None)


def measure(methods: Sequence[Method], prompts: Sequence[list[int]], cfg: BenchConfig, room: int,
            known: dict[int, list[int]] | None = None) -> tuple[list[list[int]], dict[tuple[int, float], list[Record]]]:
    """Reference greedy completions (HF ``generate``, methods[0]; ``known``: those already written, by
    prompt index), warm-up, then the timed runs."""
    max_new = [max(1, min(cfg.max_new_tokens, room - len(p))) for p in prompts]
    known = known or {}
    total = len(prompts) - len(known) + cfg.warmup * len(methods) * len(cfg.temperature) + \
        cfg.repeats * len(prompts) * len(cfg.temperature) * len(methods)
    bar = _Progress(cfg.progress, total)
    try:
        reference = []
        for i, p in enumerate(prompts):
            if i in known:
                reference.append(list(known[i]))
                continue
            reference.append(methods[0].generate(p, max_new[i], 0.0, cfg.seed).ids)
            bar.step("reference greedy")
        for w in range(cfg.warmup):
            for t in cfg.temperature:
                for m in methods:
                    m.generate(prompts[w % len(prompts)], max_new[w % len(prompts)], t, cfg.seed)
                    bar.step(f"warm-up {m.name}")
        records: dict[tuple[int, float], list[Record]] = {(i, t): [] for i in range(len(methods))
                                                           for t in cfg.temperature}
        for r, p, t, order in schedule(len(methods), cfg.repeats, len(prompts), cfg.temperature):
            for i in order:
                run: Run = timed_run(methods[i], prompts[p], max_new[p], t, run_seed(cfg.seed, r, p))
                records[(i, t)].append((r, p, run))
                bar.step(f"repeat {r + 1}/{cfg.repeats} {methods[i].name} T={t:g}")
    finally:
        bar.close()
    return reference, records


def _peak_rss_bytes() -> int | None:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def _target_info(target: nn.Module, path: str, demo: dict[str, Any] | None) -> dict[str, Any]:
    c = target.config
    demo_summary = None if demo is None else {k: demo.get(k) for k in (
        "heldout_loss", "heldout_perplexity", "greedy_repetition_rate", "sampled_repetition_rate",
        "reference_repetition_rate", "steps_done", "parameters")} | {"preset": demo["config"].get("preset")}
    return {"path": path, "architecture": (c.architectures or [type(target).__name__])[0],
            "parameters": sum(p.numel() for p in target.parameters()), "param_bytes": module_bytes(target),
            "num_hidden_layers": int(c.num_hidden_layers), "hidden_size": int(c.hidden_size),
            "vocab_size": int(target.get_output_embeddings().weight.shape[0]),
            "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
            "device": str(next(target.parameters()).device), "demo": demo_summary}


def bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the protocol and return the report (schema ``headway.bench/1``, see ``bench_report``)."""
    import transformers

    from .. import __version__
    from ..target import resolve_target_path
    from ..target import load_target

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    check_inputs(cfg)
    if cfg.adapter is None and (adapter := heads_adapter(cfg.heads)):
        from ..decode.cli import adapter_note

        print(adapter_note(adapter), file=sys.stderr)  # every method, the baselines too, runs the adapted target
        cfg = dataclasses.replace(cfg, adapter=adapter)
    target_path = resolve_target_path(cfg.target)  # builds the demo target if needed: after every check
    with quiet_transformers():
        target, tok = load_target(target_path, adapter=cfg.adapter, **cfg.load_kwargs())
        loaded = load_prompts(cfg, tok)  # before the assistant: a bad source or template fails fast
        if cfg.batch_size:
            return bench_batched(cfg, target, tok, loaded, target_path)
        assistant, assistant_info = load_assistant(cfg, target_path, tok)
        methods: list[Method] = [*baselines(target, tok, assistant, cfg), *headway_methods(target, tok, cfg)]
    prompts = loaded.ids
    room = int(getattr(target.config, "max_position_embeddings", 1 << 30))
    reference, records = measure(methods, prompts, cfg, room)
    entries = [(t, i, summarize(methods[i], t, recs, records[(0, t)], reference)) for (i, t), recs in records.items()]
    entries = [e for _, _, e in sorted(entries, key=lambda x: (x[0], x[1]))]  # by temperature, then method order
    return {
        "schema": SCHEMA, "headway_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": _target_info(target, target_path, demo_metadata(target_path)),
        "assistant": assistant_info,
        "settings": {**dataclasses.asdict(cfg), "torch": torch.__version__, "transformers": transformers.__version__,
                     "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                     "python": platform.python_version(),
                     "linear_kernels": {m.name: m.kernels.plan().describe() for m in methods if m.kernels is not None}},
        "prompts": {"source": cfg.prompts, "count": len(prompts), "prompt_format": loaded.format,
                    "mean_tokens": sum(map(len, prompts)) / len(prompts), "ids": loaded.names},
        "repetition_rate": repetition_rate(reference),
        "process_peak_rss_bytes": _peak_rss_bytes(),
        "methods": entries,
    }


def bench_batched(cfg: BenchConfig, target: nn.Module, tok: Any, loaded: Prompts, target_path: str
                  ) -> dict[str, Any]:
    """``--batch-size``: the report's ``batched`` entries (``bench/batched.py``) instead of ``methods``."""
    import transformers

    from .. import __version__
    from .batched import measure_batched

    methods = headway_methods(target, tok, cfg)
    room = int(getattr(target.config, "max_position_embeddings", 1 << 30))
    entries = measure_batched(target, tok, methods, loaded.ids, cfg, room)  # called inside quiet_transformers
    return {
        "schema": SCHEMA, "headway_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": _target_info(target, target_path, demo_metadata(target_path)), "assistant": None,
        "settings": {**dataclasses.asdict(cfg), "torch": torch.__version__, "transformers": transformers.__version__,
                     "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                     "python": platform.python_version()},
        "prompts": {"source": cfg.prompts, "count": len(loaded.ids), "prompt_format": loaded.format,
                    "mean_tokens": sum(map(len, loaded.ids)) / len(loaded.ids), "ids": loaded.names},
        "process_peak_rss_bytes": _peak_rss_bytes(),
        "methods": [], "batched": entries,
    }


def bench_cli(cfg: BenchConfig) -> int:
    from rich.console import Console

    report = bench(cfg)
    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        console = Console(width=160)
    if cfg.batch_size:
        from .batched import render_batched

        console.print(render_batched(report))
        bad = sorted({e["name"] for e in report["batched"] if not e["kind"].startswith("hf_")
                      and e["exact_match"] is not None and e["exact_match"] < 1})
    else:
        console.print(render_table(report))
        bad = [m["name"] for m in report["methods"] if m["exact_match"] is not None and m["exact_match"] < 1]
    if bad:
        console.print(f"[red]exact-match below 100% at temperature 0: {', '.join(bad)} (the decoder's output "
                      "differs from the target's greedy output)[/]")
    if cfg.json:
        path = Path(cfg.json).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report: {path}")
    if cfg.plot and cfg.batch_size:
        console.print("no plot for --batch-size runs (the table and the JSON have the numbers)")
    elif cfg.plot:
        try:
            console.print(f"plot: {write_plot(report, Path(cfg.plot).expanduser())}")
        except MissingDependency as e:  # the table and the JSON are the results; the plot is a view of them
            console.print(skip_line(e, "plot"), markup=False)
    return 1 if bad else 0
