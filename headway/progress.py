"""Progress of long jobs (train, distill, features, bench, tune, target build), one helper for all.

On a terminal: a rich bar. Anywhere else (a file, a pipe, a CI log): a bar draws nothing until
it ends, so a 26-minute job looked dead; there we print a plain line every ``every`` items (and
at least every ``interval_s`` seconds), with the rate and an ETA:

    train: 40/200 steps (20%) | 3.1 steps/s, 8,200 tok/s | elapsed 0:13 | ETA 0:52 | loss 2.3105
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

INTERVAL_S = 60.0  # a plain line at least this often while work advances, however large ``every`` is


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def clock(seconds: float) -> str:
    """``75`` -> ``1:15``, ``3725`` -> ``1:02:05``."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def default_every(total: int) -> int:
    return max(1, total // 20)  # about 20 lines per job


class Progress:
    """``with Progress("distill", 512, unit="prompts") as p: p.advance(8, tokens=1024)``.

    ``completed`` may start above 0 (a resumed run): rates and ETA count only this session's work.
    ``enabled=False`` (a non-main process, ``progress=false``) prints nothing."""

    def __init__(self, label: str, total: int, unit: str = "items", enabled: bool = True, every: int | None = None,
                 stream: TextIO | None = None, completed: int = 0, interval_s: float = INTERVAL_S) -> None:
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.every = every or default_every(total)
        self.interval_s = interval_s
        self.completed = self.first = self.last_line = completed
        self.tokens, self.info = 0, ""
        self.start = self.last_time = time.perf_counter()
        self.bar: Any = None

    # -- rates --------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    @property
    def rate(self) -> float:
        """Items per second in this session."""
        return (self.completed - self.first) / self.elapsed()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed()

    def eta(self) -> float | None:
        left = self.total - self.completed
        return left / self.rate if self.rate > 0 else (0.0 if left <= 0 else None)

    def line(self) -> str:
        pct = f" ({100 * self.completed / self.total:.0f}%)" if self.total else ""
        rate = f"{self.rate:.3g} {self.unit}/s" + (f", {self.tokens_per_s:,.0f} tok/s" if self.tokens else "")
        eta = self.eta()
        parts = [f"{self.label}: {self.completed}/{self.total} {self.unit}{pct}", rate,
                 f"elapsed {clock(self.elapsed())}", f"ETA {clock(eta) if eta is not None else '?'}"]
        return " | ".join(parts + ([self.info] if self.info else []))

    # -- updates ------------------------------------------------------------------------------
    def advance(self, n: int = 1, tokens: int = 0, info: str | None = None) -> None:
        self.update(self.completed + n, tokens=tokens, info=info)

    def update(self, completed: int, tokens: int = 0, info: str | None = None) -> None:
        """Now ``completed`` of ``total`` are done, ``tokens`` more tokens went through."""
        self.completed, self.tokens = completed, self.tokens + tokens
        if info is not None:
            self.info = info
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=completed, rate=self._bar_rate(), info=self.info)
        elif self._line_due():
            self._print()

    def _line_due(self) -> bool:
        crossed = self.completed // self.every > self.last_line // self.every
        slow = time.perf_counter() - self.last_time >= self.interval_s
        return self.completed > self.last_line and (crossed or slow or self.completed >= self.total)

    def _print(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self.last_line, self.last_time = self.completed, time.perf_counter()

    def _bar_rate(self) -> str:
        return f"{self.tokens_per_s:,.0f} tok/s" if self.tokens else f"{self.rate:.3g} {self.unit}/s"

    def __enter__(self) -> "Progress":
        self.start = self.last_time = time.perf_counter()
        if self.enabled and is_terminal(self.stream):
            self.bar = rich_bar(self.stream)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total, completed=self.completed,
                                          rate="", info=self.info)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.enabled and self.completed > self.last_line:  # the last partial stretch (a job stopped early)
            self._print()


def rich_bar(stream: TextIO) -> Any:
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=Console(file=stream))
