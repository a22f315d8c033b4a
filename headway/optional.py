"""Optional dependencies: a part that needs a package not installed is skipped (or refused) with one
line that says what to install, never a traceback after the work is done.

``need`` imports a module or raises ``MissingDependency`` naming the install command; ``skip_line``
is the one line a caller prints when it goes on without that part (a plot, a tracker).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import HeadwayError

# module -> what to install for it (the extra where headway has one)
INSTALL = {
    "matplotlib": "pip install 'headway[plot]', or pip install matplotlib",
    "wandb": "pip install wandb",
    "tensorboard": "pip install tensorboard",
}


class MissingDependency(HeadwayError, ImportError):
    """An optional package is not installed; the message names the package and the install command."""

    def __init__(self, module: str, purpose: str) -> None:
        self.module, self.purpose = module, purpose
        super().__init__(f"{purpose} needs {module}, which is not installed: {install_hint(module)}")


def install_hint(module: str) -> str:
    return INSTALL.get(module, f"pip install {module}")


def need(module: str, purpose: str) -> ModuleType:
    """``import module``, or ``MissingDependency`` saying ``purpose`` needs it and how to install it.
    Where the package is there but one of its own imports is not, that one is named."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = (getattr(e, "name", None) or module).split(".")[0]
        raise MissingDependency(missing, purpose) from None


def available(module: str) -> bool:
    try:
        need(module, "")
    except MissingDependency:
        return False
    return True


def skip_line(e: MissingDependency, what: str) -> str:
    """``plot skipped: matplotlib is not installed (pip install 'headway[plot]' ...)``."""
    return f"{what} skipped: {e.module} is not installed ({install_hint(e.module)})"
