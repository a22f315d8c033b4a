"""``headway bench`` results: per-method summaries (the JSON schema), the terminal table, the plot.

JSON schema ``headway.bench/1`` (one object; every time is in seconds, every size in bytes):

- ``schema``: "headway.bench/1"; ``headway_version``; ``created`` (ISO 8601, UTC)
- ``target``: {``path``, ``architecture``, ``parameters``, ``param_bytes``, ``num_hidden_layers``,
  ``hidden_size``, ``vocab_size``, ``dtype``, ``device``, ``demo`` (the demo target's build
  metadata summary, or null)}
- ``assistant``: {``path``, ``parameters``, ``num_hidden_layers``, ``note``} — the draft model of
  HF assisted generation; null when ``--baselines`` leaves hf-assisted out
- ``settings``: the ``BenchConfig`` fields plus ``torch``, ``transformers``, ``threads``,
  ``cpu_count``, ``linear_kernels`` ({method name: the few-row linear plan it decoded with, e.g.
  "weight-major at 2, 3-4 rows" or "stock"})
- ``prompts``: {``source``, ``count``, ``prompt_format`` (how the prompts became token ids, as
  ``headway distill`` conditions the target: "raw", "chat (template of the target)",
  "chat (template from FILE)" or "mixed: ... for N, raw for M"), ``mean_tokens``, ``ids`` (the
  source rows' ids)}
- ``repetition_rate``: the target's greedy 4-gram repetition rate on these prompts (fraction of
  4-grams in a greedy completion repeating an earlier 4-gram of the same completion; a looping
  target makes acceptance meaningless)
- ``process_peak_rss_bytes``: the whole process's RSS high-water mark (``resource``), or null
- ``methods``: one object per (method, temperature):
  ``name``, ``kind`` (hf_generate | hf_weight_major | hf_assisted | hf_prompt_lookup | medusa | eagle1 | eagle3 | dflash),
  ``tree`` (tree spec, null for baselines), ``heads`` (checkpoint path, null for baselines),
  ``temperature``, ``lossless`` (true: the output distribution is the target's),
  ``tokens_per_s`` (median over repeats of total tokens / total time over the prompts),
  ``tokens_per_s_by_repeat``, ``speedup`` (median over repeats of the ratio to ``hf_generate``
  at the same temperature in the same repeat), ``tau`` (new tokens / target forwards, prefill
  forward included: plain decoding is exactly 1.0), ``acceptance_length`` (new tokens per target
  forward after the prefill's: EAGLE's and Medusa's average acceptance length per decoding
  step, the figure their papers report; a little above ``tau`` on short generations), ``exact_match`` (fraction of runs whose ids
  equal HF greedy's token for token; null at temperature > 0), ``mismatches`` (up to 5
  {``prompt``, ``repeat``, ``position``}), ``runs``, ``new_tokens`` and ``target_forwards``
  (totals over the timed runs), ``draft_steps`` (forwards that verified a draft), ``tree_nodes``
  (tokens per verify forward, roots included, averaged over the draft steps: an adaptive tree's
  chosen sizes; null without drafts and for the HF baselines),
  ``accepted_per_depth`` (fraction of draft steps in which depth d+1 was accepted; [] without
  drafts), ``time_target_share`` / ``time_drafter_share`` (of the wall time, inside outermost
  target / drafter forwards), ``overhead_share`` (the rest: tree building, verification,
  cache bookkeeping, generate's own Python), ``peak_mem_bytes`` with ``peak_mem_kind``
  ("cuda_max_allocated", or on CPU "params+kv": parameter bytes of target and drafter plus the
  peak KV-cache bytes the forwards returned — process RSS cannot be split by method),
  ``param_bytes``, ``peak_kv_bytes``, ``output_repetition_rate`` (4-gram repetition of this
  method's own outputs).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from ..optional import need
from .methods import Method, Run
from .repetition import repetition_rate

SCHEMA = "headway.bench/1"
METHOD_KEYS = ("name", "kind", "tree", "heads", "temperature", "lossless", "tokens_per_s", "tokens_per_s_by_repeat",
               "speedup", "tau", "acceptance_length",
               "exact_match", "mismatches", "runs", "new_tokens", "target_forwards", "draft_steps", "tree_nodes",
               "accepted_per_depth", "time_target_share", "time_drafter_share", "overhead_share",
               "peak_mem_bytes", "peak_mem_kind", "param_bytes", "peak_kv_bytes", "output_repetition_rate")

Record = tuple[int, int, Run]  # (repeat, prompt index, run)


def per_repeat_rate(records: Sequence[Record]) -> dict[int, float]:
    """Repeat -> total new tokens / total seconds over that repeat's prompts."""
    tokens: dict[int, int] = defaultdict(int)
    seconds: dict[int, float] = defaultdict(float)
    for r, _, run in records:
        tokens[r] += len(run.ids)
        seconds[r] += run.seconds
    return {r: tokens[r] / seconds[r] if seconds[r] else 0.0 for r in sorted(tokens)}


def median_ratio(records: Sequence[Record], baseline: Sequence[Record]) -> float | None:
    """Median over repeats of this method's tokens/s over the baseline's in the same repeat (None
    without a common repeat): ratios within a repeat cancel the load of a shared machine."""
    rates, base = per_repeat_rate(records), per_repeat_rate(baseline)
    ratios = [rates[r] / base[r] for r in rates if base.get(r)]
    return statistics.median(ratios) if ratios else None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def exact_match(records: Sequence[Record], reference: Sequence[Sequence[int]]) -> tuple[float, list[dict]]:
    diffs = [(p, r, first_difference(run.ids, reference[p])) for r, p, run in records]
    bad = [{"prompt": p, "repeat": r, "position": d} for p, r, d in diffs if d is not None]
    return 1 - len(bad) / len(records), bad[:5]


def summarize(method: Method, temperature: float, records: Sequence[Record], baseline: Sequence[Record],
              reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    """One ``methods`` entry of the JSON report (see the module docstring)."""
    runs = [run for _, _, run in records]
    rates = per_repeat_rate(records)
    new_tokens = sum(len(r.ids) for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    seconds = sum(r.seconds for r in runs)
    steps = sum(r.draft_steps for r in runs)
    name, tree, draft_depth = method.label_at(temperature) if hasattr(method, "label_at") else \
        (method.name, method.tree, method.draft_depth)
    depth = max([draft_depth if steps else 0] + [len(r.accepted_per_depth) for r in runs])
    accepted = [sum(r.accepted_per_depth[d] for r in runs if d < len(r.accepted_per_depth)) for d in range(depth)]
    match, mismatches = exact_match(records, reference) if temperature == 0 else (None, [])
    cuda = [r.peak_cuda_bytes for r in runs if r.peak_cuda_bytes is not None]
    params, kv = method.param_bytes(), max(r.peak_kv_bytes for r in runs)
    t_target, t_drafter = sum(r.time_target for r in runs), sum(r.time_drafter for r in runs)
    return {
        "name": name, "kind": method.kind, "tree": tree, "heads": method.heads_path,
        "temperature": temperature, "lossless": True,
        "tokens_per_s": statistics.median(rates.values()),
        "tokens_per_s_by_repeat": list(rates.values()),
        "speedup": median_ratio(records, baseline),
        "tau": new_tokens / forwards if forwards else 0.0,
        # each run's prefill forward emits its first token; the other forwards are decoding steps
        "acceptance_length": (new_tokens - len(runs)) / (forwards - len(runs)) if forwards > len(runs) else None,
        "exact_match": match, "mismatches": mismatches,
        "runs": len(runs), "new_tokens": new_tokens, "target_forwards": forwards, "draft_steps": steps,
        "tree_nodes": (sum(r.tree_nodes for r in runs) / steps) if steps and any(r.tree_nodes for r in runs) else None,
        "accepted_per_depth": [a / steps for a in accepted] if steps else [],
        "time_target_share": t_target / seconds, "time_drafter_share": t_drafter / seconds,
        "overhead_share": max(0.0, 1 - (t_target + t_drafter) / seconds),
        "peak_mem_bytes": max(cuda) if cuda else params + kv,
        "peak_mem_kind": "cuda_max_allocated" if cuda else "params+kv",
        "param_bytes": params, "peak_kv_bytes": kv,
        "output_repetition_rate": repetition_rate([r.ids for r in runs]),
    }


# ---------------------------------------------------------------------------------------------
# Terminal table


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _depths(rates: Sequence[float], n: int = 5) -> str:
    return " ".join(f"{a:.2f}" for a in rates[:n]) + (" …" if len(rates) > n else "") if rates else "-"


def render_table(report: dict[str, Any]) -> Any:
    """A rich ``Table`` of the methods, with the target and repetition rate in the caption."""
    from rich.markup import escape
    from rich.table import Table

    s = report["settings"]
    t = report["target"]
    fmt = report["prompts"].get("prompt_format", "format not recorded")
    title = (f"headway bench: {escape(Path(t['path']).name)} ({t['parameters'] / 1e6:.1f}M params, {t['dtype']}, "
             f"{t['device']}) · {report['prompts']['count']} prompts ({escape(fmt)}) × {s['max_new_tokens']} "
             f"new tokens × {s['repeats']} repeats")
    caption = (f"target greedy 4-gram repetition: {report['repetition_rate']:.1%} (high = a looping target; "
               "acceptance then says little) · τ = new tokens / target forwards (EAGLE's per-step "
               "measure, prefill left out, is acceptance_length in the JSON) · speedup = median per-repeat "
               "ratio to hf generate · overhead = time outside target and drafter forwards · "
               f"mem = {report['methods'][0]['peak_mem_kind']} (MiB)")
    plans = sorted(set(s.get("linear_kernels", {}).values()))
    if plans:
        caption += f" · linear kernel: {escape('; '.join(plans))}"
    table = Table(title=title, caption=caption, caption_justify="left")
    for col, just in (("method", "left"), ("T", "right"), ("tok/s", "right"), ("speedup", "right"),
                      ("τ", "right"), ("exact", "right"), ("accept by depth", "left"), ("fwds", "right"),
                      ("overhead", "right"), ("mem", "right")):
        table.add_column(col, justify=just, no_wrap=col in ("method", "accept by depth"))
    for m in report["methods"]:
        exact = "n/a" if m["exact_match"] is None else f"{m['exact_match']:.0%}"
        style = "red" if m["exact_match"] is not None and m["exact_match"] < 1 else None
        table.add_row(escape(m["name"]), f"{m['temperature']:g}", f"{m['tokens_per_s']:.1f}", f"{m['speedup']:.2f}×",
                      f"{m['tau']:.2f}", exact, _depths(m["accepted_per_depth"]), str(m["target_forwards"]),
                      f"{m['overhead_share']:.0%}", _mib(m["peak_mem_bytes"]), style=style)
    return table


# ---------------------------------------------------------------------------------------------
# Plot


def write_plot(report: dict[str, Any], path: str | Path) -> Path:
    """Speedup by method (bars, one group per method, one bar per temperature) and acceptance
    rate by draft depth (lines: solid at temperature 0, dashed above). ``MissingDependency``
    where matplotlib is not installed (the ``plot`` extra)."""
    matplotlib = need("matplotlib", "the benchmark plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report["methods"]
    names = list(dict.fromkeys(m["name"] for m in methods))
    temps = sorted({m["temperature"] for m in methods})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(temps)
    for j, temp in enumerate(temps):
        by_name = {m["name"]: m["speedup"] for m in methods if m["temperature"] == temp}
        xs = [i + (j - (len(temps) - 1) / 2) * width for i in range(len(names))]
        ax1.bar(xs, [by_name.get(n, 0.0) for n in names], width, label=f"T={temp:g}")
    ax1.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("speedup vs HF generate")
    ax1.set_title("speedup by method")
    ax1.legend(fontsize=8)
    for i, m in enumerate(m for m in methods if m["accepted_per_depth"]):
        d = m["accepted_per_depth"]
        ax2.plot(range(1, len(d) + 1), d, marker="o", ls="-" if m["temperature"] == 0 else "--",
                 color=f"C{names.index(m['name']) % 10}", label=f"{m['name']} T={m['temperature']:g}")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_xlabel("draft depth")
    ax2.set_ylabel("fraction of steps accepting this depth")
    ax2.set_ylim(0, 1.02)
    ax2.set_title(f"acceptance by depth (target greedy repetition {report['repetition_rate']:.0%})")
    if ax2.lines:
        ax2.legend(fontsize=7)
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write a matplotlib figure as a PNG (its folder made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
