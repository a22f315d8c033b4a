"""Training's errors: a run that cannot start as configured, and one stopped by a non-finite value."""

from __future__ import annotations

from ..errors import HeadwayError


class TrainError(HeadwayError):
    """Training cannot start as configured; the message says why."""


class NonFiniteError(TrainError):
    """A NaN / infinite loss, gradient or weight stopped training; the message names the step and
    the first non-finite input. Nothing of that step is saved."""


__all__ = ["NonFiniteError", "TrainError"]
