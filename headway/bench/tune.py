"""``headway tune``: pick the tree that is fastest on *this* machine for *these* heads.

Tree size is a hardware question: on a 2-core CPU a 16-token verify costs about twice a
1-token forward, on a GPU about the same. So we measure (1) per-depth / per-rank draft
acceptance on calibration prompts, (2) the forward-cost curve of the target (tree tokens per
verify vs seconds) and the draft cost of each candidate, (3) predict tokens/s for static trees
built from the measured accuracies, then (4) run the best predictions, the fixed presets,
dynamic trees of the same budgets and every chain up to the probe depth side by side on the
prompts and keep the fastest (so never a tree slower than the best chain there). Dynamic trees
rank nodes with the heads' draft calibration (``metadata["calibration"]``; ``calibration_data``
fits it first). The result is stored with the heads (``metadata["decode"]``) and ``generate``
uses it by default. Tuned at 0 and at a temperature above, each gets its own winner: the fastest
tree differs (on SmolLM2, two candidates at depth 1 at T=0, a chain of sampled drafts at T=1),
stored as ``tree`` and ``sampling_tree``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..progress import Progress
from ..publish import check_output_path, write_text
from .configs import TuneConfig  # noqa: F401  (re-exported; light, for --help)
from ..decode.cost import forward_cost, interpolate
from ..decode.sampling import SamplingParams
from ..decode.shapes import (DynamicShape, StaticShape, TreeShape, chain, fork, from_accuracies, is_fork,
                             is_top1_chain, mc_sim_7b_63)
from ..decode.speculator import Speculator
from ..decode.step import verify_row
from ..decode.trees import build_trees


def shape_spec(shape: TreeShape) -> str:
    """The string ``parse_shape`` reads back."""
    if isinstance(shape, DynamicShape):
        return shape.spec
    if is_top1_chain(shape):
        return f"chain-{shape.depth}"
    if is_fork(shape):
        return f"fork-{shape.depth}"
    return "static:" + json.dumps([list(p) for p in shape.paths], separators=(",", ":"))


@torch.inference_mode()
def measure_acceptance(spec: Speculator, prompts: list[Any], depth: int, ranks: int, max_new: int) -> list[list[float]]:
    """``acc[d][r]``: how often the target's next token at draft depth d+1 is the draft's rank-r
    candidate, given depths 1..d were right. Measured with a probe tree: the rank-0 chain with
    ``ranks`` alternatives hanging off every chain node."""
    probe = StaticShape([(0,) * d + (r,) for d in range(depth) for r in range(ranks)], name="probe")
    probe = spec.fit_tree(probe)
    depth = probe.depth
    hits = torch.zeros(depth, ranks)
    trials = torch.zeros(depth)
    params, gen = SamplingParams(), torch.Generator()
    saved = spec.tree
    spec.tree = probe
    try:
        for prompt in prompts:
            state = spec.start(spec.encode(prompt), params, gen)
            row = state.rows[0]
            while len(row.emitted) < max_new and row.length + depth + 1 < spec.max_positions:
                scored = spec.draft_and_score(state)
                tree, b = scored.tree, scored.tree.buffers
                want = scored.logits.argmax(-1)  # target's next token after each node
                chain_nodes = [0] + [int(i) for i in (probe.ranks == 0).nonzero().flatten()[1:]]
                for d in range(depth):
                    parent = chain_nodes[d]
                    kids = (b.parents == parent).nonzero().flatten()
                    trials[d] += 1
                    match = kids[tree.tokens[kids] == want[parent]]
                    if match.numel() == 0:
                        break
                    hits[d, int(probe.ranks[match[0]])] += 1
                    if int(probe.ranks[match[0]]) != 0:
                        break
                spec.commit(state, scored, verify_row(tree, scored.node_logits, params, gen))
    finally:
        spec.tree = saved
    return (hits / trials.clamp(min=1)[:, None]).tolist()


@torch.inference_mode()
def draft_cost(spec: Speculator, shape: TreeShape, prompt: Any, repeats: int = 5) -> float:
    """Median seconds to draft one tree of ``shape`` after a prefill."""
    state = spec.start(spec.encode(prompt), SamplingParams(), torch.Generator())
    proposer, root = state.proposer, torch.tensor(state.rows[0].emitted[-1:], device=spec.device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        with spec.kernels():
            build_trees([shape], proposer, root)
        proposer.end_tree()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def expected_accepted(shape: StaticShape, acc: list[list[float]]) -> float:
    """Sum over nodes of the probability that the node is on the accepted path (independence model)."""
    total = 0.0
    for path in shape.paths:
        p = 1.0
        for d, r in enumerate(path):
            p *= acc[d][r] if d < len(acc) and r < len(acc[d]) else 0.0
        total += p
    return total


@torch.inference_mode()
def run_side_by_side(spec: Speculator, shapes: dict[str, TreeShape], prompts: list[Any], max_new: int,
                     temperature: float, repeats: int, progress: Progress | None = None) -> dict[str, dict[str, float]]:
    """Interleaved real generation: per candidate total tokens / total time (median over repeats) and tau."""
    names = list(shapes)
    tps: dict[str, list[float]] = {n: [] for n in names}
    tau: dict[str, list[float]] = {n: [] for n in names}
    saved = spec.tree, spec.sampling_tree
    try:
        spec.tree = spec.sampling_tree = shapes[names[0]]
        spec.generate(prompts[0], max_new_tokens=8, temperature=temperature, seed=0)  # warm-up
        for r in range(repeats):
            tokens = {n: 0 for n in names}
            secs = {n: 0.0 for n in names}
            for i, prompt in enumerate(prompts):
                order = names[(i + r) % len(names):] + names[:(i + r) % len(names)]  # rotate to spread noise
                for n in order:
                    spec.tree = spec.sampling_tree = shapes[n]  # candidates run at every temperature
                    out = spec.generate(prompt, max_new_tokens=max_new, temperature=temperature, seed=i)
                    tokens[n] += out.stats.new_tokens
                    secs[n] += out.stats.time_total
                    tau[n].append(out.stats.tau)
                    if progress is not None:
                        progress.advance(1, tokens=out.stats.new_tokens, info=f"T={temperature:g} {n}")
            for n in names:
                tps[n].append(tokens[n] / secs[n])
    finally:
        spec.tree, spec.sampling_tree = saved
    return {n: {"tokens_per_s": statistics.median(tps[n]), "tau": statistics.mean(tau[n])} for n in names}


def presets(spec: Speculator) -> dict[str, TreeShape]:
    proposer = spec.new_proposer()
    fix = spec.fit_tree  # clip to the heads' depth / vocab
    out = {"mc_sim_7b_63": fix(mc_sim_7b_63())}  # chains: ``chains``
    if proposer.max_depth is None:  # EAGLE: dynamic trees
        out["dynamic-4-5-16"] = fix(DynamicShape(4, 5, 16))
        out["dynamic-8-6-48"] = fix(DynamicShape(8, 6, 48))
    else:
        out["dynamic-4-4-16"] = fix(DynamicShape(4, proposer.max_depth, 16))
    return out


def chains(spec: Speculator, depth: int) -> dict[str, TreeShape]:
    """chain-1 .. chain-``depth`` (capped by the heads): always measured, so the stored tree is
    never slower than the best chain on the same prompts."""
    shapes = [spec.fit_tree(chain(d)) for d in range(1, depth + 1)]
    return {f"chain-{s.depth}": s for s in shapes}


FORK_DEPTHS = 3  # fork-1 .. fork-3 join the candidates: above T=0 the short ones pay where chains do


def forks(spec: Speculator, depth: int) -> dict[str, TreeShape]:
    """fork-1 .. fork-``depth``: a top-1 chain with a sibling at every depth, drawn from the
    drafter above T=0, where each depth then accepts at least what a sampled chain's does."""
    shapes = [spec.fit_tree(fork(d)) for d in range(1, depth + 1)]
    return {shape_spec(s): s for s in shapes}


def dynamic_budgets(spec: Speculator, sizes: list[int], depth: int) -> dict[str, TreeShape]:
    """Dynamic trees with the node budgets of the static finalists: at equal size, whether ranking
    by (calibrated) draft confidence beats the measured static tree is measured, not guessed."""
    shapes = [spec.fit_tree(DynamicShape(min(4, n), depth, n + 1)) for n in sizes]
    return {shape_spec(s): s for s in shapes}


def calibration_prompts(cfg: TuneConfig, tokenizer: Any) -> list[list[int]]:
    """Token ids of the calibration prompts, as ``headway distill`` conditions the target
    (``data.plans.prompt_ids``: same ``prompt_format`` / ``chat_template``)."""
    from ..data.chat import load_chat_template
    from ..data.plans import prompt_ids
    from ..data.sources import read_samples

    template = load_chat_template(tokenizer, cfg.chat_template)
    samples = read_samples(cfg.prompts, tokenizer=tokenizer, prompt_tokens=cfg.prompt_tokens,
                           limit=cfg.num_prompts).samples
    return [prompt_ids(s, tokenizer, template, cfg.prompt_format, cfg.target)[0] for s in samples]


def tune(cfg: TuneConfig, log: Any = None) -> dict[str, Any]:
    from ..target import resolve_target_path
    from ..decode.cli import adapter_note

    say = log or (lambda msg: print(msg, file=sys.stderr))
    if cfg.json_out:  # refused now, not after the measuring
        check_output_path(cfg.json_out, "--json-out", file=True, error=ConfigError)
    spec = Speculator.from_pretrained(resolve_target_path(cfg.target), cfg.heads, adapter=cfg.adapter,
                                      **cfg.load_kwargs(), **cfg.runtime_kwargs())
    if spec.adapter_from_heads:  # the tree is tuned on the adapted target
        say(adapter_note(spec.adapter))
    calibration = None
    if cfg.calibration_data:  # before anything is drafted: dynamic trees are ranked with it
        from ..train.calibrate import fit_calibration

        say(f"fitting the draft calibration on {cfg.calibration_data} ...")
        calibration = fit_calibration(spec.heads, spec.target, cfg.calibration_data, depth=cfg.probe_depth)
        spec.heads.metadata["calibration"] = {k: v for k, v in calibration.items() if k != "summary"}
    prompts = calibration_prompts(cfg, spec.tokenizer)
    say(f"measuring acceptance by depth and rank on {len(prompts)} prompts ...")
    acc = measure_acceptance(spec, prompts, cfg.probe_depth, cfg.probe_rank, cfg.max_new_tokens)
    say("measuring the forward-cost curve ...")
    cost = forward_cost(spec.runtime, [1] + [s + 1 for s in cfg.sizes])
    candidates: dict[str, tuple[StaticShape, float]] = {}
    for n in cfg.sizes:
        shape = spec.fit_tree(from_accuracies(acc, n))
        step = draft_cost(spec, shape, prompts[0]) + interpolate(cost, shape.size)
        candidates[f"measured-{n}"] = (shape, (1 + expected_accepted(shape, acc)) / step)
    best = sorted(candidates, key=lambda k: -candidates[k][1])[: cfg.finalists]
    shapes: dict[str, TreeShape] = {k: candidates[k][0] for k in best}
    shapes.update(presets(spec))
    shapes.update(dynamic_budgets(spec, [int(k.split("-")[1]) for k in best], cfg.probe_depth))
    shapes.update(chains(spec, len(acc)))
    shapes.update(forks(spec, min(FORK_DEPTHS, len(acc))))
    say(f"running {len(shapes)} trees side by side: {', '.join(shapes)}")
    results = {}
    runs = len(cfg.temperatures) * cfg.repeats * len(prompts) * len(shapes)
    with Progress("tune", runs, unit="runs") as progress:
        for t in cfg.temperatures:
            results[t] = run_side_by_side(spec, shapes, prompts, cfg.max_new_tokens, t, cfg.repeats, progress)
    score = {n: statistics.mean(results[t][n]["tokens_per_s"] for t in cfg.temperatures) for n in shapes}
    greedy, sampled = [t for t in cfg.temperatures if t <= 0], [t for t in cfg.temperatures if t > 0]

    def fastest(temps: list[float]) -> str:  # among measured candidates that include every chain
        return max(shapes, key=lambda n: statistics.mean(results[t][n]["tokens_per_s"] for t in temps))

    winner = fastest(greedy or sampled)  # T=0's tree; the mean's when tuned only above 0
    sampling = fastest(sampled) if greedy and sampled else winner
    best_chain = max((n for n in shapes if n.startswith("chain-")), key=score.get)
    report = {"chosen": winner, "tree": shape_spec(shapes[winner]),
              "sampling_chosen": sampling, "sampling_tree": shape_spec(shapes[sampling]), "acceptance": acc,
              "forward_cost_s": {str(k): v for k, v in cost.items()},
              "predicted_tokens_per_s": {k: v for k, (_, v) in candidates.items()},
              "side_by_side": {str(t): r for t, r in results.items()}, "mean_tokens_per_s": score,
              "best_chain": best_chain, "calibrated": bool(spec.new_proposer().temperatures),
              "device": str(spec.device), "torch_threads": torch.get_num_threads(),
              "linear_kernel": spec.kernels.plan().describe()}
    if calibration is not None:
        report["calibration"] = calibration
    if cfg.batch_sizes:
        spec.tree, spec.sampling_tree = spec.fit_tree(shapes[winner]), spec.fit_tree(shapes[sampling])
        say(f"speculation against plain decoding at batch sizes {', '.join(map(str, cfg.batch_sizes))} ...")
        report["by_batch_side_by_side"] = measure_batch_cutover(spec, prompts, cfg.batch_sizes, cfg.max_new_tokens,
                                                                cfg.temperatures, cfg.repeats)
        side = report["by_batch_side_by_side"]
        greedy_on = {str(b): r["greedy"]["entry"] for b, r in side.items() if "greedy" in r}
        sampled_on = {str(b): r["sampling"]["entry"] for b, r in side.items() if "sampling" in r}
        report["by_batch"] = greedy_on or sampled_on
        if greedy_on and sampled_on:
            report["by_batch_sampling"] = sampled_on
    if cfg.write:
        store_tree(Path(cfg.heads), report)
    if cfg.json_out:
        write_text(Path(cfg.json_out).expanduser(), json.dumps(report, indent=2))
    return report


BATCH_CHAINS = (1, 2, 3)  # the chains tried at every batch size beside the tuned tree and plain decoding
# and, when sampling, these forks: a drawn sibling lifts a sampled depth's acceptance (SmolLM2, batch 1,
# T=1: fork-2 tau 1.57 against chain-2's 1.45) for one more verified token per depth
BATCH_FORKS = (1, 2)
# drafting must beat plain decoding by this much to be stored for a batch size: a near-tie on the tune
# prompts is noise (SmolLM2, batch 8: chain-1 1.005x plain in tune, 0.93x on the bench prompts), and
# plain decoding is the choice that cannot lose to plain decoding
SPECULATE_MARGIN = 1.05


def batch_choice(rates: dict[str, float]) -> str:
    """The candidate stored for a batch size from its tokens/s (``plain`` among them): the fastest
    draft candidate where it beats plain decoding by ``SPECULATE_MARGIN``, else ``plain``."""
    fastest = max((c for c in rates if c != "plain"), key=lambda c: rates[c])
    return fastest if rates[fastest] >= SPECULATE_MARGIN * rates["plain"] else "plain"


def batch_candidates(spec: Speculator, sampling: bool, size: int) -> dict[str, bool | str]:
    """Name -> the batch table's entry: plain decoding (False), the tuned tree (True) and, above one
    prompt, the short chains (a B-row verify costs more, so a smaller tree may win), with the short
    forks when ``sampling``. One prompt compares the tuned tree with plain decoding only: the tree was
    already chosen against the chains and forks."""
    tuned = spec.tree_for(1.0 if sampling else 0.0)
    label = tuned.name if isinstance(tuned, StaticShape) else shape_spec(tuned)  # measured-16, not its paths
    out: dict[str, bool | str] = {"plain": False, label: True}
    if size > 1:
        shapes = [chain(d) for d in BATCH_CHAINS] + ([fork(d) for d in BATCH_FORKS] if sampling else [])
        for shape in shapes:
            name = shape_spec(spec.fit_tree(shape))
            out.setdefault(name, name)
    return out


@torch.inference_mode()
def measure_batch_cutover(spec: Speculator, prompts: list[Any], sizes: list[int], max_new: int,
                          temperatures: list[float], repeats: int) -> dict[int, dict[str, Any]]:
    """Per batch size, at T=0 (``greedy``) and above (``sampling``) apart: tokens/s of
    ``generate_batch`` with each candidate (``batch_candidates``: plain decoding on the same kernels
    and cache, the tuned tree, short chains), interleaved, summed over the mode's ``temperatures``.
    ``entry`` is the table entry of the fastest draft candidate where it beats plain decoding by
    ``SPECULATE_MARGIN``, else plain decoding's; ``speculate`` whether it drafts."""
    saved = spec.policy.by_batch, spec.policy.by_batch_sampling, spec.policy.batch_aware
    split = (("greedy", [t for t in temperatures if t <= 0]), ("sampling", [t for t in temperatures if t > 0]))
    modes = {name: temps for name, temps in split if temps}
    runs = sum(len(batch_candidates(spec, name == "sampling", size)) * (repeats + 1) * len(temps)
               for size in sizes for name, temps in modes.items())
    out: dict[int, dict[str, Any]] = {}
    with Progress("tune by batch size", runs, unit="runs") as progress:
        try:
            spec.policy.by_batch_sampling, spec.policy.batch_aware = None, True
            for size in sizes:
                rows = [prompts[i % len(prompts)] for i in range(size)]
                out[size] = {}
                for name, temps in modes.items():
                    cands = batch_candidates(spec, name == "sampling", size)
                    tps: dict[str, list[float]] = {c: [] for c in cands}
                    for r in range(repeats + 1):  # the first round warms up
                        order = list(cands)[r % len(cands):] + list(cands)[:r % len(cands)]
                        for c in order:
                            entry = cands[c]
                            spec.policy.by_batch = {1: entry if isinstance(entry, bool) else spec.fit_tree(entry)}
                            tokens, seconds = 0, 0.0
                            for t in temps:
                                res = spec.generate_batch(rows, max_new_tokens=max_new, temperature=t, seed=r)
                                tokens, seconds = tokens + res.new_tokens, seconds + res.time_total
                                progress.advance(1, tokens=res.new_tokens, info=f"batch {size} T={t:g} {c}")
                            if r:
                                tps[c].append(tokens / seconds)
                    rates = {c: statistics.median(v) for c, v in tps.items()}
                    fastest = max((c for c in rates if c != "plain"), key=lambda c: rates[c])
                    best = batch_choice(rates)
                    out[size][name] = {"entry": cands[best], "speculate": cands[best] is not False,
                                       "tree": None if best == "plain" else best, "tokens_per_s": rates[fastest],
                                       "plain_tokens_per_s": rates["plain"], "candidates": rates}
        finally:
            spec.policy.by_batch, spec.policy.by_batch_sampling, spec.policy.batch_aware = saved
    return out


def store_tree(heads_dir: Path, report: dict[str, Any]) -> None:
    """Record the tuned tree in the checkpoint's metadata (atomically) so generate uses it."""
    from ..heads.metadata import update_metadata

    decode = {"tree": report["tree"], "chosen": report["chosen"], "device": report["device"],
              "side_by_side": report["side_by_side"], "calibrated": report.get("calibrated", False)}
    if report.get("sampling_tree", report["tree"]) != report["tree"]:  # else the tree serves both
        decode.update(sampling_tree=report["sampling_tree"], sampling_chosen=report["sampling_chosen"])
    if "by_batch" in report:  # speculate or not, per batch size (decode/policy.py), at T=0 and above
        decode["by_batch"] = report["by_batch"]
    if "by_batch_sampling" in report:
        decode["by_batch_sampling"] = report["by_batch_sampling"]
    entries: dict[str, Any] = {"decode": decode}
    if "calibration" in report:  # fitted by tune: the tree was chosen with it, so they go together
        entries["calibration"] = {k: v for k, v in report["calibration"].items() if k != "summary"}
    update_metadata(heads_dir, entries)


def tune_cli(cfg: TuneConfig) -> int:
    from rich.console import Console
    from rich.table import Table

    report = tune(cfg)
    chosen = report["chosen"] + (f" (T=0), {report['sampling_chosen']} (T>0)"
                                 if report.get("sampling_chosen", report["chosen"]) != report["chosen"] else "")
    table = Table(title=f"tree tuning ({report['device']}); chosen: {chosen}",
                  caption="* the stored tree" + (", + the stored tree above T=0" if "(T>0)" in chosen else ""))
    table.add_column("tree")
    for t in report["side_by_side"]:
        table.add_column(f"tok/s T={t}", justify="right")
        table.add_column(f"tau T={t}", justify="right")
    for name in next(iter(report["side_by_side"].values())):
        mark = " *" if name == report["chosen"] else " +" if name == report.get("sampling_chosen") else ""
        row = [name + mark]
        for r in report["side_by_side"].values():
            row += [f"{r[name]['tokens_per_s']:.1f}", f"{r[name]['tau']:.2f}"]
        table.add_row(*row)
    Console().print(table)
    for size, modes in report.get("by_batch_side_by_side", {}).items():
        for name, r in modes.items():
            rates = ", ".join(f"{c} {v:.1f}" for c, v in r["candidates"].items())
            mode = "T=0" if name == "greedy" else "T>0"
            print(f"batch {size} ({mode}): {rates} tok/s -> {r['tree'] or 'plain decoding'}")
    if cfg.write:
        print(f"stored in {Path(cfg.heads) / 'config.json'}: generate will use tree {chosen}")
    return 0
