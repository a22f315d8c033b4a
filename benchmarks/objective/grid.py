#!/usr/bin/env python
"""The objective grid of issue #60: each training-objective option alone on top of a base recipe
(by default the SmolLM2 1,536-answer recipes configs/smollm2/eagle3-1k5.yaml and dflash-1k5.yaml),
plus seed repeats of the baseline (``--seeds``), each run in its own output folder, one after another, then one
table of the held-out numbers.

    python benchmarks/objective/grid.py --dry-run            # the plan and its expected CPU minutes
    python benchmarks/objective/grid.py                      # run it (resumable: finished runs are kept)
    python benchmarks/objective/grid.py --only baseline hass # a subset; --kinds eagle3 for one kind
    python benchmarks/objective/grid.py --collect-only       # the table of what has run so far
    python benchmarks/objective/grid.py --set optim.lr=0.002 --out runs/objective-lr2e-3  # around another base

It needs the base recipes' data steps done (runs/smollm2-distill, runs/smollm2-features,
runs/smollm2-heldout-features: see the configs' headers). Two runs need data of their own, made
first by the plan's data steps: ``stored-topk`` (the target's top-k logits, ``headway features
--topk_logits``) and ``samples2`` (two sampled answers to each of half the prompts, ``headway distill
--samples_per_prompt 2``: as many answers as the baseline's, the same distillation cost).

Every run is ``headway train --config BASE output_dir=OUT/KIND-NAME KEY=VALUE ...``. The results
(``OUT/grid.json``, ``OUT/grid.md``) come from each run's ``log.jsonl`` (the last held-out
evaluation: tau, tau_decode, top-1 by depth; the training time of the ``done`` record) and its
``final/config.json`` metadata (the options the run really trained with).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from headway.config import ConfigError, load_config, to_dict
from headway.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"eagle3": "eagle", "dflash": "dflash"}
# Rough training minutes of each base recipe on a 2-core Xeon with AMX (the configs' headers): the
# estimate scales these; --minutes replaces them (e.g. with a baseline timed on this machine)
BASE_MINUTES = {"eagle3": 4.8, "dflash": 3.6}
OVERHEAD_MINUTES = 1.0  # per run: loading the target, the held-out evaluation, saving
PREP_MINUTES = {"features": 6.0, "distill": 18.0}  # a features pass; a distillation with its features (1,536 answers)


@dataclass
class Run:
    kind: str
    name: str
    change: str  # what differs from the baseline, in words
    overrides: dict[str, Any] = field(default_factory=dict)
    cost: float = 1.0  # expected training time relative to the baseline's
    needs: list[str] = field(default_factory=list)  # data steps (their outputs) that must exist first

    @property
    def folder(self) -> str:
        return f"{self.kind}-{self.name}"


@dataclass
class Prep:
    output: str
    command: list[str]
    minutes: float


def vocab_cost(size: int, base: int = 8192) -> float:
    """A drafter step's cost with another draft vocabulary: its lm_head is ~43% of a SmolLM2 drafter
    call at 8,192 rows (2.7 ms against 8.5 ms over all 49,152, eagle3-1k5.yaml) and scales with them."""
    return 0.57 + 0.43 * size / base


def ttt_cost(steps: int, base: int = 3) -> float:
    """Each unrolled step adds ~1/3 of the first step's cost (eagle3-1k5.yaml)."""
    return (1 + (steps - 1) / 3) / (1 + (base - 1) / 3)


def options(kind: str, topk_folder: str | None, samples: tuple[str, str] | None, base: dict[str, Any],
            seeds: int = 2) -> list[Run]:
    """Every run of one kind: the baseline, its seed repeats (``seeds`` in all), each objective option
    alone, and (EAGLE-3) the TTT lengths and decays; both kinds the draft vocabulary sizes."""
    s = SECTIONS[kind]
    opts = base.get(s, {})
    vocab = int(opts.get("draft_vocab_size") or 8192)
    runs = [Run(kind, "baseline", "the base recipe"),
            *(Run(kind, f"seed{i}", f"the base recipe, seed {i}", {"seed": i}) for i in range(1, seeds)),
            Run(kind, "hass", "HASS Top-K distillation (w 1, K 10)", {f"{s}.topk_weight": 1.0, f"{s}.topk_k": 10}),
            Run(kind, "griffin", "GRIFFIN token alignment (top-3)", {f"{s}.align_topk": 3}),
            Run(kind, "chain", "expected accepted length (weight 0.5)", {f"{s}.chain_weight": 0.5})]
    # the argmax cross-entropy toggled from the base's: on, or off (the soft term alone, as speculators' KL)
    if float(opts.get("hard_weight", 0.0)):
        runs.append(Run(kind, "hard0", "no cross-entropy to the argmax (hard_weight 0)", {f"{s}.hard_weight": 0.0}))
    else:
        runs.append(Run(kind, "hard1", "+ cross-entropy to the argmax (hard_weight 1)", {f"{s}.hard_weight": 1.0}))
    # half the batch over the same tokens and epochs: twice the optimiser steps at about the same compute
    batch = int(base.get("batch_size") or TrainConfig.__dataclass_fields__["batch_size"].default)
    if batch >= 2:
        runs.append(Run(kind, f"batch{batch // 2}", f"batch_size {batch // 2} (twice the optimiser steps)",
                        {"batch_size": batch // 2}))
    if topk_folder:
        runs.append(Run(kind, "stored-topk", "soft labels from the stored top-64 logits",
                        {f"{s}.soft_labels": "stored_topk", "features": topk_folder}, 0.97, [topk_folder]))
    if samples:
        data, feats = samples
        runs.append(Run(kind, "samples2", "2 sampled answers (T=1) to each of half the prompts",
                        {"data": data, "features": feats, f"{s}.argmax_from": "logits"}, 1.0, [feats]))
    if kind == "eagle3":
        steps = int(opts.get("ttt_steps", 7))
        runs += [Run(kind, f"ttt{n}", f"ttt_steps {n}", {"eagle.ttt_steps": n}, ttt_cost(n, steps))
                 for n in range(1, 8) if n != steps]
        if opts.get("train_lm_head", True):
            runs.append(Run(kind, "frozen-head", "the draft lm_head frozen at the target's rows (speculators')",
                            {"eagle.train_lm_head": False}))
        aux = opts.get("aux_layers") or []
        if aux and opts.get("init_layer") is None:  # the decoder layer copied from the target's (docs/training.md)
            n = int(aux[-1])  # the layer that reads the deepest fused feature
            runs.append(Run(kind, f"init{n}", f"decoder layer started as target layer {n} (init_layer)",
                            {"eagle.init_layer": n}))
        decay = float(opts.get("step_decay", 0.8))
        runs += [Run(kind, f"decay{d:g}", f"step_decay {d:g}", {"eagle.step_decay": d}) for d in (0.6, 1.0)
                 if d != decay]
    runs += [Run(kind, f"vocab{n // 1024}k", f"draft_vocab_size {n}", {f"{s}.draft_vocab_size": n},
                 vocab_cost(n, vocab)) for n in (4096, 16384, 32768) if n != vocab]
    return runs


def read_yaml(path: str | Path) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text()) or {}


def stored_layers(features: str) -> list[str]:
    """The layers a features folder stores, without ``final`` (the top-k folder needs no lm_head input)."""
    manifest = Path(features) / "features.json"
    layers = json.loads(manifest.read_text())["layers"] if manifest.is_file() else ["eagle3"]
    return [str(x) for x in layers if str(x) != "final"]


def prep_steps(args: argparse.Namespace, base: dict[str, Any], headway: list[str]) -> tuple[Prep, Prep, str]:
    """The data steps the stored-topk and samples2 runs need, from the base recipe's folders: (the top-k
    features, the sampled answers' features, the sampled answers' dataset)."""
    data, feats = base["data"], base["features"]
    topk_out = f"{feats}-topk{args.topk}"
    topk = Prep(topk_out, [*headway, "features", "--config", args.features_config, "--layers",
                           *stored_layers(feats), "--topk_logits", str(args.topk), "--output", topk_out],
                PREP_MINUTES["features"])
    limit = int(read_yaml(args.distill_config).get("limit") or 0)
    n = args.samples
    sdata, sfeats = f"{data}-s{n}", f"{feats}-s{n}"
    distill = [*headway, "distill", "--config", args.distill_config, "--samples_per_prompt", str(n), "--temperature",
               str(args.temperature), "--output", sdata, "--features", sfeats, "--feature_layers",
               *stored_layers(feats), "final"] + (["--limit", str(limit // n)] if limit else [])
    return topk, Prep(sfeats, distill, PREP_MINUTES["distill"]), sdata


def trained_base(config: str | Path, settings: dict[str, str]) -> dict[str, Any]:
    """The recipe as ``headway train --config CONFIG`` with ``--set``'s overrides reads it (its parser,
    defaults and checks), so the toggles a grid plans (hard0 / hard1, batchN, frozen-head, ...) start
    from the base it really trains."""
    return to_dict(load_config(TrainConfig, config, settings))


def plan(args: argparse.Namespace) -> tuple[list[Prep], list[Run]]:
    """(the data steps the selected runs need, the selected runs), in the order they run."""
    headway = shlex.split(args.headway)
    preps: dict[str, Prep] = {}
    runs: list[Run] = []
    for kind in args.kinds:
        base = trained_base(args.config[kind], args.set)
        topk, samples, sampled_data = prep_steps(args, base, headway)
        preps.update({topk.output: topk, samples.output: samples})
        for run in options(kind, topk.output, (sampled_data, samples.output), base, args.seeds):
            if not args.only or run.name in args.only:
                runs.append(run)
    needed = [preps[o] for o in dict.fromkeys(o for r in runs for o in r.needs)]
    return needed, runs


def train_command(args: argparse.Namespace, run: Run) -> list[str]:
    # --set applies to every run (a base recipe with other settings); a run's own change wins
    over = {"output_dir": str(Path(args.out) / run.folder), **args.set, **run.overrides}
    return [*shlex.split(args.headway), "train", "--config", args.config[run.kind],
            *(f"{k}={v}" for k, v in over.items())]


def minutes(args: argparse.Namespace, run: Run) -> float:
    return args.minutes[run.kind] * run.cost + OVERHEAD_MINUTES


def describe(args: argparse.Namespace, preps: list[Prep], runs: list[Run]) -> str:
    lines = [f"objective grid: {len(preps)} data step(s), {len(runs)} training run(s), one at a time, into {args.out}"]
    for p in preps:
        done = " (done)" if finished_prep(p) else ""
        lines.append(f"  data   ~{p.minutes:5.1f} min  {shlex.join(p.command)}{done}")
    for r in runs:
        done = " (done)" if finished(Path(args.out) / r.folder) else ""
        lines.append(f"  {r.kind:6} ~{minutes(args, r):5.1f} min  {r.name}: {r.change}{done}")
        lines.append(f"         {shlex.join(train_command(args, r))}")
    todo = sum(p.minutes for p in preps if not finished_prep(p)) + sum(
        minutes(args, r) for r in runs if not finished(Path(args.out) / r.folder))
    lines.append(f"expected CPU minutes still to run: ~{todo:.0f} (base recipes "
                 + ", ".join(f"{k} {args.minutes[k]:g} min" for k in args.kinds)
                 + f" of training, +{OVERHEAD_MINUTES:g} per run; scale with --minutes for this machine)")
    return "\n".join(lines)


def finished(folder: Path) -> bool:
    return (folder / "final" / "config.json").is_file() and any(r.get("event") == "done" for r in records(folder))


def finished_prep(p: Prep) -> bool:
    manifest = Path(p.output) / "features.json"
    return manifest.is_file() and bool(json.loads(manifest.read_text()).get("complete"))


def records(folder: Path) -> list[dict[str, Any]]:
    log = folder / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []


# -- collection ---------------------------------------------------------------------------------
def collect(folder: Path, run: Run) -> dict[str, Any]:
    """One run's row: the last held-out evaluation and the training time (log.jsonl), the options it
    trained with (final/config.json metadata)."""
    recs = records(folder)
    evals = [r["eval"] for r in recs if "eval" in r]
    done = [r for r in recs if r.get("event") == "done"]
    row: dict[str, Any] = {"kind": run.kind, "run": run.name, "change": run.change, "overrides": run.overrides,
                           "folder": str(folder), "complete": finished(folder)}
    if evals:
        ev = evals[-1]
        row.update(tau=ev.get("tau"), tau_decode=ev.get("tau_decode"), top1=ev.get("top1"),
                   positions=ev.get("positions"))
    if done:
        row.update(train_time_s=round(done[-1]["train_time_s"], 3), tokens_per_s=round(done[-1]["tokens_per_s"], 1),
                   steps=done[-1]["step"])
    config = folder / "final" / "config.json"
    if config.is_file():
        training = json.loads(config.read_text()).get("metadata", {}).get("training", {})
        row.update(seed=training.get("seed"), tokens=training.get("tokens"), options=training.get("options"))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per run, tau_decode against its kind's baseline."""
    base = {r["kind"]: r.get("tau_decode") for r in rows if r["run"] == "baseline"}

    def num(x: Any, fmt: str = ".3f") -> str:
        return "—" if x is None else format(x, fmt)

    out = ["| kind | run | change | τ | τ_decode | Δτ_decode | top-1 by depth | train min | tok/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, t = base.get(r["kind"]), r.get("tau_decode")
        delta = f"{t - b:+.3f}" if t is not None and b is not None else "—"
        top1 = " / ".join(f"{x:.3f}" for x in r.get("top1") or []) or "—"
        train = num(r["train_time_s"] / 60, ".1f") if r.get("train_time_s") is not None else "—"
        mark = "" if r["complete"] else " (incomplete)"
        out.append(f"| {r['kind']} | {r['run']}{mark} | {r['change']} | {num(r.get('tau'))} | {num(t)} | {delta} | "
                   f"{top1} | {train} | {num(r.get('tokens_per_s'), '.0f')} |")
    return "\n".join(out) + "\n"


def report(args: argparse.Namespace, runs: list[Run]) -> list[dict[str, Any]]:
    rows = [collect(Path(args.out) / r.folder, r) for r in runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "grid.md").write_text(table(rows))
    return rows


# -- running ------------------------------------------------------------------------------------
def execute(command: list[str], log: Path) -> int:
    """One step, alone; its output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ {shlex.join(command)}\n")
        f.flush()
        return subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode


def run_grid(args: argparse.Namespace, preps: list[Prep], runs: list[Run]) -> int:
    logs, failed = Path(args.out) / "logs", []
    for p in preps:
        if not finished_prep(p):
            say(f"data step: {shlex.join(p.command)}")
            if execute(p.command, logs / f"prep-{Path(p.output).name}.txt"):
                failed.append(p.output)
    for r in runs:
        folder = Path(args.out) / r.folder
        if finished(folder):
            continue
        if any(o in failed for o in r.needs):
            say(f"skipping {r.folder}: its data step failed")
            failed.append(r.folder)
            continue
        t0 = time.perf_counter()
        say(f"training {r.folder} ({r.change})")
        if execute(train_command(args, r), logs / f"{r.folder}.txt"):
            failed.append(r.folder)
        say(f"  {r.folder}: {(time.perf_counter() - t0) / 60:.1f} min" + (" (failed)" if r.folder in failed else ""))
    report(args, runs)
    if failed:
        say(f"failed: {', '.join(failed)} (their logs: {logs})")
    return 1 if failed else 0


def say(text: str) -> None:
    print(text, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/objective", help="one folder per run in here, and grid.json / grid.md")
    ap.add_argument("--kinds", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--only", nargs="+", default=[], help="run names to keep (baseline, seed1, hass, griffin, chain, "
                                                           "hard0 or hard1, batchN (half the base's batch), stored-topk, samples2, ttt1..ttt7, decay0.6, decay1, frozen-head, initN, "
                                                           "vocab4k, vocab16k, vocab32k)")
    ap.add_argument("--eagle3-config", default="configs/smollm2/eagle3-1k5.yaml")
    ap.add_argument("--dflash-config", default="configs/smollm2/dflash-1k5.yaml")
    ap.add_argument("--features-config", default="configs/smollm2/features.yaml",
                    help="the features recipe the stored top-k folder repeats (with --topk_logits)")
    ap.add_argument("--distill-config", default="configs/smollm2/distill.yaml",
                    help="the distillation recipe samples2 repeats with half its prompts, 2 answers each")
    ap.add_argument("--topk", type=int, default=64, help="top-k logits stored for stored-topk")
    ap.add_argument("--samples", type=int, default=2, help="answers per prompt for the samples run")
    ap.add_argument("--temperature", type=float, default=1.0, help="their sampling temperature")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every run, e.g. --set optim.lr=0.002: the grid around another base; "
                         "use another --out for it (repeatable)")
    ap.add_argument("--seeds", type=int, default=2, help="runs of the base recipe: baseline, seed1, ... seed{N-1}")
    ap.add_argument("--minutes", nargs="+", default=[], metavar="KIND=MIN",
                    help="training minutes of each base recipe on this machine (default eagle3=4.8 dflash=3.6, "
                         "a 2-core Xeon with AMX)")
    ap.add_argument("--headway", default=f"{shlex.quote(sys.executable)} -m headway", help="how to call headway")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its expected CPU minutes only")
    ap.add_argument("--collect-only", action="store_true", help="write grid.json / grid.md of what has run")
    args = ap.parse_args(argv)
    args.config = {"eagle3": args.eagle3_config, "dflash": args.dflash_config}
    bad = [x for x in args.set if "=" not in x]
    if bad:
        ap.error(f"--set takes KEY=VALUE, got {bad[0]!r}")
    args.set = dict(x.split("=", 1) for x in args.set)
    args.minutes = {**BASE_MINUTES, **{k: float(v) for k, v in (m.split("=", 1) for m in args.minutes)}}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        preps, runs = plan(args)
    except ConfigError as e:  # a --set the recipe refuses: before any run starts
        say(f"grid.py: error: {e}")
        return 2
    if not runs:
        say(f"no run is named {' '.join(args.only)}")
        return 2
    say(describe(args, preps, runs))
    if args.dry_run:
        return 0
    if args.collect_only:
        report(args, runs)
        say((Path(args.out) / "grid.md").read_text())
        return 0
    rc = run_grid(args, preps, runs)
    say((Path(args.out) / "grid.md").read_text())
    return rc


if __name__ == "__main__":
    sys.exit(main())
