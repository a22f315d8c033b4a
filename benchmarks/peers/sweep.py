"""Run the "peers at their best" protocol (protocol.py): every tool, every mode, every seed, the LR
bracket, one run at a time; then score every checkpoint on the evaluation sets and write one table of
the mean and spread over seeds per setting.

    .venv/bin/python benchmarks/peers/sweep.py --dry-run          # the plan: each run, its state, its cost
    .venv/bin/python benchmarks/peers/sweep.py                    # run what is not finished, score, tabulate
    .venv/bin/python benchmarks/peers/sweep.py --no-train         # only score and tabulate finished runs

Defaults: ``--prepared runs/peers-1k5`` (prepare.py's folder), ``--config configs/smollm2/eagle3-1k5.yaml``
(headway's recipe), ``--seeds 0 1 2``, ``--lr 1e-3 2e-3 4e-3`` (speculators' bracket, own mode),
``--threads 2``, ``--out runs/peers-best``.

- Runs: ``OUT/jobs/<tool>-<mode>-lr<LR>-s<SEED>/``, trained by the peer's runner in its venv
  (``PEERS/<tool>/bin/python run_<tool>.py PREPARED --defaults MODE --run-dir JOB --set <seed>=S
  [--set <lr>=LR]``) or by ``headway train --config CONFIG output_dir=JOB seed=S``, each alone on
  ``--threads`` threads. A run is finished when its ``done.json`` exists: the next invocation skips it,
  so an interrupted sweep resumes where it stopped. A peer whose venv is missing is left out and named.
- Stage 2 (the bracket's other seeds) runs at the LR whose stage-1 run scored the highest tau on ``dev``.
- Scores: ``evaluate.py``'s (teacher-forced top-1 by depth, tau, tau_decode) on each ``--eval NAME=DATASET``
  (default ``dev=runs/smollm2-heldout``, the 96 rows choices are made on, and ``test=runs/smollm2-test``,
  the reporting split's rows: docs/peers.md gives the command that distills them), kept in
  ``JOB/eval-NAME.json``; a set whose dataset is missing is left out and named.
- ``OUT/peers.json`` and ``OUT/peers.md``: the plan with each run's state, and per setting the mean,
  sample standard deviation, min and max over its seeds of tau, tau_decode and top-1 by depth on each set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import defaults  # noqa: E402
import protocol  # noqa: E402
from protocol import Job  # noqa: E402

PEERS_HOME = Path(os.environ.get("PEERS", Path.home() / ".cache" / "headway" / "peers"))
DONE = "done.json"
EVAL_SETS = ["dev=runs/smollm2-heldout", "test=runs/smollm2-test"]
BRACKET = [1e-3, 2e-3, 4e-3]


def job_dir(root: Path, job: Job) -> Path:
    return root / "jobs" / job.name


def finished(root: Path, job: Job) -> bool:
    return job.lr != protocol.BEST and (job_dir(root, job) / DONE).is_file()


def peer_python(tool: str) -> Path:
    return PEERS_HOME / tool / "bin" / "python"


def installed(tool: str) -> bool:
    return tool == "headway" or os.access(peer_python(tool), os.X_OK)


def job_env(threads: int) -> dict[str, str]:
    """Every tool's environment: the same thread count, offline, no loader workers' tokenizer threads."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"})
    return env


def job_command(job: Job, args: argparse.Namespace, folder: Path) -> list[str]:
    """The argv that trains ``job`` into ``folder``."""
    sets = [f"{defaults.option(job.tool, 'seed')}={job.seed}"]
    if job.lr is not None:
        sets.append(f"{defaults.option(job.tool, 'lr')}={job.lr:g}")
    sets += args.set
    if job.tool == "headway":
        return [sys.executable, "-m", "headway", "train", "--config", args.config, f"output_dir={folder}", *sets]
    argv = [str(peer_python(job.tool)), str(HERE / f"run_{job.tool}.py"), str(args.prepared), "--defaults", job.mode,
            "--run-dir", str(folder)]
    return argv + [a for s in sets for a in ("--set", s)]


def record_headway(folder: Path, job: Job, wall_s: float) -> None:
    """headway train writes no done.json: the sweep does, once ``final/`` is there."""
    if (folder / "final" / "config.json").is_file():
        (folder / DONE).write_text(json.dumps({"tool": "headway", "checkpoint": str(folder / "final"),
                                               "wall_s": round(wall_s, 1), "seed": job.seed, "lr": job.lr},
                                              indent=2) + "\n")


def run_jobs(jobs: list[Job], root: Path, command_of: Callable[[Job, Path], list[str]], threads: int,
             say: Callable[[str], None] = print) -> list[Job]:
    """Train every unfinished job, one at a time; returns the jobs that failed (a failure stops nothing)."""
    failed = []
    for job in jobs:
        if finished(root, job):
            say(f"{job.name}: finished before, skipped")
            continue
        folder = job_dir(root, job)
        folder.mkdir(parents=True, exist_ok=True)
        say(f"[{time.strftime('%H:%M:%S')}] start {job.name}")
        t0 = time.monotonic()
        with open(folder / "job.log", "a") as log:
            rc = subprocess.run(command_of(job, folder), stdout=log, stderr=subprocess.STDOUT,
                                env=job_env(threads)).returncode
        wall = time.monotonic() - t0
        if job.tool == "headway" and rc == 0:
            record_headway(folder, job, wall)
        ok = rc == 0 and finished(root, job)
        say(f"[{time.strftime('%H:%M:%S')}] {'done' if ok else 'FAILED'} {job.name} ({wall:.0f} s; "
            f"log {folder / 'job.log'})")
        if not ok:
            failed.append(job)
    return failed


def scores(root: Path, job: Job, eval_sets: dict[str, str]) -> dict[str, dict[str, Any]]:
    """{set: evaluate.py's result} for the sets ``job`` was scored on (on that set's dataset)."""
    out = {}
    if job.lr == protocol.BEST:
        return out
    for name, dataset in eval_sets.items():
        path = job_dir(root, job) / f"eval-{name}.json"
        if path.is_file() and (r := json.loads(path.read_text())).get("data") == dataset:
            out[name] = r
    return out


def dev_taus(root: Path, jobs: list[Job], eval_sets: dict[str, str]) -> dict[tuple[str, str, float], float]:
    """{(tool, mode, lr): dev tau} of the scored stage-1 runs (what stage 2's LR is chosen from)."""
    out = {}
    for job in jobs:
        r = scores(root, job, eval_sets).get(protocol.DEV) if job.stage == 1 else None
        if r is not None and r.get("tau") is not None:
            out[(job.tool, job.mode, job.lr)] = float(r["tau"])
    return out


def evaluate_jobs(jobs: list[Job], root: Path, eval_sets: dict[str, str], target_name: str) -> None:
    """Score every finished job on every set it has no score for (the target loads only if one is missing)."""
    todo = [(j, n) for j in jobs if finished(root, j) for n in eval_sets if n not in scores(root, j, eval_sets)]
    if not todo:
        return
    import evaluate
    from headway.target import load_target, resolve_target_path

    target, _ = load_target(resolve_target_path(target_name), device="cpu")  # a built-in name, or a folder
    rows = {n: evaluate.held_out(eval_sets[n], ":") for n in {n for _, n in todo}}
    cache: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    for job, name in todo:
        folder = job_dir(root, job)
        drafter = evaluate.load_drafter(json.loads((folder / DONE).read_text())["checkpoint"], target)
        key = (name, tuple(drafter.feature_layers))
        if key not in cache:
            cache[key] = evaluate.target_batches(target, rows[name], list(key[1]))
        result = {"data": eval_sets[name], "rows": len(rows[name]), **evaluate.evaluate_batches(drafter, cache[key])}
        (folder / f"eval-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"{job.name} on {name}: tau {result['tau']:.4f} tau_decode {result.get('tau_decode', float('nan')):.4f}")


# ---------------------------------------------------------------- the plan

def prepared_plan(args: argparse.Namespace) -> dict[str, Any] | None:
    path = Path(args.prepared) / "plan.json"
    return json.loads(path.read_text()) if path.is_file() else None


def job_settings(job: Job, plan: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any] | None:
    """The peer's settings for ``job`` (the prepared plan's, else what prepare.py would write), or None for headway."""
    if job.tool == "headway":
        return None
    if plan is not None and job.tool in plan.get("settings", {}).get(job.mode, {}):
        settings = json.loads(json.dumps(plan["settings"][job.mode][job.tool]))  # a copy
    elif job.mode == "own":
        settings = defaults.own(job.tool, args.own_epochs_cap)
    else:
        settings = defaults.shared(job.tool, args.draft_vocab, args.epochs, args.ttt_steps, None)
    settings["options"][defaults.option(job.tool, "seed")] = job.seed  # what job_command's --set changes
    if isinstance(job.lr, float):
        settings["options"][defaults.option(job.tool, "lr")] = job.lr
    settings["options"].update(defaults.parse_sets(args.set))
    return settings


def headway_epochs(config: str) -> float:
    import yaml

    return float(yaml.safe_load(Path(config).read_text()).get("epochs", 1))


def describe(jobs: list[Job], root: Path, args: argparse.Namespace, plan: dict[str, Any] | None,
             eval_sets: dict[str, str]) -> list[dict[str, Any]]:
    """One row per job: tool, mode, LR, seed, stage, state, expected CPU minutes, the settings it changes, command."""
    tokens = plan["tokens"] if plan else protocol.REFERENCE_TOKENS
    vocab = plan["draft_vocab_size"] if plan else args.draft_vocab
    epochs = headway_epochs(args.config)
    rows = []
    for job in jobs:
        settings = job_settings(job, plan, args)
        if not installed(job.tool):
            state = f"NOT INSTALLED (benchmarks/peers/setup_venvs.sh {job.tool})"
        elif job.tool != "headway" and plan is None:
            state = f"not prepared (prepare.py --out {args.prepared})"
        elif job.lr == protocol.BEST:
            state = "waits for stage 1's dev scores"
        elif finished(root, job):
            state = "scored" if scores(root, job, eval_sets) else "trained"
        else:
            state = "to run"
        rows.append({"name": job.name if job.lr != protocol.BEST else f"{job.tool}-{job.mode}-lrbest-s{job.seed}",
                     "tool": job.tool, "mode": job.mode, "lr": job.lr, "seed": job.seed, "stage": job.stage,
                     "state": state, "cpu_min": round(protocol.cpu_minutes(job, settings, tokens, vocab, epochs), 1),
                     "settings": settings,
                     "command": None if job.lr == protocol.BEST else job_command(job, args, job_dir(root, job))})
    return rows


def print_plan(rows: list[dict[str, Any]], threads: int) -> None:
    print(f"{'run':34} {'stage':5} {'CPU min':>8}  state / settings")
    for r in rows:
        opts = r["settings"] and {"draft_vocab": r["settings"]["draft_vocab_size"], **r["settings"]["options"]}
        print(f"{r['name']:34} {r['stage']:5} {r['cpu_min']:8.1f}  {r['state']}")
        print(f"{'':49}{json.dumps(opts) if opts else 'the recipe (--config)'}")
    todo = [r for r in rows if r["state"] not in ("scored", "trained")]
    cpu = sum(r["cpu_min"] for r in todo)
    print(f"{len(todo)} of {len(rows)} runs left: ~{cpu:.0f} CPU minutes, ~{cpu / threads:.0f} min "
          f"({cpu / threads / 60:.1f} h) on {threads} threads one at a time (rates of docs/peers.md's runs scaled by epochs, tokens, TTT length and per-step "
          "compute, or SpecForge's and ModelOpt's own-defaults throughput measured alone; precision not modelled)")


# ---------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepared", default="runs/peers-1k5", help="the peers' prepared folder (prepare.py --out)")
    ap.add_argument("--config", default="configs/smollm2/eagle3-1k5.yaml", help="headway's recipe")
    ap.add_argument("--tools", nargs="+", default=list(defaults.TOOLS), choices=defaults.TOOLS)
    ap.add_argument("--modes", nargs="+", default=list(defaults.MODES), choices=defaults.MODES,
                    help="the peers' modes to run (headway runs its recipe in either)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr", type=float, nargs="*", default=BRACKET,
                    help="speculators' LR bracket in its own mode (none: its own LR, every seed)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    ap.add_argument("--threads", type=int, default=2, help="threads of every run (one run at a time)")
    ap.add_argument("--eval", nargs="+", default=EVAL_SETS, metavar="NAME=DATASET",
                    help=f"evaluation sets; '{protocol.DEV}' chooses stage 2's LR")
    ap.add_argument("--target", default="smollm2", help="the target the evaluation sets were distilled from")
    ap.add_argument("--out", default="runs/peers-best")
    ap.add_argument("--no-train", action="store_true", help="only score and tabulate the finished runs")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    g = ap.add_argument_group("estimates without a prepared folder (prepare.py's settings)")
    g.add_argument("--draft-vocab", type=int, default=8192)
    g.add_argument("--epochs", type=int, default=2)
    g.add_argument("--ttt-steps", type=int, default=3)
    g.add_argument("--own-epochs-cap", type=int, default=None)
    args = ap.parse_args(argv)
    eval_sets = dict(e.partition("=")[::2] for e in args.eval)
    if protocol.DEV not in eval_sets or not all(eval_sets.values()):
        ap.error(f"--eval wants NAME=DATASET pairs, one named '{protocol.DEV}'")
    args.eval_sets = eval_sets
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update({k: v for k, v in job_env(args.threads).items() if k.endswith("OFFLINE")})  # the evaluation too
    root = Path(args.out)
    plan = prepared_plan(args)
    jobs = [j for j in protocol.plan(args.seeds, args.lr, args.tools) if j.tool == "headway" or j.mode in args.modes]
    missing_sets = [f"{n}={d}" for n, d in args.eval_sets.items() if not Path(d).exists()]
    eval_sets = {n: d for n, d in args.eval_sets.items() if Path(d).exists()}
    jobs = protocol.resolve(jobs, dev_taus(root, jobs, eval_sets))
    print_plan(describe(jobs, root, args, plan, eval_sets), args.threads)
    for s in missing_sets:
        print(f"evaluation set {s}: not there, left out (docs/peers.md: how to make it)")
    if args.dry_run:
        return 0
    runnable = [j for j in jobs if installed(j.tool) and (j.tool == "headway" or plan is not None)]
    failed: list[Job] = []
    if eval_sets:
        import torch

        torch.set_num_threads(args.threads)
    for stage in (1, 2):
        if stage == 2:
            jobs = protocol.resolve(jobs, dev_taus(root, jobs, eval_sets))
            runnable = protocol.resolve(runnable, dev_taus(root, runnable, eval_sets))
        now = [j for j in runnable if j.stage == stage and j.lr != protocol.BEST]
        if not args.no_train:
            failed += run_jobs(now, root, lambda j, f: job_command(j, args, f), args.threads)
        evaluate_jobs(now, root, eval_sets, args.target)
    rows = describe(jobs, root, args, plan, eval_sets)
    summary = protocol.aggregate([(j, scores(root, j, eval_sets)) for j in jobs if finished(root, j)
                                  and scores(root, j, eval_sets)], list(eval_sets))
    root.mkdir(parents=True, exist_ok=True)
    (root / "peers.json").write_text(json.dumps({"eval": eval_sets, "eval_missing": missing_sets, "runs": rows,
                                                 "settings": summary}, indent=2, default=str) + "\n")
    left = [r for r in rows if r["state"] not in ("scored", "trained")]
    md = protocol.markdown(summary, list(eval_sets)) if summary else "No run is scored yet.\n"
    md += "".join(f"\nNot run: {r['name']} ({r['state']})" for r in left)
    (root / "peers.md").write_text(md + ("\n" if left else ""))
    print(md)
    if failed:
        print(f"sweep.py: {len(failed)} run(s) failed: {', '.join(j.name for j in failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
