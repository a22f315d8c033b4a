"""Training throughput of every tool under one wall-clock timer: each tool alone, on the same cores and
threads (2 by default), in its own default precision (the ``own`` mode), for a fixed number of
optimiser steps.

    .venv/bin/python benchmarks/peers/throughput.py --prepared runs/peers-1k5 \\
        --headway-config configs/smollm2/eagle3-1k5.yaml --steps 4 12 --out runs/throughput

Per tool and step count N, one run from a fresh process (``OUT/<tool>/steps-N``), timed by this script:

- ``wall_s``: from starting the process to its exit, the checkpoint written (loading, training,
  saving: what a user waits for);
- ``checkpoint_s``: from the start to the checkpoint's last write;
- steady state: ``(wall(N2) - wall(N1)) / (N2 - N1)`` seconds per step, the start, load and save
  cancelling out between the two runs; tokens/s = the tool's mean real tokens per step / that.

Real tokens per step: rows per step x the plan's mean row length for tools that batch rows; speculators
packs rows up to ``total_seq_len`` tokens a step, so its figure is that bound (its packing of ~170-token
rows leaves little room). Padded positions are not counted.

Before a tool's timed runs, ``--warmup`` (1) untimed runs at the smallest step count read its data and
weights into the page cache and fill compile caches, so both timed runs start alike.

Another job on the machine distorts all of this: the script waits (``--wait`` seconds) for the 1-minute
load average to fall to ``--max-load`` (1.2) before each run, and refuses to start one above it unless
``--force`` (then every result carries the load it ran at and a warning).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import defaults  # noqa: E402
import sweep  # noqa: E402


def wait_for_quiet(max_load: float, wait_s: float, force: bool, sleep=time.sleep,
                   load=lambda: os.getloadavg()[0]) -> float:
    """The 1-minute load average once it is at or below ``max_load``; past ``wait_s`` refuse, or with
    ``force`` warn and go on. Returns the load the run starts at."""
    deadline = time.monotonic() + wait_s
    while (now := load()) > max_load and time.monotonic() < deadline:
        sleep(5)
    if now > max_load:
        if not force:
            raise SystemExit(f"throughput.py: error: the 1-minute load average is {now:.2f} (> {max_load}): another "
                             "job would distort the timing; stop it, or pass --force to time anyway")
        print(f"WARNING: load average {now:.2f} > {max_load}: these timings are contended", file=sys.stderr, flush=True)
    return now


def steady(walls: dict[int, float]) -> float | None:
    """Seconds per step between the smallest and the largest step count."""
    if len(walls) < 2:
        return None
    lo, hi = min(walls), max(walls)
    return (walls[hi] - walls[lo]) / (hi - lo)


def tokens_per_step(tool: str, plan: dict[str, Any], settings: dict[str, Any], headway_batch: int) -> float:
    """Mean real (unpadded) tokens an optimiser step trains on."""
    mean_row = plan["tokens"] / plan["rows"]
    opts = settings.get("options", {})
    if tool == "speculators":
        return min(float(opts.get("total_seq_len", 8192)), float(plan["tokens"]))  # its default: schema.py:210
    rows = {"headway": headway_batch,
            "modelopt": opts.get("training.per_device_train_batch_size", 1),  # its recipe: eagle3.yaml:30
            "specforge": opts.get("training.batch_size", 1)}[tool]  # its default: config/schema.py:520
    return rows * mean_row


def command(tool: str, args: argparse.Namespace, folder: Path, steps: int) -> list[str]:
    sets = [f"{defaults.option(tool, 'max_steps')}={steps}", *args.set]
    if tool == "speculators":
        # its trainer leaves an epoch at max_steps but still starts every later one (a step, a
        # validation pass and a checkpoint each): one epoch ends the run (``measure`` checks the step
        # counts fit in it).
        sets.insert(1, f"{defaults.option(tool, 'epochs')}=1")
    if tool == "headway":
        return [sys.executable, "-m", "headway", "train", "--config", args.headway_config,
                f"output_dir={folder}", "eval_every=0", "eval_features=", *sets]
    argv = [str(sweep.peer_python(tool)), str(HERE / f"run_{tool}.py"), args.prepared, "--defaults", "own",
            "--run-dir", str(folder)]
    return argv + [a for s in sets for a in ("--set", s)]


def time_run(argv: list[str], folder: Path, threads: int, cores: list[int], run=subprocess.run,
             clock=time.monotonic) -> dict[str, float]:
    """The one timing method, the same for every tool: the wall time of the training process, from its
    start to its exit (checkpoint written), pinned to ``cores`` with ``threads`` threads. Nothing a tool
    logs about itself is read."""
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    t0 = clock()
    with open(folder / "job.log", "w") as log:
        rc = run(["taskset", "-c", ",".join(map(str, cores)), *argv], stdout=log, stderr=subprocess.STDOUT,
                 env=sweep.job_env(threads)).returncode
    wall = clock() - t0
    if rc != 0:
        raise SystemExit(f"throughput.py: error: {argv[1]} exited {rc} (log {folder / 'job.log'})")
    latest = max((p.stat().st_mtime for p in folder.rglob("*") if p.is_file() and p.name != "job.log"),
                 default=started)
    return {"wall_s": round(wall, 2), "checkpoint_s": round(latest - started, 2)}


def timed(tool: str, args: argparse.Namespace, n: int, cores: list[int], timer=time_run,
          quiet=wait_for_quiet) -> dict[str, float]:
    """One timing of ``tool`` at ``n`` steps in ``OUT/<tool>/steps-N`` (kept in its timing.json: a second
    invocation reuses it; a folder without one is an interrupted timing, which is refused)."""
    folder = Path(args.out) / tool / f"steps-{n}"
    record = folder / "timing.json"
    if record.is_file():
        return json.loads(record.read_text())
    if folder.exists():
        raise SystemExit(f"throughput.py: error: {folder} holds an interrupted timing; remove it to time it again")
    start_load = quiet(args.max_load, args.wait, args.force)
    result = {"load_1min": round(start_load, 2), **timer(command(tool, args, folder, n), folder, args.threads, cores)}
    record.write_text(json.dumps(result) + "\n")
    return result


def warm_up(tool: str, args: argparse.Namespace, cores: list[int], timer=time_run, quiet=wait_for_quiet) -> None:
    """``args.warmup`` untimed runs at the smallest step count (``OUT/<tool>/warmup-I``, replaced each time):
    the first run of a tool reads its data and checkpoint from disk and fills compile caches, which the
    later ones find warm, so without it the two timed runs do not start alike and their difference is
    not the steps' cost (SpecForge's 12 steps once took less than its 4)."""
    for i in range(args.warmup):
        folder = Path(args.out) / tool / f"warmup-{i}"
        shutil.rmtree(folder, ignore_errors=True)
        quiet(args.max_load, args.wait, args.force)
        timer(command(tool, args, folder, min(args.steps)), folder, args.threads, cores)


def measure(tool: str, args: argparse.Namespace, plan: dict[str, Any], headway_batch: int, cores: list[int],
            **how: Any) -> dict[str, Any]:
    """``tool``'s runs at each step count, its steady seconds per step and tokens/s (``how``: timed's timer
    and quiet, for tests)."""
    settings = defaults.settings_for(plan, "own", tool) if tool != "headway" else {}
    tps = tokens_per_step(tool, plan, settings, headway_batch)
    if tool == "speculators" and max(args.steps) > plan["tokens"] // tps:
        # it runs one epoch (``command``): a longer count would stop short and time fewer steps than named
        raise SystemExit(f"speculators: --steps {max(args.steps)} does not fit in one epoch of its own mode "
                         f"(at most {int(plan['tokens'] // tps)} steps of {tps:.0f} tokens in "
                         f"{plan['tokens']:,} tokens); give smaller step counts")
    if args.warmup and not all((Path(args.out) / tool / f"steps-{n}" / "timing.json").is_file() for n in args.steps):
        warm_up(tool, args, cores, **how)
    runs = {}
    for n in sorted(args.steps):
        runs[n] = timed(tool, args, n, cores, **how)
        print(f"{tool} {n} steps: {runs[n]}", flush=True)
    per_step = steady({n: r["wall_s"] for n, r in runs.items()})
    return {"runs": runs, "steady_s_per_step": per_step, "tokens_per_step": round(tps, 1),
            "steady_tokens_per_s": round(tps / per_step, 1) if per_step else None,
            "contended": any(r["load_1min"] > args.max_load for r in runs.values())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepared", required=True, help="the peers' prepared folder (prepare.py --out)")
    ap.add_argument("--headway-config", default="configs/smollm2/eagle3-1k5.yaml")
    ap.add_argument("--tools", nargs="+", default=list(defaults.TOOLS), choices=defaults.TOOLS)
    ap.add_argument("--steps", type=int, nargs="+", default=[4, 12], help="step counts (two for steady state)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per tool before its timed ones (warm page "
                    "and compile caches)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    ap.add_argument("--max-load", type=float, default=1.2)
    ap.add_argument("--wait", type=float, default=300, help="seconds to wait for the load to fall")
    ap.add_argument("--force", action="store_true", help="time even when the machine is busy (marked)")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = json.loads((Path(args.prepared) / "plan.json").read_text())
    cores = list(range(args.threads))
    headway_batch = int(yaml.safe_load(Path(args.headway_config).read_text()).get("batch_size", 1))
    results: dict[str, Any] = {"threads": args.threads, "cores": cores, "steps": args.steps, "tools": {}}
    for tool in args.tools:
        results["tools"][tool] = measure(tool, args, plan, headway_batch, cores)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "throughput.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["tools"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
