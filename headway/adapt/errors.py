"""The adapt room's error: one line the CLI prints (``headway adapt: error: ...``, exit status 2)."""

from __future__ import annotations

from ..errors import HeadwayError


class AdaptError(HeadwayError, ValueError):
    """An adapt run that cannot go on as asked; the message says why and what to do."""
