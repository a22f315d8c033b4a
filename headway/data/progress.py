"""Progress of the data commands (``headway.progress``), and hiding the libraries' own bars."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from rich.console import Console

from ..progress import Progress


def console() -> Console:
    return Console(stderr=True)


class TokenProgress(Progress):
    """``with TokenProgress("distill", total_rows) as p: p.advance(rows, tokens)``: a bar on a
    terminal, plain lines with rows/s, tokens/s and ETA in a log file."""

    def __init__(self, description: str, total: int, enabled: bool = True, unit: str = "rows") -> None:
        super().__init__(description, total, unit=unit, enabled=enabled)


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
