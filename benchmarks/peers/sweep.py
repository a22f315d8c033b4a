"""Learning rates x seeds for one trainer, each run in its own folder, then every checkpoint scored on the
held-out sets, and one table of the mean and spread over seeds per setting.

    .venv/bin/python benchmarks/peers/sweep.py --tool speculators --prepared runs/peers-1k5 --defaults own \\
        --lr 1e-3 2e-3 4e-3 --seeds 0 1 2 --out runs/sweep-speculators [--jobs 2 --threads 1]
    .venv/bin/python benchmarks/peers/sweep.py --tool headway --config configs/smollm2/eagle3-1k5.yaml \\
        --seeds 0 1 2 --out runs/sweep-headway

- Runs: ``OUT/jobs/<tool>-lr<LR>-s<SEED>/`` (``lrown`` without ``--lr``), trained by the tool's runner in
  its venv (``run_<tool>.py PREPARED --defaults MODE --run-dir JOB --set <its lr>=LR --set <its seed>=SEED``)
  or by ``headway train --config CONFIG output_dir=JOB seed=SEED [optim.lr=LR]``. A run is finished when
  its ``done.json`` exists: a second invocation skips it (an interrupted sweep resumes where it stopped).
- ``--jobs N`` trains N at a time, each pinned with ``taskset`` to its own ``--threads`` cores
  (``OMP_NUM_THREADS`` = ``--threads``); the default is one at a time on ``--threads`` threads.
- Scores: ``benchmarks/peers/evaluate.py``'s (teacher-forced top-1 by depth, tau, tau_decode) on each
  ``--eval NAME=DATASET`` (default dev = runs/smollm2-heldout, 96 chat:dev answers, and test =
  runs/smollm2-test, 96 chat:test answers, which no choice may read), kept in ``JOB/eval-NAME.json``.
- ``OUT/sweep.json`` and ``OUT/sweep.md``: per setting, the mean, sample standard deviation, min and max
  over its seeds of tau, tau_decode and top-1 by depth on each set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import defaults  # noqa: E402

PEERS_HOME = Path(os.environ.get("PEERS", Path.home() / ".cache" / "headway" / "peers"))
DONE = "done.json"
EVAL_SETS = ["dev=runs/smollm2-heldout", "test=runs/smollm2-test"]
METRICS = ("tau", "tau_decode")


@dataclass(frozen=True)
class Job:
    tool: str
    lr: float | None  # None: the tool's (or the config's) own
    seed: int

    @property
    def setting(self) -> str:
        return f"{self.tool} lr {self.lr:g}" if self.lr is not None else f"{self.tool} (its lr)"

    @property
    def name(self) -> str:
        return f"{self.tool}-lr{'own' if self.lr is None else format(self.lr, 'g')}-s{self.seed}"


def plan_jobs(tool: str, lrs: list[float] | None, seeds: list[int]) -> list[Job]:
    """Every (lr, seed), seeds innermost: a cut-short sweep has whole settings first."""
    return [Job(tool, lr, s) for lr in (lrs or [None]) for s in seeds]


def job_dir(root: Path, job: Job) -> Path:
    return root / "jobs" / job.name


def finished(root: Path, job: Job) -> bool:
    return (job_dir(root, job) / DONE).is_file()


def peer_python(tool: str) -> str:
    return str(PEERS_HOME / tool / "bin" / "python")


def job_command(job: Job, args: argparse.Namespace, folder: Path) -> list[str]:
    """The argv that trains ``job`` into ``folder``."""
    sets = [f"{defaults.option(job.tool, 'seed')}={job.seed}"]
    if job.lr is not None:
        sets.append(f"{defaults.option(job.tool, 'lr')}={job.lr:g}")
    sets += args.set
    if job.tool == "headway":
        return [sys.executable, "-m", "headway", "train", "--config", args.config, f"output_dir={folder}", *sets]
    argv = [peer_python(job.tool), str(HERE / f"run_{job.tool}.py"), args.prepared, "--defaults", args.defaults,
            "--run-dir", str(folder)]
    return argv + [a for s in sets for a in ("--set", s)]


def core_slots(jobs: int, threads: int, cores: int) -> list[list[int] | None]:
    """One core list per concurrent job (None: unpinned, the single-job default)."""
    if jobs == 1:
        return [None]
    if jobs * threads > cores:
        raise SystemExit(f"sweep.py: error: --jobs {jobs} x --threads {threads} needs {jobs * threads} cores; "
                         f"this machine has {cores}")
    return [list(range(i * threads, (i + 1) * threads)) for i in range(jobs)]


def job_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"})
    return env


def record_headway(folder: Path, job: Job, wall_s: float) -> None:
    """headway train writes no done.json: the sweep does, once ``final/`` is there."""
    final = folder / "final"
    if (final / "config.json").is_file():
        (folder / DONE).write_text(json.dumps({"tool": "headway", "checkpoint": str(final), "wall_s": round(wall_s, 1),
                                               "seed": job.seed, "lr": job.lr}, indent=2) + "\n")


def run_jobs(jobs: list[Job], root: Path, command_of: Callable[[Job, Path], list[str]],
             slots: list[list[int] | None], threads: int, poll_s: float = 5.0) -> list[Job]:
    """Train every unfinished job, ``len(slots)`` at a time; returns the jobs that failed."""
    todo = [j for j in jobs if not finished(root, j)]
    running: dict[int, tuple[Job, subprocess.Popen, float, Any]] = {}
    failed: list[Job] = []
    while todo or running:
        for slot, cores in enumerate(slots):
            if slot in running or not todo:
                continue
            job = todo.pop(0)
            folder = job_dir(root, job)
            folder.mkdir(parents=True, exist_ok=True)
            argv = command_of(job, folder)
            if cores is not None:
                argv = ["taskset", "-c", ",".join(map(str, cores)), *argv]
            log = open(folder / "job.log", "a")
            print(f"[{time.strftime('%H:%M:%S')}] start {job.name} ({len(todo)} waiting)", flush=True)
            running[slot] = (job, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                   env=job_env(threads)), time.time(), log)
        time.sleep(poll_s if running else 0)
        for slot, (job, proc, t0, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[slot]
            if job.tool == "headway" and proc.returncode == 0:
                record_headway(job_dir(root, job), job, time.time() - t0)
            ok = proc.returncode == 0 and finished(root, job)
            print(f"[{time.strftime('%H:%M:%S')}] {'done' if ok else 'FAILED'} {job.name} "
                  f"({time.time() - t0:.0f} s; log {job_dir(root, job) / 'job.log'})", flush=True)
            if not ok:
                failed.append(job)
    return failed


def evaluate_jobs(jobs: list[Job], root: Path, eval_sets: dict[str, str], target_name: str) -> None:
    """Score every finished job on every set it has no score for (the target loads only if one is missing)."""
    todo = [(j, n) for j in jobs if finished(root, j) for n in eval_sets
            if not _scored(job_dir(root, j) / f"eval-{n}.json", eval_sets[n])]
    if not todo:
        return
    import evaluate
    from headway.target import load_target

    target, _ = load_target(target_name, device="cpu")
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


def _scored(path: Path, dataset: str) -> bool:
    return path.is_file() and json.loads(path.read_text()).get("data") == dataset


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one seed), min and max."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def aggregate(jobs: list[Job], root: Path, eval_names: list[str]) -> dict[str, Any]:
    """{setting: {"seeds": [...], set: {metric: spread}}} over the scored seeds of each setting."""
    out: dict[str, Any] = {}
    for job in jobs:
        folder = job_dir(root, job)
        entry = out.setdefault(job.setting, {"tool": job.tool, "lr": job.lr, "seeds": []})
        scores = {n: folder / f"eval-{n}.json" for n in eval_names}
        if not all(p.is_file() for p in scores.values()):
            continue
        entry["seeds"].append(job.seed)
        for name, path in scores.items():
            r = json.loads(path.read_text())
            values = entry.setdefault(name, {"_raw": {}})["_raw"]
            for m in METRICS:
                if r.get(m) is not None:
                    values.setdefault(m, []).append(float(r[m]))
            for d, v in enumerate(r.get("top1") or []):
                values.setdefault(f"top1_d{d + 1}", []).append(float(v))
    for entry in out.values():
        for name in eval_names:
            if name in entry:
                entry[name] = {m: spread(v) for m, v in entry[name].pop("_raw").items()}
    return out


def markdown(summary: dict[str, Any], eval_names: list[str]) -> str:
    """One row per setting: mean ± std over seeds (n) of each set's tau and tau_decode, and dev-style top-1."""
    cols = [f"{n} {m}" for n in eval_names for m in METRICS]
    lines = ["| setting | seeds | " + " | ".join(cols) + f" | {eval_names[0]} top-1 depth 1..3 |",
             "|---|---|" + "---|" * (len(cols) + 1)]
    for setting, e in summary.items():
        cells = []
        for n in eval_names:
            for m in METRICS:
                s = e.get(n, {}).get(m)
                cells.append(f"{s['mean']:.3f} ± {s['std']:.3f}" if s else "–")
        top = e.get(eval_names[0], {})
        top1 = " ".join(f"{top[k]['mean']:.3f}" for k in ("top1_d1", "top1_d2", "top1_d3") if k in top) or "–"
        seeds = ",".join(map(str, e["seeds"])) or "none scored"
        lines.append(f"| {setting} | {seeds} | " + " | ".join(cells) + f" | {top1} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", required=True, choices=defaults.TOOLS)
    ap.add_argument("--prepared", help="a peer's prepared folder (prepare.py --out)")
    ap.add_argument("--config", help="headway's recipe (--tool headway)")
    ap.add_argument("--defaults", choices=defaults.MODES, default="own", help="the peers' mode (defaults.py)")
    ap.add_argument("--lr", type=float, nargs="+", default=None, help="learning rates (default: the tool's own)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, each pinned to its own cores")
    ap.add_argument("--threads", type=int, default=2, help="threads (and cores) per run")
    ap.add_argument("--eval", nargs="+", default=EVAL_SETS, metavar="NAME=DATASET")
    ap.add_argument("--target", default="smollm2", help="the target the held-out sets were distilled from")
    ap.add_argument("--no-train", action="store_true", help="only score and tabulate the finished runs")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and each run's command, run nothing")
    args = ap.parse_args(argv)
    if args.tool == "headway" and not args.config:
        ap.error("--tool headway needs --config")
    if args.tool != "headway" and not args.prepared:
        ap.error(f"--tool {args.tool} needs --prepared")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(args.out)
    jobs = plan_jobs(args.tool, args.lr, args.seeds)
    eval_sets = dict(e.split("=", 1) for e in args.eval)
    for job in jobs:
        state = "done" if finished(root, job) else "to run"
        print(f"{job.name:32} {state:7} {' '.join(job_command(job, args, job_dir(root, job)))}")
    if args.dry_run:
        return 0
    if not args.no_train:
        if args.jobs > 1 and not shutil.which("taskset"):
            raise SystemExit("sweep.py: error: --jobs > 1 pins runs with taskset, which is not on PATH")
        slots = core_slots(args.jobs, args.threads, os.cpu_count() or 1)
        failed = run_jobs(jobs, root, lambda j, f: job_command(j, args, f), slots, args.threads)
        if failed:
            print(f"sweep.py: {len(failed)} run(s) failed: {', '.join(j.name for j in failed)}", file=sys.stderr)
    import torch

    torch.set_num_threads(max(1, args.jobs * args.threads))
    evaluate_jobs(jobs, root, eval_sets, args.target)
    summary = aggregate(jobs, root, list(eval_sets))
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps({"tool": args.tool, "mode": args.defaults, "eval": eval_sets,
                                                 "settings": summary}, indent=2) + "\n")
    (root / "sweep.md").write_text(markdown(summary, list(eval_sets)))
    print((root / "sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
