"""A rich progress bar showing rows, tokens/s and ETA (only on the main process)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)


def console() -> Console:
    return Console(stderr=True)


class TokenProgress:
    """``with TokenProgress("distill", total_rows) as p: p.advance(rows, tokens)``."""

    def __init__(self, description: str, total: int, enabled: bool = True, unit: str = "rows") -> None:
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn(unit), TextColumn("{task.fields[tok_s]:>8.0f} tok/s"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=console(), disable=not enabled)
        self.task = self.progress.add_task(description, total=total, tok_s=0.0)
        self.tokens = 0
        self.start = time.perf_counter()

    def advance(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        self.progress.update(self.task, advance=rows, tok_s=self.tokens_per_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.start, 1e-9)

    def __enter__(self) -> "TokenProgress":
        self.progress.start()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()


class quiet_datasets:
    """Hide ``datasets``' own progress bars (save_to_disk, map) inside the block."""

    def __enter__(self) -> "quiet_datasets":
        from datasets.utils import logging as ds_logging

        self._was = ds_logging.is_progress_bar_enabled()
        ds_logging.disable_progress_bar()
        return self

    def __exit__(self, *exc: Any) -> None:
        from datasets.utils import logging as ds_logging

        if self._was:
            ds_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' own progress bars (one per checkpoint loaded or saved) inside the block:
    they would tear through our tables and bars."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
