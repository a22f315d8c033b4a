"""What the three peer runners share (standard library only: each runs inside its peer's own venv).

A run reads ``OUT/plan.json`` (prepare.py), picks the mode's settings for its tool, applies
``--set KEY=VALUE`` overrides, trains into ``--run-dir`` (default ``OUT/<tool>``) and, once the
checkpoint headway imports is written, publishes ``RUN/done.json``: the checkpoint's path, the
settings, the wall time from the runner's start and the peak memory. A run whose ``done.json`` exists
is finished: the runner says so and leaves it as it is (sweep.py's resume rests on this).

    PEERS/<tool>/bin/python benchmarks/peers/run_<tool>.py OUT [--defaults own|shared] [--run-dir DIR]
        [--set lr=0.002 --set seed=1 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import defaults  # noqa: E402  (the harness folder is not a package)

DONE = "done.json"
START = time.time()  # the runner's process start, as near as Python sees it


@dataclass
class Run:
    tool: str
    out: Path  # the prepared folder (plan.json)
    run_dir: Path
    mode: str
    plan: dict[str, Any]
    settings: dict[str, Any]  # {"draft_vocab_size": N, "options": {...}, ...}, --set applied to options
    extra: dict[str, Any] = field(default_factory=dict)  # the tool's own command-line extras

    @property
    def options(self) -> dict[str, Any]:
        return self.settings["options"]

    @property
    def me(self) -> dict[str, Any]:
        """The plan's inputs for this tool (data folder, vocab mappings by size, aux ids)."""
        return self.plan["peers"][self.tool]

    def vocab(self, kind: str) -> str:
        """The path of this run's draft-vocabulary file ``kind`` at the settings' size."""
        size = str(self.settings["draft_vocab_size"])
        try:
            return self.me["vocab"][size][kind]
        except KeyError:
            raise SystemExit(f"run_{self.tool}.py: error: {self.out}/plan.json has no draft vocabulary of {size} "
                             f"for {self.tool}: prepare it again") from None


def parser(tool: str, doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="runs/peers", help="the prepared folder (prepare.py --out)")
    ap.add_argument("--defaults", choices=defaults.MODES, default="shared",
                    help="own: the tool's own defaults (docs/peers.md); shared: the comparisons' settings")
    ap.add_argument("--run-dir", default=None, help=f"where this run writes (default OUT/{tool})")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help=f"override one of {tool}'s own options (e.g. {defaults.option(tool, 'lr')}=0.002)")
    return ap


def start(tool: str, args: argparse.Namespace) -> Run | None:
    """The run ``args`` describe, or None when it finished before (its done.json is there)."""
    out = Path(args.out).resolve()
    plan_path = out / "plan.json"
    if not plan_path.is_file():
        raise SystemExit(f"run_{tool}.py: error: no {plan_path}; run prepare.py --out {args.out} first")
    plan = json.loads(plan_path.read_text())
    if tool not in plan.get("peers", {}):
        raise SystemExit(f"run_{tool}.py: error: {plan_path} was prepared without {tool} (--peers)")
    try:
        settings = json.loads(json.dumps(defaults.settings_for(plan, args.defaults, tool)))  # a copy
        settings["options"].update(defaults.parse_sets(args.sets))
    except ValueError as e:
        raise SystemExit(f"run_{tool}.py: error: {e}") from None
    run_dir = Path(args.run_dir).resolve() if args.run_dir else out / tool
    if (run_dir / DONE).is_file():
        print(f"{run_dir} finished before ({DONE}); remove the folder to train it again")
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    return Run(tool, out, run_dir, args.defaults, plan, settings)


def peak_rss_mb() -> float:
    """The largest resident set of this process or any child it waited for (Linux reports KiB)."""
    kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return round(kib / 1024, 1)


def finish(run: Run, checkpoint: Path, **facts: Any) -> None:
    """Publish RUN/done.json (temp file + rename: a half-written one never reads as finished)."""
    if not checkpoint.exists():
        raise SystemExit(f"run_{run.tool}.py: error: training ended without {checkpoint}")
    record = {"tool": run.tool, "mode": run.mode, "checkpoint": str(checkpoint), "settings": run.settings,
              "threads": os.environ.get("OMP_NUM_THREADS"), "wall_s": round(time.time() - START, 1),
              "checkpoint_s": round(checkpoint.stat().st_mtime - START, 1), "peak_rss_mb": peak_rss_mb(), **facts}
    tmp = run.run_dir / f".{DONE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, run.run_dir / DONE)
    print(json.dumps({k: record[k] for k in ("checkpoint", "wall_s", "peak_rss_mb")}))
