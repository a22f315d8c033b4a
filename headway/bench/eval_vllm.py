"""``headway eval --engine vllm``: the suite's prompts in vLLM, beside headway's decoder, per category.

For each heads checkpoint: export it with headway's exporter (``--format vllm``) into a work folder,
start one vLLM engine on the target with that drafter (``engines.vllm_client.VllmWorker``: vLLM's
own environment, JSON job and result files; greedy, float32, the same max_new_tokens and stop
tokens), and send one request per category, reading vLLM's spec-decode counters after each
(``engines.spec_metrics``: the difference of two readings is the category's). headway's decoder
decodes the same prompts with a chain of the same length (vLLM drafts chains of
``num_speculative_tokens``), through bench's own method. The engines agree on a category when their
counters are equal (``tolerance`` 0, the default of checks/vllm_parity.py) or each position's
acceptance rate is within ``tolerance``, and their outputs are the same tokens; any other category
fails the command, named.

The work folder (export, the worker's requests and log) is removed when every engine ran; a
failure keeps it, and the error names the log.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from ..engines.spec_metrics import SpecCounters, parity_problems
from .configs import BenchConfig
from .eval_configs import EvalConfig
from .methods import HeadwayMethod, stop_ids_of
from .report import first_difference
from .suite_prompts import SuitePrompt

# speculative_config's method per kind (P-EAGLE: vLLM's EAGLE-3 drafter with parallel drafting)
VLLM_METHODS = {"medusa": "medusa", "eagle1": "eagle", "eagle3": "eagle3", "dflash": "dflash", "peagle": "eagle3"}
DEFAULT_CHAIN = 3


def chain_length(given: int | None, kind: str, block_size: int | None, num_depths: int | None = None) -> int:
    """The chain both engines draft: ``given``, else a DFlash block's drafts (block size - 1: vLLM
    drafts a block of num_speculative_tokens + 1 slots), else P-EAGLE's K (fixed at training), else 3."""
    if given:
        return given
    if kind == "peagle" and num_depths:
        return num_depths
    return block_size - 1 if kind == "dflash" and block_size else DEFAULT_CHAIN


def speculative_config(kind: str, export: Path, k: int) -> dict[str, Any]:
    extra = {"parallel_drafting": True} if kind == "peagle" else {}
    return {"method": VLLM_METHODS[kind], "model": str(export), "num_speculative_tokens": k, **extra}


def category_request(prompts: Sequence[SuitePrompt], keep: Sequence[int], max_new: Sequence[int],
                     stop_ids: Sequence[int]) -> list[dict[str, Any]]:
    """The worker requests for one category: greedy, each prompt's own token budget (a request has one
    max_tokens, so prompts are grouped by it), the stop ids, and vLLM's counters after it."""
    by_budget: dict[int, list[int]] = {}
    for i in keep:
        by_budget.setdefault(max_new[i], []).append(i)
    return [{"prompts": [prompts[i].ids for i in idx], "index": idx, "seeds": [None] * len(idx),
             "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": budget,
             "stop_token_ids": list(stop_ids), "metrics": True} for budget, idx in by_budget.items()]


def headway_side(method: HeadwayMethod, prompts: Sequence[SuitePrompt], groups: dict[str, list[int]],
                 max_new: Sequence[int], k: int, seed: int) -> tuple[list[list[int]], dict[str, SpecCounters]]:
    """headway's chain decoder on every prompt: its outputs and, per category, its counters."""
    outputs: list[list[int]] = [[] for _ in prompts]
    counts = {}
    for category, keep in groups.items():
        drafts, per_pos = 0, [0] * k
        for i in keep:
            out = method.generate(prompts[i].ids, max_new[i], 0.0, seed)
            outputs[i] = out.ids
            drafts += out.draft_steps
            for d, n in enumerate(out.accepted_per_depth[:k]):
                per_pos[d] += n
        counts[category] = SpecCounters.from_steps(drafts, per_pos, k)
    return outputs, counts


def vllm_side(worker: Any, prompts: Sequence[SuitePrompt], groups: dict[str, list[int]], max_new: Sequence[int],
              stop_ids: Sequence[int]) -> tuple[list[list[int]], dict[str, SpecCounters], dict[str, float]]:
    """vLLM on every prompt, one category after another: outputs, counters per category (the
    difference of the readings around its requests) and seconds per category."""
    outputs: list[list[int]] = [[] for _ in prompts]
    counts, seconds = {}, {}
    reading = SpecCounters()  # a fresh engine has counted nothing
    for category, keep in groups.items():
        start, before = time.perf_counter(), reading
        for req in category_request(prompts, keep, max_new, stop_ids):
            index = req.pop("index")
            result = worker.generate(req)
            for i, out in zip(index, result["outputs"]):
                outputs[i] = list(out["token_ids"])
            reading = SpecCounters.from_metrics(result.get("metrics") or {})
        counts[category], seconds[category] = reading.minus(before), time.perf_counter() - start
    return outputs, counts, seconds


def compare_category(category: str, keep: Sequence[int], hw: SpecCounters, vl: SpecCounters,
                     hw_out: Sequence[list[int]], vl_out: Sequence[list[int]], reference: Sequence[list[int]],
                     names: Sequence[str], tolerance: float) -> dict[str, Any]:
    """One category's comparison: the counters of both engines, and the problems that fail it."""
    problems = parity_problems(category, hw, vl, tolerance)
    for what, outs in (("vLLM's output", vl_out), ("headway's output", hw_out)):
        diff = [i for i in keep if first_difference(outs[i], reference[i]) is not None]
        if diff:
            problems.append(f"category '{category}': {what} differs from the target's greedy output on {len(diff)} "
                            f"of {len(keep)} prompts (first: {names[diff[0]]})")
    return {"category": category, "prompts": len(keep), "headway": hw.as_dict(), "vllm": vl.as_dict(),
            "ok": not problems, "problems": problems}


def context_needed(prompts: Sequence[SuitePrompt], max_new: Sequence[int], k: int, room: int) -> int:
    """vLLM's max_model_len: the longest prompt and its answer, room for one more draft, within the target's."""
    return min(room, max(len(p.ids) + n for p, n in zip(prompts, max_new)) + k + 1)


@dataclass
class Prompts:
    """What both engines are given, and what their outputs are checked against."""

    prompts: Sequence[SuitePrompt]
    groups: dict[str, list[int]]  # category -> prompt indices
    max_new: list[int]  # each prompt's token budget (capped by the context)
    reference: Sequence[list[int]]  # the target's greedy outputs (HF generate)
    stop_ids: list[int]
    room: int  # the target's context


def compare_heads(cfg: EvalConfig, bcfg: BenchConfig, run: Prompts, path: str, target: nn.Module, tokenizer: Any,
                  target_path: str, python: Path, work: Path) -> tuple[list[dict[str, Any]], str]:
    """One heads checkpoint in both engines: its comparison rows (one per category) and vLLM's version."""
    from ..engines.vllm_client import VllmWorker
    from ..heads import load_heads
    from ..heads.export import export_heads
    from .run import headway_methods

    heads = load_heads(path, target=target)
    k = chain_length(cfg.num_speculative_tokens, heads.kind, heads.config.block_size if heads.kind == "dflash" else None,
                     heads.config.num_depths if heads.kind == "peagle" else None)
    export = export_heads(heads, "vllm", work / "export", target=target)  # first: a refusal costs no decoding
    method = headway_methods(target, tokenizer, dataclasses.replace(bcfg, heads=[path], tree=[f"chain-{k}"]))[0]
    hw_out, hw_counts = headway_side(method, run.prompts, run.groups, run.max_new, k, cfg.seed)
    with VllmWorker(python, target_path, work / "engine", max_model_len=context_needed(run.prompts, run.max_new, k,
                                                                                         run.room),
                    seed=cfg.seed, speculative_config=speculative_config(heads.kind, export, k)) as worker:
        version = worker.wait_ready()
        vl_out, vl_counts, seconds = vllm_side(worker, run.prompts, run.groups, run.max_new, run.stop_ids)
    names = [p.name for p in run.prompts]
    rows = []
    for c, keep in run.groups.items():
        row = compare_category(c, keep, hw_counts[c], vl_counts[c], hw_out, vl_out, run.reference, names, cfg.tolerance)
        new_tokens = sum(len(vl_out[i]) for i in keep)
        rows.append(row | {"heads": str(path), "heads_name": method.name, "kind": heads.kind, "k": k,
                           "vllm_tokens_per_s": new_tokens / seconds[c] if seconds[c] else None})
    return rows, version


def compare_engines(cfg: EvalConfig, bcfg: BenchConfig, target: nn.Module, tokenizer: Any, target_path: str,
                    prompts: Sequence[SuitePrompt], reference: Sequence[list[int]], categories: Sequence[str]
                    ) -> dict[str, Any]:
    """The report's ``vllm`` and ``comparisons`` (one per heads checkpoint and category)."""
    from ..engines.vllm_client import EngineError, find_vllm_python

    python = find_vllm_python(cfg.vllm_python)
    room = int(getattr(target.config, "max_position_embeddings", 1 << 30))
    run = Prompts(prompts, {c: [i for i, p in enumerate(prompts) if p.category == c] for c in categories},
                  [max(1, min(cfg.max_new_tokens, room - len(p.ids))) for p in prompts], reference,
                  stop_ids_of(target, tokenizer), room)
    comparisons, version = [], "unknown"
    work = Path(tempfile.mkdtemp(prefix="headway-eval-vllm-"))
    try:
        for n, path in enumerate(bcfg.heads):
            (work / str(n)).mkdir()
            rows, version = compare_heads(cfg, bcfg, run, path, target, tokenizer, target_path, python, work / str(n))
            comparisons += rows
    except EngineError:
        raise  # the work folder stays: the error names the worker's log in it
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return {"vllm": {"version": version, "python": str(python), "tolerance": cfg.tolerance}, "comparisons": comparisons}
