"""Target names as the data commands accept them."""

from __future__ import annotations

from pathlib import Path

DEMO = "demo"


def resolve_target_path(name: str) -> str:
    """``"demo"`` -> the demo target's folder (built, or reused from the cache, with the default
    preset); a named real target (``"smollm2"``) -> its converted folder (built on first use);
    a local path -> its absolute form; anything else (a Hub id) unchanged."""
    from ..named_targets import NAMED_TARGETS

    if name in NAMED_TARGETS:
        from ..named_targets import resolve_named_target

        return str(resolve_named_target(name))
    if name == DEMO:
        from ..demo_target import TargetBuildConfig, build_demo_target  # lazy: heavy, optional

        return str(build_demo_target(TargetBuildConfig()))
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name
