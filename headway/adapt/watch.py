"""``headway adapt --watch LOGS``: a round whenever enough new traffic has arrived.

Each look (``poll``) takes the work folder's lock, finishes an unfinished round first, and
otherwise reads the log folder's window (``traffic``): when it holds at least
``traffic.min_new_prompts`` unique conversations that no earlier round used, a round runs on the
whole window (the traffic as it is now, not only what is new), starting from the served heads.
The conversations a finished round used are remembered by digest only (``watch.json``). Between
looks the loop sleeps ``traffic.poll_seconds``; ``--once`` looks once. The clock and the sleep are
arguments, so tests drive the loop without waiting.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..locking import output_lock
from ..publish import write_text
from .configs import AdaptConfig
from .errors import AdaptError
from .rounds import Outcome, Round, base_heads, preflight, start_round
from .state import RoundState, latest_round, resumable, round_folders, round_settings, work_folder

WATCH = "watch.json"


def used_keys(work: Path) -> set[str]:
    path = work / WATCH
    return set(json.loads(path.read_text())["used"]) if path.is_file() else set()


def remember(work: Path, folder: Path) -> None:
    """Add the conversations of the finished round in ``folder`` to those used."""
    from .prompts import PROMPTS, read_rows

    keys = used_keys(work) | {r["id"].removeprefix("traffic:") for r in read_rows(folder / PROMPTS)}
    write_text(work / WATCH, json.dumps({"used": sorted(keys)}) + "\n")


def prune_rounds(work: Path, keep: int) -> None:
    """Finished rounds beyond the newest ``keep`` go (their data; the generations they made stay)."""
    for folder in round_folders(work)[:-keep]:
        shutil.rmtree(folder, ignore_errors=True)


def unfinished(state: RoundState) -> bool:
    """A round to finish before a new one starts: steps left, or accepted and not yet published."""
    decision = state.steps.get("decision") or {}
    return not state.measured or not state.done("decision") or (decision["accepted"] and not state.done("published"))


def poll(cfg: AdaptConfig, now: float) -> Outcome | None:
    """One look at the logs: a round (resumed or new) when there is one to run, else None."""
    from .prompts import traffic_rows

    work = work_folder(cfg)
    preflight(cfg)
    with output_lock(work, AdaptError):
        last = latest_round(work)
        if last is not None and unfinished(last):
            last = resumable(last, round_settings(cfg, Path(last.data["settings"]["base"])), cfg.overwrite)
        if last is not None and unfinished(last):
            print(f"adapt --watch: resuming {last.folder}", flush=True)
            outcome = Round(cfg, work, last, Path(last.data["settings"]["base"]), now).run()
        else:
            base = base_heads(cfg)
            rows, info = traffic_rows(cfg, now)
            used = used_keys(work)
            new = sum(r["id"].removeprefix("traffic:") not in used for r in rows)
            if new < cfg.traffic.min_new_prompts:
                print(f"adapt --watch: {new} new unique prompts in the window ({len(rows)} in all); a round starts at "
                      f"{cfg.traffic.min_new_prompts}", flush=True)
                return None
            print(f"adapt --watch: {new} new unique prompts; a round on the window's {len(rows)}", flush=True)
            outcome = start_round(cfg, work, round_settings(cfg, base), base, now, rows, info)
        if outcome.stopped is None:
            remember(work, work / "rounds" / outcome.round)
            prune_rounds(work, cfg.traffic.keep_generations)
        return outcome


def watch(cfg: AdaptConfig, clock: Callable[[], float] = time.time, sleep: Callable[[float], Any] = time.sleep,
          polls: int | None = None) -> list[Outcome]:
    """Look at the logs every ``poll_seconds`` (once with ``--once``, or ``polls`` times); the rounds run."""
    outcomes: list[Outcome] = []
    looks = 0
    while True:
        outcome = poll(cfg, clock())
        looks += 1
        if outcome is not None:
            outcomes.append(outcome)
        if cfg.once or (polls is not None and looks >= polls):
            return outcomes
        sleep(cfg.traffic.poll_seconds)
