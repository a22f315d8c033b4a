"""Target names as the data commands accept them."""

from __future__ import annotations

from pathlib import Path

DEMO = "demo"


def resolve_target_path(name: str) -> str:
    """``"demo"`` -> the demo target's folder (built, or reused from the cache, with the default
    preset); a local path -> its absolute form; anything else (a Hub id) unchanged."""
    if name == DEMO:
        from ..demo_target import TargetBuildConfig, build_demo_target  # lazy: heavy, optional

        return str(build_demo_target(TargetBuildConfig()))
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name
