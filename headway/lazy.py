"""Lazy package attributes (PEP 562), so that importing one light module of a package (a config
dataclass for ``headway <command> --help``) never imports torch or transformers."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``exports`` maps a public name to the submodule defining it; returns the package's
    ``__getattr__`` (imports the submodule on first use and caches the value) and ``__dir__``."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(f".{exports[name]}", package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
