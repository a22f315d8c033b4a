"""``headway adapt``: one round (``--prompts``), the watch loop (``--watch``), or a rollback.

A one-shot run resumes the work folder's latest round when it is unfinished (same settings, or
``--overwrite`` to drop it); when that round is finished and was made with the same settings and
the same prompts, it reports it (and publishes it, if a lower threshold now passes it); otherwise
it starts the next round. Every round and rollback holds the work folder's lock; ``--out`` is
only ever replaced whole, by a copy of published heads.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..locking import output_lock
from .configs import AdaptConfig
from .errors import AdaptError
from .rounds import Outcome, Round, base_heads, check_out, preflight, start_round
from .state import latest_round, resumable, round_settings, work_folder


def gathered(cfg: AdaptConfig, now: float) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """The prompts of a source or of traffic, read now (cheap: no model runs); None for 'self'."""
    from .prompts import source_rows, traffic_rows

    kind = cfg.source_kind()
    if kind == "self":
        return None, {}
    if kind == "traffic":
        return traffic_rows(cfg, now)
    tokenizer = None
    if "demo:" in str(cfg.prompts):  # demo prompts are token windows of the demo corpus
        from ..target import load_target_shell, resolve_target_path

        tokenizer = load_target_shell(resolve_target_path(cfg.target), cfg.revision)[1]
    return source_rows(cfg, tokenizer)


def adapt(cfg: AdaptConfig, now: float | None = None) -> Outcome:
    """One round of ``cfg`` (module docstring); ``now`` dates the traffic window (default: the clock)."""
    from .prompts import rows_digest

    now = time.time() if now is None else now
    work = work_folder(cfg)
    preflight(cfg)
    base = base_heads(cfg)
    settings = round_settings(cfg, base)
    with output_lock(work, AdaptError):
        last = latest_round(work)
        if last is not None and not last.measured:
            last = resumable(last, settings, cfg.overwrite)
            if last is not None:
                print(f"adapt: resuming {last.folder}", flush=True)
                return Round(cfg, work, last, base, now).run()
        rows, info = gathered(cfg, now)
        if last is not None and last.measured and not last.check_settings(settings) and (
                rows is None or rows_digest(rows) == last.steps["prompts"]["digest"]):
            return Round(cfg, work, last, base, now).run()  # the same round again: its decision
        return start_round(cfg, work, settings, base, now, rows, info)


def rollback(cfg: AdaptConfig) -> int:
    """Republish generation ``cfg.rollback`` as ``--out`` (atomically)."""
    from .generations import serve

    work, out = work_folder(cfg), Path(cfg.out).expanduser()
    check_out(out)
    with output_lock(work, AdaptError):
        found = serve(work, int(cfg.rollback), out)
    print(f"adapt: {out} now serves generation {cfg.rollback} (tau {found.get('tau')} on its round's held-out "
          f"prompts{', ' + found['round'] if found.get('round') else ''})", flush=True)
    return 0


def adapt_cli(cfg: AdaptConfig) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a round writes one state file, one generation at a time
        raise AdaptError("headway adapt runs in one process; start it without accelerate launch")
    if cfg.rollback is not None:
        return rollback(cfg)
    if cfg.watch:
        from .watch import watch

        watch(cfg)
        return 0
    adapt(cfg)
    return 0
