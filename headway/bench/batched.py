"""``headway bench --batch-size 1 4 8``: batched throughput, HF ``generate`` against headway.

Per temperature and batch size B the prompts are cut into batches of B (the last one filled up from
the start of the list, so every batch is full); each method decodes every batch in one call: HF
``generate`` with left padding (``data.generation.generate_batch``, the baseline), the same with
headway's few-row linear kernel (``hf-weight-major``, when asked for: the same-kernel baseline) and
each headway method through ``Speculator.generate_batch``. For each repeat, for each batch, every
method runs in turn (the order rotated); tokens/s is the median over repeats of new tokens / seconds,
speedup the median per-repeat ratio to HF at the same batch size (and ``speedup_same_kernel`` to
hf-weight-major). At temperature 0, exact-match compares every row with the target's own unbatched
greedy output (HF ``generate``, one prompt at a time), so it is reported for the HF baselines too
(left padding may change float rounding, and with it a near-tie); sampled rows have no reference.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..hardware import sync
from ..kernels import LinearKernels
from .configs import BenchConfig
from .methods import HeadwayMethod, HFMethod, stop_ids_of


@dataclass
class BatchRun:
    ids: list[list[int]]  # new tokens per row
    seconds: float
    row_forwards: int  # sum over rows of the target forwards each row took part in (prefill included)


def batches(n_prompts: int, size: int) -> list[list[int]]:
    """Prompt indices in batches of ``size``; the last batch is filled up from the start of the list."""
    count = -(-n_prompts // size)
    return [[(k * size + j) % n_prompts for j in range(size)] for k in range(count)]



def run_hf(target: nn.Module, rows: Sequence[list[int]], max_new: int, stops: Sequence[int], pad: int,
           temperature: float = 0.0, seed: int = 0, kernels: LinearKernels | None = None) -> BatchRun:
    from ..data.generation import SamplingSettings, generate_batch

    dev = next(target.parameters()).device
    sync(dev)
    t = time.perf_counter()
    with kernels() if kernels is not None else contextlib.nullcontext():
        answers = generate_batch(target, rows, SamplingSettings(temperature, 1.0, 0, max_new), stops, pad,
                                 seed=seed if temperature > 0 else None)
    sync(dev)
    ids = [a.tokens for a in answers]
    return BatchRun(ids, time.perf_counter() - t, sum(len(r) for r in ids))


def run_headway(method: HeadwayMethod, rows: Sequence[list[int]], max_new: int, temperature: float = 0.0,
                seed: int = 0) -> BatchRun:
    dev = method.speculator.device
    sync(dev)
    t = time.perf_counter()
    out = method.speculator.generate_batch(list(rows), max_new_tokens=max_new, temperature=temperature, seed=seed)
    sync(dev)
    seconds = time.perf_counter() - t
    return BatchRun([r.ids for r in out.rows], seconds, sum(r.stats.target_forwards + 1 for r in out.rows))


def measure_batched(target: nn.Module, tokenizer: Any, methods: Sequence[HeadwayMethod],
                    prompts: Sequence[list[int]], cfg: BenchConfig, room: int) -> list[dict[str, Any]]:
    """The entries of ``report["batched"]``: one per (temperature, batch size, method), HF generate first."""
    stops = stop_ids_of(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or [0])[0]
    max_new = max(1, min(cfg.max_new_tokens, room - max(map(len, prompts))))
    single = HFMethod("hf-generate", "hf_generate", target, stops, pad)
    reference = [single.generate(p, max_new, 0.0, cfg.seed).ids for p in prompts]  # unbatched greedy
    same_kernel = "hf-weight-major" in cfg.baselines
    kernel = cfg.linear_kernel if cfg.linear_kernel != "stock" else "auto"  # the decoder's choice
    hf = [("hf-generate", "hf_generate", None)] + \
        ([("hf-weight-major", "hf_weight_major", LinearKernels(kernel, target))] if same_kernel else [])
    entries = []
    for t in cfg.temperature:
        entries += _measure_at(target, methods, prompts, cfg, t, max_new, stops, pad, hf, reference)
    return entries


def _measure_at(target: nn.Module, methods: Sequence[HeadwayMethod], prompts: Sequence[list[int]], cfg: BenchConfig,
                temperature: float, max_new: int, stops: Sequence[int], pad: int,
                hf: Sequence[tuple[str, str, LinearKernels | None]], reference: list[list[int]]) -> list[dict[str, Any]]:
    def call(i: int, rows: list[list[int]], seed: int) -> BatchRun:
        if i < len(hf):
            return run_hf(target, rows, max_new, stops, pad, temperature, seed, hf[i][2])
        return run_headway(methods[i - len(hf)], rows, max_new, temperature, seed)

    names = [h[0] for h in hf] + [m.name for m in methods]
    entries = []
    for size in cfg.batch_size:
        groups = batches(len(prompts), size)
        for w in range(cfg.warmup):
            for i in range(len(names)):
                call(i, [prompts[j] for j in groups[w % len(groups)]], cfg.seed)
        runs: dict[int, list[tuple[int, list[int], BatchRun]]] = {i: [] for i in range(len(names))}
        k = 0
        for r in range(cfg.repeats):
            for g in groups:
                for i in [(x + k) % len(names) for x in range(len(names))]:
                    runs[i].append((r, g, call(i, [prompts[j] for j in g], cfg.seed + k)))
                k += 1
        base = _rates(runs[0])
        same = _rates(runs[1]) if len(hf) > 1 else None
        for i, name in enumerate(names):
            rates = _rates(runs[i])
            rows = [(ids, reference[j]) for _, g, run in runs[i] for j, ids in zip(g, run.ids)]
            new = sum(len(ids) for ids, _ in rows)
            forwards = sum(run.row_forwards for _, _, run in runs[i])
            m = methods[i - len(hf)] if i >= len(hf) else None
            seconds = sum(run.seconds for _, _, run in runs[i])
            entries.append({
                "temperature": temperature, "batch_size": size, "name": name, "kind": m.kind if m else hf[i][1],
                "tree": m.tree if m else None, "tree_at_batch": tree_at_batch(m, size, temperature) if m else None,
                "heads": m.heads_path if m else None,
                "tokens_per_s": statistics.median(rates.values()),
                "tokens_per_s_per_row": statistics.median(rates.values()) / size,
                "tokens_per_s_by_repeat": [rates[r] for r in sorted(rates)],
                "speedup": statistics.median(rates[r] / base[r] for r in rates if base[r]),
                "speedup_same_kernel": statistics.median(rates[r] / same[r] for r in rates if same[r])
                if same is not None else None,
                "tau": new / forwards if forwards else 0.0,
                "exact_match": sum(ids == ref for ids, ref in rows) / len(rows) if temperature == 0 else None,
                "rows": len(rows), "new_tokens": new, "seconds": seconds})
    return entries


def tree_at_batch(method: HeadwayMethod, size: int, temperature: float) -> str:
    """What the method drafts at a batch of ``size`` rows: a tree (the tuned table's, or the method's),
    ``plain`` (the table says plain decoding) or ``measured`` (no table: chosen while decoding)."""
    policy = method.speculator.policy
    sampling = temperature > 0
    if policy.batch_aware and policy.tuned(size, sampling) is None and size > 1:
        return "measured"
    if not policy.speculate(size, sampling):
        return "plain"
    return method.label(policy.shape_for(1 << 30, sampling, size))


def _rates(runs: Sequence[tuple[int, list[int], BatchRun]]) -> dict[int, float]:
    """Repeat -> new tokens / seconds over that repeat's batches."""
    tokens: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for r, _, run in runs:
        tokens[r] = tokens.get(r, 0) + sum(map(len, run.ids))
        seconds[r] = seconds.get(r, 0.0) + run.seconds
    return {r: tokens[r] / seconds[r] if seconds[r] else 0.0 for r in tokens}


def render_batched(report: dict[str, Any]) -> Any:
    """A rich ``Table``: tokens/s and speedup against HF batched generate, per batch size."""
    from rich.markup import escape
    from rich.table import Table

    s = report["settings"]
    title = (f"headway bench --batch-size: {report['prompts']['count']} prompts × {s['max_new_tokens']} new tokens "
             f"× {s['repeats']} repeats")
    caption = ("drafts = the tree drafted at this batch size (plain: none; measured: chosen while decoding) · "
               "speedup = median per-repeat ratio to HF generate (left-padded batch) at the same batch size; "
               "vs same kernel: to HF generate with headway's linear kernel (hf-weight-major) · τ = new tokens / "
               "(row, target forward) pairs, prefill included · exact = rows equal to the target's unbatched "
               "greedy output (T=0)")
    table = Table(title=title, caption=caption, caption_justify="left")
    for col in ("T", "batch", "method", "drafts", "tok/s", "tok/s/row", "speedup", "vs same kernel", "τ", "exact"):
        table.add_column(col, justify="left" if col in ("method", "drafts") else "right", no_wrap=col == "method")
    for e in report["batched"]:
        exact = e.get("exact_match")
        style = "red" if exact is not None and exact < 1 and not e["kind"].startswith("hf_") else None
        same = e.get("speedup_same_kernel")
        table.add_row(f"{e.get('temperature', 0.0):g}", str(e["batch_size"]), escape(e["name"]),
                      escape(e.get("tree_at_batch") or "-"), f"{e['tokens_per_s']:.1f}",
                      f"{e.get('tokens_per_s_per_row', 0.0):.1f}", f"{e['speedup']:.2f}×",
                      "-" if same is None else f"{same:.2f}×", f"{e['tau']:.2f}",
                      "-" if exact is None else f"{exact:.0%}", style=style)
    return table
