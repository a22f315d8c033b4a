"""``headway eval SUITE``: ``headway bench``'s protocol on a standard suite, reported per category.

The suite's questions (``bench/suites.py``; a seeded sample per category with ``per_category``)
become token ids as bench and distill tokenise prompts, a two-turn question's second turn after
the target's own greedy first answer (``bench/suite_prompts.py``). Then bench's protocol runs
unchanged (``run.measure``): HF ``generate`` writes the greedy references, every method warms up,
the timed repeats interleave every method on every prompt, and every T=0 output is checked token
for token against HF greedy. Each method's records are summarised as bench summarises them
(``report.summarize``), over all prompts and over each category's prompts: τ, acceptance by
draft position, tokens/s, speedup against HF ``generate`` and against the same-kernel baseline
(``hf-weight-major``: HF generate with the decoder's few-row linear kernel).

``--engine vllm`` serves the exported heads in vLLM on the same prompts instead and compares its
spec-decode counters with headway's decoder category by category (``bench/eval_vllm.py``).

JSON schema ``headway.eval/1``: ``schema``, ``headway_version``, ``created``, ``engine``
("headway" or "vllm"), ``suite`` ({``name``, ``title``, ``source``, ``canonical`` (the file's sha256
is the canonical file's; null where there is no file), ``license``, ``url``, ``warnings``,
``per_category``, ``seed``, ``categories`` ({category: {``questions``, ``prompts``}}),
``prompt_format``}), ``target`` and ``settings`` as in ``headway.bench/1``, ``repetition_rate``,
and per engine:

- headway: ``methods``: bench's method entries (``headway.bench/1``) plus ``speedup_same_kernel``
  (null without hf-weight-major) and ``categories``: {category: the same numbers over its prompts
  (``CATEGORY_KEYS``)};
- vllm: ``vllm`` ({``version``, ``python``}) and ``comparisons``: one per heads checkpoint and
  category (``eval_vllm.compare_category``), with ``ok`` and the ``problems`` that fail the command.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any, Sequence

import torch

from ..data.progress import quiet_transformers
from ..optional import MissingDependency, skip_line
from ..target import demo_metadata
from .eval_configs import EvalConfig
from .methods import Method
from .repetition import repetition_rate
from .report import Record, median_ratio, summarize
from .run import _peak_rss_bytes, _target_info, baselines, check_inputs, heads_adapter, headway_methods, \
    load_assistant, measure
from .suite_prompts import SuitePrompt, suite_prompts
from .suites import LoadedSuite, SuiteError, SuiteItem, load_suite, sample_per_category, select_categories

SCHEMA = "headway.eval/1"
CATEGORY_KEYS = ("prompts", "tau", "acceptance_length", "accepted_per_depth", "tokens_per_s", "speedup",
                 "speedup_same_kernel", "exact_match", "mismatches", "new_tokens", "target_forwards", "draft_steps")


def chosen_questions(cfg: EvalConfig) -> tuple[LoadedSuite, list[SuiteItem]]:
    """The suite and the questions this run asks: read before any model is loaded, so a missing or
    malformed file, or an unknown category, fails at once."""
    suite = load_suite(cfg.suite, cfg.suite_file)
    items = select_categories(suite.items, cfg.categories, cfg.suite)
    return suite, sample_per_category(items, cfg.per_category, cfg.seed)


def category_indices(prompts: Sequence[SuitePrompt], order: Sequence[str]) -> dict[str, set[int]]:
    """Category -> the indices of its prompts (both turns of a two-turn question), in report order."""
    return {c: {i for i, p in enumerate(prompts) if p.category == c} for c in order}


def in_prompts(records: Sequence[Record], keep: set[int]) -> list[Record]:
    return [r for r in records if r[1] in keep]


def method_entries(methods: Sequence[Method], records: dict[tuple[int, float], list[Record]],
                   reference: list[list[int]], groups: dict[str, set[int]], temps: Sequence[float]
                   ) -> list[dict[str, Any]]:
    """Bench's summary of each (method, temperature), over all prompts and per category."""
    same_kernel = next((i for i, m in enumerate(methods) if m.kind == "hf_weight_major"), None)
    out = []
    for t in temps:
        for i, method in enumerate(methods):
            recs, base = records[(i, t)], records[(0, t)]
            kernel = records[(same_kernel, t)] if same_kernel is not None else None
            entry = summarize(method, t, recs, base, reference)
            entry["speedup_same_kernel"] = median_ratio(recs, kernel) if kernel is not None else None
            entry["categories"] = {}
            for category, keep in groups.items():
                sub = summarize(method, t, in_prompts(recs, keep), in_prompts(base, keep), reference)
                sub["prompts"] = len(keep)
                sub["speedup_same_kernel"] = (median_ratio(in_prompts(recs, keep), in_prompts(kernel, keep))
                                              if kernel is not None else None)
                entry["categories"][category] = {k: sub[k] for k in CATEGORY_KEYS}
            out.append(entry)
    return out


def suite_info(suite: LoadedSuite, prompts: Sequence[SuitePrompt], cfg: EvalConfig,
               prompt_format: str) -> dict[str, Any]:
    order = [c for c in suite.categories() if any(p.category == c for p in prompts)]  # those with a prompt that fits
    return {"name": suite.info.name, "title": suite.info.title, "source": suite.source, "canonical": suite.canonical,
            "license": suite.info.license, "url": suite.info.url, "warnings": suite.warnings,
            "per_category": cfg.per_category, "seed": cfg.seed,
            "categories": {c: {"questions": len({p.item for p in prompts if p.category == c}),
                               "prompts": sum(p.category == c for p in prompts)} for c in order},
            "prompt_format": prompt_format}


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Run the suite and return the report (schema ``headway.eval/1``)."""
    import transformers

    from .. import __version__
    from ..data.chat import load_chat_template
    from ..target import load_target, resolve_target_path
    from .methods import stop_ids_of

    suite, items = chosen_questions(cfg)
    bcfg = cfg.bench_config()
    check_inputs(bcfg)
    if cfg.engine == "vllm":
        from ..engines.vllm_client import find_vllm_python

        find_vllm_python(cfg.vllm_python)  # before the target loads: a missing engine is one line, at once
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if bcfg.adapter is None and (adapter := heads_adapter(bcfg.heads)):
        bcfg = dataclasses.replace(bcfg, adapter=adapter)
    target_path = resolve_target_path(cfg.target)
    with quiet_transformers():
        target, tok = load_target(target_path, adapter=bcfg.adapter, **bcfg.load_kwargs())
        template = load_chat_template(tok, cfg.chat_template)
        room = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        if cfg.engine == "vllm":
            methods: list[Method] = baselines(target, tok, None, dataclasses.replace(bcfg, baselines=[]))
        else:
            assistant, _ = load_assistant(bcfg, target_path, tok)
            methods = [*baselines(target, tok, assistant, bcfg), *headway_methods(target, tok, bcfg)]
    stops = stop_ids_of(target, tok)

    def answer(ids: list[int]) -> list[int]:  # the target's own greedy answer: HF generate, as the references
        return methods[0].generate(ids, max(1, min(cfg.max_new_tokens, room - len(ids))), 0.0, cfg.seed).ids

    built = suite_prompts(items, tok, template, cfg.prompt_format, cfg.target or "", answer, stops, room,
                          cfg.chat_template)
    prompts, answers = built.prompts, built.answers
    if built.too_long:
        suite.warnings.append(f"{len(built.too_long)} turns fill the target's context of {room} positions and are "
                              f"left out: {', '.join(built.too_long[:8])}" + (" ..." if len(built.too_long) > 8 else ""))
    if not prompts:
        raise SuiteError(f"no question of {cfg.suite} fits the target's context of {room} positions")
    info = suite_info(suite, prompts, cfg, built.format)
    report: dict[str, Any] = {
        "schema": SCHEMA, "headway_version": __version__, "engine": cfg.engine,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "suite": info, "target": _target_info(target, target_path, demo_metadata(target_path)),
        "settings": {**dataclasses.asdict(cfg), "torch": torch.__version__, "transformers": transformers.__version__,
                     "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                     "python": platform.python_version()}}
    if cfg.engine == "vllm":
        from .eval_vllm import compare_engines

        reference = [answers.get(i) or answer(p.ids) for i, p in enumerate(prompts)]
        report["repetition_rate"] = repetition_rate(reference)
        report.update(compare_engines(cfg, bcfg, target, tok, target_path, prompts, reference, list(info["categories"])))
        return report
    reference, records = measure(methods, [p.ids for p in prompts], bcfg, room, answers)
    groups = category_indices(prompts, list(info["categories"]))
    report["settings"]["linear_kernels"] = {m.name: m.kernels.plan().describe() for m in methods
                                            if m.kernels is not None}
    report["repetition_rate"] = repetition_rate(reference)
    report["process_peak_rss_bytes"] = _peak_rss_bytes()
    report["methods"] = method_entries(methods, records, reference, groups, bcfg.temperature)
    return report


def eval_cli(cfg: EvalConfig) -> int:
    from rich.console import Console

    from .eval_report import render_eval_table, render_vllm_table, store_in_cards, write_eval_plot

    report = evaluate(cfg)
    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        console = Console(width=180)
    for warning in report["suite"]["warnings"]:
        console.print(f"warning: {warning}", style="yellow", markup=False, highlight=False, soft_wrap=True)
    if cfg.engine == "vllm":
        console.print(render_vllm_table(report))
        bad = [f"{c['heads_name']}: {problem}" for c in report["comparisons"] for problem in c["problems"]]
        for line in bad:
            console.print(f"headway and vLLM disagree on {line}", style="red", markup=False, highlight=False,
                          soft_wrap=True)
    else:
        console.print(render_eval_table(report))
        bad = [f"{m['name']} {c}" for m in report["methods"] if m["exact_match"] is not None and m["exact_match"] < 1
               for c, e in m["categories"].items() if e["exact_match"] is not None and e["exact_match"] < 1]
        if bad:
            console.print(f"exact-match below 100% at temperature 0: {', '.join(bad)} (the decoder's output differs "
                          "from the target's greedy output)", style="red", markup=False, highlight=False, soft_wrap=True)
    if cfg.json:
        path = Path(cfg.json).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report: {path}", highlight=False)
    if cfg.plot:
        try:
            console.print(f"plot: {write_eval_plot(report, Path(cfg.plot).expanduser())}", highlight=False)
        except MissingDependency as e:  # the table and the JSON are the results; the plot is a view of them
            console.print(skip_line(e, "plot"), markup=False)
    if cfg.card:
        for path in store_in_cards(report):
            console.print(f"model card: {path}", highlight=False)
    return 1 if bad else 0
